// Package atomicfile writes files so that a reader (or a restart after a
// crash) sees either the old content or the new, never a torn write.
package atomicfile

import (
	"os"
	"path/filepath"
	"strings"
)

// IsTemp reports whether name (a base name) is one of Write's temporary
// files: ".<name>.tmp-<random>", left behind only when the writer died
// before its rename, so never the file's committed content.
func IsTemp(name string) bool {
	i := strings.LastIndex(name, ".tmp-")
	return strings.HasPrefix(name, ".") && i > 1 && i+len(".tmp-") < len(name)
}

// Write replaces path with data: it writes a temp file in the same
// directory, fsyncs it, renames it over path and fsyncs the directory.
func Write(path string, data []byte, perm os.FileMode) error {
	return write(path, data, perm, true)
}

// WriteVolatile replaces path with data as Write does, without the
// fsyncs: for files under the run root, which a reboot discards (tmpfs
// on a node), so that surviving a power loss means nothing for them,
// while a reader or a restarted writer must still never see a torn file.
// Each fsync costs a millisecond or more where the run root is on a disk.
func WriteVolatile(path string, data []byte, perm os.FileMode) error {
	return write(path, data, perm, false)
}

func write(path string, data []byte, perm os.FileMode, durable bool) error {
	dir := filepath.Dir(path)
	f, err := os.CreateTemp(dir, "."+filepath.Base(path)+".tmp-*") // see IsTemp
	if err != nil {
		return err
	}
	tmp := f.Name()
	defer os.Remove(tmp) // no-op after a successful rename
	if _, err := f.Write(data); err != nil {
		f.Close()
		return err
	}
	if err := f.Chmod(perm); err != nil {
		f.Close()
		return err
	}
	if durable {
		if err := f.Sync(); err != nil {
			f.Close()
			return err
		}
	}
	if err := f.Close(); err != nil {
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		return err
	}
	if !durable {
		return nil
	}
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}
