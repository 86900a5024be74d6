// Package tracing exports OpenTelemetry traces of the daemon's work. It is
// off unless the node configuration names a collector: then each CRI call
// continues the trace of its caller (the kubelet sends W3C traceparent
// with its calls), and the steps below it (the policy's decision, a pod's
// network and start, an image's layers, a container's mount) are spans
// beneath. Packages record spans with Start and End; with tracing off
// they cost a context and a no-op span. This package is the OpenTelemetry
// API only; tracing/otlp, which the daemon's main sets up, holds the SDK
// and the exporter.
package tracing

import (
	"context"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// tracer is the daemon's: it follows the global provider Setup sets.
func tracer() trace.Tracer { return otel.Tracer("github.com/stagelet/stagelet") }

// Start starts a span named name beneath the one ctx carries.
func Start(ctx context.Context, name string, attrs ...attribute.KeyValue) (context.Context, trace.Span) {
	return tracer().Start(ctx, name, trace.WithAttributes(attrs...))
}

// End ends span, marking it failed with err's message when err is not nil.
func End(span trace.Span, err error) {
	if err != nil && span.IsRecording() {
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
	}
	span.End()
}

// IDs are the trace and span IDs ctx's span has, "" when it has none or
// is not sampled: what a log line of a traced call carries.
func IDs(ctx context.Context) (traceID, spanID string) {
	sc := trace.SpanContextFromContext(ctx)
	if !sc.IsValid() || !sc.IsSampled() {
		return "", ""
	}
	return sc.TraceID().String(), sc.SpanID().String()
}

// Finished is a span recorded in another process (a pod's agent, which
// talks to no collector), IDs in hex, for this process to export: through
// Import, which takes of one answer only what lies within the bounds
// beside it (imported.go).
type Finished struct {
	Name     string            `json:"name"`
	TraceID  string            `json:"traceId"`
	SpanID   string            `json:"spanId"`
	ParentID string            `json:"parentId,omitempty"`
	Start    time.Time         `json:"start"`
	End      time.Time         `json:"end"`
	Attrs    map[string]string `json:"attrs,omitempty"`
	// Error is the status message of a failed span.
	Error string `json:"error,omitempty"`
}

var importer atomic.Pointer[func([]Finished)]

// SetImporter makes Import hand the spans it takes to f (the exporter's;
// tracing/otlp sets it); nil: to none.
func SetImporter(f func([]Finished)) { importer.Store(&f) }

// Align puts spans another process recorded during a call, sent at sent
// and answered at received on this process's clock, on this clock: when
// they do not all lie between the two (the clock of a VM restored from a
// template, say, lags or leads the host's), they are all moved by one
// offset that centres them between the two, as NTP assumes the way there
// and back take alike. Spans that fit are left as they are: a process on
// the same clock keeps its exact times. The spans are changed in place.
func Align(spans []Finished, sent, received time.Time) []Finished {
	if len(spans) == 0 {
		return spans
	}
	first, last := spans[0].Start, spans[0].End
	for _, s := range spans {
		if s.Start.Before(first) {
			first = s.Start
		}
		if s.End.After(last) {
			last = s.End
		}
	}
	if !first.Before(sent) && !last.After(received) {
		return spans
	}
	// The middle of the spans onto the middle of the call.
	shift := sent.Add(received.Sub(sent) / 2).Sub(first.Add(last.Sub(first) / 2))
	for i := range spans {
		spans[i].Start = spans[i].Start.Add(shift)
		spans[i].End = spans[i].End.Add(shift)
	}
	return spans
}

// TraceParent is the W3C traceparent of ctx's span when its trace is
// sampled, for a call to another process; "" otherwise.
func TraceParent(ctx context.Context) string {
	if !trace.SpanContextFromContext(ctx).IsSampled() {
		return ""
	}
	c := propagation.MapCarrier{}
	propagation.TraceContext{}.Inject(ctx, c)
	return c["traceparent"]
}

// Remote is ctx with the remote parent traceparent names (from
// TraceParent in the calling process); ctx unchanged when it names none.
func Remote(ctx context.Context, traceparent string) context.Context {
	if traceparent == "" {
		return ctx
	}
	return propagation.TraceContext{}.Extract(ctx, propagation.MapCarrier{"traceparent": traceparent})
}
