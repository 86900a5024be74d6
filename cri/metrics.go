package cri

import (
	"context"
	"time"

	"google.golang.org/grpc"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/broker"
	"github.com/stagelet/stagelet/network"
)

// The metrics the kubelet's CRI metrics collector exposes on
// /metrics/cadvisor: cAdvisor's names, each with the same labels, those
// cAdvisor gives a container (a pod's own figures have container ""), and
// the network ones an interface label too; they are the pod's (a pod's
// containers share its network). The per-device figures cAdvisor also has
// are not among them: the stage1s do not measure them. CRI metric values
// are integers: CPU time is in whole seconds.
var metricLabels = []string{"container", "id", "image", "name", "namespace", "pod"}

type metricDef struct {
	name, help string
	typ        runtimeapi.MetricType
	// value reads the metric; ok false: no figure (the container does not
	// run).
	value func(u *api.Stats, cs *broker.ContainerStats) (v uint64, ok bool)
}

func fromUsage(f func(*api.Stats) uint64) func(*api.Stats, *broker.ContainerStats) (uint64, bool) {
	return func(u *api.Stats, _ *broker.ContainerStats) (uint64, bool) {
		if u == nil {
			return 0, false
		}
		return f(u), true
	}
}

func fromLayer(f func(*broker.ContainerStats) uint64) func(*api.Stats, *broker.ContainerStats) (uint64, bool) {
	return func(_ *api.Stats, cs *broker.ContainerStats) (uint64, bool) {
		if cs == nil {
			return 0, false
		}
		return f(cs), true
	}
}

var metricDefs = []metricDef{
	{"container_cpu_usage_seconds_total", "Cumulative cpu time consumed in seconds.", runtimeapi.MetricType_COUNTER,
		fromUsage(func(u *api.Stats) uint64 { return u.CPUUsageNanos / 1e9 })},
	{"container_memory_usage_bytes", "Current memory usage in bytes, including all memory regardless of when it was accessed.", runtimeapi.MetricType_GAUGE,
		fromUsage(func(u *api.Stats) uint64 { return u.MemoryUsageBytes })},
	{"container_memory_working_set_bytes", "Current working set in bytes.", runtimeapi.MetricType_GAUGE,
		fromUsage(func(u *api.Stats) uint64 { return u.MemoryWorkingSet })},
	{"container_memory_rss", "Size of RSS in bytes.", runtimeapi.MetricType_GAUGE,
		fromUsage(func(u *api.Stats) uint64 { return u.MemoryRSSBytes })},
	{"container_processes", "Number of processes running inside the container.", runtimeapi.MetricType_GAUGE,
		fromUsage(func(u *api.Stats) uint64 { return u.Pids })},
	{"container_fs_usage_bytes", "Number of bytes that are consumed by the container on this filesystem.", runtimeapi.MetricType_GAUGE,
		fromLayer(func(cs *broker.ContainerStats) uint64 { return cs.WritableBytes })},
	{"container_fs_inodes_total", "Number of inodes the container uses on this filesystem.", runtimeapi.MetricType_GAUGE,
		fromLayer(func(cs *broker.ContainerStats) uint64 { return cs.WritableInodes })},
}

// netMetricLabels are the labels of the network metrics.
var netMetricLabels = append(append([]string(nil), metricLabels...), "interface")

var netMetricDefs = []struct {
	name, help string
	value      func(n *network.InterfaceStats) uint64
}{
	{"container_network_receive_bytes_total", "Cumulative count of bytes received", func(n *network.InterfaceStats) uint64 { return n.RxBytes }},
	{"container_network_receive_packets_total", "Cumulative count of packets received", func(n *network.InterfaceStats) uint64 { return n.RxPackets }},
	{"container_network_receive_packets_dropped_total", "Cumulative count of packets dropped while receiving", func(n *network.InterfaceStats) uint64 { return n.RxDropped }},
	{"container_network_receive_errors_total", "Cumulative count of errors encountered while receiving", func(n *network.InterfaceStats) uint64 { return n.RxErrors }},
	{"container_network_transmit_bytes_total", "Cumulative count of bytes transmitted", func(n *network.InterfaceStats) uint64 { return n.TxBytes }},
	{"container_network_transmit_packets_total", "Cumulative count of packets transmitted", func(n *network.InterfaceStats) uint64 { return n.TxPackets }},
	{"container_network_transmit_packets_dropped_total", "Cumulative count of packets dropped while transmitting", func(n *network.InterfaceStats) uint64 { return n.TxDropped }},
	{"container_network_transmit_errors_total", "Cumulative count of errors encountered while transmitting", func(n *network.InterfaceStats) uint64 { return n.TxErrors }},
}

// ListMetricDescriptors describes every metric ListPodSandboxMetrics
// returns.
func (s *Server) ListMetricDescriptors(ctx context.Context, r *runtimeapi.ListMetricDescriptorsRequest) (*runtimeapi.ListMetricDescriptorsResponse, error) {
	resp := &runtimeapi.ListMetricDescriptorsResponse{}
	for _, d := range metricDefs {
		resp.Descriptors = append(resp.Descriptors, &runtimeapi.MetricDescriptor{Name: d.name, Help: d.help, LabelKeys: metricLabels})
	}
	for _, d := range netMetricDefs {
		resp.Descriptors = append(resp.Descriptors, &runtimeapi.MetricDescriptor{Name: d.name, Help: d.help, LabelKeys: netMetricLabels})
	}
	return resp, nil
}

// ListPodSandboxMetrics returns the metrics of every pod and its
// containers, from the same figures as ListPodSandboxStats.
func (s *Server) ListPodSandboxMetrics(ctx context.Context, r *runtimeapi.ListPodSandboxMetricsRequest) (*runtimeapi.ListPodSandboxMetricsResponse, error) {
	resp := &runtimeapi.ListPodSandboxMetricsResponse{}
	for _, ps := range s.b.ListPodStats(ctx, broker.PodFilter{}) {
		resp.PodMetrics = append(resp.PodMetrics, podMetrics(ps))
	}
	return resp, nil
}

// StreamPodSandboxMetrics is ListPodSandboxMetrics in batches.
func (s *Server) StreamPodSandboxMetrics(r *runtimeapi.StreamPodSandboxMetricsRequest, stream grpc.ServerStreamingServer[runtimeapi.StreamPodSandboxMetricsResponse]) error {
	resp, err := s.ListPodSandboxMetrics(stream.Context(), &runtimeapi.ListPodSandboxMetricsRequest{})
	if err != nil {
		return err
	}
	return sendInBatches(resp.PodMetrics, func(b []*runtimeapi.PodSandboxMetrics) error {
		return stream.Send(&runtimeapi.StreamPodSandboxMetricsResponse{PodSandboxMetrics: b})
	})
}

func podMetrics(ps *broker.PodStats) *runtimeapi.PodSandboxMetrics {
	rec := &ps.Status.Record
	meta := rec.Config.Metadata
	out := &runtimeapi.PodSandboxMetrics{PodSandboxId: rec.ID}
	labels := []string{"", rec.ID, "", rec.ID, meta.Namespace, meta.Name}
	out.Metrics = metrics(ps.Usage, nil, labels)
	for i := range ps.Network {
		n := &ps.Network[i]
		l := append(append([]string(nil), labels...), n.Name)
		for _, d := range netMetricDefs {
			out.Metrics = append(out.Metrics, &runtimeapi.Metric{Name: d.name, Timestamp: ps.NetworkTime.UnixNano(),
				MetricType: runtimeapi.MetricType_COUNTER, LabelValues: l, Value: u64(d.value(n))})
		}
	}
	for _, cs := range ps.Containers {
		c := &cs.Record
		out.ContainerMetrics = append(out.ContainerMetrics, &runtimeapi.ContainerMetrics{
			ContainerId: c.ID,
			Metrics:     metrics(cs.Usage, cs, []string{c.Config.Metadata.Name, c.ID, c.ImageName, c.ID, meta.Namespace, meta.Name}),
		})
	}
	return out
}

// metrics are the figures of one cgroup (u) and, for a container, its
// writable layer (cs).
func metrics(u *api.Stats, cs *broker.ContainerStats, labels []string) []*runtimeapi.Metric {
	ts := time.Now().UnixNano()
	if u != nil {
		ts = u.Timestamp.UnixNano()
	}
	var out []*runtimeapi.Metric
	for _, d := range metricDefs {
		v, ok := d.value(u, cs)
		if !ok {
			continue
		}
		out = append(out, &runtimeapi.Metric{Name: d.name, Timestamp: ts, MetricType: d.typ, LabelValues: labels, Value: u64(v)})
	}
	return out
}
