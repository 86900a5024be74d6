package nri

import (
	"errors"
	"strings"
	"testing"

	nriapi "github.com/containerd/nri/pkg/api"

	"github.com/stagelet/stagelet/errdefs"
)

func TestCheckStage1(t *testing.T) {
	owners := nriapi.NewOwningPlugins()
	for _, claim := range []error{
		owners.ClaimHooks("c1", "10-hooks"),
		owners.ClaimDevice("c1", "/dev/gpu", "20-devices"),
		owners.ClaimCdiDevice("c1", "vendor.com/gpu=0", "25-cdi"),
		owners.ClaimCPUSetCPUs("c1", "30-cpus"),
		owners.ClaimCPUSetMems("c1", "40-mems"),
	} {
		if claim != nil {
			t.Fatal(claim)
		}
	}
	req := func(adj *nriapi.ContainerAdjustment) *nriapi.ValidateContainerAdjustmentRequest {
		return &nriapi.ValidateContainerAdjustmentRequest{Container: &nriapi.Container{Id: "c1"}, Adjust: adj, Owners: owners}
	}
	cpus := func(c *nriapi.LinuxCPU) *nriapi.ContainerAdjustment {
		return &nriapi.ContainerAdjustment{Linux: &nriapi.LinuxContainerAdjustment{Resources: &nriapi.LinuxResources{Cpu: c}}}
	}
	tests := []struct {
		name     string
		isolated bool
		req      *nriapi.ValidateContainerAdjustmentRequest
		want     string // "" for no error
	}{
		{"hooks", true, req(&nriapi.ContainerAdjustment{Hooks: &nriapi.Hooks{Poststart: []*nriapi.Hook{{Path: "/bin/h"}}}}), "NRI plugin 10-hooks asked for OCI hooks (/bin/h): stage1 kvm runs"},
		{"hooks, shared kernel", false, req(&nriapi.ContainerAdjustment{Hooks: &nriapi.Hooks{Poststart: []*nriapi.Hook{{Path: "/bin/h"}}}}), ""},
		{"device", true, req(&nriapi.ContainerAdjustment{Linux: &nriapi.LinuxContainerAdjustment{Devices: []*nriapi.LinuxDevice{{Path: "/dev/gpu", Type: "c"}}}}), "NRI plugin 20-devices asked for device /dev/gpu: stage1 kvm"},
		{"device removal", true, req(&nriapi.ContainerAdjustment{Linux: &nriapi.LinuxContainerAdjustment{Devices: []*nriapi.LinuxDevice{{Path: "-/dev/gpu"}}}}), ""},
		{"cdi device", true, req(&nriapi.ContainerAdjustment{CDIDevices: []*nriapi.CDIDevice{{Name: "vendor.com/gpu=0"}}}), "NRI plugin 25-cdi asked for CDI device vendor.com/gpu=0"},
		{"cpuset cpus", true, req(cpus(&nriapi.LinuxCPU{Cpus: "2-3"})), "NRI plugin 30-cpus asked for cpuset.cpus 2-3: stage1 kvm runs the container in a VM, whose vCPUs"},
		{"cpuset mems", true, req(cpus(&nriapi.LinuxCPU{Mems: "1"})), "NRI plugin 40-mems asked for cpuset.mems 1"},
		{"cpuset, shared kernel", false, req(cpus(&nriapi.LinuxCPU{Cpus: "2-3"})), ""},
		{"mounts and limits pass", true, req(&nriapi.ContainerAdjustment{
			Mounts: []*nriapi.Mount{{Destination: "/d", Source: "/host/d", Type: "bind"}},
			Linux:  &nriapi.LinuxContainerAdjustment{Resources: &nriapi.LinuxResources{Cpu: &nriapi.LinuxCPU{Shares: nriapi.UInt64(2)}}},
		}), ""},
		{"empty parts as the library sends them", true, req(&nriapi.ContainerAdjustment{Hooks: &nriapi.Hooks{}, Linux: &nriapi.LinuxContainerAdjustment{Devices: []*nriapi.LinuxDevice{}}}), ""},
		{"no owners", true, &nriapi.ValidateContainerAdjustmentRequest{Container: &nriapi.Container{Id: "c1"}, Adjust: cpus(&nriapi.LinuxCPU{Cpus: "0"})}, "NRI plugin (unknown) asked for cpuset.cpus 0"},
		{"nil request", true, nil, ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := CheckStage1(tc.isolated, "kvm", tc.req)
			if tc.want == "" {
				if err != nil {
					t.Fatalf("CheckStage1: %v, want none", err)
				}
				return
			}
			if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.HasPrefix(err.Error(), tc.want) {
				t.Fatalf("CheckStage1: %v, want InvalidArgument starting %q", err, tc.want)
			}
		})
	}
}

func TestCheckUpdateStage1(t *testing.T) {
	tests := []struct {
		name     string
		isolated bool
		plugin   string
		u        *nriapi.LinuxResources
		want     string
	}{
		{"cpus", true, "10-balloons", &nriapi.LinuxResources{Cpu: &nriapi.LinuxCPU{Cpus: "1"}}, "NRI plugin 10-balloons asked for cpuset.cpus 1: stage1 kvm"},
		{"mems, plugin unknown", true, "", &nriapi.LinuxResources{Cpu: &nriapi.LinuxCPU{Mems: "0"}}, "NRI plugin (unknown) asked for cpuset.mems 0"},
		{"limits", true, "p", &nriapi.LinuxResources{Memory: &nriapi.LinuxMemory{Limit: nriapi.Int64(1)}}, ""},
		{"shared kernel", false, "p", &nriapi.LinuxResources{Cpu: &nriapi.LinuxCPU{Cpus: "1"}}, ""},
		{"nil", true, "p", nil, ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := CheckUpdateStage1(tc.isolated, "kvm", tc.plugin, tc.u)
			if tc.want == "" {
				if err != nil {
					t.Fatalf("CheckUpdateStage1: %v, want none", err)
				}
				return
			}
			if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.HasPrefix(err.Error(), tc.want) {
				t.Fatalf("CheckUpdateStage1: %v, want InvalidArgument starting %q", err, tc.want)
			}
		})
	}
}
