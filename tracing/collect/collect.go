// Package collect records spans in a process that exports none: a pod's
// agent, which talks to no collector. Its tracer provider records only
// what a sampled caller asked for (a request's traceparent), and keeps
// each ended span until the answer to its request takes it, for the
// daemon to export (tracing.Import).
package collect

import (
	"context"
	"sync"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"

	"github.com/stagelet/stagelet/tracing"
)

// maxKept bounds the spans kept for answers that never take them (a span
// that ends after its request was answered).
const maxKept = 512

// Collector is a span processor that keeps ended spans by trace.
type Collector struct {
	mu    sync.Mutex
	spans []sdktrace.ReadOnlySpan
}

// Install makes the process's tracer provider record into a new
// Collector: sampled only beneath a sampled remote parent.
func Install() *Collector {
	c := &Collector{}
	otel.SetTracerProvider(sdktrace.NewTracerProvider(
		sdktrace.WithSampler(sdktrace.ParentBased(sdktrace.NeverSample())),
		sdktrace.WithSpanProcessor(c),
	))
	return c
}

// Take returns and forgets the ended spans of ctx's trace.
func (c *Collector) Take(ctx context.Context) []tracing.Finished {
	sc := trace.SpanContextFromContext(ctx)
	if c == nil || !sc.IsSampled() {
		return nil
	}
	c.mu.Lock()
	var mine []sdktrace.ReadOnlySpan
	kept := c.spans[:0]
	for _, s := range c.spans {
		if s.SpanContext().TraceID() == sc.TraceID() {
			mine = append(mine, s)
		} else {
			kept = append(kept, s)
		}
	}
	c.spans = kept
	c.mu.Unlock()
	out := make([]tracing.Finished, 0, len(mine))
	for _, s := range mine {
		f := tracing.Finished{
			Name: s.Name(), TraceID: s.SpanContext().TraceID().String(), SpanID: s.SpanContext().SpanID().String(),
			Start: s.StartTime(), End: s.EndTime(),
		}
		if p := s.Parent(); p.IsValid() {
			f.ParentID = p.SpanID().String()
		}
		if as := s.Attributes(); len(as) > 0 {
			f.Attrs = make(map[string]string, len(as))
			for _, a := range as {
				f.Attrs[string(a.Key)] = a.Value.String()
			}
		}
		if st := s.Status(); st.Code == codes.Error {
			f.Error = st.Description
		}
		out = append(out, f)
	}
	return out
}

// OnStart implements sdktrace.SpanProcessor.
func (c *Collector) OnStart(context.Context, sdktrace.ReadWriteSpan) {}

// OnEnd implements sdktrace.SpanProcessor: it keeps the span.
func (c *Collector) OnEnd(s sdktrace.ReadOnlySpan) {
	if !s.SpanContext().IsSampled() {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.spans) >= maxKept {
		c.spans = c.spans[1:]
	}
	c.spans = append(c.spans, s)
}

// Shutdown implements sdktrace.SpanProcessor.
func (c *Collector) Shutdown(context.Context) error { return nil }

// ForceFlush implements sdktrace.SpanProcessor.
func (c *Collector) ForceFlush(context.Context) error { return nil }
