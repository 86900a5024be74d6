package cri

import (
	"bufio"
	"context"
	"os"
	"strings"
	"sync"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/broker"
	"github.com/stagelet/stagelet/errdefs"
)

// containerResources reads a container's limits, as CreateContainer and
// UpdateContainerResources receive them (field names the request's path),
// refusing what the stage1s cannot apply rather than ignoring it:
// hugepage limits, a swap limit on a node that has swap, and any other
// unified (cgroup v2) setting. A "no swap" request (the kubelet sends one
// for every container on a cgroup v2 node, memory.swap.max=0) holds as it
// is on a node without swap. memory.oom.group (the kubelet asks it of
// every container on cgroup v2, unless singleProcessOOMKill) is applied
// to the container's cgroup.
func containerResources(r *runtimeapi.LinuxContainerResources, field string) (broker.Resources, error) {
	if r == nil {
		return broker.Resources{}, nil
	}
	for _, h := range r.GetHugepageLimits() {
		if h.GetLimit() != 0 {
			return broker.Resources{}, errdefs.InvalidArgument("%s.hugepage_limits: hugepage limits (%s) are not supported", field, h.GetPageSize())
		}
	}
	noSwap := true
	if s := r.GetMemorySwapLimitInBytes(); s != 0 && s != r.GetMemoryLimitInBytes() {
		noSwap = false
	}
	oomGroup, swapUnified := false, false
	for k, v := range r.GetUnified() {
		switch {
		case k == "memory.swap.max" && v == "0":
			swapUnified = true
		case k == "memory.oom.group" && (v == "0" || v == "1"):
			oomGroup = v == "1"
		default:
			return broker.Resources{}, errdefs.InvalidArgument("%s.unified: %s=%s is not supported (only memory.swap.max=0 and memory.oom.group)", field, k, v)
		}
	}
	if !noSwap || ((r.GetMemorySwapLimitInBytes() != 0 || swapUnified) && nodeHasSwap()) {
		return broker.Resources{}, errdefs.InvalidArgument("%s: swap limits are not supported, and this node has swap", field)
	}
	res := resourcesFrom(r)
	res.OOMGroup = oomGroup
	return res, nil
}

// resourcesFrom converts CRI limits, a container's or a pod's, to the
// broker's, field by field; what cannot be converted is
// containerResources's to refuse.
func resourcesFrom(r *runtimeapi.LinuxContainerResources) broker.Resources {
	return broker.Resources{
		CPUPeriod:   r.GetCpuPeriod(),
		CPUQuota:    r.GetCpuQuota(),
		CPUShares:   r.GetCpuShares(),
		MemoryLimit: r.GetMemoryLimitInBytes(),
		OOMScoreAdj: r.GetOomScoreAdj(),
		CpusetCpus:  r.GetCpusetCpus(),
		CpusetMems:  r.GetCpusetMems(),
	}
}

var nodeSwap = sync.OnceValue(func() bool {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return true // unknown: assume the worst
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if fs := strings.Fields(sc.Text()); len(fs) >= 2 && fs[0] == "SwapTotal:" {
			return fs[1] != "0"
		}
	}
	return true
})

// nodeHasSwap tells whether the node has swap enabled (SwapTotal > 0 when
// first asked).
func nodeHasSwap() bool { return nodeSwap() }

// UpdateContainerResources changes a running or created container's
// limits in place (the kubelet's in-place pod resize) and reports them
// back through ContainerStatus. Windows resources are refused.
func (s *Server) UpdateContainerResources(ctx context.Context, r *runtimeapi.UpdateContainerResourcesRequest) (*runtimeapi.UpdateContainerResourcesResponse, error) {
	res, err := updateResourcesFrom(r)
	if err != nil {
		return nil, err
	}
	if err := s.b.UpdateContainerResources(ctx, r.GetContainerId(), res); err != nil {
		return nil, err
	}
	return &runtimeapi.UpdateContainerResourcesResponse{}, nil
}

// updateResourcesFrom reads an UpdateContainerResources request.
func updateResourcesFrom(r *runtimeapi.UpdateContainerResourcesRequest) (broker.Resources, error) {
	if r.GetContainerId() == "" {
		return broker.Resources{}, badRequest("container_id")
	}
	if r.GetWindows() != nil {
		return broker.Resources{}, errdefs.InvalidArgument("windows: Windows resources do not apply to Linux containers")
	}
	if r.GetLinux() == nil {
		return broker.Resources{}, badRequest("linux")
	}
	return containerResources(r.GetLinux(), "linux")
}

// UpdatePodSandboxResources takes a pod's new total limits after the
// kubelet resized its containers: a VM pod checks they fit in its VM
// (FailedPrecondition, saying what growing a VM would take, when they do
// not); the others run beneath the pod cgroup the kubelet resizes itself.
// The overhead is the kubelet's to account in that cgroup.
func (s *Server) UpdatePodSandboxResources(ctx context.Context, r *runtimeapi.UpdatePodSandboxResourcesRequest) (*runtimeapi.UpdatePodSandboxResourcesResponse, error) {
	res, err := updatePodResourcesFrom(r)
	if err != nil {
		return nil, err
	}
	if err := s.b.UpdatePodResources(ctx, r.GetPodSandboxId(), res); err != nil {
		return nil, err
	}
	return &runtimeapi.UpdatePodSandboxResourcesResponse{}, nil
}

// updatePodResourcesFrom reads an UpdatePodSandboxResources request.
func updatePodResourcesFrom(r *runtimeapi.UpdatePodSandboxResourcesRequest) (broker.Resources, error) {
	if r.GetPodSandboxId() == "" {
		return broker.Resources{}, badRequest("pod_sandbox_id")
	}
	if r.GetResources() == nil {
		return broker.Resources{}, badRequest("resources")
	}
	if _, err := podResources(r.GetOverhead(), "overhead"); err != nil {
		return broker.Resources{}, err
	}
	return podResources(r.GetResources(), "resources")
}

// podResources reads a pod's limits as containerResources does, refusing
// a cpuset too: a cpuset is a container's. A pod's memory.oom.group
// (which the kubelet sends for the sandbox as for its containers) is
// each of its containers' to apply: the sandbox runs no process of its
// own that an OOM kill could leave behind, only the stage1's agent.
func podResources(r *runtimeapi.LinuxContainerResources, field string) (broker.Resources, error) {
	res, err := containerResources(r, field)
	if err != nil {
		return broker.Resources{}, err
	}
	if res.CpusetCpus != "" || res.CpusetMems != "" {
		return broker.Resources{}, errdefs.InvalidArgument("%s.cpuset_cpus, cpuset_mems: a cpuset is a container's, not a pod's", field)
	}
	return res, nil
}
