package network

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/errdefs"
)

// NetNSPath is where the network namespace of pod podID is bind-mounted. It
// does no I/O; the path exists only between NewNetNS and RemoveNetNS.
func (m *Manager) NetNSPath(podID string) string {
	return filepath.Join(m.cfg.RunDir, "netns", podID)
}

// NewNetNS creates a network namespace for pod podID, brings its loopback
// interface up and bind-mounts it at NetNSPath(podID), which it returns. It
// is idempotent: when a namespace is already mounted there, it returns the
// path. A leftover plain file there (a crash between creating the file and
// mounting) is replaced. Errors: ErrInvalidArgument for an unusable pod ID;
// others are unclassified system errors.
//
// The namespace is created on a dedicated OS thread that returns to the
// daemon's namespace afterwards, or is discarded when it cannot.
func (m *Manager) NewNetNS(ctx context.Context, podID string) (string, error) {
	if err := checkPodID(podID); err != nil {
		return "", err
	}
	path := m.NetNSPath(podID)
	if isNetNSMount(path) {
		return path, nil
	}
	if err := m.prepareNetNSDir(); err != nil {
		return "", err
	}
	// A plain file here is left from an interrupted NewNetNS.
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return "", fmt.Errorf("netns %s: %w", path, err)
	}
	f, err := os.OpenFile(path, os.O_RDONLY|os.O_CREATE|os.O_EXCL, 0o444)
	if err != nil {
		return "", fmt.Errorf("netns %s: %w", path, err)
	}
	f.Close()
	if err := onFreshThread(func() error { return unshareAndMount(path) }); err != nil {
		// The bind may not have happened (EINVAL); if it did and cannot
		// be detached, the file stays (Remove fails with EBUSY) and the
		// error says so.
		if uerr := unix.Unmount(path, unix.MNT_DETACH); uerr != nil && !errors.Is(uerr, unix.EINVAL) {
			err = fmt.Errorf("%w (and detaching it: %v)", err, uerr)
		}
		os.Remove(path)
		return "", fmt.Errorf("netns %s: %w", path, err)
	}
	m.log.DebugContext(ctx, "netns created", "pod", podID, "path", path)
	return path, nil
}

// unshareAndMount runs on a locked thread: it moves the thread into a new
// network namespace, brings lo up there and bind-mounts the namespace at
// path. The caller restores the thread's namespace.
func unshareAndMount(path string) error {
	if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
		return fmt.Errorf("unshare: %w", err)
	}
	if err := loopbackUp(); err != nil {
		return err
	}
	src := fmt.Sprintf("/proc/self/task/%d/ns/net", unix.Gettid())
	if err := unix.Mount(src, path, "", unix.MS_BIND, ""); err != nil {
		return fmt.Errorf("bind mount %s: %w", src, err)
	}
	return nil
}

// RemoveNetNS unmounts and removes the namespace bind mount at path. The
// namespace itself goes away once no process and no other mount holds it.
// Call it after Teardown: the bridge plugin finds the addresses whose
// masquerade rules it deletes inside the namespace, so a DEL without the
// namespace leaves those rules behind.
// Idempotent: a missing path is not an error. Errors: ErrInvalidArgument
// for a path that NewNetNS did not make (not directly under RunDir/netns);
// others are unclassified system errors.
func (m *Manager) RemoveNetNS(ctx context.Context, path string) error {
	if path == "" {
		return nil
	}
	if filepath.Dir(path) != filepath.Join(m.cfg.RunDir, "netns") {
		return errdefs.InvalidArgument("netns path %q is not under %s", path, filepath.Join(m.cfg.RunDir, "netns"))
	}
	for i := 0; i < 8 && isNetNSMount(path); i++ {
		if err := unix.Unmount(path, unix.MNT_DETACH); err != nil {
			if errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOENT) {
				break
			}
			return fmt.Errorf("unmount netns %s: %w", path, err)
		}
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove netns %s: %w", path, err)
	}
	m.log.DebugContext(ctx, "netns removed", "path", path)
	return nil
}

// NetNSPods lists the pod IDs that have a namespace file under
// RunDir/netns, for garbage collection after a crash.
func (m *Manager) NetNSPods() ([]string, error) {
	ents, err := os.ReadDir(filepath.Join(m.cfg.RunDir, "netns"))
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, nil
		}
		return nil, fmt.Errorf("list netns: %w", err)
	}
	ids := make([]string, 0, len(ents))
	for _, e := range ents {
		ids = append(ids, e.Name())
	}
	return ids, nil
}

func checkPodID(id string) error {
	if id == "" || id == "." || id == ".." || strings.ContainsAny(id, "/\x00") || len(id) > 200 {
		return errdefs.InvalidArgument("pod ID %q cannot name a network namespace", id)
	}
	return nil
}

// isNetNSMount reports whether path is a mounted network (nsfs) namespace.
func isNetNSMount(path string) bool {
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return false
	}
	return st.Type == unix.NSFS_MAGIC
}

// prepareNetNSDir makes RunDir/netns a shared mount point, once.
func (m *Manager) prepareNetNSDir() error {
	m.nsDirMu.Lock()
	defer m.nsDirMu.Unlock()
	if m.nsDirReady {
		return nil
	}
	dir := filepath.Join(m.cfg.RunDir, "netns")
	if err := makeSharedDir(dir); err != nil {
		return fmt.Errorf("netns dir %s: %w", dir, err)
	}
	m.nsDirReady = true
	return nil
}

// makeSharedDir creates dir and makes it a shared mount point, as iproute2
// does for /run/netns, so that namespace mounts made and removed here
// propagate to mount namespaces copied from the host's afterwards (a pod's
// mount namespace must not keep a removed pod namespace alive).
func makeSharedDir(dir string) error {
	if err := os.MkdirAll(dir, 0o711); err != nil {
		return err
	}
	err := unix.Mount("", dir, "", unix.MS_SHARED|unix.MS_REC, "")
	if err == nil {
		return nil
	}
	if !errors.Is(err, unix.EINVAL) {
		return fmt.Errorf("make shared: %w", err)
	}
	// Not a mount point yet: bind it onto itself first.
	if err := unix.Mount(dir, dir, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
		return fmt.Errorf("bind mount: %w", err)
	}
	if err := unix.Mount("", dir, "", unix.MS_SHARED|unix.MS_REC, ""); err != nil {
		return fmt.Errorf("make shared: %w", err)
	}
	return nil
}

// onFreshThread runs fn on an OS thread locked to one goroutine and then
// puts the thread back into the network namespace it had before. fn may
// change the thread's network namespace (setns, unshare) but nothing else
// about it. When the thread cannot be restored it stays locked, and the Go
// runtime ends it when the goroutine returns: no goroutine ever runs in a
// namespace it did not ask for.
func onFreshThread(fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := os.Open(fmt.Sprintf("/proc/self/task/%d/ns/net", unix.Gettid()))
		if err != nil {
			errc <- fmt.Errorf("open thread netns: %w", err)
			return // the thread is discarded
		}
		defer orig.Close()
		ferr := fn()
		if err := unix.Setns(int(orig.Fd()), unix.CLONE_NEWNET); err != nil {
			if ferr == nil {
				ferr = fmt.Errorf("restore thread netns: %w", err)
			}
			errc <- ferr
			return // still locked: the thread is discarded
		}
		runtime.UnlockOSThread()
		errc <- ferr
	}()
	return <-errc
}

// inNetNS runs fn on a thread that joined the network namespace at path;
// see onFreshThread. Errors: ErrNotFound when path is not a network
// namespace.
func inNetNS(path string, fn func() error) error {
	ns, err := os.Open(path)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return errdefs.NotFound("netns %s does not exist", path)
		}
		return fmt.Errorf("open netns: %w", err)
	}
	defer ns.Close()
	var st unix.Statfs_t
	if err := unix.Fstatfs(int(ns.Fd()), &st); err != nil {
		return fmt.Errorf("netns %s: %w", path, err)
	}
	if st.Type != unix.NSFS_MAGIC {
		return errdefs.NotFound("%s is not a network namespace", path)
	}
	return onFreshThread(func() error {
		if err := unix.Setns(int(ns.Fd()), unix.CLONE_NEWNET); err != nil {
			return fmt.Errorf("setns %s: %w", path, err)
		}
		return fn()
	})
}

// loopbackUp sets lo up in the calling thread's network namespace.
func loopbackUp() error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("loopback up: %w", err)
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq("lo")
	if err != nil {
		return fmt.Errorf("loopback up: %w", err)
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		return fmt.Errorf("loopback flags: %w", err)
	}
	if ifr.Uint16()&unix.IFF_UP != 0 {
		return nil
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	if err := unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr); err != nil {
		return fmt.Errorf("loopback up: %w", err)
	}
	return nil
}
