package otlpsink

import (
	"fmt"
	"html"
	"io"
	"slices"
	"strings"
	"time"
)

// WriteSVG draws spans (one trace, or part of one) as a waterfall, the
// way trace viewers show one: a row per span, parents above their
// children, a bar from its start to its end on a common time axis,
// labelled with its name, its service when not the first span's, and its
// duration. Spans of another service than the first's are drawn in
// another colour; failed ones in red.
func WriteSVG(w io.Writer, spans []Span) error {
	if len(spans) == 0 {
		return fmt.Errorf("no span to draw")
	}
	rows := treeOrder(spans)
	t0, t1 := rows[0].span.Start, rows[0].span.End
	for _, r := range rows {
		if r.span.Start.Before(t0) {
			t0 = r.span.Start
		}
		if r.span.End.After(t1) {
			t1 = r.span.End
		}
	}
	total := max(t1.Sub(t0), time.Microsecond)
	const (
		labelW, barW, rowH, top = 360, 560, 22, 30
	)
	width, height := labelW+barW+70, top+rowH*len(rows)+10
	x := func(t time.Time) float64 { return labelW + float64(barW)*float64(t.Sub(t0))/float64(total) }
	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="monospace" font-size="12">`+"\n", width, height)
	fmt.Fprintf(&b, `<rect width="%d" height="%d" fill="white"/>`+"\n", width, height)
	for i := 0; i <= 4; i++ {
		tx := labelW + float64(barW)*float64(i)/4
		fmt.Fprintf(&b, `<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="#ddd"/>`+"\n", tx, top-8, tx, height-6)
		anchor := "middle"
		if i == 4 {
			anchor = "end"
		}
		fmt.Fprintf(&b, `<text x="%.1f" y="%d" fill="#666" text-anchor="%s">%s</text>`+"\n", tx, top-12, anchor, round(total*time.Duration(i)/4))
	}
	service := rows[0].span.Service
	for i, r := range rows {
		sp := r.span
		y := top + i*rowH
		label := strings.Repeat("  ", r.depth) + sp.Name
		if sp.Service != service {
			label += " (" + sp.Service + ")"
		}
		fill := "#4a7fb5"
		if sp.Service != service {
			fill = "#5aa469"
		}
		if sp.Error {
			fill = "#c0392b"
		}
		x0, x1 := x(sp.Start), x(sp.End)
		fmt.Fprintf(&b, `<text x="4" y="%d" xml:space="preserve">%s</text>`+"\n", y+14, html.EscapeString(label))
		fmt.Fprintf(&b, `<rect x="%.1f" y="%d" width="%.1f" height="%d" fill="%s"/>`+"\n", x0, y+3, max(x1-x0, 1), rowH-6, fill)
		anchor, tx := "start", x1+4
		if tx > float64(width)-80 {
			anchor, tx = "end", x0-4
		}
		fmt.Fprintf(&b, `<text x="%.1f" y="%d" fill="#333" text-anchor="%s">%s</text>`+"\n", tx, y+14, anchor, round(sp.End.Sub(sp.Start)))
	}
	b.WriteString("</svg>\n")
	_, err := io.WriteString(w, b.String())
	return err
}

type row struct {
	span  Span
	depth int
}

// treeOrder puts spans parents first, children by start time beneath
// them; a span whose parent is not among spans is a root.
func treeOrder(spans []Span) []row {
	ids := map[string]bool{}
	for _, s := range spans {
		ids[s.SpanID] = true
	}
	children := map[string][]Span{}
	var roots []Span
	for _, s := range spans {
		if ids[s.ParentID] {
			children[s.ParentID] = append(children[s.ParentID], s)
		} else {
			roots = append(roots, s)
		}
	}
	byStart := func(a, b Span) int { return a.Start.Compare(b.Start) }
	var out []row
	var walk func(s Span, depth int)
	walk = func(s Span, depth int) {
		out = append(out, row{s, depth})
		kids := children[s.SpanID]
		slices.SortFunc(kids, byStart)
		for _, k := range kids {
			walk(k, depth+1)
		}
	}
	slices.SortFunc(roots, byStart)
	for _, r := range roots {
		walk(r, 0)
	}
	return out
}

// round shows d to three significant figures or so.
func round(d time.Duration) string {
	switch {
	case d >= time.Second:
		return d.Round(10 * time.Millisecond).String()
	case d >= 10*time.Millisecond:
		return d.Round(100 * time.Microsecond).String()
	case d >= time.Millisecond:
		return d.Round(10 * time.Microsecond).String()
	default:
		return d.Round(time.Microsecond).String()
	}
}
