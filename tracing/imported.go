package tracing

import (
	"time"
	"unicode/utf8"

	"go.opentelemetry.io/otel/trace"
)

// Bounds of what Import takes of one answer of another process: a pod's
// agent, whose guest (a VM's kernel, a compromised pod) controls what it
// answers. A span beyond them is dropped whole, never cut, so that no
// span is exported as something its sender did not say. Together they
// bound what one answer adds to the exporter's queue (a few hundred KiB).
const (
	// MaxImportSpans is the most spans taken of one answer; the agent
	// records a handful per request.
	MaxImportSpans = 64
	// MaxSpanName bounds a span's name, in bytes.
	MaxSpanName = 128
	// MaxSpanAttrs bounds a span's attributes; MaxSpanAttrKey and
	// MaxSpanAttrValue each one's key and value, in bytes.
	MaxSpanAttrs     = 16
	MaxSpanAttrKey   = 64
	MaxSpanAttrValue = 256
	// MaxSpanError bounds a failed span's status message, in bytes.
	MaxSpanError = 512
)

// Why Import dropped spans: the reasons it counts them under.
const (
	// DropUntraced: the call was not traced, or its trace not sampled,
	// here; nothing of another process is exported for it.
	DropUntraced = "untraced"
	// DropForeignTrace: the span names another trace than the call's.
	DropForeignTrace = "foreign_trace"
	// DropOrphan: the span is not beneath the call's span (its parent
	// is neither that span nor a span taken of the same answer).
	DropOrphan = "orphan"
	// DropMalformed: IDs that do not parse, a span ID the answer uses
	// twice or that is the call's own span's, an empty name, text that
	// is not UTF-8 (which the exporter would fail on, with the spans
	// sent beside it).
	DropMalformed = "malformed"
	// DropTooLarge: the name, attributes or status message exceed the
	// bounds above.
	DropTooLarge = "too_large"
	// DropTooMany: beyond MaxImportSpans.
	DropTooMany = "too_many"
	// DropTime: the span ends before it starts or lasts longer than the
	// call, or the answer's spans together span more than the call did:
	// no clock puts them within it.
	DropTime = "time"
)

// Call is a call to another process whose answer carried spans: Span is
// this process's span of the call, whose context the request carried
// (TraceParent; a zero SpanContext when the call was not traced), Sent
// and Received when the request was sent and the answer received, on
// this process's clock.
type Call struct {
	Span           trace.SpanContext
	Sent, Received time.Time
}

// Import exports what of spans, returned by another process for call,
// belongs beneath call.Span: spans of its trace, parented within it
// (on its span, or on a span of the same answer that is), within the
// bounds above, moved onto this clock (Align). Everything else is
// dropped; Import returns how many spans it dropped by reason (Drop*),
// nil when none. Without an exporter (SetImporter) the spans are checked
// and counted all the same. Import is the only way in for another
// process's spans.
func Import(call Call, spans []Finished) map[string]int {
	kept, dropped := vet(call, spans)
	if len(kept) > 0 {
		Align(kept, call.Sent, call.Received)
		if f := importer.Load(); f != nil && *f != nil {
			(*f)(kept)
		}
	}
	return dropped
}

// vet returns the spans of call's answer that Import may export, in an
// order where each one's parent comes before it, and the count of the
// others by reason.
func vet(call Call, spans []Finished) ([]Finished, map[string]int) {
	if len(spans) == 0 {
		return nil, nil
	}
	dropped := map[string]int{}
	if !call.Span.IsValid() || !call.Span.IsSampled() {
		dropped[DropUntraced] = len(spans)
		return nil, dropped
	}
	took := call.Received.Sub(call.Sent)
	root := call.Span.SpanID()
	seen := map[trace.SpanID]bool{root: true}
	children := map[trace.SpanID][]int{}
	candidates := 0
	for i, s := range spans {
		id, parent, why := checkSpan(s, call.Span.TraceID(), took)
		if why == "" && seen[id] {
			why = DropMalformed
		}
		if why != "" {
			dropped[why]++
			continue
		}
		seen[id] = true
		children[parent] = append(children[parent], i)
		candidates++
	}
	// Beneath the call's span, parents first: cutting this order after
	// MaxImportSpans keeps every kept span's parent.
	var kept []Finished
	reached := 0
	for queue := []trace.SpanID{root}; len(queue) > 0; queue = queue[1:] {
		for _, i := range children[queue[0]] {
			reached++
			if len(kept) == MaxImportSpans {
				dropped[DropTooMany]++
			} else {
				kept = append(kept, spans[i])
			}
			id, _ := trace.SpanIDFromHex(spans[i].SpanID)
			queue = append(queue, id)
		}
	}
	if n := candidates - reached; n > 0 {
		dropped[DropOrphan] += n
	}
	if len(kept) > 0 {
		first, last := kept[0].Start, kept[0].End
		for _, s := range kept {
			first, last = minTime(first, s.Start), maxTime(last, s.End)
		}
		if last.Sub(first) > took {
			dropped[DropTime] += len(kept)
			kept = nil
		}
	}
	if len(dropped) == 0 {
		dropped = nil
	}
	return kept, dropped
}

// checkSpan checks one span on its own: its IDs (returned, parsed), its
// trace, its size and its times. why is the reason to drop it, "" when
// it may be taken.
func checkSpan(s Finished, traceID trace.TraceID, took time.Duration) (id, parent trace.SpanID, why string) {
	tid, err := trace.TraceIDFromHex(s.TraceID)
	if err != nil {
		return id, parent, DropMalformed
	}
	if tid != traceID {
		return id, parent, DropForeignTrace
	}
	if id, err = trace.SpanIDFromHex(s.SpanID); err != nil {
		return id, parent, DropMalformed
	}
	if parent, err = trace.SpanIDFromHex(s.ParentID); err != nil {
		return id, parent, DropOrphan
	}
	if s.Name == "" || !utf8.ValidString(s.Name) || !utf8.ValidString(s.Error) {
		return id, parent, DropMalformed
	}
	if len(s.Name) > MaxSpanName || len(s.Error) > MaxSpanError || len(s.Attrs) > MaxSpanAttrs {
		return id, parent, DropTooLarge
	}
	for k, v := range s.Attrs {
		if k == "" || !utf8.ValidString(k) || !utf8.ValidString(v) {
			return id, parent, DropMalformed
		}
		if len(k) > MaxSpanAttrKey || len(v) > MaxSpanAttrValue {
			return id, parent, DropTooLarge
		}
	}
	if s.Start.IsZero() || s.End.Before(s.Start) || s.End.Sub(s.Start) > took {
		return id, parent, DropTime
	}
	return id, parent, ""
}

func minTime(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}

func maxTime(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}
