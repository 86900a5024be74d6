package metrics

import (
	"context"
	"net/http/httptest"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/stagelet/stagelet/agent/client"
	"github.com/stagelet/stagelet/broker"
	"github.com/stagelet/stagelet/policy"
	"github.com/stagelet/stagelet/stage1"
	"github.com/stagelet/stagelet/stage1/fake"
	"github.com/stagelet/stagelet/tracing"
)

// vmBackend is a stage1 that reports VM figures.
type vmBackend struct {
	stage1.Backend
	stats stage1.VMStats
}

func (v vmBackend) VMStats() stage1.VMStats { return v.stats }

type source struct {
	census   broker.Census
	backends map[string]stage1.Backend
}

func (s *source) Census() broker.Census { return s.census }
func (s *source) Stage1s() []string     { return []string{"fake", "vm"} }
func (s *source) Backend(n string) (stage1.Backend, bool) {
	b, ok := s.backends[n]
	return b, ok
}

// scrape serves m over HTTP and parses what it answers with the
// Prometheus text parser, as a scraper would.
func scrape(t *testing.T, m *Metrics) map[string]*dto.MetricFamily {
	t.Helper()
	srv := httptest.NewServer(m.Handler())
	defer srv.Close()
	resp, err := srv.Client().Get(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var p expfmt.TextParser
	fams, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatalf("parsing the scrape: %v", err)
	}
	return fams
}

// value is the value of the series of family name whose labels include
// want; ok false when there is none.
func value(fams map[string]*dto.MetricFamily, name string, want map[string]string) (float64, bool) {
	f := fams[name]
	if f == nil {
		return 0, false
	}
next:
	for _, m := range f.Metric {
		have := map[string]string{}
		for _, l := range m.Label {
			have[l.GetName()] = l.GetValue()
		}
		for k, v := range want {
			if have[k] != v {
				continue next
			}
		}
		switch {
		case m.Counter != nil:
			return m.Counter.GetValue(), true
		case m.Gauge != nil:
			return m.Gauge.GetValue(), true
		case m.Histogram != nil:
			return float64(m.Histogram.GetSampleCount()), true
		}
	}
	return 0, false
}

// TestMetrics: every metric moves with what it is told and reads, under
// its documented name and labels, and the scrape parses.
func TestMetrics(t *testing.T) {
	m := New()
	src := &source{
		census: broker.Census{
			Pods:       map[broker.StageState]int{{Stage1: "fake", State: broker.PodReady}: 2, {Stage1: "gone", State: broker.PodNotReady}: 1},
			Containers: map[broker.StageState]int{{Stage1: "fake", State: broker.ContainerRunning}: 3},
		},
		backends: map[string]stage1.Backend{
			"fake": fake.New("fake"),
			"vm":   vmBackend{Backend: fake.New("vm"), stats: stage1.VMStats{TemplateHits: 4, TemplateMisses: 1, TemplateBuilds: 1, Accelerator: "tcg"}},
		},
	}
	m.Watch(src)

	unary := m.UnaryInterceptor()
	call := func(method string, err error) {
		unary(context.Background(), nil, &grpc.UnaryServerInfo{FullMethod: "/runtime.v1.RuntimeService/" + method},
			func(context.Context, any) (any, error) { return nil, err })
	}
	call("RunPodSandbox", nil)
	call("RunPodSandbox", status.Error(codes.PermissionDenied, "refused"))
	call("Version", nil)
	stream := m.StreamInterceptor()
	stream(nil, nil, &grpc.StreamServerInfo{FullMethod: "/runtime.v1.RuntimeService/GetContainerEvents"},
		func(any, grpc.ServerStream) error { return status.Error(codes.Canceled, "gone") })

	var obs broker.Observer = m.BrokerObserver()
	obs.PolicyDecided("fake", "")
	obs.PolicyDecided("vm", "ci-in-vms")
	obs.PolicyRefused(`rule "no-privileged"`)
	obs.PodStarted("fake", 1500*time.Millisecond)
	obs.AgentDisconnected("vm")
	obs.AgentRefused("vm", client.FieldSpans, tracing.DropForeignTrace, 3)
	obs.AgentRefused("vm", client.FieldExitCode, client.ReasonRange, 1)
	obs.Recovered(broker.RecoveryResult{Ready: 2, Gone: 1, SetAside: 3, Took: 250 * time.Millisecond})

	fams := scrape(t, m)
	for _, tc := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{"stagelet_cri_requests_total", map[string]string{"method": "RunPodSandbox", "code": "OK"}, 1},
		{"stagelet_cri_requests_total", map[string]string{"method": "RunPodSandbox", "code": "PermissionDenied"}, 1},
		{"stagelet_cri_requests_total", map[string]string{"method": "GetContainerEvents", "code": "Canceled"}, 1},
		{"stagelet_cri_request_duration_seconds", map[string]string{"method": "RunPodSandbox"}, 2},
		{"stagelet_policy_decisions_total", map[string]string{"rule": "none", "stage1": "fake"}, 1},
		{"stagelet_policy_decisions_total", map[string]string{"rule": "ci-in-vms", "stage1": "vm"}, 1},
		{"stagelet_policy_refusals_total", map[string]string{"reason": `rule "no-privileged"`}, 1},
		{"stagelet_pod_start_duration_seconds", map[string]string{"stage1": "fake"}, 1},
		{"stagelet_agent_disconnects_total", map[string]string{"stage1": "vm"}, 1},
		{"stagelet_agent_spans_dropped_total", map[string]string{"stage1": "vm", "reason": "foreign_trace"}, 3},
		{"stagelet_agent_refusals_total", map[string]string{"stage1": "vm", "field": "app.exitCode", "reason": "range"}, 1},
		{"stagelet_recovery_duration_seconds", nil, 0.25},
		{"stagelet_recovery_pods", map[string]string{"outcome": "ready"}, 2},
		{"stagelet_recovery_pods", map[string]string{"outcome": "gone"}, 1},
		{"stagelet_recovery_pods", map[string]string{"outcome": "discarded"}, 0},
		{"stagelet_set_aside_records", nil, 3},
		{"stagelet_pods", map[string]string{"stage1": "fake", "state": "ready"}, 2},
		{"stagelet_pods", map[string]string{"stage1": "vm", "state": "ready"}, 0},
		{"stagelet_pods", map[string]string{"stage1": "gone", "state": "notready"}, 1},
		{"stagelet_containers", map[string]string{"stage1": "fake", "state": "running"}, 3},
		{"stagelet_containers", map[string]string{"stage1": "vm", "state": "exited"}, 0},
		{"stagelet_vm_template_hits_total", map[string]string{"stage1": "vm"}, 4},
		{"stagelet_vm_template_misses_total", map[string]string{"stage1": "vm"}, 1},
		{"stagelet_vm_template_builds_total", map[string]string{"stage1": "vm"}, 1},
		{"stagelet_vm_template_build_failures_total", map[string]string{"stage1": "vm"}, 0},
		{"stagelet_vm_accelerator_info", map[string]string{"stage1": "vm", "accelerator": "tcg"}, 1},
	} {
		got, ok := value(fams, tc.name, tc.labels)
		if !ok || got != tc.want {
			t.Errorf("%s%v = %v (present %v), want %v", tc.name, tc.labels, got, ok, tc.want)
		}
	}
	if _, ok := value(fams, "stagelet_vm_template_hits_total", map[string]string{"stage1": "fake"}); ok {
		t.Error("a stage1 that is no VMReporter has template figures")
	}
	for _, name := range []string{"go_goroutines", "process_cpu_seconds_total"} {
		if fams[name] == nil {
			t.Errorf("no %s: the Go runtime and process collectors are missing", name)
		}
	}
}

// TestOff: a nil *Metrics (metrics off) gives no interceptors and no
// observer, and Watch does nothing.
func TestOff(t *testing.T) {
	var m *Metrics
	if m.UnaryInterceptor() != nil || m.StreamInterceptor() != nil || m.BrokerObserver() != nil {
		t.Error("nil metrics give interceptors or an observer")
	}
	m.Watch(&source{})
}

// TestBrokerObserver: a broker given the metrics as its Observer counts
// a decision and a refusal of its policy.
func TestBrokerObserver(t *testing.T) {
	m := New()
	pol, err := policy.Parse("test", []byte("version: 1\ndefault_stage1: fake\nrules:\n- name: no-ci\n  match: {namespaces: [ci]}\n  refuse: \"not here\"\n"))
	if err != nil {
		t.Fatal(err)
	}
	b, err := broker.New(broker.Options{StateDir: t.TempDir(), RunDir: t.TempDir(), Policy: pol,
		Backends: stage1.Registry{"fake": fake.New("fake")}, Observer: m.BrokerObserver()})
	if err != nil {
		t.Fatal(err)
	}
	m.Watch(b)
	if _, err := b.Recover(context.Background()); err != nil {
		t.Fatal(err)
	}
	_, err = b.RunPod(context.Background(), &broker.PodConfig{Metadata: broker.PodMetadata{Name: "p", Namespace: "ci", UID: "u"}})
	if err == nil {
		t.Fatal("the policy's refuse rule let a pod in")
	}
	fams := scrape(t, m)
	if got, _ := value(fams, "stagelet_policy_refusals_total", map[string]string{"reason": `rule "no-ci"`}); got != 1 {
		t.Errorf("refusals by rule \"no-ci\" = %v, want 1", got)
	}
	if got, ok := value(fams, "stagelet_pods", map[string]string{"stage1": "fake", "state": "ready"}); !ok || got != 0 {
		t.Errorf("ready fake pods = %v (present %v), want 0", got, ok)
	}
	if _, ok := value(fams, "stagelet_recovery_duration_seconds", nil); !ok {
		t.Error("no recovery duration after Recover")
	}
}
