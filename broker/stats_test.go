package broker

import (
	"os"
	"path/filepath"
	"syscall"
	"testing"
)

// duOf counts allocated blocks, as du and containerd do, and a hard-linked
// file once.
func TestDuOf(t *testing.T) {
	dir := t.TempDir()
	if err := os.Mkdir(filepath.Join(dir, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(dir, "sub", "f")
	if err := os.WriteFile(file, make([]byte, 10000), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Link(file, filepath.Join(dir, "link")); err != nil {
		t.Fatal(err)
	}
	var want uint64
	for _, p := range []string{dir, filepath.Join(dir, "sub"), file} {
		var st syscall.Stat_t
		if err := syscall.Stat(p, &st); err != nil {
			t.Fatal(err)
		}
		want += uint64(st.Blocks) * 512
	}
	bytes, inodes := duOf(dir)
	if bytes != want || inodes != 3 {
		t.Errorf("duOf = %d bytes, %d inodes; want %d bytes (the blocks of 2 directories and 1 file), 3 inodes", bytes, inodes, want)
	}
	if bytes < 10000 {
		t.Errorf("duOf = %d bytes for a file of 10000", bytes)
	}
	if b, i := duOf(filepath.Join(dir, "missing")); b != 0 || i != 0 {
		t.Errorf("duOf(missing) = %d, %d", b, i)
	}
}
