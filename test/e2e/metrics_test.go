package e2e

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"testing"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"google.golang.org/grpc/codes"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/test/e2e/harness"
)

// metricsPolicy is bothStage1sPolicy with a rule that refuses the pods of
// one namespace.
const metricsPolicy = bothStage1sPolicy + "rules:\n  - name: no-refused-ns\n    match: {namespaces: [refused-ns]}\n    refuse: \"this namespace runs nothing\"\n"

// scrapeMetrics is one scrape of the daemon's metrics endpoint, parsed
// with the Prometheus text parser.
type scrapeMetrics map[string]*dto.MetricFamily

func (e *env) scrape(url string) scrapeMetrics {
	e.t.Helper()
	req, err := http.NewRequestWithContext(e.ctx(), http.MethodGet, url, nil)
	if err != nil {
		e.t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		e.t.Fatalf("scrape %s: %v", url, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		e.t.Fatalf("scrape %s: %s", url, resp.Status)
	}
	var p expfmt.TextParser
	fams, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		e.t.Fatalf("scrape %s: the Prometheus text parser: %v", url, err)
	}
	return fams
}

// value is the series of family name with exactly labels: a counter's or
// gauge's value, a histogram's sample count; 0 when there is none.
func (s scrapeMetrics) value(name string, labels map[string]string) float64 {
	f := s[name]
	if f == nil {
		return 0
	}
next:
	for _, m := range f.Metric {
		if len(m.Label) != len(labels) {
			continue
		}
		for _, l := range m.Label {
			if v, ok := labels[l.GetName()]; !ok || v != l.GetValue() {
				continue next
			}
		}
		switch {
		case m.Counter != nil:
			return m.Counter.GetValue()
		case m.Gauge != nil:
			return m.Gauge.GetValue()
		case m.Histogram != nil:
			return float64(m.Histogram.GetSampleCount())
		}
	}
	return 0
}

// TestMetrics: with metrics.address set the daemon serves Prometheus
// metrics, and a pod start moves the right series: the CRI calls with
// their codes, the policy's decision, the pods and containers by stage1
// and state, the pod start duration; a refusal counts under its rule; the
// Go runtime's and the process's metrics are there.
func TestMetrics(t *testing.T) {
	for _, s := range []podStage1{flyStage1, nspawnStage1} {
		t.Run(s.handler, func(t *testing.T) {
			e := newEnvOpts(t, harness.Options{Policy: metricsPolicy, MetricsAddress: "127.0.0.1:0"}, true)
			url, err := e.d.MetricsURL()
			if err != nil {
				t.Fatal(err)
			}
			stage1 := map[string]string{"stage1": s.handler}
			ready := map[string]string{"stage1": s.handler, "state": "ready"}
			running := map[string]string{"stage1": s.handler, "state": "running"}
			decided := map[string]string{"stage1": s.handler, "rule": "none"}
			ok := func(method string) map[string]string {
				return map[string]string{"method": method, "code": codes.OK.String()}
			}

			before := e.scrape(url)
			for _, name := range []string{"go_goroutines", "process_resident_memory_bytes", "stagelet_recovery_duration_seconds"} {
				if before[name] == nil {
					t.Errorf("no %s in the scrape", name)
				}
			}
			if got := before.value("stagelet_pods", ready); got != 0 {
				t.Errorf("before any pod: stagelet_pods%v = %v", ready, got)
			}

			podCfg := e.netPodConfig("metrics", s)
			podID := e.runStage1Pod(podCfg, s)
			e.createAndStart(podID, podCfg, e.netContainer(s, "app", "sleep", "1000"))

			after := e.scrape(url)
			for _, c := range []struct {
				name   string
				labels map[string]string
				delta  float64
			}{
				{"stagelet_cri_requests_total", ok("RunPodSandbox"), 1},
				{"stagelet_cri_requests_total", ok("CreateContainer"), 1},
				{"stagelet_cri_requests_total", ok("StartContainer"), 1},
				{"stagelet_cri_request_duration_seconds", map[string]string{"method": "RunPodSandbox"}, 1},
				{"stagelet_policy_decisions_total", decided, 1},
				{"stagelet_pods", ready, 1},
				{"stagelet_containers", running, 1},
				{"stagelet_pod_start_duration_seconds", stage1, 1},
			} {
				if d := after.value(c.name, c.labels) - before.value(c.name, c.labels); d != c.delta {
					t.Errorf("%s%v moved by %v, want %v", c.name, c.labels, d, c.delta)
				}
			}

			refused := e.podConfig("refused")
			refused.Metadata.Namespace = "refused-ns"
			_, err = e.rt().RunPodSandbox(e.ctx(), &runtimeapi.RunPodSandboxRequest{Config: refused})
			requireCode(t, err, codes.PermissionDenied, "RunPodSandbox in a namespace a rule refuses")
			if _, err := e.rt().StopPodSandbox(e.ctx(), &runtimeapi.StopPodSandboxRequest{PodSandboxId: podID}); err != nil {
				t.Fatal(err)
			}

			last := e.scrape(url)
			if got := last.value("stagelet_policy_refusals_total", map[string]string{"reason": fmt.Sprintf("rule %q", "no-refused-ns")}); got != 1 {
				t.Errorf("refusals by rule no-refused-ns = %v, want 1", got)
			}
			denied := map[string]string{"method": "RunPodSandbox", "code": codes.PermissionDenied.String()}
			if got := last.value("stagelet_cri_requests_total", denied); got != 1 {
				t.Errorf("stagelet_cri_requests_total%v = %v, want 1", denied, got)
			}
			notReady := map[string]string{"stage1": s.handler, "state": "notready"}
			if r, n := last.value("stagelet_pods", ready), last.value("stagelet_pods", notReady); r != 0 || n != 1 {
				t.Errorf("after StopPodSandbox: %v ready and %v notready %s pods, want 0 and 1", r, n, s.handler)
			}
		})
	}
}

// TestMetricsAfterRestart: a daemon killed and started again with a pod
// running reports its recovery (the pod ready, how long it took) and the
// recovered pod and container, and does not time the recovered pod's
// start again.
func TestMetricsAfterRestart(t *testing.T) {
	s := nspawnStage1
	e := newEnvOpts(t, harness.Options{Policy: metricsPolicy, MetricsAddress: "127.0.0.1:0"}, true)
	podCfg := e.netPodConfig("recovered", s)
	podID := e.runStage1Pod(podCfg, s)
	e.createAndStart(podID, podCfg, e.netContainer(s, "app", "sleep", "1000"))

	ctx, cancel := context.WithTimeout(t.Context(), startTimeout)
	defer cancel()
	if err := e.d.Kill9(ctx); err != nil {
		t.Fatal(err)
	}
	if err := e.d.Restart(ctx); err != nil {
		t.Fatalf("restart: %v", err)
	}
	url, err := e.d.MetricsURL()
	if err != nil {
		t.Fatal(err)
	}
	m := e.scrape(url)
	for _, c := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{"stagelet_recovery_pods", map[string]string{"outcome": "ready"}, 1},
		{"stagelet_recovery_pods", map[string]string{"outcome": "gone"}, 0},
		{"stagelet_set_aside_records", nil, 0},
		{"stagelet_pods", map[string]string{"stage1": s.handler, "state": "ready"}, 1},
		{"stagelet_containers", map[string]string{"stage1": s.handler, "state": "running"}, 1},
		{"stagelet_pod_start_duration_seconds", map[string]string{"stage1": s.handler}, 0},
	} {
		if got := m.value(c.name, c.labels); got != c.want {
			t.Errorf("%s%v = %v, want %v", c.name, c.labels, got, c.want)
		}
	}
	if m["stagelet_recovery_duration_seconds"] == nil {
		t.Error("no stagelet_recovery_duration_seconds after a restart")
	}
}

// TestMetricsKVM: kvm pods move the VM template counters (the first pod
// of a shape waits for its template's build, the second is restored from
// it) and the accelerator in use is reported.
func TestMetricsKVM(t *testing.T) {
	requireRoot(t)
	if os.Getenv("STAGELET_GUEST_ASSETS") == "" {
		t.Skip("no kvm guest assets: run through `make test` or `make e2e`, or set STAGELET_GUEST_ASSETS (make guest)")
	}
	e := newEnvOpts(t, harness.Options{Policy: allStage1sPolicy, MetricsAddress: "127.0.0.1:0"}, true)
	url, err := e.d.MetricsURL()
	if err != nil {
		t.Fatal(err)
	}
	kvm := map[string]string{"stage1": "kvm"}
	for i, name := range []string{"vm-a", "vm-b"} {
		cfg := e.netPodConfig(name, kvmStage1)
		id := e.runStage1Pod(cfg, kvmStage1)
		e.createAndStart(id, cfg, e.netContainer(kvmStage1, "app", "sleep", "1000"))
		m := e.scrape(url)
		for _, c := range []struct {
			name   string
			labels map[string]string
			want   float64
		}{
			{"stagelet_vm_template_misses_total", kvm, 1},
			{"stagelet_vm_template_builds_total", kvm, 1},
			{"stagelet_vm_template_hits_total", kvm, float64(i)},
			{"stagelet_vm_template_build_failures_total", kvm, 0},
			{"stagelet_pods", map[string]string{"stage1": "kvm", "state": "ready"}, float64(i + 1)},
			{"stagelet_pod_start_duration_seconds", kvm, float64(i + 1)},
		} {
			if got := m.value(c.name, c.labels); got != c.want {
				t.Errorf("after pod %s: %s%v = %v, want %v", name, c.name, c.labels, got, c.want)
			}
		}
		accel := m.value("stagelet_vm_accelerator_info", map[string]string{"stage1": "kvm", "accelerator": "kvm"}) +
			m.value("stagelet_vm_accelerator_info", map[string]string{"stage1": "kvm", "accelerator": "tcg"})
		if accel != 1 {
			t.Errorf("after pod %s: stagelet_vm_accelerator_info names no accelerator of kvm (kvm or tcg)", name)
		}
	}
}
