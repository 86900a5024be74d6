// Package metrics owns the daemon's Prometheus metrics: their names, on a
// registry of their own (never the process-global one), and the HTTP
// handler that serves them. It learns what happens from three places: the
// CRI calls, through gRPC interceptors it provides; the broker, as its
// broker.Observer; and, at scrape time, the broker's in-memory census and
// the stage1 backends' optional stage1.VMReporter. No scrape does I/O to
// a pod.
//
// Names follow the Prometheus conventions (base units in the name,
// _total for counters, _info for a constant 1 carrying labels), with the
// prefix stagelet_, as containerd's are prefixed containerd_.
package metrics

import (
	"context"
	"net/http"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"

	"github.com/stagelet/stagelet/agent/client"
	"github.com/stagelet/stagelet/broker"
	"github.com/stagelet/stagelet/stage1"
)

const namespace = "stagelet"

// Buckets of the latency histograms, in seconds: a CRI call takes from a
// millisecond (a list) to minutes (a VM pod whose template is built first,
// an image pull); so does a pod's start.
var (
	criBuckets      = []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 240}
	podStartBuckets = []float64{.1, .25, .5, 1, 2, 5, 10, 20, 30, 60, 120, 240}
)

// Metrics holds the collectors on their own registry. It is the broker's
// Observer. A nil *Metrics is valid and observes nothing: metrics are
// off.
type Metrics struct {
	reg *prometheus.Registry

	criRequests  *prometheus.CounterVec
	criDuration  *prometheus.HistogramVec
	podStart     *prometheus.HistogramVec
	decisions    *prometheus.CounterVec
	refusals     *prometheus.CounterVec
	disconnects  *prometheus.CounterVec
	recoveryTook prometheus.Gauge
	recoveryPods *prometheus.GaugeVec
	setAside     prometheus.Gauge
	verified     *prometheus.CounterVec
	spansDropped *prometheus.CounterVec
	agentRefused *prometheus.CounterVec
}

var _ broker.Observer = (*Metrics)(nil)

// New returns the metrics, registered with the Go runtime's and the
// process's collectors.
func New() *Metrics {
	m := &Metrics{
		reg: prometheus.NewRegistry(),
		criRequests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Subsystem: "cri", Name: "requests_total",
			Help: "CRI calls handled, by method and gRPC status code.",
		}, []string{"method", "code"}),
		criDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: namespace, Subsystem: "cri", Name: "request_duration_seconds",
			Help:    "How long CRI calls took, by method.",
			Buckets: criBuckets,
		}, []string{"method"}),
		podStart: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: namespace, Name: "pod_start_duration_seconds",
			Help:    "Time from a pod's RunPodSandbox to its first container running, by stage1.",
			Buckets: podStartBuckets,
		}, []string{"stage1"}),
		decisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Subsystem: "policy", Name: "decisions_total",
			Help: "Pods the policy gave a stage1, by the rule that chose it (\"none\": a handler or the default) and the stage1.",
		}, []string{"rule", "stage1"}),
		refusals: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Subsystem: "policy", Name: "refusals_total",
			Help: "Pods the policy refused, by what refused (a rule, handlers, annotations.allow, a conflict, ...).",
		}, []string{"reason"}),
		disconnects: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Subsystem: "agent", Name: "disconnects_total",
			Help: "Event streams of pods' agents that ended while the daemon followed them (the agent died, or the stream broke), by stage1.",
		}, []string{"stage1"}),
		recoveryTook: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: namespace, Subsystem: "recovery", Name: "duration_seconds",
			Help: "How long the restart recovery of this daemon took (0 until it ends).",
		}),
		recoveryPods: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: namespace, Subsystem: "recovery", Name: "pods",
			Help: "Pods the restart recovery of this daemon found, by outcome: ready, gone, unrecovered, stopped, discarded.",
		}, []string{"outcome"}),
		setAside: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: namespace, Name: "set_aside_records",
			Help: "Pods and containers whose records are set aside (quarantined, or written by a newer stagelet) and left alone, as of recovery.",
		}),
		verified: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Subsystem: "image", Name: "verifications_total",
			Help: "Images checked against the signature policy, by stage (pull, create) and result (accepted: signatures verified; unverified: the policy accepts the image without; rejected; error: signatures could not be fetched).",
		}, []string{"stage", "result"}),
		spansDropped: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Subsystem: "agent", Name: "spans_dropped_total",
			Help: "Spans pods' agents returned that the daemon did not export, by stage1 and reason (untraced, foreign_trace, orphan, malformed, too_large, too_many, time).",
		}, []string{"stage1", "reason"}),
		agentRefused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Subsystem: "agent", Name: "refusals_total",
			Help: "Values in pods' agents' answers the daemon did not take as they were (it refused the answer, or replaced the value), by stage1, field and reason (missing, mismatch, invalid, range, time, length, control, size, rate).",
		}, []string{"stage1", "field", "reason"}),
	}
	m.reg.MustRegister(
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		m.criRequests, m.criDuration, m.podStart, m.decisions, m.refusals,
		m.disconnects, m.recoveryTook, m.recoveryPods, m.setAside, m.verified,
		m.spansDropped, m.agentRefused,
	)
	return m
}

// Registry is where the metrics are registered, for tests and for
// adding collectors.
func (m *Metrics) Registry() *prometheus.Registry { return m.reg }

// Handler serves the metrics in the Prometheus exposition formats.
func (m *Metrics) Handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{Registry: m.reg})
}

// Source is what the scrape-time metrics read: the broker's census and
// its backends. Each answers from memory.
type Source interface {
	Census() broker.Census
	Stage1s() []string
	Backend(name string) (stage1.Backend, bool)
}

// Watch adds the metrics computed at each scrape from src: pods and
// containers by stage1 and state, and each VM stage1's template counts
// and accelerator. Call it once.
func (m *Metrics) Watch(src Source) {
	if m == nil {
		return
	}
	m.reg.MustRegister(&census{src: src})
}

// BrokerObserver is m as the broker's Observer, nil when m is nil.
func (m *Metrics) BrokerObserver() broker.Observer {
	if m == nil {
		return nil
	}
	return m
}

// method is the CRI method's short name: "RunPodSandbox" of
// "/runtime.v1.RuntimeService/RunPodSandbox".
func method(full string) string { return full[strings.LastIndexByte(full, '/')+1:] }

func (m *Metrics) observeCall(full string, err error, took time.Duration) {
	meth := method(full)
	m.criRequests.WithLabelValues(meth, status.Code(err).String()).Inc()
	m.criDuration.WithLabelValues(meth).Observe(took.Seconds())
}

// UnaryInterceptor counts and times unary CRI calls. It goes first in the
// chain, so that it sees the status code the CRI server chose (and the
// Unavailable of calls refused during recovery). Nil m: none.
func (m *Metrics) UnaryInterceptor() grpc.UnaryServerInterceptor {
	if m == nil {
		return nil
	}
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		start := time.Now()
		resp, err := handler(ctx, req)
		m.observeCall(info.FullMethod, err, time.Since(start))
		return resp, err
	}
}

// StreamInterceptor counts and times streaming CRI calls, as
// UnaryInterceptor.
func (m *Metrics) StreamInterceptor() grpc.StreamServerInterceptor {
	if m == nil {
		return nil
	}
	return func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		start := time.Now()
		err := handler(srv, ss)
		m.observeCall(info.FullMethod, err, time.Since(start))
		return err
	}
}

// PolicyDecided implements broker.Observer.
func (m *Metrics) PolicyDecided(stage1, rule string) {
	if rule == "" {
		rule = "none"
	}
	m.decisions.WithLabelValues(rule, stage1).Inc()
}

// PolicyRefused implements broker.Observer.
func (m *Metrics) PolicyRefused(reason string) { m.refusals.WithLabelValues(reason).Inc() }

// PodStarted implements broker.Observer.
func (m *Metrics) PodStarted(stage1 string, took time.Duration) {
	m.podStart.WithLabelValues(stage1).Observe(took.Seconds())
}

// AgentDisconnected implements broker.Observer.
func (m *Metrics) AgentDisconnected(stage1 string) { m.disconnects.WithLabelValues(stage1).Inc() }

// ImageVerified implements broker.Observer.
func (m *Metrics) ImageVerified(stage, result string) {
	m.verified.WithLabelValues(stage, result).Inc()
}

// AgentRefused implements broker.Observer: spans count in
// stagelet_agent_spans_dropped_total, other fields in
// stagelet_agent_refusals_total.
func (m *Metrics) AgentRefused(stage1, field, reason string, n int) {
	if field == client.FieldSpans {
		m.spansDropped.WithLabelValues(stage1, reason).Add(float64(n))
		return
	}
	m.agentRefused.WithLabelValues(stage1, field, reason).Add(float64(n))
}

// Recovered implements broker.Observer.
func (m *Metrics) Recovered(r broker.RecoveryResult) {
	m.recoveryTook.Set(r.Took.Seconds())
	for outcome, n := range map[string]int{
		"ready": r.Ready, "gone": r.Gone, "unrecovered": r.Unrecovered, "stopped": r.Stopped, "discarded": r.Discarded,
	} {
		m.recoveryPods.WithLabelValues(outcome).Set(float64(n))
	}
	m.setAside.Set(float64(r.SetAside))
}
