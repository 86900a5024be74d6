// Package sysctl classifies sysctls by the namespace that isolates them,
// as the kubelet does, and maps a sysctl's name to its file beneath a
// proc mount. The broker (which namespace a pod's sysctl goes to), the
// network setup (net.*, in the pod's network namespace) and the in-pod
// agent (IPC sysctls, in the pod's IPC namespace) read the same
// classification.
package sysctl

import (
	"path/filepath"
	"strings"

	"github.com/stagelet/stagelet/errdefs"
)

// Namespaces, as Namespace names them.
const (
	Net = "net"
	IPC = "ipc"
)

// Namespace says which namespace isolates the sysctl name ("net.x.y" or
// "net/x/y"): Net, IPC (kernel.shm*, kernel.msg*, kernel.sem,
// fs.mqueue.*), or "" for sysctls no namespace isolates (host-wide
// ones). It follows the kubelet's classification.
func Namespace(name string) string {
	n := strings.ReplaceAll(name, "/", ".")
	switch {
	case strings.HasPrefix(n, "net."):
		return Net
	case strings.HasPrefix(n, "kernel.shm"), strings.HasPrefix(n, "kernel.msg"),
		n == "kernel.sem", strings.HasPrefix(n, "fs.mqueue."):
		return IPC
	}
	return ""
}

// Path maps a sysctl name to its file beneath the proc mount proc
// ("/proc": "/proc/sys/..."). With a "/" in the name, "/" separates and
// "." is literal (an interface name like eth0.100); otherwise "."
// separates. InvalidArgument for a malformed name (an empty, "." or ".."
// element, a NUL or a newline).
func Path(proc, name string) (string, error) {
	var parts []string
	if strings.Contains(name, "/") {
		parts = strings.Split(name, "/")
	} else {
		parts = strings.Split(name, ".")
	}
	for _, p := range parts {
		if p == "" || p == "." || p == ".." || strings.ContainsAny(p, "\x00\n") {
			return "", errdefs.InvalidArgument("sysctl %q: malformed name", name)
		}
	}
	return filepath.Join(append([]string{proc, "sys"}, parts...)...), nil
}
