package mountsafe

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/internal/testutil"
)

func needRoot(t *testing.T) {
	t.Helper()
	testutil.NeedRoot(t, "mounts")
}

func write(t *testing.T, path string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
}

func exists(path string) bool {
	_, err := os.Lstat(path)
	return err == nil
}

func bind(t *testing.T, src, dst string) {
	t.Helper()
	if err := os.MkdirAll(dst, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount(src, dst, "", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(dst, unix.MNT_DETACH) })
}

func TestRemovesTreeAndLinksNotTargets(t *testing.T) {
	base := t.TempDir()
	outside := filepath.Join(base, "outside")
	write(t, filepath.Join(outside, "keep.txt"))
	tree := filepath.Join(base, "tree")
	write(t, filepath.Join(tree, "a", "b", "c.txt"))
	write(t, filepath.Join(tree, "top.txt"))
	if err := os.Symlink(outside, filepath.Join(tree, "a", "link")); err != nil {
		t.Fatal(err)
	}
	if err := RemoveAll(tree); err != nil {
		t.Fatal(err)
	}
	if exists(tree) {
		t.Error("the tree is still there")
	}
	if !exists(filepath.Join(outside, "keep.txt")) {
		t.Error("a file behind a symbolic link was removed")
	}
	if err := RemoveAll(tree); err != nil {
		t.Errorf("removing a missing path: %v", err)
	}
	if err := RemoveAll(filepath.Join(base, "no", "such", "dir")); err != nil {
		t.Errorf("removing beneath a missing path: %v", err)
	}
}

// TestStopsAtBindMounts: a bind of the same file system (same st_dev) is a
// mount too; what is beneath it survives, what is beside it goes.
func TestStopsAtBindMounts(t *testing.T) {
	needRoot(t)
	base := t.TempDir()
	vol := filepath.Join(base, "volume")
	write(t, filepath.Join(vol, "keep.txt"))
	write(t, filepath.Join(vol, "sub", "nested.txt"))
	tree := filepath.Join(base, "run")
	write(t, filepath.Join(tree, "state.json"))
	bind(t, vol, filepath.Join(tree, "ctr", "mounts", "data"))

	err := RemoveAll(tree)
	if !errors.Is(err, ErrMounted) {
		t.Fatalf("RemoveAll across a bind mount: %v, want ErrMounted", err)
	}
	for _, f := range []string{"keep.txt", "sub/nested.txt"} {
		if !exists(filepath.Join(vol, f)) {
			t.Errorf("%s was removed through the bind mount", f)
		}
	}
	if exists(filepath.Join(tree, "state.json")) {
		t.Error("a file beside the mount point stayed")
	}
	if err := unix.Unmount(filepath.Join(tree, "ctr", "mounts", "data"), 0); err != nil {
		t.Fatal(err)
	}
	if err := RemoveAll(tree); err != nil {
		t.Fatalf("after the unmount: %v", err)
	}
	if exists(tree) || !exists(filepath.Join(vol, "keep.txt")) {
		t.Error("after the unmount the tree should go and the volume stay")
	}
}

// TestPathItselfMounted: a mount at the path itself is not entered.
func TestPathItselfMounted(t *testing.T) {
	needRoot(t)
	base := t.TempDir()
	tree := filepath.Join(base, "tree")
	if err := os.Mkdir(tree, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", tree, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(tree, unix.MNT_DETACH) })
	write(t, filepath.Join(tree, "keep.txt"))
	if err := RemoveAll(tree); !errors.Is(err, ErrMounted) {
		t.Fatalf("RemoveAll of a mount point: %v, want ErrMounted", err)
	}
	if !exists(filepath.Join(tree, "keep.txt")) {
		t.Error("a file on the mounted tmpfs was removed")
	}
}

// TestFileBindMount: a file bind-mounted inside the tree keeps its source.
func TestFileBindMount(t *testing.T) {
	needRoot(t)
	base := t.TempDir()
	src := filepath.Join(base, "resolv.conf")
	write(t, src)
	tree := filepath.Join(base, "tree")
	dst := filepath.Join(tree, "etc", "resolv.conf")
	write(t, dst)
	if err := unix.Mount(src, dst, "", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(dst, unix.MNT_DETACH) })
	if err := RemoveAll(tree); err == nil {
		t.Error("RemoveAll removed a tree holding a mounted file")
	}
	if !exists(src) {
		t.Error("the source of a file bind mount was removed")
	}
}
