package image

import (
	"archive/tar"
	"bytes"
	"errors"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/test/testregistry"
)

var discard = slog.New(slog.NewTextHandler(io.Discard, nil))

func reg(name string, data string) testregistry.Entry {
	return testregistry.Entry{Header: tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: 0o644}, Data: []byte(data)}
}

func symlink(name, target string) testregistry.Entry {
	return testregistry.Entry{Header: tar.Header{Typeflag: tar.TypeSymlink, Name: name, Linkname: target, Mode: 0o777}}
}

func hardlink(name, target string) testregistry.Entry {
	return testregistry.Entry{Header: tar.Header{Typeflag: tar.TypeLink, Name: name, Linkname: target}}
}

func dirEntry(name string, mode int64) testregistry.Entry {
	return testregistry.Entry{Header: tar.Header{Typeflag: tar.TypeDir, Name: name, Mode: mode}}
}

// listTree returns every path under dir, relative, sorted.
func listTree(t *testing.T, dir string) []string {
	t.Helper()
	var out []string
	err := filepath.Walk(dir, func(p string, _ os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		if p != dir {
			rel, _ := filepath.Rel(dir, p)
			out = append(out, rel)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(out)
	return out
}

func TestUnpackHostile(t *testing.T) {
	isRoot := os.Geteuid() == 0
	tests := []struct {
		name     string
		entries  func(sentinel string) []testregistry.Entry
		needRoot bool
		wantErr  error  // class; nil for success
		errHas   string // text the error must carry (the entry name)
		check    func(t *testing.T, layer string)
	}{
		{
			name:    "dotdot escapes",
			entries: func(string) []testregistry.Entry { return []testregistry.Entry{reg("a/../../sentinel/evil", "x")} },
			wantErr: errdefs.ErrInvalidArgument, errHas: "a/../../sentinel/evil",
		},
		{
			name:    "absolute name",
			entries: func(string) []testregistry.Entry { return []testregistry.Entry{reg("/etc/evil", "x")} },
			wantErr: errdefs.ErrInvalidArgument, errHas: "/etc/evil",
		},
		{
			name: "dotdot inside the root is fine",
			entries: func(string) []testregistry.Entry {
				return []testregistry.Entry{reg("./a/b/../c", "x")}
			},
			check: func(t *testing.T, layer string) {
				if _, err := os.Stat(filepath.Join(layer, "a/c")); err != nil {
					t.Error(err)
				}
			},
		},
		{
			name: "write through absolute symlinked parent stays inside",
			entries: func(sentinel string) []testregistry.Entry {
				return []testregistry.Entry{symlink("link", sentinel), reg("link/evil", "x")}
			},
			check: func(t *testing.T, layer string) {
				// The absolute target is interpreted inside the layer.
				fi, err := os.Lstat(filepath.Join(layer, "link"))
				if err != nil || fi.Mode()&os.ModeSymlink == 0 {
					t.Errorf("link is not a symlink: %v", err)
				}
			},
		},
		{
			name: "write through relative symlinked parent stays inside",
			entries: func(string) []testregistry.Entry {
				return []testregistry.Entry{symlink("link", "../../sentinel"), reg("link/evil", "x")}
			},
			check: func(t *testing.T, layer string) {
				if _, err := os.Stat(filepath.Join(layer, "sentinel/evil")); err != nil {
					t.Errorf("the write did not land inside the layer: %v", err)
				}
			},
		},
		{
			name: "symlink to root then a nested write",
			entries: func(string) []testregistry.Entry {
				return []testregistry.Entry{symlink("rootlink", "/"), reg("rootlink/tmp/evil", "x")}
			},
			check: func(t *testing.T, layer string) {
				if _, err := os.Stat(filepath.Join(layer, "tmp/evil")); err != nil {
					t.Error(err)
				}
			},
		},
		{
			name: "file replaces a symlink instead of writing through it",
			entries: func(sentinel string) []testregistry.Entry {
				return []testregistry.Entry{symlink("f", filepath.Join(sentinel, "f")), reg("f", "inside")}
			},
			check: func(t *testing.T, layer string) {
				fi, err := os.Lstat(filepath.Join(layer, "f"))
				if err != nil || !fi.Mode().IsRegular() {
					t.Errorf("f is not a regular file: %v", err)
				}
			},
		},
		{
			name: "symlink target text is kept",
			entries: func(string) []testregistry.Entry {
				return []testregistry.Entry{symlink("sh", "/bin/busybox"), symlink("up", "../../../x")}
			},
			check: func(t *testing.T, layer string) {
				for n, want := range map[string]string{"sh": "/bin/busybox", "up": "../../../x"} {
					if got, _ := os.Readlink(filepath.Join(layer, n)); got != want {
						t.Errorf("%s -> %q, want %q", n, got, want)
					}
				}
			},
		},
		{
			name:    "hardlink to outside",
			entries: func(string) []testregistry.Entry { return []testregistry.Entry{hardlink("hl", "../sentinel/keep")} },
			wantErr: errdefs.ErrInvalidArgument, errHas: "../sentinel/keep",
		},
		{
			name: "hardlink through a symlink to outside",
			entries: func(sentinel string) []testregistry.Entry {
				return []testregistry.Entry{symlink("ln", sentinel), hardlink("hl", "ln/keep")}
			},
			wantErr: errdefs.ErrInvalidArgument, errHas: "ln/keep",
		},
		{
			name: "hardlink to a directory",
			entries: func(string) []testregistry.Entry {
				return []testregistry.Entry{dirEntry("d/", 0o755), hardlink("hl", "d")}
			},
			wantErr: errdefs.ErrInvalidArgument, errHas: "directory",
		},
		{
			name: "hardlink inside",
			entries: func(string) []testregistry.Entry {
				return []testregistry.Entry{reg("a", "data"), hardlink("b", "a")}
			},
			check: func(t *testing.T, layer string) {
				a, _ := os.Stat(filepath.Join(layer, "a"))
				b, err := os.Stat(filepath.Join(layer, "b"))
				if err != nil || !os.SameFile(a, b) {
					t.Errorf("b is not a hard link of a: %v", err)
				}
			},
		},
		{
			name: "device nodes are skipped",
			entries: func(string) []testregistry.Entry {
				return []testregistry.Entry{
					{Header: tar.Header{Typeflag: tar.TypeChar, Name: "dev/mem", Mode: 0o600, Devmajor: 1, Devminor: 1}},
					{Header: tar.Header{Typeflag: tar.TypeBlock, Name: "dev/sda", Mode: 0o600, Devmajor: 8}},
				}
			},
			check: func(t *testing.T, layer string) {
				for _, n := range []string{"dev/mem", "dev/sda"} {
					if _, err := os.Lstat(filepath.Join(layer, n)); !errors.Is(err, os.ErrNotExist) {
						t.Errorf("%s was created (err %v)", n, err)
					}
				}
			},
		},
		{
			name: "fifo and special mode bits",
			entries: func(string) []testregistry.Entry {
				return []testregistry.Entry{
					{Header: tar.Header{Typeflag: tar.TypeFifo, Name: "fifo", Mode: 0o644}},
					{Header: tar.Header{Typeflag: tar.TypeReg, Name: "suid", Mode: 0o4755}, Data: []byte("x")},
					dirEntry("tmp/", 0o1777),
				}
			},
			check: func(t *testing.T, layer string) {
				if fi, err := os.Lstat(filepath.Join(layer, "fifo")); err != nil || fi.Mode()&os.ModeNamedPipe == 0 {
					t.Errorf("fifo: %v %v", fi, err)
				}
				if fi, _ := os.Stat(filepath.Join(layer, "suid")); fi.Mode()&os.ModeSetuid == 0 {
					t.Errorf("suid lost: %v", fi.Mode())
				}
				if fi, _ := os.Stat(filepath.Join(layer, "tmp")); fi.Mode()&os.ModeSticky == 0 || fi.Mode().Perm() != 0o777 {
					t.Errorf("tmp mode %v", fi.Mode())
				}
			},
		},
		{
			name: "whiteout",
			entries: func(string) []testregistry.Entry {
				return []testregistry.Entry{dirEntry("a/", 0o755), reg("a/.wh.gone", "")}
			},
			needRoot: true,
			check: func(t *testing.T, layer string) {
				var st unix.Stat_t
				if err := unix.Lstat(filepath.Join(layer, "a/gone"), &st); err != nil {
					t.Fatal(err)
				}
				if st.Mode&unix.S_IFMT != unix.S_IFCHR || st.Rdev != 0 {
					t.Errorf("a/gone is not a 0:0 char device: mode %o rdev %d", st.Mode, st.Rdev)
				}
				if _, err := os.Lstat(filepath.Join(layer, "a/.wh.gone")); err == nil {
					t.Error("the .wh. entry itself was created")
				}
			},
		},
		{
			name: "whiteout through a symlinked parent stays inside",
			entries: func(sentinel string) []testregistry.Entry {
				return []testregistry.Entry{symlink("s", sentinel), reg("s/.wh.keep", "")}
			},
			needRoot: true,
		},
		{
			name: "opaque directory",
			entries: func(string) []testregistry.Entry {
				return []testregistry.Entry{dirEntry("o/", 0o755), reg("o/.wh..wh..opq", "")}
			},
			needRoot: true,
			check: func(t *testing.T, layer string) {
				buf := make([]byte, 8)
				n, err := unix.Lgetxattr(filepath.Join(layer, "o"), "trusted.overlay.opaque", buf)
				if err != nil || string(buf[:n]) != "y" {
					t.Errorf("opaque xattr: %q %v", buf[:n], err)
				}
			},
		},
		{
			name: "overlay xattrs from the archive are ignored",
			entries: func(string) []testregistry.Entry {
				return []testregistry.Entry{{Header: tar.Header{Typeflag: tar.TypeDir, Name: "x/", Mode: 0o755,
					PAXRecords: map[string]string{"SCHILY.xattr.trusted.overlay.redirect": "/etc", "SCHILY.xattr.user.ok": "1"}}}}
			},
			check: func(t *testing.T, layer string) {
				buf := make([]byte, 64)
				if _, err := unix.Lgetxattr(filepath.Join(layer, "x"), "trusted.overlay.redirect", buf); err == nil {
					t.Error("trusted.overlay.redirect was applied")
				}
			},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if tc.needRoot && !isRoot {
				t.Skip("whiteouts need root (mknod, trusted.* xattrs)")
			}
			base := t.TempDir()
			layer := filepath.Join(base, "layer", "inner")
			sentinel := filepath.Join(base, "sentinel")
			for _, d := range []string{layer, sentinel} {
				if err := os.MkdirAll(d, 0o755); err != nil {
					t.Fatal(err)
				}
			}
			if err := os.WriteFile(filepath.Join(sentinel, "keep"), []byte("keep"), 0o644); err != nil {
				t.Fatal(err)
			}
			// The layer sits two levels down so that "../../sentinel" from
			// inside it would reach the sentinel.
			layer = filepath.Join(base, "layer", "inner")
			b, err := testregistry.TarBytes(tc.entries(sentinel)...)
			if err != nil {
				t.Fatal(err)
			}
			_, err = unpackLayer(t.Context(), bytes.NewReader(b), layer, discard)
			switch {
			case tc.wantErr == nil && err != nil:
				t.Fatalf("unpack: %v", err)
			case tc.wantErr != nil && !errors.Is(err, tc.wantErr):
				t.Fatalf("unpack error = %v, want class %v", err, tc.wantErr)
			case tc.wantErr != nil && !strings.Contains(err.Error(), tc.errHas):
				t.Fatalf("unpack error %q does not mention %q", err, tc.errHas)
			}
			if got := listTree(t, sentinel); !slices.Equal(got, []string{"keep"}) {
				t.Errorf("sentinel dir changed: %v", got)
			}
			if got, _ := os.ReadFile(filepath.Join(sentinel, "keep")); string(got) != "keep" {
				t.Errorf("sentinel file changed: %q", got)
			}
			if got := listTree(t, base); !slices.Equal(got[:2], []string{"layer", "layer/inner"}) || slices.ContainsFunc(got, func(p string) bool {
				return !strings.HasPrefix(p, "layer") && !strings.HasPrefix(p, "sentinel")
			}) {
				t.Errorf("unexpected paths beside the layer: %v", got)
			}
			if tc.check != nil && err == nil {
				tc.check(t, layer)
			}
		})
	}
}

func TestEntryPath(t *testing.T) {
	for in, want := range map[string]string{
		"a/b": "a/b", "./a//b/": "a/b", "./": ".", "a/../b": "b", "a/..": ".",
	} {
		got, err := entryPath(in)
		if err != nil || got != want {
			t.Errorf("entryPath(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	for _, bad := range []string{"", "/a", "..", "../a", "a/../../b", "a/b/../../.."} {
		if _, err := entryPath(bad); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("entryPath(%q) = %v, want ErrInvalidArgument", bad, err)
		}
	}
}
