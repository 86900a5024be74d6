package cgroups

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
)

// A ViewDir is one hierarchy of a container's view of its own cgroups:
// the directory of the caller's cgroup in that hierarchy (Dir, a path in
// the caller's mount namespace) and the name it gets beneath
// /sys/fs/cgroup in the container (Name: "memory", "cpu,cpuacct",
// "systemd", as runc names them after the hierarchy's mount point; empty
// for the cgroup2 hierarchy of a pure v2 host, which is /sys/fs/cgroup
// itself). Controllers are the hierarchy's controllers as
// /proc/self/cgroup names them ("cpu", "cpuacct", "name=systemd").
type ViewDir struct {
	Name        string
	Dir         string
	Controllers []string
}

// OwnView returns the caller's cgroups as a container shows them beneath
// its /sys/fs/cgroup: on a pure cgroup v2 host the one cgroup2 directory
// (v2 true); elsewhere one directory per cgroup v1 hierarchy the caller
// is in and can reach through a mount (the hybrid cgroup2 hierarchy is
// left out, as runc leaves it out). Mounts beneath exclude (the
// container's own root, say) are not used. Read from /proc/self/cgroup
// and /proc/thread-self/mountinfo.
func OwnView(exclude string) (v2 bool, dirs []ViewDir, err error) {
	pc, err := os.Open("/proc/self/cgroup")
	if err != nil {
		return false, nil, fmt.Errorf("cgroups: %w", err)
	}
	defer pc.Close()
	mi, err := os.Open("/proc/thread-self/mountinfo")
	if err != nil {
		return false, nil, fmt.Errorf("cgroups: %w", err)
	}
	defer mi.Close()
	v2 = hostV2()
	dirs, err = viewOf(pc, mi, v2, exclude)
	return v2, dirs, err
}

// procLine is one line of /proc/PID/cgroup.
type procLine struct {
	controllers []string // nil for the cgroup2 line
	path        string
}

func parseProcLines(r io.Reader) ([]procLine, error) {
	var out []procLine
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" {
			continue
		}
		parts := strings.SplitN(line, ":", 3)
		if len(parts) != 3 {
			return nil, fmt.Errorf("cgroups: bad /proc/self/cgroup line %q", line)
		}
		var ctls []string
		if parts[1] != "" {
			ctls = strings.Split(parts[1], ",")
		}
		out = append(out, procLine{controllers: ctls, path: parts[2]})
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("cgroups: read /proc/self/cgroup: %w", err)
	}
	return out, nil
}

// viewOf is OwnView from a /proc/self/cgroup and a mountinfo file.
func viewOf(procCgroup, mountInfo io.Reader, v2 bool, exclude string) ([]ViewDir, error) {
	lines, err := parseProcLines(procCgroup)
	if err != nil {
		return nil, err
	}
	all, err := parseMountinfo(mountInfo)
	if err != nil {
		return nil, err
	}
	mounts := all[:0]
	for _, m := range all {
		if exclude == "" || !within(exclude, m.point) {
			mounts = append(mounts, m)
		}
	}
	var out []ViewDir
	for _, l := range lines {
		if (l.controllers == nil) != v2 {
			continue // v1 lines on a v2 host, the hybrid line on a v1 one
		}
		m, ok := reaching(mounts, l)
		if !ok {
			continue
		}
		d := ViewDir{Dir: filepath.Join(m.point, relTo(m.root, l.path)), Controllers: l.controllers}
		if !v2 {
			d.Name = viewName(m)
		}
		out = append(out, d)
	}
	if len(out) == 0 {
		return nil, errors.New("cgroups: no mounted hierarchy holds the caller's cgroup")
	}
	return out, nil
}

// reaching is the mount of l's hierarchy through which l's cgroup is
// reached: of those whose root holds it, the one with the deepest root,
// then the one beneath /sys/fs/cgroup.
func reaching(mounts []mount, l procLine) (mount, bool) {
	var best mount
	found := false
	for _, m := range mounts {
		if !servesLine(m, l) || !holds(m.root, l.path) {
			continue
		}
		better := !found || len(m.root) > len(best.root) ||
			(len(m.root) == len(best.root) && within("/sys/fs/cgroup", m.point) && !within("/sys/fs/cgroup", best.point))
		if better {
			best, found = m, true
		}
	}
	return best, found
}

// servesLine tells whether mount m is of the hierarchy of line l.
func servesLine(m mount, l procLine) bool {
	if l.controllers == nil {
		return m.fstype == "cgroup2"
	}
	if m.fstype != "cgroup" {
		return false
	}
	for _, c := range l.controllers {
		if !slices.Contains(m.opts, c) {
			return false
		}
	}
	return true
}

// holds tells whether the cgroup path p is root or beneath it. Paths
// outside the reader's cgroup namespace begin with "/.." and are held
// only by a root that names them so.
func holds(root, p string) bool {
	if root == "/" {
		return p != "/.." && !strings.HasPrefix(p, "/../")
	}
	return p == root || strings.HasPrefix(p, strings.TrimSuffix(root, "/")+"/")
}

// relTo is p relative to root, which holds it, as an absolute path.
func relTo(root, p string) string {
	if root == "/" {
		return p
	}
	return "/" + strings.TrimPrefix(strings.TrimPrefix(p, strings.TrimSuffix(root, "/")), "/")
}

// within tells whether path p is dir or beneath it.
func within(dir, p string) bool {
	dir = filepath.Clean(dir)
	p = filepath.Clean(p)
	return p == dir || strings.HasPrefix(p, strings.TrimSuffix(dir, "/")+"/")
}

// viewName is the name of a v1 hierarchy beneath a container's
// /sys/fs/cgroup: its mount point's name where it is mounted beneath the
// caller's /sys/fs/cgroup, else its controllers ("cpu,cpuacct";
// "systemd" for name=systemd).
func viewName(m mount) string {
	if filepath.Dir(m.point) == "/sys/fs/cgroup" {
		return filepath.Base(m.point)
	}
	var names []string
	for _, o := range m.opts {
		switch {
		case strings.HasPrefix(o, "name="):
			names = append(names, strings.TrimPrefix(o, "name="))
		case knownV1Controller(o):
			names = append(names, o)
		}
	}
	return strings.Join(names, ",")
}

// HierarchyOf is the v1 hierarchy a cgroup mount with super options opts
// shows, as /proc/PID/cgroup names it: its controllers ("cpu,cpuacct")
// or its name ("name=systemd").
func HierarchyOf(opts []string) string {
	var names []string
	for _, o := range opts {
		if strings.HasPrefix(o, "name=") || knownV1Controller(o) {
			names = append(names, o)
		}
	}
	return strings.Join(names, ",")
}

// knownV1Controller tells a controller's name from a mount option.
func knownV1Controller(o string) bool {
	switch o {
	case "cpu", "cpuacct", "cpuset", "memory", "pids", "freezer", "devices", "blkio",
		"net_cls", "net_prio", "perf_event", "hugetlb", "rdma", "misc":
		return true
	}
	return false
}
