package kvm

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/stage1"
	"github.com/stagelet/stagelet/stage1/host"
)

// vmPaths is a kvm pod's ContainerPaths: the pod's shared directory, and
// the PCI devices a container is given (VFIO), hot-plugged into the VM
// before the agent creates the container and unplugged when it is gone.
// A passed-through device is bound to its driver in the guest kernel, as
// Kata's "guest-kernel" mode does; the container gets no device node of
// it.
type vmPaths struct {
	host.SharedDir
	p *Pod
}

var _ stage1.ContainerPaths = vmPaths{}

// vfioPlugs are the VFIO devices plugged into a pod's VM, by container.
type vfioPlugs struct {
	mu  sync.Mutex
	ids map[string][]string // container ID → qemu device IDs
}

// vfioDeviceArgs are the arguments of QMP device_add for the PCI device at
// addr, passed through as qemu device id.
func vfioDeviceArgs(id, addr string) map[string]any {
	return map[string]any{"driver": "vfio-pci", "host": addr, "id": id}
}

// vfioDeviceID names the qemu device of a container's n-th PCI device.
func vfioDeviceID(ctr string, n int) string {
	if len(ctr) > 12 {
		ctr = ctr[:12]
	}
	return "vfio-" + ctr + "-" + strconv.Itoa(n)
}

// Share implements stage1.ContainerPaths.
func (v vmPaths) Share(ctx context.Context, spec *stage1.ContainerSpec, known func(context.Context, string) (bool, error)) (*stage1.ContainerSpec, error) {
	if len(spec.PCIDevices) > 0 {
		if err := v.p.plugPCI(ctx, spec.ID, spec.PCIDevices); err != nil {
			return nil, err
		}
	}
	rest, place, err := v.p.guestMounts(ctx, spec)
	if err != nil {
		v.p.unplugPCI(ctx, spec.ID)
		return nil, err
	}
	out, err := v.SharedDir.Share(ctx, rest, known)
	if err != nil {
		v.p.unplugPCI(ctx, spec.ID)
		return nil, err
	}
	out.Mounts = place(out.Mounts)
	// The container writes into a layer in the guest's memory: over 9p
	// each file's creation, lookup and removal is a round trip to qemu
	// (the host's rootfs, beneath, stays as the image left it). Not in a
	// pod with a user namespace of its own: its agent, inside it, could
	// mount that overlay only without the trusted extended attributes
	// that keep its whiteouts and opaque directories, and the guest's
	// tmpfs has no user ones before Linux 6.6; it writes into the host's
	// layer, over 9p.
	out.LocalUpper = v.SharedDir.UserNS == nil
	if err := v.p.rootfsDisk(ctx, spec, out); err != nil {
		if uerr := v.SharedDir.Unshare(spec.ID); uerr != nil {
			v.p.log.WarnContext(ctx, "kvm: undo the sharing of a container whose disk failed", "container", spec.ID, "err", uerr)
		}
		v.p.unplugPCI(ctx, spec.ID)
		return nil, err
	}
	if err := v.p.needShare(ctx, spec, out); err != nil {
		v.Unshare(spec.ID)
		return nil, err
	}
	return out, nil
}

// Unshare implements stage1.ContainerPaths.
func (v vmPaths) Unshare(id string) error {
	v.p.unplugPCI(context.Background(), id) // stage1.ContainerPaths.Unshare is called with no request
	v.p.forgetContainer(id)
	derr := v.p.detachImageDisk(context.Background(), id)
	return errors.Join(derr, v.SharedDir.Unshare(id))
}

// plugPCI passes the PCI devices addrs through to the VM (QMP
// device_add). Only a q35 VM has a PCI bus: a microvm is
// FailedPrecondition, naming the option that gives one.
func (p *Pod) plugPCI(ctx context.Context, ctr string, addrs []string) error {
	if m := p.st.VM.Machine; m != "q35" {
		return errdefs.FailedPrecondition("kvm: the pod's VM is a %s, which has no PCI bus to pass VFIO devices %v through to: set kvm.machine: q35 in the node configuration", m, addrs)
	}
	p.vfio.mu.Lock()
	defer p.vfio.mu.Unlock()
	q, err := p.dialQMP(ctx)
	if err != nil {
		return err
	}
	defer q.Close()
	var ids []string
	for i, addr := range addrs {
		id := vfioDeviceID(ctr, i)
		if _, err := q.run(ctx, "device_add", vfioDeviceArgs(id, addr)); err != nil {
			for _, done := range ids {
				q.run(ctx, "device_del", map[string]any{"id": done})
			}
			return errdefs.FailedPrecondition("kvm: pass PCI device %s through to the VM: %w", addr, err)
		}
		ids = append(ids, id)
	}
	if p.vfio.ids == nil {
		p.vfio.ids = map[string][]string{}
	}
	p.vfio.ids[ctr] = ids
	return nil
}

// unplugPCI asks the guest to give back the container's passed-through
// devices (QMP device_del; the guest ejects them). Failures are logged:
// the devices go with the VM at the latest. It runs to its own timeout
// whether or not ctx ends; ctx gives its logs the request's values.
func (p *Pod) unplugPCI(ctx context.Context, ctr string) {
	p.vfio.mu.Lock()
	defer p.vfio.mu.Unlock()
	ids := p.vfio.ids[ctr]
	if len(ids) == 0 {
		return
	}
	delete(p.vfio.ids, ctr)
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	q, err := p.dialQMP(ctx)
	if err != nil {
		p.log.WarnContext(ctx, "unplug VFIO devices", "container", ctr, "err", err)
		return
	}
	defer q.Close()
	for _, id := range ids {
		if _, err := q.run(ctx, "device_del", map[string]any{"id": id}); err != nil {
			p.log.WarnContext(ctx, "unplug VFIO device", "container", ctr, "device", id, "err", err)
		}
	}
}

// dialQMP connects to the VM's QMP socket.
func (p *Pod) dialQMP(ctx context.Context) (*qmp, error) {
	q, err := dialQMP(ctx, p.st.qmpSocket(), func() bool { return true })
	if err != nil {
		return nil, fmt.Errorf("kvm: the VM's QMP: %w", err)
	}
	return q, nil
}
