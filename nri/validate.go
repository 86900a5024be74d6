package nri

import (
	"fmt"
	"strings"

	nriapi "github.com/containerd/nri/pkg/api"

	"github.com/stagelet/stagelet/errdefs"
)

// CheckStage1 is the ValidateContainerAdjustment check of the daemon's
// builtin plugin: for a pod whose stage1 runs it in a kernel of its own
// (kernelIsolated, a VM), it refuses with InvalidArgument, naming the
// plugin that asked (req.Owners) and what it asked for, the adjustments
// the guest cannot honour:
//   - OCI hooks: they would run on the host, against a process of the
//     guest's;
//   - host devices, and CDI devices, which are the host's: a device node
//     of the host is not the guest's;
//   - cpusets: the guest's vCPUs and memory nodes are not the host's.
//
// Mounts stay allowed: the daemon shares a host path into the guest.
// Updates to other containers (req.Update) are checked against their
// own pods' stage1 by whoever applies them (CheckUpdateStage1). A pod
// that shares the host's kernel passes. Pure: no lock, no I/O.
func CheckStage1(kernelIsolated bool, stage1 string, req *nriapi.ValidateContainerAdjustmentRequest) error {
	if !kernelIsolated || req == nil {
		return nil
	}
	id := req.GetContainer().GetId()
	o := req.GetOwners()
	if o == nil {
		o = nriapi.NewOwningPlugins() // owns nothing: every owner is unknown
	}
	adj := req.GetAdjust()
	refuse := func(plugin, what, why string) error {
		return errdefs.InvalidArgument("NRI plugin %s asked for %s: %s", plugin, what, fmt.Sprintf(why, stage1))
	}
	if hasHooks(adj.GetHooks()) {
		return refuse(name(o.HooksOwner(id)), "OCI hooks ("+hookPaths(adj.GetHooks())+")",
			"stage1 %s runs the container in a VM, and a hook would run on the host against a process of the guest's")
	}
	for _, d := range adj.GetLinux().GetDevices() {
		path, remove := d.IsMarkedForRemoval()
		if remove {
			continue
		}
		return refuse(name(o.DeviceOwner(id, path)), "device "+path,
			"stage1 %s runs the container in a VM, whose kernel has none of the host's devices")
	}
	for _, d := range adj.GetCDIDevices() {
		return refuse(name(o.CdiDeviceOwner(id, d.GetName())), "CDI device "+d.GetName(),
			"stage1 %s runs the container in a VM, whose kernel has none of the host's devices")
	}
	c := adj.GetLinux().GetResources().GetCpu()
	if c.GetCpus() != "" {
		return refuse(name(o.CPUSetCPUsOwner(id)), "cpuset.cpus "+c.GetCpus(), cpusetWhy)
	}
	if c.GetMems() != "" {
		return refuse(name(o.CPUSetMemsOwner(id)), "cpuset.mems "+c.GetMems(), cpusetWhy)
	}
	return nil
}

// CheckUpdateStage1 is CheckStage1 for limits a plugin sets on a created
// container (its UpdateContainer answer, or an update it asks for on its
// own): plugin names it, as the caller knows it ("" when unknown).
func CheckUpdateStage1(kernelIsolated bool, stage1, plugin string, u *nriapi.LinuxResources) error {
	if !kernelIsolated {
		return nil
	}
	if plugin == "" {
		plugin = unknownPlugin
	}
	c := u.GetCpu()
	for _, f := range []struct{ name, v string }{{"cpuset.cpus", c.GetCpus()}, {"cpuset.mems", c.GetMems()}} {
		if f.v != "" {
			return errdefs.InvalidArgument("NRI plugin %s asked for %s %s: %s", plugin, f.name, f.v, fmt.Sprintf(cpusetWhy, stage1))
		}
	}
	return nil
}

const (
	cpusetWhy     = "stage1 %s runs the container in a VM, whose vCPUs and memory nodes are not the host's"
	unknownPlugin = "(unknown)"
)

// name is an owner lookup's plugin, or unknownPlugin.
func name(plugin string, ok bool) string {
	if !ok || plugin == "" {
		return unknownPlugin
	}
	return plugin
}

// hookPaths lists the executables of h.
func hookPaths(h *nriapi.Hooks) string {
	var paths []string
	for _, hs := range [][]*nriapi.Hook{h.GetPrestart(), h.GetCreateRuntime(), h.GetCreateContainer(), h.GetStartContainer(), h.GetPoststart(), h.GetPoststop()} {
		for _, x := range hs {
			paths = append(paths, x.GetPath())
		}
	}
	return strings.Join(paths, ", ")
}
