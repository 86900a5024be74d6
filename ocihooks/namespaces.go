package ocihooks

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/osthread"
)

// joined are the namespaces of the container's init a hook run by
// RunInNamespaces joins, in the order it joins them (the mount namespace
// last: it changes what /proc is). The pid namespace is the one the hook
// is created in.
var joined = []struct {
	name string
	kind int
}{
	{"cgroup", unix.CLONE_NEWCGROUP},
	{"ipc", unix.CLONE_NEWIPC},
	{"uts", unix.CLONE_NEWUTS},
	{"net", unix.CLONE_NEWNET},
	{"pid", unix.CLONE_NEWPID},
	{"mnt", unix.CLONE_NEWNS},
}

// RunInNamespaces runs the hooks of stage (createContainer or
// startContainer; any other is refused with ErrInvalidArgument) as Run
// does, but in the namespaces of the container's init, the process pid
// (as the runtime sees it): its cgroup, IPC, UTS, network, PID and mount
// namespaces, with its root directory as the hook's root and working
// directory. The state the hooks read has st.Pid replaced by pid as the
// container sees it (runtime.md: "for hooks executed in the container
// namespace, it is the pid as seen by the container").
//
// The namespaces are joined with setns(2) by a thread of the daemon that
// does nothing else and ends afterwards (internal/osthread), which then
// starts the hook: the hook is the daemon's child, so its argv[0], its
// environment, its timeout and its killing are exactly Run's. nsenter(1)
// would do the joining too, but it cannot set argv[0], and the hook would
// be nsenter's child, out of reach of the daemon's wait. The user
// namespace is not joined (the kernel refuses setns(CLONE_NEWUSER) to a
// process with more than one thread): the hook keeps the daemon's
// credentials, where runc's keep its init's (root of the container's user
// namespace when it has one).
//
// The hook's path is resolved in the container's root, which by the time
// the daemon can run a hook is the container's image (the agent has
// already pivoted into it; runc runs createContainer before pivot_root,
// where the path resolves in the runtime's tree). Run there with the
// daemon's privileges, a file of the image would be code of the
// container's author outside every confinement of the container. So the
// file at the path in the container must be the runtime's own file at the
// same path (same device and inode: mounted into the container from the
// host, as NRI and CDI do for the tools they inject); otherwise the hook
// is refused with ErrFailedPrecondition and not started.
func RunInNamespaces(ctx context.Context, stage Stage, hooks []Hook, st State, pid int) error {
	if !stage.InContainer() {
		return errdefs.InvalidArgument("ocihooks: RunInNamespaces cannot run %q hooks: they run in the runtime's namespaces (Run)", stage)
	}
	if len(hooks) == 0 {
		return nil
	}
	inner, err := innerPid(pid)
	if err != nil {
		return err
	}
	st.Pid = inner
	return runAll(ctx, stage, hooks, st, func(cmd *exec.Cmd) error { return startIn(pid, cmd) })
}

// innerPid is pid as the innermost PID namespace it is in sees it (the
// last NSpid of /proc/pid/status); ErrNotFound when pid is gone.
func innerPid(pid int) (int, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if os.IsNotExist(err) {
		return 0, errdefs.NotFound("ocihooks: the container's init %d is gone: %w", pid, err)
	}
	if err != nil {
		return 0, fmt.Errorf("ocihooks: %w", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), "NSpid:"); ok {
			fields := strings.Fields(rest)
			if len(fields) > 0 {
				return strconv.Atoi(fields[len(fields)-1])
			}
		}
	}
	return 0, fmt.Errorf("ocihooks: /proc/%d/status has no NSpid: %w", pid, sc.Err())
}

// startIn starts cmd in the namespaces of pid, with pid's root as its root
// and working directory, once cmd.Path there is found to be the runtime's
// own file.
func startIn(pid int, cmd *exec.Cmd) error {
	own, err := os.Stat(cmd.Path)
	if err != nil {
		return err
	}
	fds, root, err := openNamespaces(pid)
	if err != nil {
		return err
	}
	defer closeAll(append(fds, root))
	return osthread.Run(func() error {
		if err := enter(fds, root); err != nil {
			return err
		}
		if err := sameFile(own, cmd.Path); err != nil {
			return err
		}
		return cmd.Start()
	})
}

// openNamespaces opens pid's namespaces in the order of joined, and its
// root directory.
func openNamespaces(pid int) (fds []int, root int, err error) {
	for _, ns := range joined {
		fd, err := unix.Open(fmt.Sprintf("/proc/%d/ns/%s", pid, ns.name), unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			closeAll(fds)
			return nil, -1, errdefs.New(errdefs.ErrNotFound, "the %s namespace of the container's init %d: %w", ns.name, pid, err)
		}
		fds = append(fds, fd)
	}
	root, err = unix.Open(fmt.Sprintf("/proc/%d/root", pid), unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		closeAll(fds)
		return nil, -1, errdefs.New(errdefs.ErrNotFound, "the root of the container's init %d: %w", pid, err)
	}
	return fds, root, nil
}

// enter moves the calling thread, which osthread.Run discards afterwards,
// into the namespaces fds (in the order of joined) and root.
func enter(fds []int, root int) error {
	// A thread that shares its root and working directory with the
	// others cannot join a mount namespace.
	if err := unix.Unshare(unix.CLONE_FS); err != nil {
		return fmt.Errorf("unshare(CLONE_FS): %w", err)
	}
	for i, ns := range joined {
		if err := unix.Setns(fds[i], ns.kind); err != nil {
			return fmt.Errorf("join the container's %s namespace: %w", ns.name, err)
		}
	}
	if err := unix.Fchdir(root); err != nil {
		return fmt.Errorf("the container's root: %w", err)
	}
	if err := unix.Chroot("."); err != nil {
		return fmt.Errorf("the container's root: %w", err)
	}
	return nil
}

// sameFile refuses path, seen from the container, unless it is own, the
// runtime's file at that path.
func sameFile(own os.FileInfo, path string) error {
	in, err := os.Stat(path)
	if err != nil {
		return fmt.Errorf("in the container: %w", err)
	}
	if !os.SameFile(own, in) {
		return fmt.Errorf("%s in the container is not the runtime's file of that path: stagelet runs no file of a container's image with the runtime's privileges", path)
	}
	return nil
}

func closeAll(fds []int) {
	for _, fd := range fds {
		unix.Close(fd)
	}
}
