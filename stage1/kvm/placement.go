package kvm

import (
	"context"
	"fmt"
	"strings"

	"github.com/stagelet/stagelet/cgroups"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/stage1"
	"github.com/stagelet/stagelet/stage1/host"
)

// Placement is where a pod's qemu runs, and so whose memory its VM is
// charged to: a process's memory is charged to one memory cgroup (its
// own), guest memory included, so a VM cannot be charged part to the pod
// and part elsewhere.
type Placement string

const (
	// PlacementAuto runs qemu in the pod's cgroup when the limit the
	// kubelet set on it holds the VM and qemu's own memory (the pod has
	// no memory limit, or its RuntimeClass gives the overhead), and in
	// the overhead cgroup otherwise. The default.
	PlacementAuto Placement = "auto"
	// PlacementPod always runs qemu in the pod's cgroup (Kata's
	// sandbox_cgroup_only): a pod whose cgroup cannot hold its VM is
	// refused, naming the RuntimeClass overhead it needs.
	PlacementPod Placement = "pod"
	// PlacementOverhead always runs qemu in the overhead cgroup.
	PlacementOverhead Placement = "overhead"
)

// Placements lists the placements, for the configuration's checks.
var Placements = []Placement{PlacementAuto, PlacementPod, PlacementOverhead}

// Defaults of Config.OverheadCgroup: a cgroup beneath the daemon's own
// (the plain launcher), or a slice beneath stagelet.slice (a
// UnitLauncher).
const (
	DefaultOverheadCgroup = "stagelet-vmm"
	DefaultOverheadSlice  = "stagelet-vmm.slice"
)

// vmPlan is how a pod's VM runs, decided before anything is taken: its
// size, and whether its qemu goes to the overhead cgroup.
type vmPlan struct {
	vm vmInfo
	// overhead: qemu runs in the overhead cgroup, in a cgroup of its own
	// capped at capMiB, not in the pod's.
	overhead bool
	// budget is the memory limit of the pod's cgroup (0: none).
	budget uint64
}

// capMiB is the memory cap of a VM's cgroup in the overhead cgroup: the
// guest's memory and qemu's own.
func (p vmPlan) capMiB() int { return p.vm.MemoryMiB + qemuOwnMiB(p.vm) }

// planVM decides a pod's VM (vmConfig) on accelerator accel ("" when not
// yet probed: qemu's own memory is then counted as under KVM, the
// lesser, so that a plan made before the probe refuses nothing the
// start would take) and where its qemu goes, given budget, the memory
// limit of the pod's cgroup (0: none). It is pure. Errors: those of
// vmConfig, and with PlacementPod fitVM's FailedPrecondition.
func (b *Backend) planVM(spec *stage1.PodSpec, accel string, budget uint64) (vmPlan, error) {
	vm, err := b.vmConfig(spec.Options, spec.Resources)
	if err != nil {
		return vmPlan{}, err
	}
	vm.Accelerator = accel
	if accel == "tcg" {
		vm.TBSizeMiB = b.cfg.TBSizeMiB
	}
	p := vmPlan{vm: vm, budget: budget}
	switch b.cfg.Placement {
	case PlacementPod:
		if err := fitVM(&p.vm, budget, spec.Options[OptionMemory] != "", spec.Resources); err != nil {
			return vmPlan{}, fmt.Errorf("%w (kvm.placement is %s: the VM must fit in the pod's cgroup; with auto or overhead it runs in %s instead)", err, PlacementPod, b.overheadName())
		}
	case PlacementOverhead:
		p.overhead = true
	case PlacementAuto:
		p.overhead = budget != 0 && uint64(p.capMiB())<<20 > budget
	default:
		return vmPlan{}, errdefs.FailedPrecondition("kvm: placement %q: want %s", b.cfg.Placement, placementList())
	}
	return p, nil
}

func placementList() string {
	s := make([]string, len(Placements))
	for i, p := range Placements {
		s[i] = string(p)
	}
	return strings.Join(s, ", ")
}

// describe says what the plan gives, for people.
func (p vmPlan) describe(b *Backend) string {
	var w strings.Builder
	fmt.Fprintf(&w, "a VM of %d MiB and %d vCPU(s)", p.vm.MemoryMiB, p.vm.VCPUs)
	if p.vm.Accelerator == "" {
		fmt.Fprintf(&w, " (the accelerator is not probed yet: under TCG qemu takes %d MiB more, its translation cache)", b.cfg.TBSizeMiB)
	}
	switch {
	case p.overhead && p.budget != 0:
		fmt.Fprintf(&w, "; qemu runs in the overhead cgroup %s, capped at %d MiB: the pod's cgroup (%d MiB) cannot hold the VM and qemu's own %d MiB", b.overheadName(), p.capMiB(), p.budget>>20, qemuOwnMiB(p.vm))
	case p.overhead:
		fmt.Fprintf(&w, "; qemu runs in the overhead cgroup %s, capped at %d MiB (kvm.placement: %s)", b.overheadName(), p.capMiB(), b.cfg.Placement)
	case p.budget != 0:
		fmt.Fprintf(&w, "; qemu runs in the pod's cgroup (%d MiB holds the VM and qemu's own %d MiB)", p.budget>>20, qemuOwnMiB(p.vm))
	default:
		w.WriteString("; qemu runs in the pod's cgroup (no memory limit)")
	}
	return w.String()
}

// podBudget is the memory limit of the cgroup that bounds what the pod
// runs on the host (cgroups.PodBudget; 0: none), unless the spec says it.
func podBudget(spec *stage1.PodSpec) (uint64, error) {
	if spec.CgroupMemoryLimit != nil {
		return *spec.CgroupMemoryLimit, nil
	}
	budget, err := cgroups.PodBudget(spec.CgroupParent, spec.ID)
	if err != nil {
		return 0, fmt.Errorf("kvm: pod cgroup: %w", err)
	}
	limit, err := budget.MemoryLimit()
	if err != nil {
		return 0, fmt.Errorf("kvm: %w", err)
	}
	return limit, nil
}

var _ stage1.PodPlanner = (*Backend)(nil)

// PlanPod implements stage1.PodPlanner: the pod's VM and where its qemu
// runs, or why the pod cannot run (InvalidArgument: a spec a VM cannot
// run, bad options; FailedPrecondition: with kvm.placement pod, a pod
// cgroup that cannot hold the VM). It probes nothing: before the first
// pod (or NodeInfo) chose the accelerator, the plan counts qemu's own
// memory as under KVM.
func (b *Backend) PlanPod(spec *stage1.PodSpec) (string, error) {
	if err := validate(spec); err != nil {
		return "", err
	}
	budget, err := podBudget(spec)
	if err != nil {
		return "", err
	}
	accel := b.cfg.Accelerator
	if a := b.chosen.Load(); a != nil {
		accel = *a
	}
	p, err := b.planVM(spec, accel, budget)
	if err != nil {
		return "", err
	}
	return p.describe(b), nil
}

// overheadName is the overhead cgroup (or slice) as configured.
func (b *Backend) overheadName() string { return b.cfg.OverheadCgroup }

// overheadParent is the overhead cgroup under the plain launcher,
// created, with its cap (Config.OverheadMemoryMax) set: on the first
// pod placed there, and again after a failure.
func (b *Backend) overheadParent() (*cgroups.Cgroup, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.overhead != nil {
		return b.overhead, nil
	}
	cg, err := cgroups.Resolve(b.cfg.OverheadCgroup)
	if err != nil {
		return nil, fmt.Errorf("kvm: overhead cgroup %s: %w", b.cfg.OverheadCgroup, err)
	}
	if err := cg.Create(); err != nil {
		return nil, fmt.Errorf("kvm: overhead cgroup: %w", err)
	}
	if err := cg.Set(cgroups.Resources{MemoryLimit: capOrNone(b.cfg.OverheadMemoryMax)}); err != nil {
		return nil, fmt.Errorf("kvm: overhead cgroup's cap: %w", err)
	}
	b.overhead = cg
	return cg, nil
}

// limitOverheadSlice caps the overhead slice under a UnitLauncher: on
// the first pod placed there, and again after a failure.
func (b *Backend) limitOverheadSlice(ctx context.Context, ul host.UnitLauncher) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.sliceLimited {
		return nil
	}
	if err := ul.LimitSlice(ctx, b.cfg.OverheadCgroup, b.cfg.OverheadMemoryMax); err != nil {
		return fmt.Errorf("kvm: overhead slice's cap: %w", err)
	}
	b.sliceLimited = true
	return nil
}

// capOrNone is a cap for cgroups.Resources.MemoryLimit: -1 lifts one.
func capOrNone(bytes int64) int64 {
	if bytes > 0 {
		return bytes
	}
	return -1
}

// vmmCgroup is where qemu runs under the plain launcher: the pod cgroup
// (cgroups.PodCgroup), or with overhead placement "stagelet-pod-<id>"
// beneath the overhead cgroup (made when first needed).
func (b *Backend) vmmCgroup(spec *stage1.PodSpec, overhead bool) (*cgroups.Cgroup, error) {
	if !overhead {
		cg, err := cgroups.PodCgroup(spec.CgroupParent, spec.ID)
		if err != nil {
			return nil, fmt.Errorf("kvm: pod cgroup: %w", err)
		}
		return cg, nil
	}
	parent, err := b.overheadParent()
	if err != nil {
		return nil, err
	}
	return parent.Child(cgroups.PodCgroupName(spec.ID)), nil
}
