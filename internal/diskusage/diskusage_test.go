package diskusage

import (
	"os"
	"path/filepath"
	"syscall"
	"testing"
)

// Of counts allocated blocks, as du and containerd do, and a hard-linked
// file once.
func TestOf(t *testing.T) {
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
	bytes, inodes, err := Of(dir)
	if err != nil {
		t.Fatal(err)
	}
	if bytes != want || inodes != 3 {
		t.Errorf("Of = %d bytes, %d inodes; want %d bytes (the blocks of 2 directories and 1 file), 3 inodes", bytes, inodes, want)
	}
	if bytes < 10000 {
		t.Errorf("Of = %d bytes for a file of 10000", bytes)
	}
	if b, i, err := Of(filepath.Join(dir, "missing")); b != 0 || i != 0 || err != nil {
		t.Errorf("Of(missing) = %d, %d, %v", b, i, err)
	}
}
