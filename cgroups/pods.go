package cgroups

import (
	"errors"
	"fmt"
	"maps"
	"os"
	"slices"
	"strings"
	"sync"
)

// Pod cgroups: their names, where they go beneath a pod's cgroup parent,
// the cgroup v1 memory cgroups a pod's runtime processes are charged to
// instead, and collecting those no pod record names.

// PodCgroupPrefix names every pod cgroup ("stagelet-pod-<id>") and the
// launch units of a pod's host processes.
const PodCgroupPrefix = "stagelet-pod-"

// PodCgroupName is the name of pod id's cgroup and the prefix of its
// launch units.
func PodCgroupName(id string) string { return PodCgroupPrefix + id }

// ValidPodID: pod IDs, as the broker makes them and pod cgroups are
// named after them, are 64 lower-case hex digits.
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

// PodCgroup is the cgroup pod id's host processes run in under the plain
// launcher (the cgroupfs driver): "stagelet-pod-<id>" beneath parent (the
// pod's cgroup parent), an absolute cgroup path or one relative to the
// daemon's own (delegated) cgroup; see Resolve. An empty parent, or one
// that names a slice (SliceOf), means the daemon's own. Under the systemd
// driver the pod's processes run in their units' cgroups instead.
func PodCgroup(parent, id string) (*Cgroup, error) {
	if parent == "" || SliceOf(parent) != "" {
		parent = "."
	}
	p, err := Resolve(parent)
	if err != nil {
		return nil, err
	}
	return p.Child(PodCgroupName(id)), nil
}

// PodBudget is the cgroup whose limits bound everything pod id runs on
// the host: the slice its cgroup parent names (units go into it), else
// PodCgroup (not created yet when a start asks; its limits are its
// parent's, the kubelet's pod cgroup).
func PodBudget(parent, id string) (*Cgroup, error) {
	if s := SliceOf(parent); s != "" {
		return Resolve(SlicePath(s))
	}
	return PodCgroup(parent, id)
}

// RuntimeMemoryParent is the daemon's own memory cgroup on a cgroup v1 or
// hybrid host whose memory controller has a hierarchy of its own (key
// "memory"), beneath which RuntimeMemoryCgroup places the pods' runtime
// processes; nil otherwise (cgroup v2, memory co-mounted with another
// controller, no cgroups). Read once (the daemon does not change cgroups
// on v1): not again for every pod start. Callers do not modify it.
var RuntimeMemoryParent = sync.OnceValue(runtimeMemoryParent)

func runtimeMemoryParent() *Cgroup {
	self, err := Self()
	if err != nil || self.IsV2() {
		return nil
	}
	mem, ok := self.Paths["memory"]
	if !ok {
		return nil
	}
	for k, p := range self.Paths {
		if k != "memory" && p == mem {
			return nil
		}
	}
	return &Cgroup{Paths: map[string]string{"memory": mem}}
}

// RuntimeMemoryCgroup is the memory cgroup a pod's runtime processes (its
// agent; systemd-nspawn) are charged to instead of the pod cgroup
// (PodCgroup of parent and id), under the plain launcher on a cgroup v1
// host: "stagelet-pod-<id>" beneath the daemon's own memory cgroup
// (RuntimeMemoryParent), as containerd's shim is charged to containerd's
// cgroup rather than the pod's. The agent makes its apps' memory cgroups
// beneath the pod cgroup's all the same (its --memory-cgroup: WithMemory
// on the agent's side), so the pod's memory limit bounds its containers
// only. Otherwise the kernel's OOM killer, choosing within the pod's
// cgroup, may take the agent (its static binary, mapped, counts as
// resident) before the app that ran out of memory, and with the agent
// every app of the pod. Nil where RuntimeMemoryParent is, or where this
// would be the pod cgroup itself (its parent is the daemon's own cgroup).
// On cgroup v2 a process cannot move another into a cgroup outside its
// cgroup namespace, which nspawn's agent has, so the agent stays in the
// pod cgroup there; under the service unit its oom_score_adj of -999
// keeps the OOM killer off it.
func RuntimeMemoryCgroup(parent, id string) *Cgroup {
	rt := RuntimeMemoryParent()
	if rt == nil {
		return nil
	}
	cg := rt.Child(PodCgroupName(id))
	if pod, err := PodCgroup(parent, id); err != nil || pod.Paths["memory"] == cg.Paths["memory"] {
		return nil
	}
	return cg
}

// WithMemory is cg with its memory directory set to mem's (a cgroup of
// RuntimeMemoryCgroup, beneath RuntimeMemoryParent, or the pod cgroup's
// memory cgroup the agent's apps go beneath), or cg itself when mem is
// nil: a cgroup v1 memory hierarchy apart from the others. cg is not
// modified.
func WithMemory(cg, mem *Cgroup) *Cgroup {
	if mem == nil {
		return cg
	}
	out := &Cgroup{Paths: maps.Clone(cg.Paths)}
	out.Paths["memory"] = mem.Paths["memory"]
	return out
}

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
	p, err := Resolve(parent)
	if err != nil {
		return nil, err
	}
	ids, err := unkeptPodCgroups(p, keep)
	if err != nil {
		return nil, fmt.Errorf("collect pod cgroups: %w", err)
	}
	var out []OrphanCgroup
	for id := range ids {
		c := p.Child(PodCgroupName(id))
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
func CollectEmptyPodCgroups(parent *Cgroup, keep func(podID string) bool) ([]string, error) {
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
		cg := parent.Child(PodCgroupName(id))
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
func unkeptPodCgroups(parent *Cgroup, keep func(podID string) bool) (map[string]bool, error) {
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
			if id, ok := strings.CutPrefix(e.Name(), PodCgroupPrefix); ok && e.IsDir() && ValidPodID(id) && !keep(id) {
				ids[id] = true
			}
		}
	}
	return ids, nil
}
