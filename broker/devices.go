package broker

import (
	"slices"
	"strings"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/devices"
	"github.com/stagelet/stagelet/errdefs"
)

// hostDev and hostSys are the host's /dev, whose nodes a privileged
// container gets where its stage1 gives privileged containers the host's
// devices, and /sys, where VFIO groups' devices are listed.
var hostDev, hostSys = "/dev", "/sys"

// appDevices gives app the device nodes its container asks for and the
// device cgroup rules that fence the rest, by what the pod's stage1 is:
//   - in a VM, a host device node means nothing to the guest kernel:
//     devices are refused but VFIO groups (/dev/vfio/N), whose PCI
//     devices the stage1 passes through to the guest (returned), and the
//     guest's own devices are not fenced (the VM is the boundary);
//   - in a pod with a user namespace of its own, the kernel makes no
//     device node and the agent, not root there, attaches no device
//     filter: devices are refused, the pod's /dev holds the usual nodes
//     only;
//   - otherwise a container may open the default devices and its own; a
//     privileged one every device, and gets the host's nodes where its
//     stage1 makes privileged mean the host's devices (fly) and the
//     runtime handler does not say otherwise, else the pod's (nspawn's).
//
// A privileged container in a VM gets the guest's device nodes.
func (b *Broker) appDevices(p *pod, cfg *ContainerConfig, app *api.AppSpec) (pci []string, err error) {
	b.mu.Lock()
	stage1 := p.rec.Stage1
	noHostDevices := p.rec.PrivilegedWithoutHostDevices
	userns := p.rec.Config.UserNS != nil
	b.mu.Unlock()
	caps := b.caps[stage1]
	cdiNames, err := devices.FromAnnotations(cfg.Annotations)
	if err != nil {
		return nil, err
	}
	cdiNames = append(slices.Clone(cfg.CDIDevices), cdiNames...)
	switch {
	case caps.KernelIsolated:
		for i, d := range cfg.Devices {
			vfio, addrs, err := devices.VFIOGroup(d.Host, hostDev, hostSys)
			switch {
			case !vfio:
				return nil, errdefs.InvalidArgument("config.devices[%d]: the pod runs in a VM (stage1 %s), whose kernel has none of the host's device nodes (%s); only VFIO groups (/dev/vfio/N) can be passed through", i, stage1, d.Host)
			case err != nil:
				return nil, errdefs.InvalidArgument("config.devices[%d].host_path: %w", i, err)
			}
			pci = append(pci, addrs...)
		}
		if len(cdiNames) > 0 {
			return nil, errdefs.InvalidArgument("config.CDI_devices: the pod runs in a VM (stage1 %s), whose kernel has none of the host's devices (%s)", stage1, strings.Join(cdiNames, ", "))
		}
		app.PodDevices = app.Privileged // the guest's devices
		return pci, nil
	case userns:
		if len(cfg.Devices) > 0 || len(cdiNames) > 0 {
			return nil, errdefs.InvalidArgument("config.devices, CDI_devices: the pod has a user namespace of its own (hostUsers: false), in which no device node can be made")
		}
		return nil, nil
	}
	set, err := devices.Resolve(cfg.Devices, "config.devices")
	if err != nil {
		return nil, err
	}
	edits, err := b.opts.CDI.Resolve(cdiNames, "config.CDI_devices")
	if err != nil {
		return nil, err
	}
	set.Nodes = append(set.Nodes, edits.Nodes...)
	set.Rules = append(set.Rules, edits.Rules...)
	applyCDI(app, edits)
	if app.Privileged {
		app.DeviceCgroup = devices.AllowAll()
		switch {
		case caps.Privileged != "host":
			app.PodDevices = true // the pod's own, not the host's
		case !noHostDevices:
			host, err := devices.Host(hostDev)
			if err != nil {
				return nil, err
			}
			app.Devices = host
		}
	} else {
		app.DeviceCgroup = append(devices.DefaultRules(), set.Rules...)
	}
	app.Devices = append(app.Devices, set.Nodes...)
	return nil, nil
}

// applyCDI adds CDI edits beside the device nodes: bind mounts,
// environment variables (replacing the container's of the same name) and
// supplementary groups.
func applyCDI(app *api.AppSpec, e devices.Edits) {
	for _, m := range e.Mounts {
		app.Mounts = append(app.Mounts, api.Mount{
			Source: m.Host, Destination: m.Container, Readonly: m.Readonly, RecursiveReadonly: m.RecursiveReadonly,
			Propagation: m.Propagation, NoSuid: m.NoSuid, NoDev: m.NoDev, NoExec: m.NoExec,
		})
	}
	for _, kv := range e.Env {
		name, _, _ := strings.Cut(kv, "=")
		app.Env = slices.DeleteFunc(app.Env, func(x string) bool { return strings.HasPrefix(x, name+"=") })
		app.Env = append(app.Env, kv)
	}
	for _, g := range e.GIDs {
		if !slices.Contains(app.AdditionalGIDs, g) {
			app.AdditionalGIDs = append(app.AdditionalGIDs, g)
		}
	}
}
