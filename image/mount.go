package image

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/errdefs"
)

// maxMountData is the kernel's limit on mount(2) option data (one page).
const maxMountData = 4096 - 1

// MountRootfs builds a writable root filesystem for a container of image
// imageID (any form Get accepts): overlayfs with the image's layers as lower
// directories (top first), dir/upper and dir/work, mounted at dir/rootfs,
// which it returns. Idempotent: if dir/rootfs is already mounted it is
// returned as is. Needs root.
//
// Errors: ErrNotFound for an unknown image; ErrFailedPrecondition when a
// layer is missing on disk or the layer list is too long for one mount;
// ErrPermissionDenied without the privilege to mount.
func (s *Store) MountRootfs(imageID, dir string) (rootfs string, err error) {
	img, err := s.Get(imageID)
	if err != nil {
		return "", err
	}
	dir, err = filepath.Abs(dir)
	if err != nil {
		return "", errdefs.InvalidArgument("rootfs dir %q: %v", dir, err)
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
	for _, d := range []string{dir, upper, work, rootfs} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return "", fmt.Errorf("mount rootfs: %w", err)
		}
	}
	data := "lowerdir=" + strings.Join(lowers, ":") + ",upperdir=" + upper + ",workdir=" + work
	if len(data) > maxMountData {
		return "", errdefs.FailedPrecondition("image %s: %d layers are too many for one overlay mount (%d bytes of options)", img.ID, len(img.Layers), len(data))
	}
	if err := unix.Mount("overlay", rootfs, "overlay", 0, data); err != nil {
		if errors.Is(err, unix.EPERM) {
			return "", fmt.Errorf("mount rootfs at %s: %w: %v", rootfs, errdefs.ErrPermissionDenied, err)
		}
		return "", fmt.Errorf("mount rootfs at %s: %w", rootfs, err)
	}
	s.log.Debug("rootfs mounted", "image", img.ID, "rootfs", rootfs, "layers", len(img.Layers))
	return rootfs, nil
}

// UnmountRootfs unmounts dir/rootfs (and anything mounted beneath dir) and
// removes dir. Idempotent: a missing dir, or one not mounted, is fine. It
// never removes files through a mount: if something under dir is still
// mounted afterwards it fails with ErrFailedPrecondition and keeps dir.
func (s *Store) UnmountRootfs(dir string) error {
	dir, err := filepath.Abs(dir)
	if err != nil {
		return errdefs.InvalidArgument("rootfs dir %q: %v", dir, err)
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
					s.log.Warn("unmount failed", "path", m, "err", err)
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
	s.log.Debug("rootfs removed", "dir", dir)
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
