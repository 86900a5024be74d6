package atomicfile

import (
	"os"
	"path/filepath"
	"testing"
)

func TestIsTemp(t *testing.T) {
	for name, want := range map[string]bool{
		".a.json.tmp-123": true,
		"a.json":          false,
		".a.json":         false,
		"a.json.tmp-1":    false, // not hidden: not Write's
		".tmp-1":          false,
		".a.json.tmp-":    false,
	} {
		if got := IsTemp(name); got != want {
			t.Errorf("IsTemp(%q) = %v, want %v", name, got, want)
		}
	}
	// What Write makes while it writes is what IsTemp recognises.
	dir := t.TempDir()
	f, err := os.CreateTemp(dir, "."+filepath.Base("x.json")+".tmp-*")
	if err != nil {
		t.Fatal(err)
	}
	f.Close()
	if !IsTemp(filepath.Base(f.Name())) {
		t.Errorf("IsTemp(%q) = false", filepath.Base(f.Name()))
	}
}

// Both writes replace the file whole, with its mode, and leave no
// temporary file.
func TestWrite(t *testing.T) {
	for name, write := range map[string]func(string, []byte, os.FileMode) error{"Write": Write, "WriteVolatile": WriteVolatile} {
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			p := filepath.Join(dir, "rec.json")
			for _, data := range []string{"first, longer content", "second"} {
				if err := write(p, []byte(data), 0o640); err != nil {
					t.Fatal(err)
				}
				b, err := os.ReadFile(p)
				if err != nil || string(b) != data {
					t.Fatalf("content %q, %v; want %q", b, err, data)
				}
			}
			fi, err := os.Stat(p)
			if err != nil || fi.Mode().Perm() != 0o640 {
				t.Errorf("mode %v, %v", fi.Mode(), err)
			}
			if ents, _ := os.ReadDir(dir); len(ents) != 1 {
				t.Errorf("files left: %v", ents)
			}
			if err := write(filepath.Join(dir, "none", "x"), nil, 0o600); err == nil {
				t.Error("write into a missing directory succeeded")
			}
		})
	}
}
