package image

import (
	"archive/tar"
	"bytes"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/stagelet/stagelet/test/testregistry"
)

// FuzzUnpackLayer: whatever a layer holds, unpacking it never panics and
// writes nothing outside its target directory: a sentinel beside the
// target is untouched and nothing appears next to it.
func FuzzUnpackLayer(f *testing.F) {
	seeds := [][]testregistry.Entry{
		{dirEntry("etc/", 0o755), reg("etc/passwd", "root:x:0:0::/root:/bin/sh\n"), symlink("bin", "usr/bin"), hardlink("etc/passwd2", "etc/passwd")},
		{symlink("escape", "../outside"), reg("escape/sentinel", "overwritten")},
		{symlink("abs", "/"), reg("abs/tmp/x", "x"), hardlink("h", "../outside/sentinel")},
		{reg("a/.wh.b", ""), reg("a/.wh..wh..opq", ""), dirEntry("a/c/", 0o700)},
		{symlink("d", "."), symlink("d/e", "../.."), reg("d/e/f", "f")},
	}
	for _, s := range seeds {
		b, err := testregistry.TarBytes(s...)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Add([]byte{})
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: "../../x", Size: 1})
	tw.Write([]byte("x"))
	tw.Close()
	f.Add(buf.Bytes())
	base := f.TempDir()
	f.Fuzz(func(t *testing.T, layer []byte) {
		dir, err := os.MkdirTemp(base, "")
		if err != nil {
			t.Fatal(err)
		}
		defer os.RemoveAll(dir)
		outside := filepath.Join(dir, "outside")
		target := filepath.Join(dir, "target")
		for _, d := range []string{outside, target} {
			if err := os.Mkdir(d, 0o755); err != nil {
				t.Fatal(err)
			}
		}
		if err := os.WriteFile(filepath.Join(outside, "sentinel"), []byte("keep"), 0o644); err != nil {
			t.Fatal(err)
		}
		done := make(chan struct{})
		go func() {
			defer close(done)
			_, _ = unpackLayer(t.Context(), bytes.NewReader(layer), target, discard)
		}()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			t.Fatalf("unpacking a %d-byte layer has not returned after 10s", len(layer))
		}
		if got := listTree(t, outside); !slices.Equal(got, []string{"sentinel"}) {
			t.Fatalf("unpacking wrote beside its target: %v", got)
		}
		if b, err := os.ReadFile(filepath.Join(outside, "sentinel")); err != nil || string(b) != "keep" {
			t.Fatalf("the sentinel beside the target: %q, %v", b, err)
		}
		ents, _ := os.ReadDir(dir)
		if len(ents) != 2 {
			t.Fatalf("unpacking made %d entries beside its target", len(ents)-2)
		}
		// The temporary directory's cleanup must be able to remove what
		// was unpacked (read-only directories included).
		filepath.WalkDir(target, func(p string, d os.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				os.Chmod(p, 0o755)
			}
			return nil
		})
	})
}
