package host

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"

	"github.com/stagelet/stagelet/cgroups"
)

// podCgroupPrefix names every pod cgroup (PodCgroup) and launch unit.
const podCgroupPrefix = "stagelet-pod-"

// OrphanCgroup is a pod cgroup no pod record names, as CollectPodCgroups
// found and released it.
type OrphanCgroup struct {
	PodID string
	// Procs is how many processes it still held (killed).
	Procs int
	// Err is why it could not be released (it is left), or nil.
	Err error
}

// CollectPodCgroups releases the pod cgroups of the plain launcher
// ("stagelet-pod-<id>" beneath parent: the node's default cgroup parent,
// where PodCgroup puts them, or the kvm stage1's overhead cgroup) whose
// pod ID keep refuses: what a crash between
// taking a pod's resources and recording the pod, or a record lost since,
// left behind. The processes in such a cgroup (an agent, an nspawn, a
// qemu or virtiofsd of every stage1 alike) are killed and the cgroup is
// removed. Cgroups the kubelet placed elsewhere (an absolute parent per
// pod) are not searched: the kubelet removes pod cgroups it does not know.
func CollectPodCgroups(parent string, keep func(podID string) bool) ([]OrphanCgroup, error) {
	if parent == "" || SliceOf(parent) != "" {
		parent = "."
	}
	p, err := cgroups.Resolve(parent)
	if err != nil {
		return nil, err
	}
	ids, err := unkeptPodCgroups(p, keep)
	if err != nil {
		return nil, fmt.Errorf("collect pod cgroups: %w", err)
	}
	var out []OrphanCgroup
	for id := range ids {
		c := p.Child(podCgroupPrefix + id)
		o := OrphanCgroup{PodID: id}
		if pids, err := c.Procs(); err == nil {
			o.Procs = len(pids)
		}
		if err := c.Kill(); err != nil {
			o.Err = err
		} else if err := c.Delete(); err != nil {
			o.Err = err
		}
		out = append(out, o)
	}
	return out, nil
}

// CollectEmptyPodCgroups removes the cgroups "stagelet-pod-<id>" beneath
// parent whose pod ID keep refuses and that hold no process: the cgroups a
// stage1 keeps outside the pod cgroup (systemd-nspawn's own hierarchies,
// the runtime's memory cgroup) after a lost record's processes went with
// its pod cgroup (CollectPodCgroups, first). Those beneath the daemon's
// own cgroup are shared by every daemon on the host, whose pods this one
// does not know: one still holding a process is left. It returns the
// pods whose cgroups it removed.
func CollectEmptyPodCgroups(parent *cgroups.Cgroup, keep func(podID string) bool) ([]string, error) {
	if parent == nil {
		return nil, nil
	}
	ids, err := unkeptPodCgroups(parent, keep)
	if err != nil {
		return nil, fmt.Errorf("collect: %w", err)
	}
	var done []string
	var errs []error
	for id := range ids {
		cg := parent.Child(podCgroupPrefix + id)
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

// unkeptPodCgroups are the IDs of the cgroups "stagelet-pod-<id>" beneath
// parent, in any of its hierarchies (one missing is skipped), whose pod
// keep refuses.
func unkeptPodCgroups(parent *cgroups.Cgroup, keep func(podID string) bool) (map[string]bool, error) {
	ids := map[string]bool{}
	for _, dir := range parent.Paths {
		ents, err := os.ReadDir(dir)
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, err
		}
		for _, e := range ents {
			if id, ok := strings.CutPrefix(e.Name(), podCgroupPrefix); ok && e.IsDir() && ValidPodID(id) && !keep(id) {
				ids[id] = true
			}
		}
	}
	return ids, nil
}

// PodCgroupName is the name of pod id's cgroup and the prefix of its
// launch units.
func PodCgroupName(id string) string { return podCgroupPrefix + id }

// ValidPodID: the broker's IDs are 64 lower-case hex digits.
func ValidPodID(id string) bool {
	if len(id) != 64 {
		return false
	}
	for _, r := range id {
		if !(r >= '0' && r <= '9' || r >= 'a' && r <= 'f') {
			return false
		}
	}
	return true
}

// CollectUnits releases the units of a UnitLauncher named after a pod
// ("stagelet-pod-<id>", or "stagelet-pod-<id>-<what>" for a pod's other
// processes) whose pod keep refuses: under the systemd driver, what a
// lost record leaves running. Without a UnitLauncher there is nothing to
// do. It returns the pods whose units it released.
func CollectUnits(ctx context.Context, l Launcher, keep func(podID string) bool) ([]string, error) {
	u, ok := l.(UnitLauncher)
	if !ok {
		return nil, nil
	}
	names, err := u.Units(ctx, podCgroupPrefix)
	if err != nil {
		return nil, err
	}
	var done []string
	var errs []error
	for _, name := range names {
		id := strings.TrimPrefix(name, podCgroupPrefix)
		if len(id) > 64 && id[64] == '-' {
			id = id[:64]
		}
		if !ValidPodID(id) || keep(id) {
			continue
		}
		if err := u.Release(ctx, name); err != nil {
			errs = append(errs, err)
			continue
		}
		if !slices.Contains(done, id) {
			done = append(done, id)
		}
	}
	slices.Sort(done)
	return done, errors.Join(errs...)
}
