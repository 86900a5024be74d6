package mountsafe

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
)

// MountsUnder returns the mount points of the calling thread's mount
// namespace at dir or beneath it, deepest (latest) first. The thread's,
// not /proc/self's: that is the main thread's view, which is another
// namespace when the main thread ever joined one.
func MountsUnder(dir string) ([]string, error) {
	dir = filepath.Clean(dir)
	ms, err := mountinfo.GetMounts(mountinfo.PrefixFilter(dir))
	if err != nil {
		return nil, err
	}
	out := make([]string, 0, len(ms))
	for _, m := range ms {
		out = append(out, m.Mountpoint)
	}
	// Later lines are mounted later: unmount them first; deeper paths
	// before their parents.
	slices.Reverse(out)
	sort.SliceStable(out, func(i, j int) bool {
		return strings.Count(out[i], "/") > strings.Count(out[j], "/")
	})
	return out, nil
}

// UnmountAll detaches every mount at dir or beneath it. Mounts already
// gone are not errors. They are made private first: a bind of a shared
// mount (a volume on a host whose root is shared, as under systemd) is a
// peer of its source, and unmounting what lies beneath a peer unmounts it
// beneath the source too: the host's own mounts inside a volume would go
// with the daemon's bind of it.
func UnmountAll(dir string) error {
	for range 3 { // a detached parent may take children with it
		ms, err := MountsUnder(dir)
		if err != nil {
			return err
		}
		if len(ms) == 0 {
			return nil
		}
		for _, m := range ms {
			err := unix.Mount("", m, "", unix.MS_PRIVATE|unix.MS_REC, "")
			if err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
				return fmt.Errorf("make %s private before unmounting it: %w", m, err)
			}
		}
		for _, m := range ms {
			err := unix.Unmount(m, unix.MNT_DETACH)
			if err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
				return fmt.Errorf("unmount %s: %w", m, err)
			}
		}
	}
	ms, err := MountsUnder(dir)
	if err != nil {
		return err
	}
	if len(ms) > 0 {
		return fmt.Errorf("mounts left beneath %s: %v", dir, ms)
	}
	return nil
}

// RemoveUnmounted unmounts everything at dir or beneath it and removes
// dir. It never removes across a mount: when a mount remains (or one
// appeared in the meantime), it fails and leaves the files beneath it
// (RemoveAll). A missing dir is not an error.
func RemoveUnmounted(dir string) error {
	if _, err := os.Lstat(dir); errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err := UnmountAll(dir); err != nil {
		return err
	}
	return RemoveAll(dir)
}
