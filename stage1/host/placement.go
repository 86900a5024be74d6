package host

import (
	"maps"
	"sync"

	"github.com/stagelet/stagelet/cgroups"
	"github.com/stagelet/stagelet/stage1"
)

// PodCgroup is the cgroup a pod's host processes run in under the plain
// launcher (the cgroupfs driver): "stagelet-pod-<id>" beneath
// spec.CgroupParent, an absolute cgroup path or one relative to the
// daemon's own (delegated) cgroup; see cgroups.Resolve. Under a
// UnitLauncher the pod's processes run in their units' cgroups instead.
func PodCgroup(spec *stage1.PodSpec) (*cgroups.Cgroup, error) {
	parent := spec.CgroupParent
	if parent == "" || SliceOf(parent) != "" {
		parent = "."
	}
	p, err := cgroups.Resolve(parent)
	if err != nil {
		return nil, err
	}
	return p.Child(podCgroupPrefix + spec.ID), nil
}

// PodSlice is the systemd slice a UnitLauncher puts a pod's units in: the
// pod's cgroup parent when it is a slice (the kubelet's systemd driver
// names "kubepods-burstable-pod<uid>.slice", as that slice's cgroup path;
// see SliceOf), else "": the launcher's own.
func PodSlice(spec *stage1.PodSpec) string {
	return SliceOf(spec.CgroupParent)
}

// PodBudget is the cgroup whose limits bound everything a pod runs on the
// host: the pod's slice under a UnitLauncher, else PodCgroup (not created
// yet when StartPod asks; its limits are its parent's, the kubelet's pod
// cgroup).
func PodBudget(spec *stage1.PodSpec) (*cgroups.Cgroup, error) {
	if s := PodSlice(spec); s != "" {
		return cgroups.Resolve(slicePath(s))
	}
	return PodCgroup(spec)
}

// RuntimeMemoryParent is the daemon's own memory cgroup on a cgroup v1 or
// hybrid host whose memory controller has a hierarchy of its own (key
// "memory"), beneath which RuntimeMemoryCgroup places the pods' runtime
// processes; nil otherwise (cgroup v2, memory co-mounted with another
// controller, no cgroups). Read once (the daemon does not change cgroups
// on v1): not again for every pod start. Callers do not modify it.
var RuntimeMemoryParent = sync.OnceValue(runtimeMemoryParent)

func runtimeMemoryParent() *cgroups.Cgroup {
	self, err := cgroups.Self()
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
	return &cgroups.Cgroup{Paths: map[string]string{"memory": mem}}
}

// RuntimeMemoryCgroup is the memory cgroup a pod's runtime processes (its
// agent; systemd-nspawn) are charged to instead of the pod cgroup, under
// the plain launcher on a cgroup v1 host: "stagelet-pod-<id>" beneath the
// daemon's own memory cgroup (RuntimeMemoryParent), as containerd's shim
// is charged to containerd's cgroup rather than the pod's. The agent makes
// its apps' memory cgroups beneath the pod cgroup's all the same (its
// --memory-cgroup), so the pod's memory limit bounds its containers only.
// Otherwise the kernel's OOM killer, choosing within the pod's cgroup,
// may take the agent (its static binary, mapped, counts as resident)
// before the app that ran out of memory, and with the agent every app of
// the pod. Nil where RuntimeMemoryParent is, or where this would be the
// pod cgroup itself (its parent is the daemon's own cgroup). On cgroup v2
// a process cannot move another into a cgroup outside its cgroup
// namespace, which nspawn's agent has, so the agent stays in the pod
// cgroup there; under the service unit its oom_score_adj of -999 keeps
// the OOM killer off it.
func RuntimeMemoryCgroup(spec *stage1.PodSpec) *cgroups.Cgroup {
	parent := RuntimeMemoryParent()
	if parent == nil {
		return nil
	}
	cg := parent.Child(podCgroupPrefix + spec.ID)
	if pod, err := PodCgroup(spec); err != nil || pod.Paths["memory"] == cg.Paths["memory"] {
		return nil
	}
	return cg
}

// WithMemory is cg with its memory directory replaced by mem's (a cgroup
// of RuntimeMemoryCgroup), or cg itself when mem is nil.
func WithMemory(cg, mem *cgroups.Cgroup) *cgroups.Cgroup {
	if mem == nil {
		return cg
	}
	out := &cgroups.Cgroup{Paths: maps.Clone(cg.Paths)}
	out.Paths["memory"] = mem.Paths["memory"]
	return out
}
