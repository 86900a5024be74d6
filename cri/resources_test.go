package cri

import (
	"errors"
	"testing"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/broker"
	"github.com/stagelet/stagelet/errdefs"
)

// TestContainerResources: what the stage1s apply is read; what they
// cannot is refused, naming the field; the kubelet's "no swap" and empty
// hugepage limits pass on a node without swap.
func TestContainerResources(t *testing.T) {
	got, err := containerResources(&runtimeapi.LinuxContainerResources{
		CpuPeriod: 100000, CpuQuota: 50000, CpuShares: 512, MemoryLimitInBytes: 64 << 20, OomScoreAdj: 7,
		HugepageLimits: []*runtimeapi.HugepageLimit{{PageSize: "2MB", Limit: 0}},
		CpusetCpus:     "0-1", CpusetMems: "0",
	}, "linux")
	want := broker.Resources{CPUPeriod: 100000, CPUQuota: 50000, CPUShares: 512, MemoryLimit: 64 << 20, OOMScoreAdj: 7, CpusetCpus: "0-1", CpusetMems: "0"}
	if err != nil || got != want {
		t.Fatalf("got %+v %v, want %+v", got, err, want)
	}
	if r, err := containerResources(nil, "linux"); err != nil || r != (broker.Resources{}) {
		t.Errorf("nil resources: %+v %v", r, err)
	}
	for name, r := range map[string]*runtimeapi.LinuxContainerResources{
		"hugepage":       {HugepageLimits: []*runtimeapi.HugepageLimit{{PageSize: "2MB", Limit: 2 << 20}}},
		"unified":        {Unified: map[string]string{"memory.high": "1000000"}},
		"swap":           {MemoryLimitInBytes: 64 << 20, MemorySwapLimitInBytes: 128 << 20},
		"unified (swap)": {Unified: map[string]string{"memory.swap.max": "max"}},
	} {
		if _, err := containerResources(r, "linux"); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("%s: %v, want InvalidArgument", name, err)
		}
	}
	// The kubelet's OOM group on cgroup v2, with its no-swap request.
	r, err := containerResources(&runtimeapi.LinuxContainerResources{MemoryLimitInBytes: 64 << 20, Unified: map[string]string{"memory.oom.group": "1"}}, "linux")
	if err != nil || !r.OOMGroup || r.MemoryLimit != 64<<20 {
		t.Errorf("memory.oom.group=1: %+v %v", r, err)
	}
	if r, err := containerResources(&runtimeapi.LinuxContainerResources{Unified: map[string]string{"memory.oom.group": "0"}}, "linux"); err != nil || r.OOMGroup {
		t.Errorf("memory.oom.group=0: %+v %v", r, err)
	}
	if _, err := containerResources(&runtimeapi.LinuxContainerResources{Unified: map[string]string{"memory.oom.group": "2"}}, "linux"); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("memory.oom.group=2: %v, want InvalidArgument", err)
	}
	noSwap := []*runtimeapi.LinuxContainerResources{
		{MemoryLimitInBytes: 64 << 20, MemorySwapLimitInBytes: 64 << 20},
		{Unified: map[string]string{"memory.swap.max": "0"}},
	}
	for _, r := range noSwap {
		_, err := containerResources(r, "linux")
		if nodeHasSwap() {
			if !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Errorf("no swap on a node with swap: %v, want InvalidArgument", err)
			}
		} else if err != nil {
			t.Errorf("no swap on a node without swap: %v", err)
		}
	}
}
