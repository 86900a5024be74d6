package supervisor

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	securejoin "github.com/cyphar/filepath-securejoin"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"
)

// mountIn resolves dest inside rootfs (symlinks are resolved as if rootfs
// were the root), creates it as a directory or an empty file if missing,
// and runs each step with a /proc/self/fd path naming it. Before every
// step the target is opened again without following a last symlink and
// checked to be still inside rootfs, so that a concurrent symlink swap
// cannot redirect a mount to the host, and so that a step after a mount
// acts on the new mount rather than on the directory it covers.
func mountIn(rootfs, dest string, dir bool, steps ...func(target string) error) error {
	p, err := securejoin.SecureJoin(rootfs, dest)
	if err != nil {
		return fmt.Errorf("mount %s: %w", dest, err)
	}
	if dir {
		err = os.MkdirAll(p, 0o755)
	} else {
		err = createFile(p)
	}
	if err != nil {
		return fmt.Errorf("mount %s: create target: %w", dest, err)
	}
	for _, step := range steps {
		if err := atTarget(rootfs, p, step); err != nil {
			return fmt.Errorf("mount %s: %w", dest, err)
		}
	}
	return nil
}

func atTarget(rootfs, p string, step func(target string) error) error {
	fd, err := unix.Open(p, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open target: %w", err)
	}
	defer unix.Close(fd)
	proc := "/proc/self/fd/" + strconv.Itoa(fd)
	real, err := os.Readlink(proc)
	if err != nil {
		return err
	}
	if !within(rootfs, real) {
		return fmt.Errorf("target resolved outside the rootfs (%s)", real)
	}
	return step(proc)
}

// within reports whether path is root or beneath it (both clean).
func within(root, path string) bool {
	root = filepath.Clean(root)
	path = filepath.Clean(path)
	return path == root || strings.HasPrefix(path, root+"/") || root == "/"
}

// createFile makes an empty file at p (and its parent directories) unless
// something is already there.
func createFile(p string) error {
	if _, err := os.Lstat(p); err == nil {
		return nil
	} else if !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		return err
	}
	f, err := os.OpenFile(p, os.O_CREATE|os.O_WRONLY|unix.O_NOFOLLOW, 0o644)
	if err != nil {
		return err
	}
	return f.Close()
}

// makeDevice makes the device node d in rootfs (mknod, then its owner and
// mode): its parent directories are made as needed and must resolve
// inside rootfs. A node already there as the same device (one of /dev's
// usual ones) is kept; anything else there is an error.
func makeDevice(rootfs string, d specs.LinuxDevice) error {
	p, err := securejoin.SecureJoin(rootfs, d.Path)
	if err != nil {
		return fmt.Errorf("device %s: %w", d.Path, err)
	}
	var typ uint32
	switch d.Type {
	case "c", "u":
		typ = unix.S_IFCHR
	case "b":
		typ = unix.S_IFBLK
	default:
		return fmt.Errorf("device %s: type %q", d.Path, d.Type)
	}
	rdev := unix.Mkdev(uint32(d.Major), uint32(d.Minor))
	var st unix.Stat_t
	if err := unix.Lstat(p, &st); err == nil {
		if st.Mode&unix.S_IFMT == typ && st.Rdev == rdev {
			return nil
		}
		return fmt.Errorf("device %s: the path is taken", d.Path)
	}
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		return fmt.Errorf("device %s: %w", d.Path, err)
	}
	return atTarget(rootfs, filepath.Dir(p), func(dir string) error {
		name := filepath.Base(p)
		mode := uint32(0o666)
		if d.FileMode != nil {
			mode = uint32(d.FileMode.Perm())
		}
		if err := unix.Mknod(filepath.Join(dir, name), typ|mode, int(rdev)); err != nil {
			return fmt.Errorf("device %s: mknod: %w", d.Path, err)
		}
		uid, gid := 0, 0
		if d.UID != nil {
			uid = int(*d.UID)
		}
		if d.GID != nil {
			gid = int(*d.GID)
		}
		if err := unix.Lchown(filepath.Join(dir, name), uid, gid); err != nil {
			return fmt.Errorf("device %s: chown: %w", d.Path, err)
		}
		// mknod's mode went through the umask.
		if err := unix.Chmod(filepath.Join(dir, name), mode); err != nil {
			return fmt.Errorf("device %s: chmod: %w", d.Path, err)
		}
		return nil
	})
}
