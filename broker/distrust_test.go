package broker

import (
	"context"
	"io"
	"math"
	"strings"
	"sync"
	"testing"
	"time"
	"unicode"

	"go.opentelemetry.io/otel"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/agent/client"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/testutil"
	"github.com/stagelet/stagelet/stage1/fake"
	"github.com/stagelet/stagelet/tracing"
)

// The tests here drive the broker against a pod's agent that lies (the
// fake stage1's Pod.Lie): nothing it says is believed unchecked.

// lyingPod returns a broker with a ready pod of the fake stage1 and a
// running container in it, the pod's fake (to make it lie) and the
// Observer's recorder.
func lyingPod(t *testing.T) (*Broker, *fake.Pod, string, *recorder) {
	t.Helper()
	e := newEnv(t)
	rec := &recorder{}
	e.obs = rec
	b := e.broker(t)
	ctx := context.Background()
	podID, err := b.RunPod(ctx, podCfg("liar"))
	if err != nil {
		t.Fatal(err)
	}
	cid, err := b.CreateContainer(ctx, podID, ctrCfg("c"))
	if err != nil {
		t.Fatal(err)
	}
	if err := b.StartContainer(ctx, cid); err != nil {
		t.Fatal(err)
	}
	return b, e.be.Pod(podID), cid, rec
}

// answering returns a Liar that changes the answers to op only.
func answering(op string, lie func(req *api.Request, resp *api.Response)) fake.Liar {
	return fake.Liar{Answer: func(req *api.Request, resp *api.Response) {
		if req.Op == op {
			lie(req, resp)
		}
	}}
}

func clean(t *testing.T, what, s string, max int) {
	t.Helper()
	if len(s) > max {
		t.Errorf("%s: %d bytes, more than %d", what, len(s), max)
	}
	if strings.ContainsFunc(s, unicode.IsControl) {
		t.Errorf("%s: control characters in %q", what, s[:min(len(s), 80)])
	}
}

// TestLyingAgentStatusRefused: a status answer without the app, or of
// another app, or with a state, PID no agent has, is refused (the call
// fails, Unavailable, and the daemon does not fall over); an exit code,
// reason, message or time out of range is replaced by one the daemon
// can stand behind before it reaches the record (and the kubelet).
func TestLyingAgentStatusRefused(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name  string
		lie   func(req *api.Request, resp *api.Response)
		field string
	}{
		{"no app", func(_ *api.Request, resp *api.Response) { resp.App = nil }, client.FieldApp},
		{"another app", func(_ *api.Request, resp *api.Response) { resp.App.ID = "someone-else" }, client.FieldAppID},
		{"no such state", func(_ *api.Request, resp *api.Response) { resp.App.State = "zombie" }, client.FieldState},
		{"negative PID", func(_ *api.Request, resp *api.Response) { resp.App.State, resp.App.PID = api.StateRunning, -1 }, client.FieldPID},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, p, cid, rec := lyingPod(t)
			p.Lie(answering(api.OpStop, tc.lie))
			err := b.StopContainer(ctx, cid, time.Second)
			wantClass(t, err, errdefs.ErrUnavailable)
			if n := rec.refusals("fake", tc.field, reasonOf(tc.field)); n != 1 {
				t.Errorf("%s refusals counted: %d, want 1 (%v)", tc.field, n, rec.agentRefused)
			}
		})
	}

	b, p, cid, rec := lyingPod(t)
	future := time.Now().AddDate(1000, 0, 0)
	liar := answering(api.OpStop, func(_ *api.Request, resp *api.Response) {
		resp.App.ExitCode = 100000
		resp.App.Reason = "<script>alert(1)</script>"
		resp.App.Message = "\x1b[31mred\x1b[0m\n" + strings.Repeat("m", 64<<10)
		resp.App.StartedAt, resp.App.FinishedAt = future, future
	})
	// The stop's answer alone tells of the exit: the event of the real
	// one (SIGTERM's 143) would race it.
	liar.Event = func(*api.Event) []*api.Event { return nil }
	p.Lie(liar)
	before := time.Now()
	if err := b.StopContainer(ctx, cid, time.Second); err != nil {
		t.Fatal(err)
	}
	r, err := b.ContainerStatus(ctx, cid)
	if err != nil {
		t.Fatal(err)
	}
	if r.State != ContainerExited || r.ExitCode != client.MaxExitCode || r.Reason != api.ReasonError {
		t.Errorf("recorded %s, exit code %d, reason %q; want exited, %d, %q", r.State, r.ExitCode, r.Reason, client.MaxExitCode, api.ReasonError)
	}
	clean(t, "message", r.Message, client.MaxMessage)
	if r.FinishedAt.Before(before) || r.FinishedAt.After(time.Now()) || r.StartedAt.After(time.Now()) {
		t.Errorf("recorded started %v, finished %v: not the time the answer came", r.StartedAt, r.FinishedAt)
	}
	for _, want := range []struct{ field, reason string }{
		{client.FieldExitCode, client.ReasonRange}, {client.FieldReason, client.ReasonInvalid},
		{client.FieldMessage, client.ReasonControl}, {client.FieldMessage, client.ReasonLength}, {client.FieldAppTime, client.ReasonTime},
	} {
		if rec.refusals("fake", want.field, want.reason) == 0 {
			t.Errorf("no %s/%s refusal counted (%v)", want.field, want.reason, rec.agentRefused)
		}
	}
}

// reasonOf is the reason a refused field of TestLyingAgentStatusRefused
// is counted under.
func reasonOf(field string) string {
	switch field {
	case client.FieldApp:
		return client.ReasonMissing
	case client.FieldAppID:
		return client.ReasonMismatch
	case client.FieldPID:
		return client.ReasonRange
	}
	return client.ReasonInvalid
}

// TestLyingAgentFiguresRefused: stats with figures no cgroup has (a
// negative number sent as unsigned, more memory than any host) are not
// handed on; an over-long, coloured error reaches the caller as one
// bounded line; an answer larger than its bound is refused before it is
// read whole; exec exit codes out of range are replaced.
func TestLyingAgentFiguresRefused(t *testing.T) {
	ctx := context.Background()
	b, p, cid, rec := lyingPod(t)

	p.Lie(answering(api.OpStats, func(_ *api.Request, resp *api.Response) {
		resp.Stats.MemoryWorkingSet = math.MaxUint64 - 4095 // -4096 as unsigned
	}))
	st, err := b.ContainerStats(ctx, cid)
	if err != nil {
		t.Fatal(err)
	}
	if st.Usage != nil {
		t.Errorf("usage handed on: %+v", st.Usage)
	}
	p.Lie(answering(api.OpStats, func(_ *api.Request, resp *api.Response) { resp.Stats.MemoryUsageBytes = 1 << 60 }))
	if st, err := b.ContainerStats(ctx, cid); err != nil || st.Usage != nil {
		t.Errorf("1 EiB of memory handed on: %+v, %v", st.Usage, err)
	}
	if n := rec.refusals("fake", client.FieldStats, client.ReasonRange); n != 2 {
		t.Errorf("stats refusals counted: %d, want 2", n)
	}

	p.Lie(answering(api.OpStats, func(_ *api.Request, resp *api.Response) {
		resp.Stats.Timestamp = time.Now().Add(1000 * time.Hour)
	}))
	if st, err := b.ContainerStats(ctx, cid); err != nil || st.Usage == nil || st.Usage.Timestamp.After(time.Now()) {
		t.Errorf("stats from the future: %+v, %v", st.Usage, err)
	}

	p.Lie(answering(api.OpStats, func(_ *api.Request, resp *api.Response) {
		resp.Error = strings.Repeat("x", 2*client.MaxResponse) // still OK
	}))
	if st, err := b.ContainerStats(ctx, cid); err != nil || st.Usage != nil {
		t.Errorf("a %d-byte answer taken: %+v, %v", 2*client.MaxResponse, st.Usage, err)
	}
	if n := rec.refusals("fake", client.FieldResponse, client.ReasonSize); n != 1 {
		t.Errorf("oversized answers counted: %d, want 1", n)
	}

	p.Lie(answering(api.OpExec, func(_ *api.Request, resp *api.Response) {
		resp.Code, resp.Error = api.CodeFailedPrecondition, "\x1b]0;owned\x07"+strings.Repeat("e\n", 64<<10)
	}))
	_, err = b.ExecSync(ctx, cid, []string{"true"}, 0)
	wantClass(t, err, errdefs.ErrFailedPrecondition)
	clean(t, "exec error", err.Error(), client.MaxError+len("exec: "))

	p.Lie(answering(api.OpExec, func(_ *api.Request, resp *api.Response) { resp.Exec.ExitCode = -1 }))
	res, err := b.ExecSync(ctx, cid, []string{"true"}, 0)
	if err != nil || res.ExitCode != client.MaxExitCode {
		t.Errorf("exec: exit code %v, %v; want %d", res, err, client.MaxExitCode)
	}
	p.Lie(answering(api.OpExec, func(_ *api.Request, resp *api.Response) { resp.Exec = nil }))
	_, err = b.ExecSync(ctx, cid, []string{"true"}, 0)
	wantClass(t, err, errdefs.ErrUnavailable)

	p.Lie(fake.Liar{SessionEnd: func(end *api.SessionEnd) { end.ExitCode = 1 << 30 }})
	code, err := b.Exec(ctx, cid, []string{"true"}, StreamIO{Stdout: io.Discard})
	if err != nil || code != client.MaxExitCode {
		t.Errorf("exec session: exit code %d, %v; want %d", code, err, client.MaxExitCode)
	}
	if n := rec.refusals("fake", client.FieldSession, client.ReasonRange); n != 1 {
		t.Errorf("session exit codes counted: %d, want 1", n)
	}
}

// TestLyingAgentEventsRefused: events the agent pushes are checked as
// answers are (an exit's code, reason, message and time), events of no
// known type are dropped, and a flood is read no faster than the bound.
func TestLyingAgentEventsRefused(t *testing.T) {
	ctx := context.Background()
	b, p, cid, rec := lyingPod(t)
	var once sync.Once
	p.Lie(fake.Liar{Event: func(ev *api.Event) []*api.Event {
		if ev.Type != api.EventExited {
			return []*api.Event{ev}
		}
		ev.App.ExitCode, ev.App.Reason, ev.App.Message = -9, "Not a\nreason", "\x00bell\a"
		ev.App.FinishedAt = time.Now().Add(48 * time.Hour)
		out := []*api.Event{{Type: "bogus", App: ev.App, Time: ev.Time}, ev}
		once.Do(func() {
			// A flood of events the broker has nothing to do with.
			removed := &api.Event{Type: api.EventRemoved, App: &api.AppStatus{ID: "x", State: api.StateExited, FinishedAt: ev.Time}, Time: ev.Time}
			for range client.EventBurst + 5*client.EventRate {
				out = append(out, removed)
			}
		})
		return out
	}})
	before := time.Now()
	p.Exit(cid, 3)
	testutil.WaitFor(t, 10*time.Second, "the exit recorded", testutil.NoError(func() (bool, error) {
		r, err := b.ContainerStatus(ctx, cid)
		return err == nil && r.State == ContainerExited, err
	}))
	r, _ := b.ContainerStatus(ctx, cid)
	if r.ExitCode != client.MaxExitCode || r.Reason != api.ReasonError || r.FinishedAt.Before(before) || r.FinishedAt.After(time.Now()) {
		t.Errorf("recorded exit code %d, reason %q, finished %v", r.ExitCode, r.Reason, r.FinishedAt)
	}
	clean(t, "message", r.Message, client.MaxMessage)
	testutil.WaitFor(t, 10*time.Second, "the flood throttled", testutil.Holds(func() bool {
		return rec.refusals("fake", client.FieldEvents, client.ReasonRate) > 0
	}))
	if rec.refusals("fake", client.FieldEvent, client.ReasonInvalid) == 0 {
		t.Errorf("the bogus event was not counted (%v)", rec.agentRefused)
	}

	// A snapshot of more apps than a pod has is refused, and the
	// broker subscribes again.
	p.Lie(answering(api.OpEvents, func(_ *api.Request, resp *api.Response) {
		for i := range client.MaxApps + 1 {
			resp.Apps = append(resp.Apps, &api.AppStatus{ID: "a" + strings.Repeat("x", i%100) + string(rune('a'+i%26)), State: api.StateCreated})
		}
	}))
	p.DropSubscribers()
	testutil.WaitFor(t, 10*time.Second, "the snapshot refused", testutil.Holds(func() bool {
		return rec.refusals("fake", client.FieldApps, client.ReasonLength) > 0
	}))
}

// spanRecorder is the exporter of the spans the daemon imports.
type spanRecorder struct {
	mu    sync.Mutex
	spans []tracing.Finished
}

func (r *spanRecorder) got() []tracing.Finished {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]tracing.Finished(nil), r.spans...)
}

// traceAll makes every span of the daemon sampled (sample: or none) and
// its imported spans go to the returned recorder, until the test ends.
// The fake's agents, in this process, install a tracer provider of their
// own when they start: call it after.
func traceAll(t *testing.T, sample bool) *spanRecorder {
	sampler := sdktrace.NeverSample()
	if sample {
		sampler = sdktrace.AlwaysSample()
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithSampler(sampler))
	otel.SetTracerProvider(tp)
	r := &spanRecorder{}
	tracing.SetImporter(func(s []tracing.Finished) {
		r.mu.Lock()
		defer r.mu.Unlock()
		r.spans = append(r.spans, s...)
	})
	t.Cleanup(func() {
		tracing.SetImporter(nil)
		otel.SetTracerProvider(noop.NewTracerProvider())
		_ = tp.Shutdown(context.Background())
	})
	return r
}

// spansLie answers op with spans: those the call may have (one beneath
// its span, and many beneath that one), and one each of another trace,
// beneath no span of the call, and with a huge name; with late, one more
// an hour after the others, which no clock's offset puts within the call.
func spansLie(op string, late bool) fake.Liar {
	return answering(op, func(req *api.Request, resp *api.Response) {
		tid, parent := trace.TraceID{0xee}, trace.SpanID{0xee} // an untraced call's: none
		if parts := strings.Split(req.TraceParent, "-"); len(parts) == 4 {
			tid, _ = trace.TraceIDFromHex(parts[1])
			parent, _ = trace.SpanIDFromHex(parts[2])
		}
		now := time.Now()
		span := func(id byte, tid trace.TraceID, parent trace.SpanID, name string) tracing.Finished {
			return tracing.Finished{Name: name, TraceID: tid.String(), SpanID: trace.SpanID{0xab, id}.String(),
				ParentID: parent.String(), Start: now, End: now}
		}
		handle := span(1, tid, parent, "handle."+op)
		resp.Spans = append(resp.Spans, handle)
		for i := range tracing.MaxImportSpans + 5 {
			resp.Spans = append(resp.Spans, span(byte(10+i), tid, trace.SpanID{0xab, 1}, "step"))
		}
		resp.Spans = append(resp.Spans,
			span(2, trace.TraceID{0x66}, parent, "someone else's"),
			span(3, tid, trace.SpanID{0x77}, "beneath nothing"),
			span(4, tid, parent, strings.Repeat("n", 1<<16)))
		if late {
			s := span(5, tid, parent, "late")
			// Of no length: only its place in time is a lie (a span
			// longer than a fast call is dropped on its own).
			s.Start, s.End = now.Add(time.Hour), now.Add(time.Hour)
			resp.Spans = append(resp.Spans, s)
		}
	})
}

// TestLyingAgentSpansRefused: of the spans an agent returns, the daemon
// exports only those of a call it traced and sampled, of that call's
// trace, beneath the call's span, at most tracing.MaxImportSpans within
// the bounds; everything else is dropped and counted by reason.
func TestLyingAgentSpansRefused(t *testing.T) {
	ctx := context.Background()
	b, p, cid, rec := lyingPod(t)
	exported := traceAll(t, true) // after the agent's, which sets its own

	p.Lie(spansLie(api.OpExec, false))
	if _, err := b.ExecSync(ctx, cid, []string{"true"}, 0); err != nil {
		t.Fatal(err)
	}
	got := exported.got()
	if len(got) != tracing.MaxImportSpans {
		t.Errorf("exported %d spans, want %d", len(got), tracing.MaxImportSpans)
	}
	ids := map[string]bool{}
	var tid string
	for _, s := range got {
		if tid == "" {
			tid = s.TraceID
		}
		if s.TraceID != tid || (s.Name != "handle.exec" && s.Name != "step") || (len(ids) > 0 && !ids[s.ParentID]) {
			t.Errorf("exported %.40s (trace %s, parent %s)", s.Name, s.TraceID, s.ParentID)
		}
		ids[s.SpanID] = true
	}
	for reason, want := range map[string]int{
		tracing.DropForeignTrace: 1, tracing.DropOrphan: 1, tracing.DropTooLarge: 1,
		tracing.DropTooMany: 6, // of the handle's and its 69 steps
	} {
		if n := rec.refusals("fake", client.FieldSpans, reason); n != want {
			t.Errorf("spans dropped as %s: %d, want %d", reason, n, want)
		}
	}

	// One span no clock puts within the call: none of the answer's is
	// believed.
	p.Lie(spansLie(api.OpExec, true))
	if _, err := b.ExecSync(ctx, cid, []string{"true"}, 0); err != nil {
		t.Fatal(err)
	}
	if n := len(exported.got()); n != tracing.MaxImportSpans {
		t.Errorf("an answer with a span an hour late exported %d spans", n-tracing.MaxImportSpans)
	}
	if n := rec.refusals("fake", client.FieldSpans, tracing.DropTime); n != tracing.MaxImportSpans {
		t.Errorf("spans dropped as time: %d, want %d", n, tracing.MaxImportSpans)
	}

	// The stats path is not traced: whatever spans come are dropped.
	p.Lie(spansLie(api.OpStats, false))
	if _, err := b.ContainerStats(ctx, cid); err != nil {
		t.Fatal(err)
	}
	if n := len(exported.got()); n != tracing.MaxImportSpans {
		t.Errorf("an untraced call exported %d spans", n-tracing.MaxImportSpans)
	}
	if n := rec.refusals("fake", client.FieldSpans, tracing.DropUntraced); n != tracing.MaxImportSpans+9 {
		t.Errorf("untraced spans dropped: %d, want %d", n, tracing.MaxImportSpans+9)
	}
}

// TestLyingAgentSpansOfUnsampledCall: a traced call whose trace is not
// sampled takes none of the agent's spans, whatever trace they name.
func TestLyingAgentSpansOfUnsampledCall(t *testing.T) {
	b, p, cid, rec := lyingPod(t)
	exported := traceAll(t, false) // after the agent's, which sets its own
	p.Lie(spansLie(api.OpExec, false))
	if _, err := b.ExecSync(context.Background(), cid, []string{"true"}, 0); err != nil {
		t.Fatal(err)
	}
	if got := exported.got(); len(got) != 0 {
		t.Errorf("exported %d spans of an unsampled call", len(got))
	}
	if n := rec.refusals("fake", client.FieldSpans, tracing.DropUntraced); n != tracing.MaxImportSpans+9 {
		t.Errorf("spans dropped as untraced: %d, want %d", n, tracing.MaxImportSpans+9)
	}
}
