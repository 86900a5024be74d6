package supervisor

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/agent/api"
)

// An app whose spec asks for a local writable layer (AppSpec.LocalUpper)
// gets one at create: a tmpfs of its own beneath <StateDir>/layers/<id>,
// holding the upper and work directories of an overlay mounted over its
// Rootfs, which becomes the overlay's only, read-only, lower layer. Its
// files live as long as the app's record: remove unmounts both. In a kvm
// guest this keeps a container's file creation, removal and metadata in
// guest memory instead of a 9p round trip to the host each.

// layerDir is where app id's local writable layer is mounted.
func (a *Agent) layerDir(id string) string { return filepath.Join(a.dir, "layers", id) }

// mountLayer mounts app spec's local writable layer over its Rootfs, or
// over its RootfsDisk mounted (disk.go), in the layer's tmpfs, which then
// becomes its Rootfs. Nothing is left mounted on failure.
func (a *Agent) mountLayer(spec *api.AppSpec) (err error) {
	dir := a.layerDir(spec.ID)
	lower, target := spec.Rootfs, spec.Rootfs
	if spec.RootfsDisk != nil {
		if lower, err = a.acquireDisk(spec.ID, spec.RootfsDisk); err != nil {
			return fmt.Errorf("writable layer: %w", err)
		}
		defer func() {
			if err == nil {
				return
			}
			if rerr := a.releaseDisk(spec.ID, spec.RootfsDisk); rerr != nil {
				err = errors.Join(err, fmt.Errorf("writable layer: undo: %w", rerr))
			}
		}()
		target = filepath.Join(dir, "root")
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("writable layer: %w", err)
	}
	if err := unix.Mount("tmpfs", dir, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "mode=700"); err != nil {
		os.Remove(dir)
		return fmt.Errorf("writable layer: tmpfs: %w", err)
	}
	defer func() {
		if err == nil {
			return
		}
		if uerr := unix.Unmount(dir, unix.MNT_DETACH); uerr != nil {
			err = errors.Join(err, fmt.Errorf("writable layer: undo: unmount %s: %w", dir, uerr))
			return
		}
		os.Remove(dir)
	}()
	upper, work := filepath.Join(dir, "upper"), filepath.Join(dir, "work")
	dirs := []string{upper, work}
	if target != spec.Rootfs {
		dirs = append(dirs, target)
	}
	for _, d := range dirs {
		if err := os.Mkdir(d, 0o755); err != nil {
			return fmt.Errorf("writable layer: %w", err)
		}
	}
	// The root directory's owner and mode are the image's: the overlay's
	// root shows the upper directory's.
	var st unix.Stat_t
	if err := unix.Stat(lower, &st); err != nil {
		return fmt.Errorf("writable layer: rootfs: %w", err)
	}
	if err := os.Chown(upper, int(st.Uid), int(st.Gid)); err != nil {
		return fmt.Errorf("writable layer: %w", err)
	}
	if err := os.Chmod(upper, os.FileMode(st.Mode&0o7777)); err != nil {
		return fmt.Errorf("writable layer: %w", err)
	}
	opts := "lowerdir=" + lower + ",upperdir=" + upper + ",workdir=" + work
	if err := unix.Mount("overlay", target, "overlay", 0, opts); err != nil {
		return fmt.Errorf("writable layer: overlay on %s: %w", target, err)
	}
	spec.Rootfs = target
	return nil
}

// unmountLayer releases app spec's local writable layer: the overlay over
// its Rootfs, then the tmpfs. Idempotent: a layer already gone is not an
// error.
func (a *Agent) unmountLayer(spec *api.AppSpec) error {
	dir := a.layerDir(spec.ID)
	if _, err := os.Stat(dir); errors.Is(err, os.ErrNotExist) {
		return a.releaseLayerDisk(spec)
	}
	var errs []error
	if err := unmountIfMounted(spec.Rootfs); err != nil {
		errs = append(errs, err)
	}
	if err := unmountIfMounted(dir); err != nil {
		errs = append(errs, err)
	} else if err := os.Remove(dir); err != nil && !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, err)
	} else if err := a.releaseLayerDisk(spec); err != nil {
		errs = append(errs, err)
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("writable layer: %w", err)
	}
	return nil
}

// unmountIfMounted unmounts the mount at path; a path that is no mount
// point (EINVAL) or is gone is not an error. A busy mount is detached.
func unmountIfMounted(path string) error {
	err := unix.Unmount(path, 0)
	if errors.Is(err, unix.EBUSY) {
		err = unix.Unmount(path, unix.MNT_DETACH)
	}
	if err == nil || errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOENT) {
		return nil
	}
	return fmt.Errorf("unmount %s: %w", path, err)
}

// layerUsage is the space and inodes app id's local writable layer holds
// (its tmpfs's own figures); ok is false when it has none.
func (a *Agent) layerUsage(id string) (bytes, inodes uint64, ok bool) {
	var fs unix.Statfs_t
	if err := unix.Statfs(a.layerDir(id), &fs); err != nil || fs.Type != unix.TMPFS_MAGIC {
		return 0, 0, false
	}
	return (fs.Blocks - fs.Bfree) * uint64(fs.Bsize), fs.Files - fs.Ffree, true
}

// releaseLayerDisk releases the disk app spec's layer is over, if any.
func (a *Agent) releaseLayerDisk(spec *api.AppSpec) error {
	if spec.RootfsDisk == nil {
		return nil
	}
	if err := a.releaseDisk(spec.ID, spec.RootfsDisk); err != nil {
		return fmt.Errorf("writable layer: %w", err)
	}
	return nil
}
