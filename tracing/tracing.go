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

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
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
