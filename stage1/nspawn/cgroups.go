package nspawn

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/cgroups"
	"github.com/stagelet/stagelet/stage1"
	"github.com/stagelet/stagelet/stage1/host"
)

// systemdCgroup is the pod's cgroup in the hierarchies systemd-nspawn
// itself moves processes in on a v1 or hybrid host: name=systemd and the
// hybrid cgroup2 mount, where no controller stagelet uses is attached. It
// is "stagelet-pod-<id>" beneath the daemon's own cgroup there (the spec's
// cgroup parent names the controllers' hierarchies only), so no parent is
// created. On a pure v2 host the pod cgroup already is nspawn's, and an
// error is returned.
func systemdCgroup(spec *stage1.PodSpec) (*cgroups.Cgroup, error) {
	parent, err := systemdParent()
	if err != nil {
		return nil, err
	}
	return parent.Child(host.LaunchName(spec.ID)), nil
}

// systemdParent is the daemon's own cgroup in the hierarchies of
// systemdCgroup.
func systemdParent() (*cgroups.Cgroup, error) {
	var sfs unix.Statfs_t
	if err := unix.Statfs("/sys/fs/cgroup", &sfs); err != nil {
		return nil, err
	}
	if sfs.Type == unix.CGROUP2_SUPER_MAGIC {
		return nil, errors.New("pure cgroup v2")
	}
	own, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return nil, err
	}
	self := map[string]string{} // "name=systemd" or "" (cgroup2) → path
	for _, line := range strings.Split(string(own), "\n") {
		parts := strings.SplitN(line, ":", 3)
		if len(parts) == 3 && (parts[1] == "name=systemd" || parts[1] == "") {
			self[parts[1]] = parts[2]
		}
	}
	ms, err := mountinfo.GetMounts(mountinfo.FSTypeFilter("cgroup", "cgroup2"))
	if err != nil {
		return nil, err
	}
	cg := &cgroups.Cgroup{Paths: map[string]string{}}
	for _, m := range ms {
		var key, selfKey string
		switch {
		case m.FSType == "cgroup2":
			key, selfKey = "cgroup2", ""
		case slices.Contains(strings.Split(m.VFSOptions, ","), "name=systemd"):
			key, selfKey = "name=systemd", "name=systemd"
		default:
			continue
		}
		if _, dup := cg.Paths[key]; dup {
			continue
		}
		path, ok := self[selfKey]
		if !ok {
			continue
		}
		rel := path
		if m.Root != "/" {
			if r, ok := strings.CutPrefix(path, m.Root); ok && (r == "" || r[0] == '/') {
				rel = r
			}
		}
		cg.Paths[key] = filepath.Join(m.Mountpoint, filepath.Clean("/"+rel))
	}
	if len(cg.Paths) == 0 {
		return nil, errors.New("no name=systemd or hybrid cgroup2 hierarchy")
	}
	return cg, nil
}

// Collect implements stage1.Collector for what a lost record leaves,
// which the broker's search of the pod cgroups does not reach: under the
// systemd driver, the pods' units (host.CollectUnits); on a v1 or hybrid
// host under the plain launcher, the pod cgroups in systemd-nspawn's own
// hierarchies (systemdCgroup) once nothing runs in them (these are
// shared with any other daemon on the host). keep says which pods have a
// record. It returns the pods whose resources it released.
func (b *Backend) Collect(ctx context.Context, keep func(podID string) bool) ([]string, error) {
	if b.UnitLaunch() {
		return host.CollectUnits(ctx, b.Launcher, keep) // nspawn's cgroup is its unit's
	}
	parent, err := systemdParent()
	if err != nil {
		return nil, nil // pure cgroup v2: the pod cgroup is nspawn's
	}
	ids := map[string]bool{}
	for _, dir := range parent.Paths {
		ents, err := os.ReadDir(dir)
		if err != nil {
			return nil, fmt.Errorf("nspawn: collect: %w", err)
		}
		for _, e := range ents {
			if id, ok := strings.CutPrefix(e.Name(), host.LaunchName("")); ok && e.IsDir() && host.ValidPodID(id) && !keep(id) {
				ids[id] = true
			}
		}
	}
	var done []string
	var errs []error
	for id := range ids {
		cg := parent.Child(host.LaunchName(id))
		// Only an empty one: a lost pod's processes went with its pod
		// cgroup (the broker's collection, first), and these hierarchies
		// are shared by every daemon on the host, whose pods this one
		// does not know.
		if pids, err := cg.Procs(); err != nil || len(pids) > 0 {
			continue
		}
		if err := cg.Delete(); err != nil {
			errs = append(errs, err)
		} else {
			done = append(done, id)
		}
	}
	slices.Sort(done)
	return done, errors.Join(errs...)
}
