package staticbin

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

func TestCheck(t *testing.T) {
	if _, err := exec.LookPath("go"); err != nil {
		t.Skip("needs the go tool to build the binaries it checks")
	}
	dir := t.TempDir()
	src := filepath.Join(dir, "main.go")
	// os/user makes a cgo build link the C library dynamically.
	prog := "package main\nimport \"os/user\"\nfunc main() { user.Current() }\n"
	if err := os.WriteFile(src, []byte(prog), 0o644); err != nil {
		t.Fatal(err)
	}
	build := func(cgo, out string) string {
		t.Helper()
		bin := filepath.Join(dir, out)
		cmd := exec.Command("go", "build", "-o", bin, src)
		cmd.Env = append(os.Environ(), "CGO_ENABLED="+cgo, "GOFLAGS=")
		if b, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("go build CGO_ENABLED=%s: %v\n%s", cgo, err, b)
		}
		return bin
	}
	if err := Check(build("0", "static")); err != nil {
		t.Errorf("CGO_ENABLED=0 binary: %v, want nil", err)
	}
	if _, err := exec.LookPath("gcc"); err != nil {
		t.Log("no C compiler: the dynamic case is checked on /bin/sh only")
	} else {
		err := Check(build("1", "dynamic"))
		if err == nil || !strings.Contains(err.Error(), "dynamically linked (interpreter /lib") {
			t.Errorf("cgo binary: %v, want dynamically linked with its interpreter", err)
		}
	}
	sh, err := filepath.EvalSymlinks("/bin/sh")
	if err != nil {
		t.Skip("no /bin/sh")
	}
	if err := Check(sh); err == nil {
		t.Errorf("%s: nil, want dynamically linked", sh)
	}
	if err := Check(src); err == nil {
		t.Errorf("a Go source file: nil, want an error")
	}
}
