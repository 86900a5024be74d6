package cri

import (
	"context"
	"time"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/broker"
	"github.com/stagelet/stagelet/network"
)

func u64(v uint64) *runtimeapi.UInt64Value { return &runtimeapi.UInt64Value{Value: v} }

func cpuMem(u *api.Stats) (*runtimeapi.CpuUsage, *runtimeapi.MemoryUsage) {
	if u == nil {
		return nil, nil
	}
	ts := u.Timestamp.UnixNano()
	return &runtimeapi.CpuUsage{Timestamp: ts, UsageCoreNanoSeconds: u64(u.CPUUsageNanos)},
		&runtimeapi.MemoryUsage{
			Timestamp:       ts,
			WorkingSetBytes: u64(u.MemoryWorkingSet),
			UsageBytes:      u64(u.MemoryUsageBytes),
			RssBytes:        u64(u.MemoryRSSBytes),
			PageFaults:      u64(u.MemoryPageFaults),
			MajorPageFaults: u64(u.MemoryMajorPageFault),
		}
}

func containerStats(cs *broker.ContainerStats) *runtimeapi.ContainerStats {
	rec := &cs.Record
	cpu, mem := cpuMem(cs.Usage)
	return &runtimeapi.ContainerStats{
		Attributes: &runtimeapi.ContainerAttributes{
			Id:          rec.ID,
			Metadata:    ctrMeta(rec.Config.Metadata),
			Labels:      rec.Config.Labels,
			Annotations: rec.Config.Annotations,
		},
		Cpu:    cpu,
		Memory: mem,
		WritableLayer: &runtimeapi.FilesystemUsage{
			Timestamp:  time.Now().UnixNano(),
			FsId:       &runtimeapi.FilesystemIdentifier{Mountpoint: cs.WritableMount},
			UsedBytes:  u64(cs.WritableBytes),
			InodesUsed: u64(cs.WritableInodes),
		},
	}
}

// ContainerStats returns one container's usage.
func (s *Server) ContainerStats(ctx context.Context, r *runtimeapi.ContainerStatsRequest) (*runtimeapi.ContainerStatsResponse, error) {
	if r.GetContainerId() == "" {
		return nil, badRequest("container_id")
	}
	cs, err := s.b.ContainerStats(ctx, r.GetContainerId())
	if err != nil {
		return nil, err
	}
	return &runtimeapi.ContainerStatsResponse{Stats: containerStats(cs)}, nil
}

// ListContainerStats returns the usage of the containers matching the filter.
func (s *Server) ListContainerStats(ctx context.Context, r *runtimeapi.ListContainerStatsRequest) (*runtimeapi.ListContainerStatsResponse, error) {
	f := broker.ContainerFilter{}
	if rf := r.GetFilter(); rf != nil {
		f.ID, f.PodID, f.LabelSelector = rf.GetId(), rf.GetPodSandboxId(), rf.GetLabelSelector()
	}
	resp := &runtimeapi.ListContainerStatsResponse{}
	for _, cs := range s.b.ListContainerStats(ctx, f) {
		resp.Stats = append(resp.Stats, containerStats(cs))
	}
	return resp, nil
}

func podStats(ps *broker.PodStats) *runtimeapi.PodSandboxStats {
	rec := &ps.Status.Record
	cpu, mem := cpuMem(ps.Usage)
	out := &runtimeapi.PodSandboxStats{
		Attributes: &runtimeapi.PodSandboxAttributes{
			Id:          rec.ID,
			Metadata:    podMeta(rec.Config.Metadata),
			Labels:      rec.Config.Labels,
			Annotations: rec.Config.Annotations,
		},
		Linux: &runtimeapi.LinuxPodSandboxStats{Cpu: cpu, Memory: mem},
	}
	if ps.Usage != nil {
		out.Linux.Process = &runtimeapi.ProcessUsage{Timestamp: ps.Usage.Timestamp.UnixNano(), ProcessCount: u64(ps.Usage.Pids)}
	}
	out.Linux.Network = networkUsage(ps)
	for _, cs := range ps.Containers {
		out.Linux.Containers = append(out.Linux.Containers, containerStats(cs))
	}
	return out
}

// networkUsage are the pod's interface counters, every interface in
// Interfaces as cAdvisor lists them; eth0, the interface CNI makes, is the
// default one. nil when the pod has no network of its own.
func networkUsage(ps *broker.PodStats) *runtimeapi.NetworkUsage {
	if len(ps.Network) == 0 {
		return nil
	}
	out := &runtimeapi.NetworkUsage{Timestamp: ps.NetworkTime.UnixNano()}
	for _, n := range ps.Network {
		u := &runtimeapi.NetworkInterfaceUsage{
			Name:     n.Name,
			RxBytes:  u64(n.RxBytes),
			RxErrors: u64(n.RxErrors),
			TxBytes:  u64(n.TxBytes),
			TxErrors: u64(n.TxErrors),
		}
		if n.Name == network.IfName {
			out.DefaultInterface = u
		}
		out.Interfaces = append(out.Interfaces, u)
	}
	return out
}

// PodSandboxStats returns a pod's usage.
func (s *Server) PodSandboxStats(ctx context.Context, r *runtimeapi.PodSandboxStatsRequest) (*runtimeapi.PodSandboxStatsResponse, error) {
	if r.GetPodSandboxId() == "" {
		return nil, badRequest("pod_sandbox_id")
	}
	ps, err := s.b.PodStats(ctx, r.GetPodSandboxId())
	if err != nil {
		return nil, err
	}
	return &runtimeapi.PodSandboxStatsResponse{Stats: podStats(ps)}, nil
}

// ListPodSandboxStats returns the usage of the pods matching the filter.
func (s *Server) ListPodSandboxStats(ctx context.Context, r *runtimeapi.ListPodSandboxStatsRequest) (*runtimeapi.ListPodSandboxStatsResponse, error) {
	f := broker.PodFilter{}
	if rf := r.GetFilter(); rf != nil {
		f.ID, f.LabelSelector = rf.GetId(), rf.GetLabelSelector()
	}
	resp := &runtimeapi.ListPodSandboxStatsResponse{}
	for _, ps := range s.b.ListPodStats(ctx, f) {
		resp.Stats = append(resp.Stats, podStats(ps))
	}
	return resp, nil
}
