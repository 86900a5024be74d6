package image

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"

	"golang.org/x/sys/unix"

	securejoin "github.com/cyphar/filepath-securejoin"

	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/bindmount"
	"github.com/stagelet/stagelet/internal/lsm"
)

// maxMountData is the kernel's limit on mount(2) option data (one page).
const maxMountData = 4096 - 1

// MountRootfs builds a writable root filesystem for a container of image
// imageID (any form Get accepts): overlayfs with the image's layers as lower
// directories (top first), dir/upper and dir/work, mounted at dir/rootfs,
// which it returns. Idempotent: if dir/rootfs is already mounted it is
// returned as is. Needs root. Where SELinux is enabled and mountLabel is
// set, every file of the overlay has that label (context=), as a
// container at its level needs, whatever the layers' own labels.
//
// The overlay is volatile where the kernel has it (5.10 and later): it
// never syncs its writable layer, so unmounting it does not write back
// the whole host file system holding it (half of RemoveContainer's time
// before), and fsync in the container returns at once. A container's
// writable layer is not kept across a host crash anyway: the kubelet
// makes new containers after a reboot, and this store never mounts a
// container's layer twice.
//
// Errors: ErrNotFound for an unknown image; ErrFailedPrecondition when a
// layer is missing on disk or the layer list is too long for one mount;
// ErrPermissionDenied without the privilege to mount.
func (s *Store) MountRootfs(ctx context.Context, imageID, dir string, userns *UserNS, mountLabel string) (rootfs string, err error) {
	img, err := s.Get(imageID)
	if err != nil {
		return "", err
	}
	dir, err = filepath.Abs(dir)
	if err != nil {
		return "", errdefs.InvalidArgument("rootfs dir %q: %w", dir, err)
	}
	rootfs = filepath.Join(dir, "rootfs")
	upper := filepath.Join(dir, "upper")
	work := filepath.Join(dir, "work")

	s.gcMu.RLock()
	defer s.gcMu.RUnlock()
	if isMountPoint(rootfs) {
		return rootfs, nil
	}
	lowers := make([]string, 0, len(img.Layers))
	for i := len(img.Layers) - 1; i >= 0; i-- {
		p := s.layerPath(img.Layers[i])
		if _, err := os.Stat(p); err != nil {
			return "", errdefs.FailedPrecondition("image %s: layer %s is missing; pull the image again", img.ID, img.Layers[i])
		}
		lowers = append(lowers, p)
	}
	if len(lowers) == 0 {
		lowers = append(lowers, s.emptyDir())
	}
	if userns != nil {
		// The layers seen through the user namespace's ID mapping (its
		// root owns what the host's root owns on disk), beneath dir:
		// dir/lower/<n>. The writable layer is the namespace's root's on
		// disk (overlayfs, mounted by the host's root, cannot write
		// through an idmapped upper layer). UnmountRootfs detaches them.
		for _, d := range []string{upper, work} {
			if err := os.MkdirAll(d, 0o755); err != nil {
				return "", fmt.Errorf("mount rootfs: %w", err)
			}
			if err := os.Chown(d, userns.UID, userns.GID); err != nil {
				return "", fmt.Errorf("mount rootfs: %w", err)
			}
		}
		for i, l := range lowers {
			m := filepath.Join(dir, "lower", strconv.Itoa(i))
			if !isMountPoint(m) {
				if err := bindmount.BindIDMapped(l, m, userns.File); err != nil {
					if errors.Is(err, bindmount.ErrNoIDMap) {
						err = fmt.Errorf("%w (which a container in a user namespace needs)", err)
					}
					return "", fmt.Errorf("mount rootfs: %w", err)
				}
			}
			lowers[i] = m
		}
	}
	for _, d := range []string{dir, upper, work, rootfs} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return "", fmt.Errorf("mount rootfs: %w", err)
		}
	}
	data := lsm.MountData("lowerdir="+strings.Join(lowers, ":")+",upperdir="+upper+",workdir="+work, mountLabel)
	if len(data) > maxMountData {
		return "", errdefs.FailedPrecondition("image %s: %d layers are too many for one overlay mount (%d bytes of options)", img.ID, len(img.Layers), len(data))
	}
	if err := mountOverlay(rootfs, data); err != nil {
		if errors.Is(err, unix.EPERM) {
			return "", errdefs.New(errdefs.ErrPermissionDenied, "mount rootfs at %s: %w", rootfs, err)
		}
		return "", fmt.Errorf("mount rootfs at %s: %w", rootfs, err)
	}
	s.log.DebugContext(ctx, "rootfs mounted", "image", img.ID, "rootfs", rootfs, "layers", len(img.Layers))
	return rootfs, nil
}

// noVolatile is set once the kernel refused a volatile overlay.
var noVolatile atomic.Bool

// mountOverlay mounts overlayfs with options data at target, volatile
// unless the kernel refuses that option (before 5.10).
func mountOverlay(target, data string) error {
	if !noVolatile.Load() && len(data)+len(",volatile") <= maxMountData {
		err := unix.Mount("overlay", target, "overlay", 0, data+",volatile")
		if !errors.Is(err, unix.EINVAL) {
			return err
		}
		if err := unix.Mount("overlay", target, "overlay", 0, data); err != nil {
			return err // not the volatile option's fault
		}
		noVolatile.Store(true)
		return nil
	}
	return unix.Mount("overlay", target, "overlay", 0, data)
}

// UnmountRootfs unmounts dir/rootfs (and anything mounted beneath dir) and
// removes dir. Idempotent: a missing dir, or one not mounted, is fine. It
// never removes files through a mount: if something under dir is still
// mounted afterwards it fails with ErrFailedPrecondition and keeps dir.
func (s *Store) UnmountRootfs(ctx context.Context, dir string) error {
	dir, err := filepath.Abs(dir)
	if err != nil {
		return errdefs.InvalidArgument("rootfs dir %q: %w", dir, err)
	}
	if _, err := os.Lstat(dir); errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if real, err := filepath.EvalSymlinks(dir); err == nil {
		dir = real
	}
	// Deepest first; retry lazily when busy.
	for range 3 {
		mounts := mountsUnder(dir)
		if len(mounts) == 0 {
			break
		}
		for _, m := range mounts {
			if err := unix.Unmount(m, 0); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
				if err := unix.Unmount(m, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
					s.log.WarnContext(ctx, "unmount failed", "path", m, "err", err)
				}
			}
		}
	}
	if left := mountsUnder(dir); len(left) > 0 {
		return errdefs.FailedPrecondition("rootfs %s: still mounted: %s", dir, strings.Join(left, ", "))
	}
	if err := os.RemoveAll(dir); err != nil {
		return fmt.Errorf("remove rootfs dir %s: %w", dir, err)
	}
	s.log.DebugContext(ctx, "rootfs removed", "dir", dir)
	return nil
}

// mountsUnder lists the mount points at or beneath dir, deepest first.
func mountsUnder(dir string) []string {
	var out []string
	for _, m := range readMountInfo() {
		if m.mountPoint == dir || strings.HasPrefix(m.mountPoint, dir+"/") {
			out = append(out, m.mountPoint)
		}
	}
	slices.SortFunc(out, func(a, b string) int {
		if len(a) != len(b) {
			return len(b) - len(a)
		}
		return strings.Compare(a, b)
	})
	return slices.Compact(out)
}

func isMountPoint(p string) bool {
	real, err := filepath.EvalSymlinks(p)
	if err != nil {
		return false
	}
	for _, m := range readMountInfo() {
		if m.mountPoint == real {
			return true
		}
	}
	return false
}

// UserNS is a user namespace a container's root filesystem is mounted
// for: File is the namespace, UID and GID the host's IDs of its root.
type UserNS struct {
	File     *os.File
	UID, GID int
}

// MountImageVolume mounts the root filesystem of image ref (any form Get
// accepts) read-only at dir/root for an image volume (CRI Mount.image,
// KEP-4639) and returns the path within it that subPath names (the root
// when empty). The mount goes with UnmountRootfs of a directory holding
// dir. Idempotent.
//
// Errors: ErrNotFound for an image the store does not have (the kubelet
// pulls it first); ErrInvalidArgument for a subPath that leaves the image
// or does not exist in it; ErrFailedPrecondition for a missing layer.
func (s *Store) MountImageVolume(ref, dir, subPath string) (string, error) {
	img, err := s.Get(ref)
	if err != nil {
		return "", err
	}
	dir, err = filepath.Abs(dir)
	if err != nil {
		return "", errdefs.InvalidArgument("image volume dir %q: %w", dir, err)
	}
	root := filepath.Join(dir, "root")
	s.gcMu.RLock()
	defer s.gcMu.RUnlock()
	if !isMountPoint(root) {
		lowers := make([]string, 0, len(img.Layers)+1)
		for i := len(img.Layers) - 1; i >= 0; i-- {
			p := s.layerPath(img.Layers[i])
			if _, err := os.Stat(p); err != nil {
				return "", errdefs.FailedPrecondition("image %s: layer %s is missing; pull the image again", img.ID, img.Layers[i])
			}
			lowers = append(lowers, p)
		}
		// Without an upper directory overlayfs wants two lower ones.
		for len(lowers) < 2 {
			lowers = append(lowers, s.emptyDir())
		}
		data := "lowerdir=" + strings.Join(lowers, ":")
		if len(data) > maxMountData {
			return "", errdefs.FailedPrecondition("image %s: %d layers are too many for one overlay mount (%d bytes of options)", img.ID, len(img.Layers), len(data))
		}
		if err := os.MkdirAll(root, 0o755); err != nil {
			return "", fmt.Errorf("image volume: %w", err)
		}
		if err := unix.Mount("overlay", root, "overlay", unix.MS_RDONLY, data); err != nil {
			return "", fmt.Errorf("image volume of %s at %s: %w", img.ID, root, err)
		}
	}
	if subPath == "" {
		return root, nil
	}
	if filepath.IsAbs(subPath) || slices.Contains(strings.Split(subPath, "/"), "..") {
		return "", errdefs.InvalidArgument("image_sub_path %q: want a relative path without ..", subPath)
	}
	p, err := securejoin.SecureJoin(root, subPath)
	if err != nil {
		return "", errdefs.InvalidArgument("image_sub_path %q: %w", subPath, err)
	}
	if _, err := os.Stat(p); err != nil {
		return "", errdefs.InvalidArgument("image_sub_path %q: not in image %s", subPath, img.ID)
	}
	return p, nil
}
