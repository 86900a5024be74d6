package image

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/test/testregistry"
)

// A container's writable layer, exported and imported under a second
// container of the same image, shows the same tree: what it added,
// changed and deleted, owners, modes, links and xattrs included.
func TestExportImportLayer(t *testing.T) {
	requireRoot(t)
	r := testregistry.Start(t)
	ref := r.PushBusybox(t, "busybox", "latest")
	s := newStore(t, Config{})
	img, err := s.Pull(pullCtx(t), ref, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	mount := func(dir string) string {
		t.Cleanup(func() { _ = s.UnmountRootfs(context.Background(), dir) })
		rootfs, err := s.MountRootfs(t.Context(), img.ID, dir, nil, "")
		if err != nil {
			t.Fatal(err)
		}
		return rootfs
	}
	dir1 := filepath.Join(t.TempDir(), "ctr1")
	root1 := mount(dir1)
	in := func(p string) string { return filepath.Join(root1, p) }
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.WriteFile(in("etc/new"), []byte("new file"), 0o640))
	must(os.Chown(in("etc/new"), 1000, 1001))
	must(os.WriteFile(in("etc/passwd"), []byte("root:x:0:0::/root:/bin/sh\n"), 0o644))
	must(os.Remove(in("etc/group")))
	// A directory of the image removed and made again: opaque.
	must(os.RemoveAll(in("bin")))
	must(os.MkdirAll(in("bin/spool"), 0o700))
	must(os.WriteFile(in("bin/spool/job"), []byte("job"), 0o600))
	must(os.WriteFile(in("hl1"), []byte("linked"), 0o4755))
	must(os.Chmod(in("hl1"), 0o4755))
	must(os.Link(in("hl1"), in("hl2")))
	must(os.Symlink("/etc/new", in("sym")))
	must(unix.Mkfifo(in("fifo"), 0o600))
	must(unix.Lsetxattr(in("etc/new"), "user.note", []byte("kept"), 0))

	var buf bytes.Buffer
	deleted, err := ExportLayer(dir1, &buf)
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"/etc/group"}; !slices.Equal(deleted, want) {
		t.Errorf("deleted = %q, want %q", deleted, want)
	}
	var names []string
	tr := tar.NewReader(bytes.NewReader(buf.Bytes()))
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		must(err)
		names = append(names, hdr.Name)
	}
	for _, want := range []string{"etc/.wh.group", "bin/", "bin/.wh..wh..opq", "bin/spool/job", "etc/new", "hl1", "hl2", "sym", "fifo"} {
		if !slices.Contains(names, want) {
			t.Errorf("layer tar lacks %s: %q", want, names)
		}
	}

	dir2 := filepath.Join(t.TempDir(), "ctr2")
	must(ImportLayer(t.Context(), dir2, bytes.NewReader(buf.Bytes()), slog.New(slog.DiscardHandler)))
	root2 := mount(dir2)
	if a, b := treeOf(t, root1), treeOf(t, root2); !slices.Equal(a, b) {
		t.Errorf("imported tree differs:\n%q\n%q", a, b)
	}
	for _, p := range []string{"etc/group", "bin/busybox"} {
		if _, err := os.Lstat(filepath.Join(root2, p)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("deleted %s is back: %v", p, err)
		}
	}
	if v, err := getXattr(filepath.Join(root2, "etc/new"), "user.note"); err != nil || string(v) != "kept" {
		t.Errorf("xattr: %q, %v", v, err)
	}
	var a, b unix.Stat_t
	must(unix.Lstat(filepath.Join(root2, "hl1"), &a))
	must(unix.Lstat(filepath.Join(root2, "hl2"), &b))
	if a.Ino != b.Ino {
		t.Error("hard link not kept")
	}

	// Only into an empty writable layer.
	if err := ImportLayer(t.Context(), dir2, bytes.NewReader(buf.Bytes()), slog.New(slog.DiscardHandler)); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Errorf("import over a layer: %v", err)
	}
}

// A layer tar reaching out of the layer is refused and leaves no layer.
func TestImportLayerRefusesEscape(t *testing.T) {
	requireRoot(t)
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: "../escape", Mode: 0o644}); err != nil {
		t.Fatal(err)
	}
	tw.Close()
	dir := t.TempDir()
	err := ImportLayer(t.Context(), dir, &buf, slog.New(slog.DiscardHandler))
	if !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("import: %v", err)
	}
	if _, err := os.Lstat(filepath.Join(dir, "upper")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("partial layer left: %v", err)
	}
	if _, err := os.Lstat(filepath.Join(filepath.Dir(dir), "escape")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("file written outside: %v", err)
	}
}

// treeOf lists root's entries with type, mode, owner, size, link target
// and content digest, in order.
func treeOf(t *testing.T, root string) []string {
	t.Helper()
	var out []string
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			return err
		}
		line := fmt.Sprintf("%s %o %d:%d", rel, st.Mode, st.Uid, st.Gid)
		switch {
		case d.Type()&fs.ModeSymlink != 0:
			l, err := os.Readlink(p)
			if err != nil {
				return err
			}
			line += " -> " + l
		case d.Type().IsRegular():
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			line += " " + string(b)
		}
		out = append(out, line)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}
