package supervisor

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	securejoin "github.com/cyphar/filepath-securejoin"
	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/cgroups"
	"github.com/stagelet/stagelet/internal/lsm"
)

// An app sees its own cgroups at /sys/fs/cgroup, as a runc container
// does, so that programs that size themselves from their limits (a JVM's
// heap, Go's GOMAXPROCS, .NET's GC) find them:
//
//   - The app's init, already in the app's cgroups (the agent moved it
//     there before sending its spec), unshares a cgroup namespace rooted
//     at them, on cgroup v1 as on v2: /proc/self/cgroup then reads "/" in
//     every hierarchy, and the paths the mounts show are the same. (runc
//     gives a cgroup namespace on v2 only; on v1 its containers read the
//     node's cgroup paths there.) Exec'd commands join that namespace.
//   - On a pure cgroup v2 host cgroup2 is mounted at /sys/fs/cgroup,
//     showing the namespace's root, the app's cgroup.
//   - On a v1 or hybrid host a tmpfs is mounted there, and each v1
//     hierarchy the app is in is bound from the app's own cgroup
//     directory in it to /sys/fs/cgroup/<name>, with a link for each
//     controller of a co-mounted hierarchy (cpu -> cpu,cpuacct), as runc
//     lays them out. The hybrid cgroup2 hierarchy is left out, as runc
//     leaves it out.
//
// Everything is read-only unless the app is privileged, as runc mounts
// it for containerd. In a VM pod the hierarchies are the guest's, where
// the app's limits are enforced; in an nspawn pod on a v1 host the
// memory hierarchy is reached through the pod's memory cgroup bound into
// the pod (cgroups.OwnView finds it).

// cgroupFS is where an app's cgroups are shown.
const cgroupFS = "/sys/fs/cgroup"

// mountCgroupView gives the app at rootfs its cgroup namespace and its
// cgroups at /sys/fs/cgroup; /sys is mounted already. Where the agent
// sees no cgroup at all the app gets an empty /sys/fs/cgroup, with a
// warning.
func mountCgroupView(rootfs string, app *api.AppSpec, warn func(string, ...any)) error {
	v2, dirs, err := cgroups.OwnView(rootfs)
	if err != nil {
		warn("the app's cgroups are not shown at %s: %v", cgroupFS, err)
		return nil
	}
	if err := unix.Unshare(unix.CLONE_NEWCGROUP); err != nil {
		return fmt.Errorf("cgroup namespace: %w", err)
	}
	ro := !app.Privileged
	if v2 {
		return mountCgroup2(rootfs, dirs[0].Dir, ro)
	}
	return mountCgroupV1(rootfs, dirs, ro, app.SELinuxMountLabel)
}

// private makes the mount at t private: the view's mounts propagate
// nowhere, and criu, which checkpoints the app with its mounts, finds no
// peer or master of theirs outside the app's namespace.
func private(t string) error { return unix.Mount("", t, "", unix.MS_PRIVATE, "") }

// viewFlags are the flags of the cgroup view's mounts.
func viewFlags(ro bool) uintptr {
	f := uintptr(unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC)
	if ro {
		f |= unix.MS_RDONLY
	}
	return f
}

// mountCgroup2 mounts cgroup2 at rootfs's /sys/fs/cgroup: inside the
// app's cgroup namespace its root is the app's cgroup. Where the kernel
// refuses a new mount (EPERM; EBUSY in a pod's own user namespace on
// Debian 12's kernel, critest's user namespace spec in the node VM), the
// app's cgroup directory dir is bound there instead: the same directory,
// its root named the same inside the app's cgroup namespace.
func mountCgroup2(rootfs, dir string, ro bool) error {
	bound := false
	return mountIn(rootfs, cgroupFS, true, func(t string) error {
		err := unix.Mount("cgroup2", t, "cgroup2", viewFlags(ro), "")
		if !errors.Is(err, unix.EPERM) && !errors.Is(err, unix.EBUSY) {
			return err
		}
		bound = true
		return unix.Mount(dir, t, "", unix.MS_BIND, "")
	}, func(t string) error {
		if !bound {
			return nil
		}
		return unix.Mount("", t, "", unix.MS_BIND|unix.MS_REMOUNT|viewFlags(ro), "")
	}, private)
}

// mountCgroupV1 lays out the v1 hierarchies dirs beneath rootfs's
// /sys/fs/cgroup on a tmpfs (labelled with the app's mount label).
func mountCgroupV1(rootfs string, dirs []cgroups.ViewDir, ro bool, mountLabel string) error {
	if err := mountIn(rootfs, cgroupFS, true, func(t string) error {
		return unix.Mount("tmpfs", t, "tmpfs", viewFlags(false), lsm.MountData("mode=755", mountLabel))
	}, private); err != nil {
		return err
	}
	links := map[string]string{}
	for _, d := range dirs {
		if d.Name == "" || strings.Contains(d.Name, "/") {
			continue
		}
		dest := filepath.Join(cgroupFS, d.Name)
		if err := mountIn(rootfs, dest, true, func(t string) error {
			return unix.Mount(d.Dir, t, "", unix.MS_BIND, "")
		}, func(t string) error {
			return unix.Mount("", t, "", unix.MS_BIND|unix.MS_REMOUNT|viewFlags(ro), "")
		}, private); err != nil {
			return err
		}
		if strings.Contains(d.Name, ",") {
			for _, c := range strings.Split(d.Name, ",") {
				links[c] = d.Name
			}
		}
	}
	// The tmpfs is fresh and ours: plain joins are safe inside it, once
	// its own path is resolved inside the root.
	base, err := securejoin.SecureJoin(rootfs, cgroupFS)
	if err != nil {
		return err
	}
	for c, target := range links {
		if err := os.Symlink(target, filepath.Join(base, c)); err != nil && !errors.Is(err, os.ErrExist) {
			return fmt.Errorf("%s/%s: %w", cgroupFS, c, err)
		}
	}
	if !ro {
		return nil
	}
	return mountIn(rootfs, cgroupFS, true, func(t string) error {
		return unix.Mount("", t, "", unix.MS_BIND|unix.MS_REMOUNT|viewFlags(true), "")
	})
}
