package otlpsink

import (
	"encoding/xml"
	"strings"
	"testing"
	"time"
)

// A small trace draws parents above children, in start order, as
// well-formed SVG with a bar and a label per span.
func TestWriteSVG(t *testing.T) {
	t0 := time.Unix(1000, 0)
	spans := []Span{
		{Name: "b", SpanID: "3", ParentID: "1", Service: "stagelet", Start: t0.Add(40 * time.Millisecond), End: t0.Add(90 * time.Millisecond)},
		{Name: "root", SpanID: "1", ParentID: "caller", Service: "stagelet", Start: t0, End: t0.Add(100 * time.Millisecond)},
		{Name: "a", SpanID: "2", ParentID: "1", Service: "stagelet", Start: t0.Add(time.Millisecond), End: t0.Add(30 * time.Millisecond)},
		{Name: "in <pod>", SpanID: "4", ParentID: "3", Service: "stagelet-agent", Start: t0.Add(50 * time.Millisecond), End: t0.Add(60 * time.Millisecond), Error: true},
	}
	var b strings.Builder
	if err := WriteSVG(&b, spans); err != nil {
		t.Fatal(err)
	}
	svg := b.String()
	if err := xml.Unmarshal([]byte(svg), new(struct{})); err != nil {
		t.Fatalf("not well-formed: %v\n%s", err, svg)
	}
	order := []string{">root<", ">  a<", ">  b<", ">    in &lt;pod&gt; (stagelet-agent)<"}
	last := -1
	for _, o := range order {
		i := strings.Index(svg, o)
		if i < last {
			t.Errorf("%q missing or out of order in:\n%s", o, svg)
		}
		last = i
	}
	if n := strings.Count(svg, "<rect "); n != 1+len(spans) {
		t.Errorf("%d rectangles, want a background and %d bars", n, len(spans))
	}
	if !strings.Contains(svg, `fill="#c0392b"`) || !strings.Contains(svg, ">100ms<") {
		t.Errorf("no failed bar or no total duration:\n%s", svg)
	}
	if WriteSVG(&b, nil) == nil {
		t.Error("no spans drew")
	}
}
