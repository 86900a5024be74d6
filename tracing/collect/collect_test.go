package collect

import (
	"context"
	"errors"
	"testing"

	"go.opentelemetry.io/otel/attribute"

	"github.com/stagelet/stagelet/tracing"
)

// TestTakeOnlyWhatTheCallerSampled: beneath a sampled remote parent (the
// daemon's traceparent) the agent's spans are kept and taken by the
// request's trace, parents and failures included; without one nothing is
// recorded.
func TestTakeOnlyWhatTheCallerSampled(t *testing.T) {
	c := Install()
	const parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	ctx := tracing.Remote(context.Background(), parent)
	ctx, span := tracing.Start(ctx, "handle.create", attribute.String("stagelet.app", "a"))
	_, child := tracing.Start(ctx, "app.cgroup")
	tracing.End(child, errors.New("no cgroup"))
	tracing.End(span, nil)

	other, o := tracing.Start(tracing.Remote(context.Background(), "00-1af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"), "handle.start")
	tracing.End(o, nil)

	got := c.Take(ctx)
	if len(got) != 2 {
		t.Fatalf("took %d spans, want 2: %+v", len(got), got)
	}
	byName := map[string]tracing.Finished{}
	for _, f := range got {
		byName[f.Name] = f
		if f.TraceID != "0af7651916cd43dd8448eb211c80319c" {
			t.Errorf("%s: trace %s", f.Name, f.TraceID)
		}
	}
	h, a := byName["handle.create"], byName["app.cgroup"]
	if h.ParentID != "b7ad6b7169203331" || a.ParentID != h.SpanID || h.Attrs["stagelet.app"] != "a" || a.Error != "no cgroup" || h.Error != "" {
		t.Errorf("spans: %+v", got)
	}
	if again := c.Take(ctx); len(again) != 0 {
		t.Errorf("taken twice: %+v", again)
	}
	if len(c.Take(other)) != 1 {
		t.Error("the other request's span was not kept for it")
	}

	// No traceparent: a root span, not sampled, not kept.
	plain, p := tracing.Start(context.Background(), "handle.info")
	tracing.End(p, nil)
	if p.IsRecording() || len(c.Take(plain)) != 0 || tracing.TraceParent(plain) != "" {
		t.Error("a request without a sampled parent was recorded")
	}
	if tp := tracing.TraceParent(ctx); tp == "" || tp[:35] != parent[:35] {
		t.Errorf("TraceParent = %q, want the trace of %q", tp, parent)
	}
}
