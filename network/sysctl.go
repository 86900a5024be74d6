package network

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"slices"
	"strings"

	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/sysctl"
)

// ErrNotNetSysctl says a sysctl is namespaced, but by a namespace other than
// the network one (IPC), so ApplySysctls does not set it; the caller may
// apply it where that namespace is made. It is of class ErrInvalidArgument.
var ErrNotNetSysctl = errdefs.New(errdefs.ErrInvalidArgument, "sysctl belongs to the IPC namespace, not the network namespace")

// UnprivilegedPortStart is the sysctl of the lowest port a process
// without CAP_NET_BIND_SERVICE over the network namespace may bind: a pod
// whose root is not the namespace owner's gets 0, as a pod's root can
// bind any port (containerd sets it for every pod).
const UnprivilegedPortStart = "net.ipv4.ip_unprivileged_port_start"

// ApplySysctls sets network-namespaced sysctls (net.*) inside the network
// namespace at netnsPath; the host's values are not touched. Every name is
// checked before any is written. Errors: ErrNotNetSysctl (wrapped, class
// ErrInvalidArgument) for an IPC-namespaced sysctl; ErrInvalidArgument,
// naming the key, for a sysctl no namespace isolates, a malformed name, a
// net.* sysctl the namespace does not have (host-wide), or a value the
// kernel refuses; ErrNotFound when netnsPath is not a network namespace.
// Applying the same values again is harmless.
func ApplySysctls(netnsPath string, sysctls map[string]string) error {
	if len(sysctls) == 0 {
		return nil
	}
	names, paths, err := checkSysctls(sysctls)
	if err != nil {
		return err
	}
	return inNetNS(netnsPath, func() error { return writeSysctls(names, paths, sysctls) })
}

// SetSysctls is ApplySysctls in the caller's own network namespace: a kvm
// pod's guest, whose network stack is the pod's.
func SetSysctls(sysctls map[string]string) error {
	names, paths, err := checkSysctls(sysctls)
	if err != nil {
		return err
	}
	return writeSysctls(names, paths, sysctls)
}

// checkSysctls checks every name and value of sysctls, and returns the
// names sorted and their /proc/sys files.
func checkSysctls(sysctls map[string]string) ([]string, map[string]string, error) {
	names := make([]string, 0, len(sysctls))
	for k := range sysctls {
		names = append(names, k)
	}
	slices.Sort(names)
	paths := make(map[string]string, len(names))
	for _, k := range names {
		switch sysctl.Namespace(k) {
		case sysctl.Net:
		case sysctl.IPC:
			return nil, nil, fmt.Errorf("sysctl %q: %w", k, ErrNotNetSysctl)
		default:
			return nil, nil, errdefs.InvalidArgument("sysctl %q is not namespaced: it would change the host", k)
		}
		p, err := sysctl.Path("/proc", k)
		if err != nil {
			return nil, nil, err
		}
		if strings.ContainsAny(sysctls[k], "\x00") {
			return nil, nil, errdefs.InvalidArgument("sysctl %q: value contains a NUL byte", k)
		}
		paths[k] = p
	}
	return names, paths, nil
}

// writeSysctls writes each of names (in order) to its file in paths, on
// the calling thread.
func writeSysctls(names []string, paths, sysctls map[string]string) error {
	for _, k := range names {
		if err := writeSysctl(paths[k], sysctls[k]); err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return errdefs.InvalidArgument("sysctl %q does not exist in the pod's network namespace (it is host-wide or unknown)", k)
			}
			if errors.Is(err, fs.ErrPermission) {
				return errdefs.New(errdefs.ErrPermissionDenied, "sysctl %q: %w", k, err)
			}
			return errdefs.InvalidArgument("sysctl %q=%q: %w", k, sysctls[k], err)
		}
	}
	return nil
}

// writeSysctl writes value to the /proc/sys file at path, which must be
// opened on the calling (namespace-joined) thread.
func writeSysctl(path, value string) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_TRUNC, 0)
	if err != nil {
		return err
	}
	_, werr := f.WriteString(value)
	cerr := f.Close()
	if werr != nil {
		return werr
	}
	return cerr
}
