// Package bindmount makes the bind mounts the daemon gives pods and
// containers: plain, or idmapped through a user namespace (open_tree,
// mount_setattr, move_mount), and the user namespaces such a bind maps
// with. The image store's idmapped layers and the binds of a container's
// paths into a pod (stage1/host's SharedDir) are made here alike.
package bindmount

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/errdefs"
)

// Bind binds src (recursively) onto dst, creating dst as a directory or an
// empty file to match src.
func Bind(src, dst string) error {
	if err := MakeTarget(src, dst); err != nil {
		return err
	}
	if err := unix.Mount(src, dst, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
		return fmt.Errorf("bind %s on %s: %w", src, dst, err)
	}
	return nil
}

// ErrNoIDMap says a file system cannot be mounted idmapped.
var ErrNoIDMap = errors.New("the file system cannot be idmapped")

// BindIDMapped binds src (recursively) onto dst, creating dst as Bind
// does, with the ID mapping of the user namespace userns: a file the host
// sees owned by ID n is owned by n inside that namespace (n mapped to the
// host's n+base: the pod's root owns what the host's root owns). The
// bind is a detached copy of src moved into place (open_tree,
// mount_setattr, move_mount). ErrNoIDMap (wrapped) when src's file
// system does not support idmapped mounts.
func BindIDMapped(src, dst string, userns *os.File) error {
	if err := MakeTarget(src, dst); err != nil {
		return err
	}
	fd, err := unix.OpenTree(unix.AT_FDCWD, src, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC|unix.AT_RECURSIVE)
	if err != nil {
		return fmt.Errorf("clone %s: %w", src, err)
	}
	defer unix.Close(fd)
	attr := unix.MountAttr{Attr_set: unix.MOUNT_ATTR_IDMAP, Userns_fd: uint64(userns.Fd())}
	if err := unix.MountSetattr(fd, "", unix.AT_EMPTY_PATH|unix.AT_RECURSIVE, &attr); err != nil {
		if errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOTSUP) {
			return fmt.Errorf("idmap %s: %w: %w", src, err, ErrNoIDMap)
		}
		return fmt.Errorf("idmap %s: %w", src, err)
	}
	if err := unix.MoveMount(fd, "", unix.AT_FDCWD, dst, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		return fmt.Errorf("bind %s on %s: %w", src, dst, err)
	}
	return nil
}

// MakeTarget creates dst as a directory or an empty file to match src,
// the mount point of a bind of src. FailedPrecondition when src is
// missing.
func MakeTarget(src, dst string) error {
	fi, err := os.Stat(src)
	if err != nil {
		return errdefs.FailedPrecondition("mount source: %w", err)
	}
	if fi.IsDir() {
		return os.MkdirAll(dst, 0o755)
	}
	f, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	return f.Close()
}

// UserNSFile opens a user namespace mapping size IDs from the host's
// hostID at its root (users and groups alike), for idmapped mounts: any namespace with the same mapping maps
// files the same way. It is made by a short-lived child (sleep) that is
// gone when UserNSFile returns; the namespace lives as long as the file.
func UserNSFile(hostID, size uint32) (*os.File, error) { return userNSFile(hostID, size, false) }

// ServedUserNSFile is UserNSFile for the idmapped mounts a host process
// running as root serves to a pod: qemu's 9p server creates each file
// and directory a kvm pod makes as root, then gives it the owner the
// guest asked for. An idmapped mount lets only an ID it maps create
// files, so the namespace also maps the host's root, to UnownedID on
// disk: a file keeps that owner only if the second step failed, and
// shows as the guest's root (outside the pod's range) in the VM.
func ServedUserNSFile(hostID, size uint32) (*os.File, error) {
	return userNSFile(hostID, size, true)
}

// UnownedID is the user and group ID that files created through a
// ServedUserNSFile mount by the host's root get on disk until they are
// given their owner: (uid_t)-2, the highest valid ID, which no ordinary
// user holds (old NFS set-ups named it nfsnobody).
const UnownedID = 1<<32 - 2

func userNSFile(hostID, size uint32, served bool) (*os.File, error) {
	ids := []syscall.SysProcIDMap{{ContainerID: 0, HostID: int(hostID), Size: int(size)}}
	if served {
		ids = append(ids, syscall.SysProcIDMap{ContainerID: UnownedID, HostID: 0, Size: 1})
	}
	cmd := exec.Command("sleep", "60")
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags:  syscall.CLONE_NEWUSER,
		UidMappings: ids,
		GidMappings: ids,
		Pdeathsig:   syscall.SIGKILL,
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("user namespace of %d IDs from %d: %w", size, hostID, err)
	}
	f, err := os.Open("/proc/" + strconv.Itoa(cmd.Process.Pid) + "/ns/user")
	_ = cmd.Process.Kill()
	_ = cmd.Wait()
	if err != nil {
		return nil, fmt.Errorf("user namespace of %d IDs from %d: %w", size, hostID, err)
	}
	return f, nil
}
