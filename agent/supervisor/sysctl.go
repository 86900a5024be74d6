package supervisor

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/sysctl"
)

// ipcSysctlPath is the file of an IPC sysctl beneath a proc mount
// (sysctl.Path); InvalidArgument for a sysctl the IPC namespace does not
// isolate (sysctl.Namespace) or a malformed name.
func ipcSysctlPath(proc, name string) (string, error) {
	if sysctl.Namespace(name) != sysctl.IPC {
		return "", errdefs.InvalidArgument("sysctl %q: not isolated by the IPC namespace", name)
	}
	return sysctl.Path(proc, name)
}

// setIPCSysctls writes IPC sysctls; they apply to the IPC namespace of
// the writer, which is the pod's for the agent and every app it starts.
// Where /proc/sys is read-only (systemd-nspawn mounts it so), a private
// proc mount beneath scratch is written through instead, then detached.
// InvalidArgument for a name the IPC namespace does not isolate (checked
// before anything is written) or a value the kernel refuses.
func setIPCSysctls(sysctls map[string]string, scratch string) (retErr error) {
	names := make([]string, 0, len(sysctls))
	for k, v := range sysctls {
		if _, err := ipcSysctlPath("/proc", k); err != nil {
			return err
		}
		if strings.ContainsAny(v, "\x00") {
			return errdefs.InvalidArgument("sysctl %q: value contains a NUL byte", k)
		}
		names = append(names, k)
	}
	if len(names) == 0 {
		return nil
	}
	slices.Sort(names)
	proc := "/proc"
	if unix.Access("/proc/sys/kernel", unix.W_OK) != nil || readonlyMount("/proc/sys") {
		dir, err := os.MkdirTemp(scratch, "proc-")
		if err != nil {
			return fmt.Errorf("sysctls: %w", err)
		}
		defer os.Remove(dir) // not a mount point any more, or EBUSY: never recursive
		if err := unix.Mount("proc", dir, "proc", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
			return fmt.Errorf("sysctls: mount a private proc: %w", err)
		}
		defer func() {
			if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil && retErr == nil {
				retErr = fmt.Errorf("sysctls: detach the private proc %s: %w", dir, err)
			}
		}()
		proc = dir
	}
	for _, k := range names {
		p, _ := ipcSysctlPath(proc, k)
		f, err := os.OpenFile(p, os.O_WRONLY|os.O_TRUNC, 0)
		if errors.Is(err, os.ErrNotExist) {
			return errdefs.InvalidArgument("sysctl %q: the kernel has no such setting", k)
		} else if err != nil {
			return fmt.Errorf("sysctl %q: %w", k, err)
		}
		_, err = f.WriteString(sysctls[k])
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ERANGE) {
			return errdefs.InvalidArgument("sysctl %q: the kernel refuses %q", k, sysctls[k])
		} else if err != nil {
			return fmt.Errorf("sysctl %q: %w", k, err)
		}
	}
	return nil
}

// readonlyMount tells whether the mount holding path is read-only.
func readonlyMount(path string) bool {
	var st unix.Statfs_t
	return unix.Statfs(path, &st) == nil && st.Flags&unix.ST_RDONLY != 0
}
