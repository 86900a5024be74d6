// Package otlp sets up the daemon's OpenTelemetry SDK: spans are batched
// and sent over OTLP/gRPC to the collector the node configuration names,
// and CRI calls continue their callers' traces (otelgrpc's server
// handler, W3C trace context).
package otlp

import (
	"context"
	"fmt"
	"time"

	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/metric/noop"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/instrumentation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	semconv "go.opentelemetry.io/otel/semconv/v1.37.0"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc/stats"

	"github.com/stagelet/stagelet/tracing"
)

// Config is what the node configuration says (config.Tracing).
type Config struct {
	// Endpoint is the collector's OTLP/gRPC host:port; "" turns tracing off.
	Endpoint string
	// SamplingRatePerMillion is how many of a million calls without a
	// sampled parent get traced; a call whose caller sampled its trace
	// always is.
	SamplingRatePerMillion int
	// ServiceName names the daemon in its spans.
	ServiceName string
	// Version is the daemon's version, a resource attribute.
	Version string
	// BatchTimeout is how long spans wait to be sent together; 0: the
	// SDK's default (5 s).
	BatchTimeout time.Duration
}

// Tracing is the daemon's tracer provider, or nothing when tracing is off.
type Tracing struct {
	tp *sdktrace.TracerProvider
}

// Setup starts exporting spans to cfg.Endpoint and makes tracing.Start
// record them. With no endpoint it returns a Tracing whose methods
// do nothing. The exporter connects lazily: a collector that is down
// loses spans, never a CRI call.
func Setup(ctx context.Context, cfg Config) (*Tracing, error) {
	if cfg.Endpoint == "" {
		return &Tracing{}, nil
	}
	exp, err := otlptracegrpc.New(ctx, otlptracegrpc.WithEndpoint(cfg.Endpoint), otlptracegrpc.WithInsecure())
	if err != nil {
		return nil, fmt.Errorf("tracing: OTLP exporter to %s: %w", cfg.Endpoint, err)
	}
	name := cfg.ServiceName
	if name == "" {
		name = "stagelet"
	}
	res := resource.NewSchemaless(semconv.ServiceName(name), semconv.ServiceVersion(cfg.Version))
	var batch []sdktrace.BatchSpanProcessorOption
	if cfg.BatchTimeout > 0 {
		batch = append(batch, sdktrace.WithBatchTimeout(cfg.BatchTimeout))
	}
	bsp := sdktrace.NewBatchSpanProcessor(exp, batch...)
	tp := sdktrace.NewTracerProvider(
		sdktrace.WithSpanProcessor(bsp),
		sdktrace.WithResource(res),
		sdktrace.WithSampler(sdktrace.ParentBased(sdktrace.TraceIDRatioBased(float64(cfg.SamplingRatePerMillion)/1e6))),
	)
	otel.SetTracerProvider(tp)
	otel.SetTextMapPropagator(propagation.TraceContext{})
	agentRes := resource.NewSchemaless(semconv.ServiceName(name+"-agent"), semconv.ServiceVersion(cfg.Version))
	tracing.SetImporter(func(spans []tracing.Finished) {
		for _, f := range spans {
			if s, ok := snapshot(f, agentRes); ok {
				bsp.OnEnd(s)
			}
		}
	})
	return &Tracing{tp: tp}, nil
}

// agentScope is the instrumentation scope of the spans pods' agents
// record.
var agentScope = instrumentation.Scope{Name: "github.com/stagelet/stagelet/agent"}

// snapshot is a span a pod's agent recorded, as the SDK exports its own;
// false for one whose IDs do not parse.
func snapshot(f tracing.Finished, res *resource.Resource) (sdktrace.ReadOnlySpan, bool) {
	tid, err := trace.TraceIDFromHex(f.TraceID)
	if err != nil {
		return nil, false
	}
	sid, err := trace.SpanIDFromHex(f.SpanID)
	if err != nil {
		return nil, false
	}
	stub := tracetest.SpanStub{
		Name:                 f.Name,
		SpanContext:          trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid, TraceFlags: trace.FlagsSampled}),
		SpanKind:             trace.SpanKindServer,
		StartTime:            f.Start,
		EndTime:              f.End,
		Resource:             res,
		InstrumentationScope: agentScope,
	}
	if pid, err := trace.SpanIDFromHex(f.ParentID); err == nil {
		stub.Parent = trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: pid, TraceFlags: trace.FlagsSampled, Remote: true})
	}
	for k, v := range f.Attrs {
		stub.Attributes = append(stub.Attributes, attribute.String(k, v))
	}
	if f.Error != "" {
		stub.Status = sdktrace.Status{Code: codes.Error, Description: f.Error}
	}
	return stub.Snapshot(), true
}

// Enabled tells whether spans are exported.
func (t *Tracing) Enabled() bool { return t != nil && t.tp != nil }

// ServerHandler is the gRPC stats handler that continues the caller's
// trace in each call (otelgrpc): nil when tracing is off, so that the
// server carries no handler at all. Calls whose full method untraced
// accepts get no span, whatever their caller's: the handler then returns
// at once. It records no metrics (the daemon has its own, of every call).
func (t *Tracing) ServerHandler(untraced func(fullMethod string) bool) stats.Handler {
	if !t.Enabled() {
		return nil
	}
	return otelgrpc.NewServerHandler(otelgrpc.WithTracerProvider(t.tp), otelgrpc.WithPropagators(propagation.TraceContext{}),
		otelgrpc.WithMeterProvider(noop.NewMeterProvider()),
		otelgrpc.WithFilter(func(info *stats.RPCTagInfo) bool { return !untraced(info.FullMethodName) }))
}

// Shutdown sends the spans not sent yet and stops exporting.
func (t *Tracing) Shutdown(ctx context.Context) error {
	if !t.Enabled() {
		return nil
	}
	return t.tp.Shutdown(ctx)
}
