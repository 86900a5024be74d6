// Package transport carries the agent's protocol between the daemon and
// a pod's agent, one stream per call: a unix socket of any path length
// (fly, nspawn), or yamux sessions over a VM's virtio-serial port (kvm:
// SerialListener in the guest, SerialDialer on the host).
package transport

import (
	"context"
	"fmt"
	"net"
	"path/filepath"
	"strconv"

	"golang.org/x/sys/unix"
)

// maxSunPath is the room for a path in a unix socket address, less the
// terminating NUL.
const maxSunPath = len(unix.RawSockaddrUnix{}.Path) - 1

// shortSocketPath returns an address that reaches path even when path is
// longer than a unix socket address can hold: the socket's directory is
// opened and named through /proc/self/fd. The returned func closes the
// directory after the bind or connect. Short paths are returned as they are.
func shortSocketPath(path string) (string, func(), error) {
	if len(path) <= maxSunPath {
		return path, func() {}, nil
	}
	fd, err := unix.Open(filepath.Dir(path), unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return "", nil, fmt.Errorf("socket %s: %w", path, err)
	}
	short := "/proc/self/fd/" + strconv.Itoa(fd) + "/" + filepath.Base(path)
	if len(short) > maxSunPath {
		unix.Close(fd)
		return "", nil, fmt.Errorf("socket %s: name too long", path)
	}
	return short, func() { unix.Close(fd) }, nil
}

// DialUnix connects to the unix socket at path, of any length (a socket
// whose path is longer than a socket address holds is reached through
// its directory's /proc/self/fd name).
func DialUnix(ctx context.Context, path string) (net.Conn, error) {
	addr, done, err := shortSocketPath(path)
	if err != nil {
		return nil, err
	}
	defer done()
	var d net.Dialer
	return d.DialContext(ctx, "unix", addr)
}

// ListenUnix listens on the unix socket at path, of any length.
func ListenUnix(path string) (net.Listener, error) {
	addr, done, err := shortSocketPath(path)
	if err != nil {
		return nil, err
	}
	defer done()
	return net.Listen("unix", addr)
}
