package testregistry

import (
	"archive/tar"
	"bytes"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"

	"github.com/stagelet/stagelet/internal/testutil"
)

// TestPushJRE pushes the JRE image, pulls it back, unpacks it as a whole root
// filesystem and runs java in a chroot into it: nothing of the host is
// visible there, so this proves the image carries everything java needs.
func TestPushJRE(t *testing.T) {
	testutil.NeedRoot(t, "runs java chrooted into an unpacked image")
	start := time.Now()
	img := jreImage(t)
	t.Logf("built the JRE image in %v", time.Since(start))

	r := Start(t)
	ref := r.PushJRE(t, "jre", "17")
	if want := r.Host + "/jre:17"; ref != want {
		t.Fatalf("ref = %q, want %q", ref, want)
	}
	pulled, err := remote.Image(mustRef(t, ref))
	if err != nil {
		t.Fatal(err)
	}
	got, err := pulled.Digest()
	if err != nil {
		t.Fatal(err)
	}
	want, err := img.Digest()
	if err != nil {
		t.Fatal(err)
	}
	if got != want {
		t.Fatalf("pulled digest %s, pushed %s", got, want)
	}
	layers, err := pulled.Layers()
	if err != nil {
		t.Fatal(err)
	}
	var size int64
	for _, l := range layers {
		s, err := l.Size()
		if err != nil {
			t.Fatal(err)
		}
		size += s
	}
	t.Logf("%s: %d layers, %.1f MB compressed", ref, len(layers), float64(size)/1e6)

	cf, err := pulled.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	if p := cf.Config.Env[0]; !strings.HasPrefix(p, "PATH="+JREHome+"/bin:") || !strings.HasSuffix(p, strings.TrimPrefix(DefaultPath, "PATH=")) {
		t.Errorf("config PATH = %q", p)
	}
	if c := strings.Join(cf.Config.Cmd, " "); c != "java -version" {
		t.Errorf("config Cmd = %q", c)
	}

	dir := t.TempDir()
	rc := mutate.Extract(pulled)
	defer rc.Close()
	extract(t, rc, dir)

	// java finds libjli.so through its RPATH $ORIGIN/../lib, and the loader
	// reads /proc/self/exe to expand $ORIGIN: a bare chroot without /proc
	// fails with "libjli.so: cannot open shared object file". As a runtime
	// does, mount /proc first: busybox from the image does it, in a mount
	// namespace of its own (Go makes its mounts private), then execs java.
	cmd := exec.Command("/bin/busybox", "sh", "-c",
		"mount -t proc proc /proc && exec java -XshowSettings:system -version")
	cmd.Dir = "/"
	cmd.Env = []string{cf.Config.Env[0]}
	cmd.SysProcAttr = &syscall.SysProcAttr{Chroot: dir, Unshareflags: syscall.CLONE_NEWNS}
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("chroot %s java: %v\nstdout:\n%s\nstderr:\n%s", dir, err, stdout.String(), stderr.String())
	}
	// java 17 prints this header always, then "Provider: ..." or, with no
	// cgroup metrics to read, "No metrics available for this platform".
	if !strings.Contains(stderr.String(), "Operating System Metrics:") || !strings.Contains(stderr.String(), `openjdk version "17.`) {
		t.Fatalf("java -XshowSettings:system -version printed:\n%s", stderr.String())
	}
	t.Logf("java in the image:\n%s", stderr.String())
}

// TestJREDeterministic builds the JRE image a second time and compares
// digests.
func TestJREDeterministic(t *testing.T) {
	first := jreImage(t)
	start := time.Now()
	again, err := buildJRE(BusyboxImage(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("rebuilt the JRE image in %v", time.Since(start))
	d1, err := first.Digest()
	if err != nil {
		t.Fatal(err)
	}
	d2, err := again.Digest()
	if err != nil {
		t.Fatal(err)
	}
	if d1 != d2 {
		t.Fatalf("JRE image is not deterministic: %s vs %s", d1, d2)
	}
}

// extract unpacks a flattened image (mutate.Extract) beneath dir: directories,
// regular files with their modes, and symlinks as they are (they are resolved
// inside dir only once java runs chrooted into it). It refuses names that
// leave dir or pass through a symlink.
func extract(t *testing.T, r io.Reader, dir string) {
	t.Helper()
	tr := tar.NewReader(r)
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			return
		}
		if err != nil {
			t.Fatal(err)
		}
		p := filepath.Join(dir, filepath.Clean("/"+hdr.Name))
		if parent, err := filepath.EvalSymlinks(filepath.Dir(p)); err == nil && parent != filepath.Dir(p) {
			t.Fatalf("%s: parent is reached through a symlink (%s)", hdr.Name, parent)
		}
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		mode := os.FileMode(hdr.Mode).Perm()
		switch hdr.Typeflag {
		case tar.TypeDir:
			if err := os.Mkdir(p, mode); err != nil && !os.IsExist(err) {
				t.Fatal(err)
			}
		case tar.TypeReg:
			f, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_EXCL|syscall.O_NOFOLLOW, mode)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := io.Copy(f, tr); err != nil {
				t.Fatal(err)
			}
			if err := f.Close(); err != nil {
				t.Fatal(err)
			}
		case tar.TypeSymlink:
			if err := os.Symlink(hdr.Linkname, p); err != nil {
				t.Fatal(err)
			}
		default:
			t.Fatalf("%s: unexpected type %c", hdr.Name, hdr.Typeflag)
		}
	}
}
