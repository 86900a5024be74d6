package host

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/bindmount"
	"github.com/stagelet/stagelet/internal/lsm"
	"github.com/stagelet/stagelet/internal/mountsafe"
	"github.com/stagelet/stagelet/stage1"
)

// SharedDir is how a pod whose agent does not see the host's files (an
// nspawn container, a VM) reaches what the daemon prepares after the pod
// started: a host directory with shared mount propagation, which the pod
// has at InPod (an nspawn bind, a VM's shared filesystem). For each
// container the backend binds the rootfs, the log directory (unless the
// daemon writes the log: AppSpec.HostLog) and every mount source beneath
// it, and the agent is given the in-pod paths.
type SharedDir struct {
	// Host is the directory on the host; InPod is where the agent sees it.
	Host, InPod string
	// BindShared places the source of a bidirectional (rshared) mount at
	// a host path beneath Host, which exists (a directory or a file like
	// the source), so that the agent sees it there as a peer of the
	// source's mount: a bind through the propagating directory arrives
	// as a slave, which propagates nothing back. Nil: the pod cannot
	// have such mounts (InvalidArgument).
	BindShared func(src, host string) error
	// UnbindSourcesOnStart undoes the host-side binds of a container's
	// mount sources once it started (Started): the app holds its own
	// mounts in its own namespace by then, and a bind left in the host's
	// namespace would keep the host from removing a volume's mount points
	// (EBUSY) while the container runs, where runc's containers do not.
	// Not for a pod that reaches the binds through a file server (a VM).
	UnbindSourcesOnStart bool
	// UserNS, when set, opens the pod's user namespace: the binds of a
	// container's rootfs, log directory and mount sources are then
	// idmapped with it (bindmount.BindIDMapped), so that the pod's root
	// owns what the host's root owns; a mount source whose file system cannot be
	// idmapped is bound as it is (its files then show as the overflow ID
	// in the pod). The directories beneath Host are made traversable by
	// the pod's IDs.
	UserNS func() (*os.File, error)
	// LabelLogs gives a container's log directory the container's
	// SELinux mount label before it is bound (where SELinux is enabled):
	// a VM's qemu, confined at its pod's level, writes the logs its guest
	// sends through the file server. An nspawn pod's agent, unconfined,
	// writes its own.
	LabelLogs bool
}

var _ stage1.ContainerPaths = SharedDir{}

// Prepare creates the directory and makes it a shared mount point (a bind
// of itself), so that mounts made beneath it later propagate into the pod.
// Idempotent.
func (d SharedDir) Prepare() error {
	if err := os.MkdirAll(d.Host, 0o700); err != nil {
		return err
	}
	if d.UserNS != nil {
		// The pod's root is not the host's: it may only pass through.
		if err := os.Chmod(d.Host, 0o711); err != nil {
			return err
		}
	}
	ms, err := mountsafe.MountsUnder(d.Host)
	if err != nil {
		return err
	}
	if !slices.Contains(ms, filepath.Clean(d.Host)) {
		if err := unix.Mount(d.Host, d.Host, "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("bind %s: %w", d.Host, err)
		}
	}
	if err := unix.Mount("", d.Host, "", unix.MS_SHARED, ""); err != nil {
		return fmt.Errorf("make %s shared: %w", d.Host, err)
	}
	return nil
}

// Release unmounts everything beneath the directory, and the directory
// itself, and removes it. Idempotent; never removes across a mount.
func (d SharedDir) Release() error { return mountsafe.RemoveUnmounted(d.Host) }

// Map is the pod's PathMapper: a host path beneath the directory maps to
// the same path beneath InPod; any other path is not reachable from inside
// the pod (InvalidArgument).
func (d SharedDir) Map(host string) (string, error) {
	rel, err := filepath.Rel(d.Host, filepath.Clean(host))
	if err != nil || rel == ".." || strings.HasPrefix(rel, "../") {
		return "", errdefs.InvalidArgument("%s is not reachable from inside the pod", host)
	}
	return filepath.Join(d.InPod, rel), nil
}

func (d SharedDir) containerDir(id string) (string, error) {
	if id == "" || id == "." || id == ".." || strings.ContainsAny(id, "/\x00") {
		return "", errdefs.InvalidArgument("bad container id %q", id)
	}
	return filepath.Join(d.Host, id), nil
}

// BindContainer binds a container's rootfs, log directory and mount
// sources beneath the directory (<Host>/<id>/rootfs, log, m<N>) and returns
// the spec with those host paths, for the pod's PathMapper to map. exists
// tells whether the agent already knows the container: a directory left by
// a create that did not finish is released and made again. Errors:
// InvalidArgument (bad id or paths), AlreadyExists, FailedPrecondition (a
// mount source that does not exist). On failure nothing stays bound, or
// the error says what could not be undone.
func (d SharedDir) BindContainer(ctx context.Context, spec *stage1.ContainerSpec, exists func(context.Context, string) (bool, error)) (_ *stage1.ContainerSpec, retErr error) {
	if spec == nil || spec.Rootfs == "" {
		return nil, errdefs.InvalidArgument("create container: no rootfs")
	}
	dir, err := d.containerDir(spec.ID)
	if err != nil {
		return nil, err
	}
	if err := makeContainerDir(ctx, dir, spec.ID, exists); err != nil {
		return nil, err
	}
	defer func() {
		if retErr == nil {
			return
		}
		if err := mountsafe.RemoveUnmounted(dir); err != nil {
			retErr = errors.Join(retErr, fmt.Errorf("undoing the binds of container %s: %w", spec.ID, err))
		}
	}()
	bind, closeNS, err := d.binder(spec.ID, dir)
	if err != nil {
		return nil, err
	}
	defer closeNS()
	inPod := *spec
	inPod.Rootfs = filepath.Join(dir, "rootfs")
	if err := bind(spec.Rootfs, inPod.Rootfs); err != nil {
		return nil, fmt.Errorf("container %s: rootfs: %w", spec.ID, err)
	}
	if spec.LogPath != "" && !spec.HostLog {
		if inPod.LogPath, err = bindLogDir(spec, dir, bind, d.LabelLogs); err != nil {
			return nil, err
		}
	}
	if len(spec.Mounts) > 0 {
		if inPod.Mounts, err = d.bindSources(spec, dir, bind); err != nil {
			return nil, err
		}
	}
	return &inPod, nil
}

// makeContainerDir creates dir, the directory of container id. When it
// is there already, exists asks whether the agent knows the container:
// if so AlreadyExists (dir is left as it is); if not it was left by a
// create that did not finish, and is released and made again.
func makeContainerDir(ctx context.Context, dir, id string, exists func(context.Context, string) (bool, error)) error {
	if err := os.Mkdir(dir, 0o700); errors.Is(err, os.ErrExist) {
		known, err := exists(ctx, id)
		if err != nil {
			return err
		}
		if known {
			return errdefs.AlreadyExists("container %q already exists", id)
		}
		if err := mountsafe.RemoveUnmounted(dir); err != nil {
			return fmt.Errorf("container %s: %w", id, err)
		}
		if err := os.Mkdir(dir, 0o700); err != nil {
			return err
		}
	} else if err != nil {
		return err
	}
	return nil
}

// binder is how a container's rootfs, log directory and mount sources
// are bound beneath dir, its directory: as they are, or with UserNS
// idmapped with the pod's user namespace (dir is then made traversable
// by the pod's IDs). The caller calls closeNS once it is done binding;
// on error there is nothing to close.
func (d SharedDir) binder(id, dir string) (bind func(src, dst string) error, closeNS func(), err error) {
	if d.UserNS == nil {
		return bindmount.Bind, func() {}, nil
	}
	ns, err := d.UserNS()
	if err != nil {
		return nil, nil, fmt.Errorf("container %s: the pod's user namespace: %w", id, err)
	}
	if err := os.Chmod(dir, 0o711); err != nil {
		ns.Close()
		return nil, nil, err
	}
	// A file system that cannot be idmapped is bound as it is: a
	// container rootfs the image store mounted over idmapped layers
	// (overlayfs itself cannot be), a volume whose files then show
	// as the overflow ID in the pod.
	bind = func(src, dst string) error {
		err := bindmount.BindIDMapped(src, dst, ns)
		if errors.Is(err, bindmount.ErrNoIDMap) {
			return bindmount.Bind(src, dst)
		}
		return err
	}
	return bind, func() { ns.Close() }, nil
}

// bindLogDir binds the directory of spec's log path (made first, and
// given the container's mount label when label) at <dir>/log and returns
// the log path beneath it. InvalidArgument: a relative log path.
func bindLogDir(spec *stage1.ContainerSpec, dir string, bind func(src, dst string) error, label bool) (string, error) {
	if !filepath.IsAbs(spec.LogPath) {
		return "", errdefs.InvalidArgument("container %s: log path %q is not absolute", spec.ID, spec.LogPath)
	}
	logDir := filepath.Dir(spec.LogPath)
	if err := os.MkdirAll(logDir, 0o755); err != nil {
		return "", fmt.Errorf("container %s: log: %w", spec.ID, err)
	}
	if label {
		if err := lsm.Relabel(logDir, spec.SELinuxMountLabel); err != nil {
			return "", fmt.Errorf("container %s: log: %w", spec.ID, err)
		}
	}
	if err := bind(logDir, filepath.Join(dir, "log")); err != nil {
		return "", fmt.Errorf("container %s: log: %w", spec.ID, err)
	}
	return filepath.Join(dir, "log", filepath.Base(spec.LogPath)), nil
}

// bindSources binds the source of each of spec's mounts at <dir>/m<N>, a
// bidirectional (rshared) one with BindShared, and returns a copy of the
// mounts with those sources, in order. It stops at the first that fails;
// what it bound stays for the caller to release. InvalidArgument: a
// relative source, or an rshared mount without BindShared.
func (d SharedDir) bindSources(spec *stage1.ContainerSpec, dir string, bindSource func(src, dst string) error) ([]api.Mount, error) {
	mounts := append([]api.Mount(nil), spec.Mounts...)
	for i, m := range spec.Mounts {
		if !filepath.IsAbs(m.Source) {
			return nil, errdefs.InvalidArgument("container %s: mount source %q is not absolute", spec.ID, m.Source)
		}
		target := filepath.Join(dir, "m"+strconv.Itoa(i))
		bind := bindSource
		if m.Propagation == "rshared" {
			if d.BindShared == nil {
				return nil, errdefs.InvalidArgument("container %s: mount %s: bidirectional mount propagation cannot reach this pod", spec.ID, m.Destination)
			}
			bind = func(src, dst string) error {
				if err := bindmount.MakeTarget(src, dst); err != nil {
					return err
				}
				return d.BindShared(src, dst)
			}
		}
		if err := bind(m.Source, target); err != nil {
			return nil, fmt.Errorf("container %s: mount %s: %w", spec.ID, m.Destination, err)
		}
		mounts[i].Source = target
	}
	return mounts, nil
}

// UnbindContainer undoes BindContainer. Idempotent.
func (d SharedDir) UnbindContainer(id string) error {
	dir, err := d.containerDir(id)
	if err != nil {
		return err
	}
	return mountsafe.RemoveUnmounted(dir)
}

// Share implements stage1.ContainerPaths: BindContainer, then the spec's paths
// as the pod sees them.
func (d SharedDir) Share(ctx context.Context, spec *stage1.ContainerSpec, known func(context.Context, string) (bool, error)) (*stage1.ContainerSpec, error) {
	bound, err := d.BindContainer(ctx, spec, known)
	if err != nil {
		return nil, err
	}
	fail := func(err error) (*stage1.ContainerSpec, error) {
		if uerr := d.UnbindContainer(spec.ID); uerr != nil {
			err = errors.Join(err, fmt.Errorf("undoing the binds: %w", uerr))
		}
		return nil, err
	}
	if bound.Rootfs, err = d.Map(bound.Rootfs); err != nil {
		return fail(fmt.Errorf("container %s: rootfs: %w", spec.ID, err))
	}
	if bound.LogPath != "" && !bound.HostLog {
		if bound.LogPath, err = d.Map(bound.LogPath); err != nil {
			return fail(fmt.Errorf("container %s: log: %w", spec.ID, err))
		}
	}
	for i := range bound.Mounts {
		if bound.Mounts[i].Source, err = d.Map(bound.Mounts[i].Source); err != nil {
			return fail(fmt.Errorf("container %s: mount %s: %w", spec.ID, bound.Mounts[i].Destination, err))
		}
	}
	return bound, nil
}

// Started implements stage1.ContainerPaths: with UnbindSourcesOnStart, the
// host-side binds of the container's mount sources are undone.
func (d SharedDir) Started(id string) error {
	if !d.UnbindSourcesOnStart {
		return nil
	}
	return d.UnbindSources(id)
}

// Unshare implements stage1.ContainerPaths: UnbindContainer.
func (d SharedDir) Unshare(id string) error { return d.UnbindContainer(id) }

// UnbindSources unmounts the binds of a container's mount sources
// (<Host>/<id>/m<N>) and removes their mount points; the rootfs and log
// binds stay. Idempotent.
func (d SharedDir) UnbindSources(id string) error {
	dir, err := d.containerDir(id)
	if err != nil {
		return err
	}
	ents, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	} else if err != nil {
		return err
	}
	var errs []error
	for _, e := range ents {
		if n := e.Name(); len(n) > 1 && n[0] == 'm' && strings.Trim(n[1:], "0123456789") == "" {
			if err := mountsafe.RemoveUnmounted(filepath.Join(dir, n)); err != nil {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}
