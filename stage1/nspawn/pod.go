package nspawn

import (
	"fmt"
	"os"
	"strconv"

	"github.com/stagelet/stagelet/stage1/host"

	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/bindmount"
	"github.com/stagelet/stagelet/internal/osthread"
)

// shared is the pod's propagating directory: <RunDir>/mounts on the host,
// bound at /mnt/stagelet in the container. Containers reach the pod
// through it (host.SharedDir).
func (st *state) shared() host.SharedDir {
	d := host.SharedDir{Host: st.mounts(), InPod: podMounts}
	if m := st.UserNS; m != nil {
		d.UserNS = func() (*os.File, error) { return bindmount.UserNSFile(m.HostID, m.Size) }
	}
	return d
}

// bindShared is the pod's host.SharedDir.BindShared. systemd-nspawn makes
// every mount of its container a slave of the host's, so a bind beneath
// the propagating directory reaches the container as a slave. Instead, a
// recursive clone of src (open_tree: a peer of src's mount, when that is
// shared) is attached at host's place inside the container's own mount
// namespace, from a thread of the daemon that joins it. Nothing of it is
// mounted in the host's namespace.
func (p *Pod) bindShared(src, host string) error {
	inPod, err := p.dir.Map(host)
	if err != nil {
		return err
	}
	leader := p.st.leader()
	if leader == nil || !leader.Alive() {
		return errdefs.FailedPrecondition("nspawn: the pod's init is not known or not running: a bidirectional mount cannot be placed")
	}
	ns, err := os.Open("/proc/" + strconv.Itoa(leader.PID) + "/ns/mnt")
	if err != nil {
		return errdefs.FailedPrecondition("nspawn: the pod's mount namespace: %w", err)
	}
	defer ns.Close()
	tree, err := unix.OpenTree(unix.AT_FDCWD, src, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC|unix.AT_RECURSIVE)
	if err != nil {
		return fmt.Errorf("nspawn: clone %s: %w", src, err)
	}
	defer unix.Close(tree)
	// The thread leaves the daemon's mount namespace: it ends with fn.
	err = osthread.Run(func() error {
		// Only a thread with file system attributes of its own may join
		// a mount namespace.
		if err := unix.Unshare(unix.CLONE_FS); err != nil {
			return fmt.Errorf("unshare CLONE_FS: %w", err)
		}
		if err := unix.Setns(int(ns.Fd()), unix.CLONE_NEWNS); err != nil {
			return fmt.Errorf("join the pod's mount namespace: %w", err)
		}
		return unix.MoveMount(tree, "", unix.AT_FDCWD, inPod, unix.MOVE_MOUNT_F_EMPTY_PATH)
	})
	if err != nil {
		return fmt.Errorf("nspawn: place %s at %s in the pod: %w", src, inPod, err)
	}
	return nil
}
