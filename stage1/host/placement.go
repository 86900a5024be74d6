package host

import (
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
