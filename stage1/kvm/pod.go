package kvm

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/stagelet/stagelet/stage1/host"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/agent/client"
	"github.com/stagelet/stagelet/cgroups"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/stage1"
)

// Pod is a running kvm pod: its VM and the agent inside it, reached over
// the VM's serial session.
type Pod struct {
	// dial opens a stream of the VM's serial session (shared by every
	// connection to the agent: Agent).
	dial client.Dialer
	id   string
	st   *state
	log  *slog.Logger
	b    *Backend
	// vfio are the PCI devices containers were given, plugged into the
	// VM.
	vfio *vfioPlugs
	// share is whether the guest mounted the 9p share, and why.
	share *podShare
	// spec is the pod's, for a VM started again (RestorePod).
	spec *stage1.PodSpec
	// stMu guards st's VM and qemu against RestorePod, which changes
	// them, for State and Details, which the status path reads.
	stMu sync.RWMutex
	// disks guards the record of the image disks plugged into the VM.
	disks *diskPlugs
	// runDir is the pod's run directory; vols its volumes that live in
	// the guest (volumes.go).
	runDir string
	vols   *podVolumes
}

var _ stage1.Pod = (*Pod)(nil)

var (
	_ stage1.PodResizer  = (*Pod)(nil)
	_ stage1.HostStatser = (*Pod)(nil)
)

func (b *Backend) newPod(spec *stage1.PodSpec, st *state) *Pod {
	d := b.dialer(st.ctlSocket())
	p := &Pod{dial: d.Dial, id: spec.ID, st: st, log: b.Log.With("pod", spec.ID), b: b, vfio: &vfioPlugs{}, share: &podShare{}, spec: spec, disks: &diskPlugs{}, runDir: spec.RunDir}
	if st.ShareOnDemand && st.dir() != "" {
		use, err := loadShareUse(st)
		if err != nil {
			// Refusing the move is the safe reading of a bad record.
			p.log.Warn("kvm: the record of the 9p share's use", "err", err)
			use = &shareUse{Container: "unknown", HostPath: "unknown", CtrPath: "unknown"}
		}
		p.share.use = use
	}
	p.vols = newPodVolumes(st.dir(), p.log, client.NewClient(d.Dial))
	return p
}

// Agent implements stage1.Pod: streams over the VM's serial session, and
// the pod's shared directory (the guest's 9p mount) for container paths.
func (p *Pod) Agent() stage1.AgentEndpoint {
	return stage1.AgentEndpoint{Dial: p.dial, Paths: vmPaths{SharedDir: p.st.shared(), p: p}}
}

// State implements stage1.Pod.
func (p *Pod) State() []byte {
	p.stMu.RLock()
	defer p.stMu.RUnlock()
	return p.st.marshal()
}

// UpdatePodResources implements stage1.PodResizer: the VM's memory and
// vCPUs are fixed when it boots, so new totals must fit in them (the
// memory limit beside the guest's own GuestBaseMiB). Growing a VM would
// take memory hotplug or a balloon device and vCPU hotplug, which this
// stage1 does not do: FailedPrecondition says so. Limits that fit need no
// change here: the containers' own limits, inside the guest, do the rest.
func (p *Pod) UpdatePodResources(ctx context.Context, r stage1.PodResources) error {
	vm := p.st.VM
	if r.MemoryLimit > 0 && vm.MemoryMiB > 0 {
		if need := int((r.MemoryLimit+(1<<20)-1)>>20) + GuestBaseMiB; need > vm.MemoryMiB {
			return errdefs.FailedPrecondition("kvm: the pod's VM has %d MiB, and a %d MiB memory limit needs %d MiB with the guest's own: a VM's memory is fixed at boot (growing it would take memory hotplug or a balloon device); recreate the pod to resize it", vm.MemoryMiB, r.MemoryLimit>>20, need)
		}
	}
	if r.CPUQuota > 0 && r.CPUPeriod > 0 && vm.VCPUs > 0 {
		if need := int((r.CPUQuota + r.CPUPeriod - 1) / r.CPUPeriod); need > vm.VCPUs {
			return errdefs.FailedPrecondition("kvm: the pod's VM has %d vCPUs and the new CPU limit needs %d: a VM's vCPUs are fixed at boot (adding them would take vCPU hotplug); recreate the pod to resize it", vm.VCPUs, need)
		}
	}
	return nil
}

// Details implements stage1.Pod: the VM's accelerator ("kvm" or "tcg"),
// machine type, memory, vCPUs and guest kernel, its network, and where
// its qemu runs: "placement" is "pod" (the pod's cgroup) or "overhead"
// (the overhead cgroup, capped at "qemuMemoryCapMiB"), "qemuCgroup" the
// cgroup; "mountsOver9p", when any, the containers' mounts that reach
// the guest over 9p (SharedMounts).
func (p *Pod) Details() map[string]string {
	p.stMu.RLock()
	defer p.stMu.RUnlock()
	d := map[string]string{
		"stage1":      Name,
		"accelerator": p.st.VM.Accelerator,
		"machine":     p.st.VM.Machine,
		"memoryMiB":   strconv.Itoa(p.st.VM.MemoryMiB),
		"vcpus":       strconv.Itoa(p.st.VM.VCPUs),
		"network":     "none",
	}
	if p.st.VM.Kernel != "" {
		d["guestKernel"] = p.st.VM.Kernel
	}
	if p.st.VM.Template != "" {
		d["template"] = p.st.VM.Template
	}
	if tap, _ := p.st.tap(); tap != "" {
		d["network"] = "tap " + tap + " mirrored to " + podIf
		d["mac"] = p.st.VM.MAC
	}
	if p.st.qemu() != nil {
		d["qemuPID"] = strconv.Itoa(p.st.qemu().PID)
	}
	d["placement"] = string(PlacementPod)
	if p.st.VM.Overhead {
		d["placement"] = string(PlacementOverhead)
		d["qemuMemoryCapMiB"] = strconv.Itoa(p.st.VM.CapMiB)
	}
	if cg := p.st.cgroup(); cg != nil {
		d["qemuCgroup"] = cg.String()
	}
	if m := p.SharedMounts(); len(m) > 0 {
		d["mountsOver9p"] = strings.Join(m, "; ")
	}
	return d
}

// Stop implements stage1.Pod: it asks the agent to stop every app
// (SIGTERM, timeout, SIGKILL) and power the guest off; waits for qemu to
// exit (at most timeout plus ExitGrace, or ctx); kills qemu if it did not,
// then whatever remains in the pod cgroup (an earlier version's virtiofsd
// exits with qemu). The
// tap, mounts and cgroup stay until DestroyPod. Idempotent: a gone pod is
// fine.
func (p *Pod) Stop(ctx context.Context, timeout time.Duration, shutdown stage1.Shutdown) error {
	p.vols.stop()
	if p.st.qemu().Alive() {
		sctx, cancel := context.WithTimeout(ctx, timeout+ExitGrace)
		err := shutdown(sctx, timeout)
		cancel()
		if err != nil && !errors.Is(err, errdefs.ErrUnavailable) {
			p.log.WarnContext(ctx, "kvm: agent shutdown", "err", err)
		}
		wctx, cancel := context.WithTimeout(ctx, ExitGrace)
		err = p.st.qemu().Wait(wctx)
		cancel()
		if err != nil {
			p.log.WarnContext(ctx, "kvm: qemu did not exit after the guest's shutdown; killing it", "pid", p.st.qemu().PID)
			if err := p.st.qemu().Signal(syscall.SIGKILL); err != nil && !errors.Is(err, host.ErrProcessGone) {
				return fmt.Errorf("kvm: kill qemu: %w", err)
			}
		}
	}
	p.b.dropDialer(p.st.ctlSocket())
	for _, cg := range []*cgroups.Cgroup{p.st.cgroup(), p.st.Cgroup(roleVirtiofsdCgroup)} {
		if cg == nil {
			continue
		}
		if err := cg.Kill(); err != nil {
			return fmt.Errorf("kvm: %w", err)
		}
	}
	wctx, cancel := context.WithTimeout(context.Background(), ExitGrace)
	defer cancel()
	for _, proc := range []*host.Process{p.st.qemu(), p.st.Process(roleVirtiofsd)} {
		if proc == nil {
			continue
		}
		if err := proc.Wait(wctx); err != nil {
			return fmt.Errorf("kvm: pid %d did not exit: %w", proc.PID, errdefs.ErrDeadlineExceeded)
		}
	}
	return nil
}

// HostStats implements stage1.HostStatser: the VM's cost on the host,
// CPU and memory of qemu's cgroup, the pod cgroup or its cgroup in the
// overhead cgroup (guest memory the guest touched, its vCPU threads, its
// own overhead; an earlier version's pods also virtiofsd). Containers'
// figures come from their cgroups inside the guest, through the agent.
func (p *Pod) HostStats() (*api.Stats, error) {
	if p.st.cgroup() == nil {
		return nil, errdefs.FailedPrecondition("kvm: the pod has no host cgroup")
	}
	host, herr := p.st.cgroup().Stats()
	if herr == nil && p.st.Cgroup(roleVirtiofsdCgroup) != nil {
		// Under systemd, virtiofsd has a unit (and cgroup) of its own.
		fs, err := p.st.Cgroup(roleVirtiofsdCgroup).Stats()
		if err != nil {
			herr = err
		} else {
			host.CPUUsageNanos += fs.CPUUsageNanos
			host.MemoryUsage += fs.MemoryUsage
			host.MemoryWorkingSet += fs.MemoryWorkingSet
			host.MemoryRSS += fs.MemoryRSS
			host.PageFaults += fs.PageFaults
			host.MajorPageFaults += fs.MajorPageFaults
		}
	}
	if herr != nil {
		return nil, fmt.Errorf("kvm: the host pod cgroup: %w", herr)
	}
	return &api.Stats{
		Timestamp:            time.Now(),
		CPUUsageNanos:        host.CPUUsageNanos,
		MemoryUsageBytes:     host.MemoryUsage,
		MemoryWorkingSet:     host.MemoryWorkingSet,
		MemoryRSSBytes:       host.MemoryRSS,
		MemoryPageFaults:     host.PageFaults,
		MemoryMajorPageFault: host.MajorPageFaults,
	}, nil
}
