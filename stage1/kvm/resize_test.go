package kvm

import (
	"context"
	"errors"
	"testing"

	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/stage1"
)

// TestUpdatePodResources: new totals that fit in the VM are taken; more
// memory or CPUs than it booted with are refused, saying why.
func TestUpdatePodResources(t *testing.T) {
	p := &Pod{st: &state{VM: vmInfo{MemoryMiB: 512, VCPUs: 2}}}
	ctx := context.Background()
	for _, r := range []stage1.PodResources{
		{},
		{MemoryLimit: (512 - GuestBaseMiB) << 20},
		{CPUQuota: 200000, CPUPeriod: 100000},
	} {
		if err := p.UpdatePodResources(ctx, r); err != nil {
			t.Errorf("%+v: %v", r, err)
		}
	}
	for _, r := range []stage1.PodResources{
		{MemoryLimit: (512-GuestBaseMiB)<<20 + 1},
		{CPUQuota: 200001, CPUPeriod: 100000},
	} {
		if err := p.UpdatePodResources(ctx, r); !errors.Is(err, errdefs.ErrFailedPrecondition) {
			t.Errorf("%+v: %v, want FailedPrecondition", r, err)
		}
	}
}
