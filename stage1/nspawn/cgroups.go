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

// systemdCgroup is the pod's cgroup in the hierarchies where
// systemd-nspawn and the agent run outside the pod cgroup, on a v1 or
// hybrid host: name=systemd and the hybrid cgroup2 mount, which
// systemd-nspawn itself moves processes in (into payload/ and
// supervisor/) and where no controller stagelet uses is attached; and the
// memory hierarchy (cgroups.RuntimeMemoryCgroup), so that the pod's memory
// limit bounds its apps only, the agent making their memory cgroups
// beneath the pod's, bound into the pod at podMemoryCgroup. It is
// "stagelet-pod-<id>" beneath the daemon's own cgroup there (the spec's
// cgroup parent names the controllers' hierarchies only), so no parent is
// created. On a pure cgroup v2 host the pod cgroup already is nspawn's,
// and an error is returned.
func systemdCgroup(spec *stage1.PodSpec) (*cgroups.Cgroup, error) {
	parent, err := systemdParent()
	if err != nil {
		return nil, err
	}
	return cgroups.WithMemory(parent.Child(host.LaunchName(spec.ID)), cgroups.RuntimeMemoryCgroup(spec.CgroupParent, spec.ID)), nil
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
// host under the plain launcher, the pods' cgroups outside the pod cgroup
// (systemdCgroup) once nothing runs in them (these are shared with any
// other daemon on the host). keep says which pods have a
// record. It returns the pods whose resources it released.
func (b *Backend) Collect(ctx context.Context, keep func(podID string) bool) ([]string, error) {
	if b.UnitLaunch() {
		return host.CollectUnits(ctx, b.Launcher, keep) // nspawn's cgroup is its unit's
	}
	parent, err := systemdParent()
	if err != nil {
		return nil, nil // pure cgroup v2: the pod cgroup is nspawn's
	}
	// Only empty ones: a lost pod's processes went with its pod cgroup
	// (the broker's collection, first).
	done, err := cgroups.CollectEmptyPodCgroups(cgroups.WithMemory(parent, cgroups.RuntimeMemoryParent()), keep)
	if err != nil {
		return done, fmt.Errorf("nspawn: collect: %w", err)
	}
	return done, nil
}
