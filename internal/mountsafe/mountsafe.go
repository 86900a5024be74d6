// Package mountsafe removes directory trees without ever reaching through
// a mount: what is mounted at or beneath the tree belongs to someone else
// (a volume, the host's root, a container's rootfs) and stays. It also
// lists and detaches the mounts beneath a directory the daemon made
// (MountsUnder, UnmountAll), so that the directory can go
// (RemoveUnmounted).
package mountsafe

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// ErrMounted says a mount point was found where a removal would have
// continued into it.
var ErrMounted = errors.New("a mount point is in the way")

// RemoveAll removes path and everything beneath it that lies on the same
// mount as path's own directory entry. It never opens a directory on
// another mount: when path itself, or any directory beneath it, is a mount
// point, it removes what it can beside it and fails with ErrMounted,
// naming the mount point. Symbolic links are removed, never followed. A
// missing path is not an error. Mounts are told apart by mount ID (statx
// STATX_MNT_ID, or name_to_handle_at on kernels before 5.8), so a bind of
// the same file system counts as a mount.
func RemoveAll(path string) error {
	path = filepath.Clean(path)
	parent, err := unix.Open(filepath.Dir(path), unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.ENOENT) {
		return nil
	} else if err != nil {
		return &os.PathError{Op: "open", Path: filepath.Dir(path), Err: err}
	}
	defer unix.Close(parent)
	// The entry's own mount: that of its parent directory, unless the
	// parent is itself the root of a mount that only covers it.
	mnt, err := mountID(parent, "")
	if err != nil {
		return &os.PathError{Op: "mount id", Path: filepath.Dir(path), Err: err}
	}
	err = removeAt(parent, filepath.Base(path), path, mnt)
	if errors.Is(err, unix.ENOENT) {
		return nil
	}
	return err
}

// removeAt removes name in the directory dirfd (shown as path in errors),
// which lies on mount mnt.
func removeAt(dirfd int, name, path string, mnt uint64) error {
	var st unix.Stat_t
	if err := unix.Fstatat(dirfd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return &os.PathError{Op: "stat", Path: path, Err: err}
	}
	if st.Mode&unix.S_IFMT != unix.S_IFDIR {
		// Unlinking a file never reaches what is mounted on it: the
		// kernel refuses (EBUSY) in this namespace and removes only the
		// name elsewhere.
		if err := unix.Unlinkat(dirfd, name, 0); err != nil && !errors.Is(err, unix.ENOENT) {
			return &os.PathError{Op: "unlinkat", Path: path, Err: err}
		}
		return nil
	}
	fd, err := unix.Openat(dirfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return &os.PathError{Op: "openat", Path: path, Err: err}
	}
	id, err := mountID(fd, "")
	if err != nil {
		unix.Close(fd)
		return &os.PathError{Op: "mount id", Path: path, Err: err}
	}
	if id != mnt {
		unix.Close(fd)
		return fmt.Errorf("remove %s: %w: %s is a mount point", path, ErrMounted, path)
	}
	errs := removeEntries(fd, path, mnt)
	unix.Close(fd)
	if errs != nil {
		return errs
	}
	if err := unix.Unlinkat(dirfd, name, unix.AT_REMOVEDIR); err != nil && !errors.Is(err, unix.ENOENT) {
		return &os.PathError{Op: "unlinkat", Path: path, Err: err}
	}
	return nil
}

// removeEntries removes every entry of the open directory fd.
func removeEntries(fd int, path string, mnt uint64) error {
	var errs []error
	for {
		// Read a batch of names, remove them, read again from the start:
		// the directory changes under the offset as entries go.
		names, err := readNames(fd)
		if err != nil {
			return &os.PathError{Op: "readdir", Path: path, Err: err}
		}
		progress := false
		for _, n := range names {
			err := removeAt(fd, n, filepath.Join(path, n), mnt)
			if err == nil {
				progress = true
			} else if !errors.Is(err, unix.ENOENT) {
				errs = append(errs, err)
			}
		}
		if len(errs) > 0 || !progress {
			return errors.Join(errs...)
		}
	}
}

// readNames reads the names in the open directory fd from its start.
func readNames(fd int) ([]string, error) {
	if _, err := unix.Seek(fd, 0, 0); err != nil {
		return nil, err
	}
	var names []string
	buf := make([]byte, 32*1024)
	for {
		n, err := unix.Getdents(fd, buf)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return nil, err
		}
		if n <= 0 {
			return names, nil
		}
		_, _, names = unix.ParseDirent(buf[:n], -1, names)
	}
}

// mountID returns the ID of the mount that name in dirfd (the directory
// itself when name is empty) lies on.
func mountID(dirfd int, name string) (uint64, error) {
	flags := unix.AT_SYMLINK_NOFOLLOW
	if name == "" {
		flags |= unix.AT_EMPTY_PATH
	}
	var stx unix.Statx_t
	err := unix.Statx(dirfd, name, flags, unix.STATX_MNT_ID, &stx)
	if err == nil && stx.Mask&unix.STATX_MNT_ID != 0 {
		return stx.Mnt_id, nil
	}
	if err != nil && !errors.Is(err, unix.ENOSYS) {
		return 0, err
	}
	_, id, err := unix.NameToHandleAt(dirfd, name, flags&^unix.AT_SYMLINK_NOFOLLOW)
	if err != nil {
		return 0, fmt.Errorf("cannot tell mounts apart here (no STATX_MNT_ID, name_to_handle_at: %w)", err)
	}
	return uint64(id), nil
}
