// Package diskusage counts what a directory tree takes on disk, as du
// does and as containerd and CRI-O report image and writable layer usage.
package diskusage

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"
)

// Of returns the bytes allocated (blocks, not apparent sizes) and the
// inodes below dir, dir included; a file with several hard links counts
// once. Entries removed during the walk, or a missing dir, count as
// nothing. Other errors do not stop the count: the first is returned with
// the figures of what could be read.
func Of(dir string) (bytes, inodes uint64, err error) {
	seen := map[uint64]bool{}
	var first error
	note := func(err error) {
		if first == nil && !errors.Is(err, os.ErrNotExist) {
			first = err
		}
	}
	filepath.WalkDir(dir, func(_ string, d fs.DirEntry, err error) error {
		if err != nil {
			note(err)
			return nil
		}
		info, err := d.Info()
		if err != nil {
			note(err)
			return nil
		}
		st, ok := info.Sys().(*syscall.Stat_t)
		if !ok {
			return nil
		}
		if st.Nlink > 1 && !d.IsDir() {
			if seen[st.Ino] {
				return nil
			}
			seen[st.Ino] = true
		}
		inodes++
		bytes += uint64(st.Blocks) * 512
		return nil
	})
	return bytes, inodes, first
}
