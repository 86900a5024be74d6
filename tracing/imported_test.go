package tracing

import (
	"maps"
	"strings"
	"testing"
	"time"

	"go.opentelemetry.io/otel/trace"
)

// TestImportVets: of the spans another process returns, only those of
// a traced and sampled call, of its trace, beneath its span and within
// the bounds are taken; each other one is counted under its reason.
func TestImportVets(t *testing.T) {
	tid := trace.TraceID{1, 2, 3}
	root := trace.SpanID{9}
	sampled := trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: root, TraceFlags: trace.FlagsSampled})
	unsampled := trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: root})
	sent := time.Unix(1000, 0)
	call := Call{Span: sampled, Sent: sent, Received: sent.Add(100 * time.Millisecond)}
	span := func(id, parent byte, mutate ...func(*Finished)) Finished {
		f := Finished{Name: "handle.x", TraceID: tid.String(), SpanID: trace.SpanID{id}.String(),
			ParentID: trace.SpanID{parent}.String(), Start: sent.Add(10 * time.Millisecond), End: sent.Add(20 * time.Millisecond)}
		for _, m := range mutate {
			m(&f)
		}
		return f
	}
	many := func(n int) []Finished {
		out := []Finished{span(1, 9)}
		for i := 2; i <= n; i++ {
			out = append(out, span(byte(i+10), 1)) // past the call's 9
		}
		return out
	}
	for _, tc := range []struct {
		name    string
		call    Call
		spans   []Finished
		kept    []string // span IDs' first bytes, in order
		dropped map[string]int
	}{
		{"beneath the call, a child before its parent", call, []Finished{span(2, 1), span(1, 9)}, []string{"01", "02"}, nil},
		{"untraced call", Call{Sent: call.Sent, Received: call.Received}, []Finished{span(1, 9)}, nil, map[string]int{DropUntraced: 1}},
		{"unsampled call", Call{Span: unsampled, Sent: call.Sent, Received: call.Received}, []Finished{span(1, 9)}, nil, map[string]int{DropUntraced: 1}},
		{"foreign trace", call, []Finished{span(1, 9, func(f *Finished) { f.TraceID = trace.TraceID{7}.String() })}, nil, map[string]int{DropForeignTrace: 1}},
		{"orphan and its child", call, []Finished{span(1, 8), span(2, 1), span(3, 9)}, []string{"03"}, map[string]int{DropOrphan: 2}},
		{"no parent", call, []Finished{span(1, 9, func(f *Finished) { f.ParentID = "" })}, nil, map[string]int{DropOrphan: 1}},
		{"the call's own span ID", call, []Finished{span(9, 9)}, nil, map[string]int{DropMalformed: 1}},
		{"a span ID twice", call, []Finished{span(1, 9), span(1, 9)}, []string{"01"}, map[string]int{DropMalformed: 1}},
		{"bad IDs", call, []Finished{span(1, 9, func(f *Finished) { f.SpanID = "zz" }), span(2, 9, func(f *Finished) { f.TraceID = "nope" })}, nil, map[string]int{DropMalformed: 2}},
		{"not UTF-8", call, []Finished{span(1, 9, func(f *Finished) { f.Name = "\xff" }), span(2, 9, func(f *Finished) { f.Attrs = map[string]string{"k": "\xfe"} })}, nil, map[string]int{DropMalformed: 2}},
		{"name too long", call, []Finished{span(1, 9, func(f *Finished) { f.Name = strings.Repeat("n", MaxSpanName+1) })}, nil, map[string]int{DropTooLarge: 1}},
		{"too many attributes", call, []Finished{span(1, 9, func(f *Finished) {
			f.Attrs = map[string]string{}
			for i := range MaxSpanAttrs + 1 {
				f.Attrs[strings.Repeat("k", i+1)] = "v"
			}
		})}, nil, map[string]int{DropTooLarge: 1}},
		{"attribute too long", call, []Finished{span(1, 9, func(f *Finished) { f.Attrs = map[string]string{"k": strings.Repeat("v", MaxSpanAttrValue+1)} })}, nil, map[string]int{DropTooLarge: 1}},
		{"error too long", call, []Finished{span(1, 9, func(f *Finished) { f.Error = strings.Repeat("e", MaxSpanError+1) })}, nil, map[string]int{DropTooLarge: 1}},
		{"too many", call, many(MaxImportSpans + 3), nil, map[string]int{DropTooMany: 3}},
		{"ends before it starts", call, []Finished{span(1, 9, func(f *Finished) { f.End = f.Start.Add(-time.Second) })}, nil, map[string]int{DropTime: 1}},
		{"longer than the call", call, []Finished{span(1, 9, func(f *Finished) { f.End = f.Start.Add(time.Hour) })}, nil, map[string]int{DropTime: 1}},
		{"together longer than the call", call, []Finished{span(1, 9), span(2, 9, func(f *Finished) {
			f.Start, f.End = f.Start.Add(time.Hour), f.End.Add(time.Hour)
		})}, nil, map[string]int{DropTime: 2}},
		{"on a lagging clock", call, []Finished{span(1, 9, func(f *Finished) { f.Start, f.End = f.Start.Add(-time.Hour), f.End.Add(-time.Hour) })}, []string{"01"}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			kept, dropped := vet(tc.call, tc.spans)
			if tc.name == "too many" {
				if len(kept) != MaxImportSpans || kept[0].SpanID != (trace.SpanID{1}).String() {
					t.Errorf("kept %d spans, the first %s; want %d, the parent first", len(kept), kept[0].SpanID, MaxImportSpans)
				}
			} else {
				var got []string
				for _, s := range kept {
					got = append(got, s.SpanID[:2])
				}
				if strings.Join(got, ",") != strings.Join(tc.kept, ",") {
					t.Errorf("kept %v, want %v", got, tc.kept)
				}
			}
			if !maps.Equal(dropped, tc.dropped) {
				t.Errorf("dropped %v, want %v", dropped, tc.dropped)
			}
		})
	}
}

// TestImportExportsOnlyVetted: Import hands the exporter the spans it
// takes, on this clock, and nothing of an untraced call.
func TestImportExportsOnlyVetted(t *testing.T) {
	var got []Finished
	SetImporter(func(s []Finished) { got = append(got, s...) })
	t.Cleanup(func() { SetImporter(nil) })
	sc := trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{1}, SpanID: trace.SpanID{9}, TraceFlags: trace.FlagsSampled})
	sent := time.Unix(1000, 0)
	call := Call{Span: sc, Sent: sent, Received: sent.Add(time.Second)}
	lag := []Finished{{Name: "handle.x", TraceID: sc.TraceID().String(), SpanID: trace.SpanID{1}.String(), ParentID: sc.SpanID().String(),
		Start: sent.Add(-time.Hour), End: sent.Add(-time.Hour + 10*time.Millisecond)}}
	if d := Import(call, lag); d != nil {
		t.Fatalf("dropped %v", d)
	}
	if len(got) != 1 || got[0].Start.Before(sent) {
		t.Fatalf("exported %+v, want the span moved into the call", got)
	}
	got = nil
	if d := Import(Call{Sent: sent, Received: sent.Add(time.Second)}, lag); d[DropUntraced] != 1 || got != nil {
		t.Fatalf("untraced: dropped %v, exported %v", d, got)
	}
	SetImporter(nil)
	Import(call, lag) // no exporter: no panic
}
