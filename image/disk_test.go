package image

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/test/testregistry"
)

// diskTestImage is busybox with a second layer that removes a file
// (whiteout), makes a directory opaque, and adds a file with an extended
// attribute and a known modification time.
func diskTestImage(t *testing.T, r *testregistry.Registry) string {
	t.Helper()
	mtime := time.Date(2021, 3, 4, 5, 6, 7, 0, time.UTC)
	added := reg("etc/added", "added\n")
	added.Header.ModTime = mtime
	added.Header.PAXRecords = map[string]string{"SCHILY.xattr.user.origin": "layer2"}
	top := testregistry.Layer(t,
		dirEntry("etc/", 0o755),
		reg("etc/.wh.group", ""),
		added,
		dirEntry("var/", 0o755),
		reg("var/.wh..wh..opq", ""),
		reg("var/only", "only\n"),
	)
	img, err := mutate.AppendLayers(testregistry.BusyboxImage(t), top)
	if err != nil {
		t.Fatal(err)
	}
	return r.Push(t, "layered", "v1", img)
}

// needErofs skips a test that makes and mounts erofs images where the
// host cannot.
func needErofs(t *testing.T) {
	t.Helper()
	requireRoot(t)
	if _, err := exec.LookPath("mkfs.erofs"); err != nil {
		t.Skip("mkfs.erofs is not installed (erofs-utils)")
	}
}

// mountDisk mounts the erofs image at p read-only and returns where.
func mountDisk(t *testing.T, p string) string {
	t.Helper()
	dir := t.TempDir()
	if out, err := exec.Command("mount", "-t", "erofs", "-o", "ro,loop", p, dir).CombinedOutput(); err != nil {
		t.Skipf("cannot mount an erofs image here: %v: %s", err, out)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(dir, 0); err != nil {
			t.Errorf("unmount %s: %v", dir, err)
		}
	})
	return dir
}

func TestDiskReproducibleAndMerged(t *testing.T) {
	needErofs(t)
	r := testregistry.Start(t)
	ref := diskTestImage(t, r)
	var disks []Disk
	var id string
	for i := range 2 {
		s := newStore(t, Config{})
		img, err := s.Pull(pullCtx(t), ref, nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		id = img.ID
		// A host's label on the store's copy (where no SELinux claims
		// the attribute, the file system keeps it as it is).
		label := "system_u:object_r:host" + string(rune('a'+i)) + "_t:s0"
		if err := unix.Lsetxattr(filepath.Join(s.layerPath(img.Layers[1]), "etc/added"), "security.selinux", []byte(label), 0); err != nil {
			t.Logf("cannot label a layer's file here: %v", err)
		}
		d, err := s.Disk(t.Context(), ref)
		if err != nil {
			t.Fatal(err)
		}
		if d.Path != s.diskPath(img.ID) {
			t.Errorf("disk at %s, want %s", d.Path, s.diskPath(img.ID))
		}
		sum, size, err := fileSHA256(d.Path)
		if err != nil {
			t.Fatal(err)
		}
		if sum != d.SHA256 || size != d.Size {
			t.Errorf("disk sha256 %s size %d, file has %s %d", d.SHA256, d.Size, sum, size)
		}
		// Made once: a second call returns the same file untouched.
		fi, _ := os.Stat(d.Path)
		again, err := s.Disk(t.Context(), img.ID)
		if err != nil || again != d {
			t.Fatalf("second Disk = %+v, %v; want %+v", again, err, d)
		}
		if fi2, _ := os.Stat(d.Path); !os.SameFile(fi, fi2) {
			t.Error("the disk was made again")
		}
		disks = append(disks, d)
	}
	if disks[0].SHA256 != disks[1].SHA256 {
		t.Fatalf("two stores made different disks of image %s: %s and %s", id, disks[0].SHA256, disks[1].SHA256)
	}

	root := mountDisk(t, disks[0].Path)
	if _, err := os.Stat(filepath.Join(root, "bin/busybox")); err != nil {
		t.Errorf("lower layer's file: %v", err)
	}
	if _, err := os.Lstat(filepath.Join(root, "etc/group")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("whiteout not applied: etc/group: %v", err)
	}
	if _, err := os.Lstat(filepath.Join(root, "etc/.wh.group")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("whiteout entry in the disk: %v", err)
	}
	if b, err := os.ReadFile(filepath.Join(root, "etc/passwd")); err != nil || !bytes.Contains(b, []byte("root")) {
		t.Errorf("etc/passwd = %q, %v", b, err)
	}
	ents, err := os.ReadDir(filepath.Join(root, "var"))
	if err != nil || len(ents) != 1 || ents[0].Name() != "only" {
		t.Errorf("opaque var/ has %v (%v), want only", ents, err)
	}
	p := filepath.Join(root, "etc/added")
	fi, err := os.Stat(p)
	if err != nil {
		t.Fatal(err)
	}
	if want := time.Date(2021, 3, 4, 5, 6, 7, 0, time.UTC); !fi.ModTime().Equal(want) {
		t.Errorf("etc/added mtime %v, want %v", fi.ModTime(), want)
	}
	buf := make([]byte, 64)
	n, err := unix.Lgetxattr(p, "user.origin", buf)
	if err != nil || string(buf[:n]) != "layer2" {
		t.Errorf("user.origin = %q, %v", buf[:max(n, 0)], err)
	}
	if n, err := unix.Lgetxattr(p, "security.selinux", buf); err == nil {
		t.Errorf("the host's SELinux label reached the disk: %q", buf[:n])
	}
	var st unix.Stat_t
	if err := unix.Stat(root, &st); err != nil || st.Mode&0o7777 != 0o755 || st.Uid != 0 || st.Mtim.Sec != 0 {
		t.Errorf("root %+v %v: want 0755 root-owned dated 0", st, err)
	}
}

func TestDiskSingleLayerAndRemove(t *testing.T) {
	needErofs(t)
	r := testregistry.Start(t)
	ref := r.PushBusybox(t, "busybox", "latest")
	s := newStore(t, Config{})
	img, err := s.Pull(pullCtx(t), ref, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	d, err := s.Disk(t.Context(), img.ID)
	if err != nil {
		t.Fatal(err)
	}
	root := mountDisk(t, d.Path)
	if _, err := os.Stat(filepath.Join(root, "bin/busybox")); err != nil {
		t.Errorf("single layer: %v", err)
	}
	if err := s.Remove(t.Context(), img.ID); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{d.Path, d.Path + ".sha256"} {
		if _, err := os.Stat(p); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s after the image was removed: %v", p, err)
		}
	}
	if ents, _ := os.ReadDir(s.disksDir()); len(ents) != 0 {
		t.Errorf("disks/ holds %v", ents)
	}
	if _, err := s.Disk(t.Context(), img.ID); !errdefs.IsNotFound(err) {
		t.Errorf("Disk of a removed image = %v, want NotFound", err)
	}
}

func TestDiskWithoutMkfs(t *testing.T) {
	requireRoot(t)
	r := testregistry.Start(t)
	ref := r.PushBusybox(t, "busybox", "latest")
	s := newStore(t, Config{})
	if _, err := s.Pull(pullCtx(t), ref, nil, nil); err != nil {
		t.Fatal(err)
	}
	old := mkfsErofs
	mkfsErofs = filepath.Join(t.TempDir(), "no-mkfs.erofs")
	t.Cleanup(func() { mkfsErofs = old })
	_, err := s.Disk(t.Context(), ref)
	if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "erofs-utils") {
		t.Fatalf("Disk without mkfs.erofs = %v, want FailedPrecondition naming erofs-utils", err)
	}
	if ents, _ := os.ReadDir(s.disksDir()); len(ents) != 0 {
		t.Errorf("disks/ holds %v", ents)
	}
}

func TestDiskUUID(t *testing.T) {
	a, b := diskUUID("sha256:aa"), diskUUID("sha256:bb")
	if a == b || a != diskUUID("sha256:aa") || len(a) != 36 || a[14] != '4' {
		t.Errorf("diskUUID: %s %s", a, b)
	}
}
