package cri

import (
	"context"
	"testing"
	"time"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/broker"
)

// TestPodMetrics: every metric has a descriptor and one label value per
// label key (the kubelet's collector drops a metric that does not); the
// values are the stats' figures; a container without a cgroup (not
// running) has only its writable layer's.
func TestPodMetrics(t *testing.T) {
	now := time.Now()
	ps := &broker.PodStats{
		Status: &broker.PodStatus{Record: broker.PodRecord{ID: "pod1", Config: broker.PodConfig{Metadata: broker.PodMetadata{Name: "web", Namespace: "ns"}}}},
		Usage:  &api.Stats{Timestamp: now, CPUUsageNanos: 3e9 + 1, MemoryWorkingSet: 100, MemoryUsageBytes: 200, Pids: 4},
		Containers: []*broker.ContainerStats{
			{Record: broker.ContainerRecord{ID: "c1", ImageName: "busybox", Config: broker.ContainerConfig{Metadata: broker.ContainerMetadata{Name: "app"}}},
				Usage: &api.Stats{Timestamp: now, CPUUsageNanos: 2e9, MemoryWorkingSet: 50, MemoryRSSBytes: 40, Pids: 2}, WritableBytes: 4096, WritableInodes: 3},
			{Record: broker.ContainerRecord{ID: "c2", Config: broker.ContainerConfig{Metadata: broker.ContainerMetadata{Name: "done"}}}, WritableBytes: 1},
		},
	}
	s := &Server{}
	descs, _ := s.ListMetricDescriptors(context.Background(), nil)
	known := map[string]int{}
	for _, d := range descs.Descriptors {
		known[d.Name] = len(d.LabelKeys)
	}
	pm := podMetrics(ps)
	if pm.PodSandboxId != "pod1" || len(pm.ContainerMetrics) != 2 {
		t.Fatalf("pod metrics %+v", pm)
	}
	values := map[string]uint64{}
	for _, m := range pm.Metrics {
		if n, ok := known[m.Name]; !ok || n != len(m.LabelValues) {
			t.Errorf("pod metric %s: described %v with %d labels, has %d", m.Name, ok, n, len(m.LabelValues))
		}
		if m.LabelValues[0] != "" || m.LabelValues[4] != "ns" || m.LabelValues[5] != "web" {
			t.Errorf("pod metric %s labels %v", m.Name, m.LabelValues)
		}
		values["pod "+m.Name] = m.Value.Value
	}
	for _, cm := range pm.ContainerMetrics {
		for _, m := range cm.Metrics {
			if n, ok := known[m.Name]; !ok || n != len(m.LabelValues) {
				t.Errorf("container metric %s: described %v with %d labels, has %d", m.Name, ok, n, len(m.LabelValues))
			}
			values[cm.ContainerId+" "+m.Name] = m.Value.Value
		}
	}
	for k, want := range map[string]uint64{
		"pod container_cpu_usage_seconds_total":  3,
		"pod container_memory_working_set_bytes": 100,
		"pod container_processes":                4,
		"c1 container_cpu_usage_seconds_total":   2,
		"c1 container_memory_rss":                40,
		"c1 container_fs_usage_bytes":            4096,
		"c1 container_fs_inodes_total":           3,
		"c2 container_fs_usage_bytes":            1,
	} {
		if got, ok := values[k]; !ok || got != want {
			t.Errorf("%s = %d (present %v), want %d", k, got, ok, want)
		}
	}
	if _, ok := values["c2 container_memory_working_set_bytes"]; ok {
		t.Error("a container that does not run has memory figures")
	}
	if _, ok := values["pod container_fs_usage_bytes"]; ok {
		t.Error("the pod has a writable layer figure")
	}
}
