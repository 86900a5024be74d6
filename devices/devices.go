// Package devices turns what a container asks of the host's devices into
// what its agent makes: device nodes (major, minor, mode, owner, as the
// host has them) and the device cgroup rules that fence the rest.
//
// The rules follow runc's: a default container may create any device node
// (mknod) but open only null, zero, full, random, urandom, tty, console,
// ptmx and the pseudo-terminals; the devices it is given are added; a
// privileged container may use every device. Rules are in the canonical
// form the agent applies (cgroups.Devices): a first rule that allows or
// denies everything, then what is allowed besides.
package devices

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/errdefs"
)

// Request is one device a container asks for (CRI Device): the host's
// node, or a directory of nodes, at Host; where the container sees it;
// and "rwm" access (read, write, mknod), empty meaning all.
type Request struct {
	Host        string `json:"host"`
	Container   string `json:"container"`
	Permissions string `json:"permissions,omitempty"`
}

// Set is a container's devices: the nodes its agent makes and the cgroup
// rules it applies.
type Set struct {
	Nodes []specs.LinuxDevice
	Rules []specs.LinuxDeviceCgroup
}

func ptr[T any](v T) *T { return &v }

// rule is an allow rule of one device class.
func rule(typ string, major, minor int64, access string) specs.LinuxDeviceCgroup {
	r := specs.LinuxDeviceCgroup{Allow: true, Type: typ, Access: access}
	if major >= 0 {
		r.Major = ptr(major)
	}
	if minor >= 0 {
		r.Minor = ptr(minor)
	}
	return r
}

// DefaultRules are a container's rules before its own devices: deny all,
// then runc's allow list.
func DefaultRules() []specs.LinuxDeviceCgroup {
	return []specs.LinuxDeviceCgroup{
		{Allow: false, Type: "a", Access: "rwm"},
		rule("c", -1, -1, "m"), // mknod of any node; opening it is what the rest decide
		rule("b", -1, -1, "m"),
		rule("c", 1, 3, "rwm"),    // null
		rule("c", 1, 5, "rwm"),    // zero
		rule("c", 1, 7, "rwm"),    // full
		rule("c", 1, 8, "rwm"),    // random
		rule("c", 1, 9, "rwm"),    // urandom
		rule("c", 5, 0, "rwm"),    // tty
		rule("c", 5, 1, "rwm"),    // console
		rule("c", 5, 2, "rwm"),    // ptmx
		rule("c", 136, -1, "rwm"), // the pseudo-terminals, /dev/pts/N
	}
}

// AllowAll is a privileged container's rule: every device.
func AllowAll() []specs.LinuxDeviceCgroup {
	return []specs.LinuxDeviceCgroup{{Allow: true, Type: "a", Access: "rwm"}}
}

// validPermissions tells whether p is a non-empty subset of "rwm".
func validPermissions(p string) bool {
	if p == "" || len(p) > 3 {
		return false
	}
	seen := map[rune]bool{}
	for _, c := range p {
		if !strings.ContainsRune("rwm", c) || seen[c] {
			return false
		}
		seen[c] = true
	}
	return true
}

// Resolve reads the host's nodes of reqs (field names the requests in
// errors, "config.devices"): a node's type, numbers, mode and owner are
// the host's; a directory gives every node beneath it, at the same place
// beneath the container path. Errors: InvalidArgument (a relative path,
// bad permissions, a host path that is not a device or a directory
// holding none, one that does not exist).
func Resolve(reqs []Request, field string) (Set, error) {
	var s Set
	for i, r := range reqs {
		f := fmt.Sprintf("%s[%d]", field, i)
		perms := r.Permissions
		if perms == "" {
			perms = "rwm"
		}
		if !validPermissions(perms) {
			return Set{}, errdefs.InvalidArgument("%s.permissions: %q: want some of r, w, m", f, r.Permissions)
		}
		if !filepath.IsAbs(r.Host) {
			return Set{}, errdefs.InvalidArgument("%s.host_path: %q is not absolute", f, r.Host)
		}
		ctr := r.Container
		if ctr == "" {
			ctr = r.Host
		}
		if !filepath.IsAbs(ctr) {
			return Set{}, errdefs.InvalidArgument("%s.container_path: %q is not absolute", f, ctr)
		}
		nodes, err := nodesAt(r.Host, filepath.Clean(ctr))
		if err != nil {
			return Set{}, errdefs.InvalidArgument("%s.host_path: %w", f, err)
		}
		for _, n := range nodes {
			s.Nodes = append(s.Nodes, n)
			s.Rules = append(s.Rules, rule(n.Type, n.Major, n.Minor, perms))
		}
	}
	return s, nil
}

// nodesAt reads the device node at host (following symbolic links, as
// /dev/disk/by-id/... are), or every node beneath a directory.
func nodesAt(host, ctr string) ([]specs.LinuxDevice, error) {
	st, err := os.Stat(host)
	if err != nil {
		return nil, err
	}
	if !st.IsDir() {
		n, err := Node(host, ctr)
		if err != nil {
			return nil, err
		}
		return []specs.LinuxDevice{n}, nil
	}
	var out []specs.LinuxDevice
	err = filepath.WalkDir(host, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || d.Type()&fs.ModeDevice == 0 {
			return err
		}
		rel, _ := filepath.Rel(host, p)
		n, err := Node(p, filepath.Join(ctr, rel))
		if err != nil {
			return err
		}
		out = append(out, n)
		return nil
	})
	if err != nil {
		return nil, err
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("%s: a directory holding no device node", host)
	}
	return out, nil
}

var errNotDevice = errors.New("not a device node")

// Node reads the device node at host (symbolic links followed) as the
// container's node at ctr.
func Node(host, ctr string) (specs.LinuxDevice, error) {
	var st unix.Stat_t
	if err := unix.Stat(host, &st); err != nil {
		return specs.LinuxDevice{}, &os.PathError{Op: "stat", Path: host, Err: err}
	}
	var typ string
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFCHR:
		typ = "c"
	case unix.S_IFBLK:
		typ = "b"
	default:
		return specs.LinuxDevice{}, fmt.Errorf("%s: %w", host, errNotDevice)
	}
	return specs.LinuxDevice{
		Path:     ctr,
		Type:     typ,
		Major:    int64(unix.Major(uint64(st.Rdev))),
		Minor:    int64(unix.Minor(uint64(st.Rdev))),
		FileMode: ptr(os.FileMode(st.Mode & 0o7777)),
		UID:      ptr(st.Uid),
		GID:      ptr(st.Gid),
	}, nil
}

// hostSkip are the parts of the host's /dev a privileged container does
// not get from it: its own terminals, shared memory and message queues
// are made for it, and the rest are runtimes' and udev's bookkeeping.
var hostSkip = map[string]bool{"pts": true, "shm": true, "fd": true, "mqueue": true, ".lxc": true, ".lxd-mounts": true, ".udev": true}

// Host lists the device nodes of the host's /dev (root, for tests) as a
// privileged container gets them, the console and ptmx aside (the
// container has its own).
func Host(root string) ([]specs.LinuxDevice, error) {
	var out []specs.LinuxDevice
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			if p != root && errors.Is(err, fs.ErrPermission) {
				return nil
			}
			return err
		}
		if d.IsDir() {
			if p != root && hostSkip[d.Name()] {
				return filepath.SkipDir
			}
			return nil
		}
		if d.Type()&fs.ModeDevice == 0 || d.Name() == "console" || d.Name() == "ptmx" {
			return nil
		}
		rel, _ := filepath.Rel(root, p)
		n, err := Node(p, filepath.Join("/dev", rel))
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return nil // gone since it was listed
			}
			return err
		}
		out = append(out, n)
		return nil
	})
	return out, err
}
