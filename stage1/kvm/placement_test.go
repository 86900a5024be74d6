package kvm

import (
	"errors"
	"strings"
	"testing"

	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/stage1"
)

// Where a pod's qemu runs, by placement and by the limit the kubelet set
// on the pod's cgroup (its containers' limits plus its RuntimeClass
// overhead): under TCG qemu's own memory is 32 MiB and its translation
// cache's 32.
func TestPlanVM(t *testing.T) {
	const mib = 1 << 20
	limited := stage1.PodResources{MemoryLimit: 64 * mib}
	for _, tt := range []struct {
		name      string
		placement Placement
		accel     string
		res       stage1.PodResources
		budget    uint64
		memMiB    int
		overhead  bool
		capMiB    int
		refused   string // the refusal's message holds it
	}{
		{name: "no limit", placement: PlacementAuto, accel: "tcg", memMiB: DefaultMemoryMiB},
		{name: "a limit without overhead", placement: PlacementAuto, accel: "tcg", res: limited, budget: 64 * mib,
			memMiB: 64 + GuestBaseMiB, overhead: true, capMiB: 64 + GuestBaseMiB + 64},
		{name: "a limit with the overhead it needs", placement: PlacementAuto, accel: "tcg", res: limited, budget: (64 + 192) * mib,
			memMiB: 64 + GuestBaseMiB},
		{name: "a limit with too little overhead", placement: PlacementAuto, accel: "tcg", res: limited, budget: (64 + 191) * mib,
			memMiB: 64 + GuestBaseMiB, overhead: true, capMiB: 64 + GuestBaseMiB + 64},
		{name: "not probed yet: qemu's own as under KVM", placement: PlacementAuto, res: limited, budget: (64 + 160) * mib,
			memMiB: 64 + GuestBaseMiB},
		{name: "KVM: no translation cache", placement: PlacementAuto, accel: "kvm", res: limited, budget: (64 + 160) * mib,
			memMiB: 64 + GuestBaseMiB},
		{name: "overhead always", placement: PlacementOverhead, accel: "tcg", memMiB: DefaultMemoryMiB, overhead: true, capMiB: DefaultMemoryMiB + 64},
		{name: "overhead always, with room in the pod", placement: PlacementOverhead, accel: "tcg", res: limited, budget: 1024 * mib,
			memMiB: 64 + GuestBaseMiB, overhead: true, capMiB: 64 + GuestBaseMiB + 64},
		{name: "pod: no limit", placement: PlacementPod, accel: "tcg", memMiB: DefaultMemoryMiB},
		{name: "pod: fits", placement: PlacementPod, accel: "tcg", res: limited, budget: (64 + 192) * mib, memMiB: 64 + GuestBaseMiB},
		{name: "pod: refused without overhead", placement: PlacementPod, accel: "tcg", res: limited, budget: 64 * mib,
			refused: "overhead.podFixed.memory of at least 192Mi"},
		{name: "unknown placement", placement: "somewhere", accel: "tcg", refused: "placement"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			b := New(nil, Config{Placement: tt.placement})
			p, err := b.planVM(&stage1.PodSpec{Resources: tt.res}, tt.accel, tt.budget)
			if tt.refused != "" {
				if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), tt.refused) {
					t.Fatalf("plan %+v, %v; want FailedPrecondition naming %q", p, err, tt.refused)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if p.vm.MemoryMiB != tt.memMiB || p.overhead != tt.overhead || tt.overhead && p.capMiB() != tt.capMiB {
				t.Errorf("VM %d MiB, overhead %t (cap %d MiB); want %d MiB, overhead %t (cap %d MiB)",
					p.vm.MemoryMiB, p.overhead, p.capMiB(), tt.memMiB, tt.overhead, tt.capMiB)
			}
		})
	}
}

// PlanPod for a pod with no cgroup yet (stagelet policy explain) takes
// the cgroup's limit it is given, and says what it decided.
func TestPlanPodWithoutCgroup(t *testing.T) {
	const mib = 1 << 20
	budget := uint64(64 * mib)
	spec := stage1.PodSpec{ID: "p1", RunDir: "/run/stagelet/pods/p1", Resources: stage1.PodResources{MemoryLimit: 64 * mib}, CgroupMemoryLimit: &budget}
	auto := New(nil, Config{Accelerator: "tcg"})
	plan, err := auto.PlanPod(&spec)
	if err != nil || !strings.Contains(plan, "overhead cgroup "+DefaultOverheadCgroup) || !strings.Contains(plan, "(64 MiB) cannot hold") {
		t.Errorf("64 MiB of limits, no overhead: %q, %v", plan, err)
	}
	budget = (64 + 192) * mib
	if plan, err := auto.PlanPod(&spec); err != nil || !strings.Contains(plan, "qemu runs in the pod's cgroup (256 MiB holds") {
		t.Errorf("with 192 MiB of overhead: %q, %v", plan, err)
	}
	budget = 64 * mib
	strict := New(nil, Config{Accelerator: "tcg", Placement: PlacementPod})
	if _, err := strict.PlanPod(&spec); !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "kvm.placement is pod") {
		t.Errorf("placement pod, no overhead: %v", err)
	}
	spec.HostNetwork = true
	if _, err := auto.PlanPod(&spec); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("a hostNetwork pod: %v", err)
	}
}
