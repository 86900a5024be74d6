package main

import (
	"strings"
	"testing"
	"time"
)

func TestParseFigures(t *testing.T) {
	m, err := parseFigures(strings.NewReader("# containerd\nRemoveContainer\t8.4\n\nExecSync true\t14\n"))
	if err != nil {
		t.Fatal(err)
	}
	if len(m) != 2 || m["RemoveContainer"] != 8.4 || m["ExecSync true"] != 14 {
		t.Errorf("figures: %v", m)
	}
	for _, bad := range []string{"RemoveContainer 8.4\n", "RemoveContainer\tfast\n"} {
		if _, err := parseFigures(strings.NewReader(bad)); err == nil {
			t.Errorf("%q: no error", bad)
		}
	}
}

// The other runs' medians stand beside this run's, with its ratio to
// them; a measure they lack shows as -.
func TestPrintRows(t *testing.T) {
	rows := []callRow{
		{"  RemoveContainer", []time.Duration{4 * time.Millisecond, 4 * time.Millisecond, 5 * time.Millisecond}},
		{"StopPodSandbox", []time.Duration{50 * time.Millisecond}},
	}
	var b strings.Builder
	printRows(&b, rows, []otherFigures{{name: "containerd", ms: map[string]float64{"RemoveContainer": 8}}})
	lines := strings.Split(strings.TrimSpace(b.String()), "\n")
	if len(lines) != 3 || !strings.Contains(lines[0], "containerd") {
		t.Fatalf("report:\n%s", b.String())
	}
	if f := strings.Fields(lines[1]); f[len(f)-1] != "0.50x" || f[len(f)-3] != "8.0" {
		t.Errorf("RemoveContainer row %q: want containerd's 8.0 ms and the ratio 0.50x", lines[1])
	}
	if f := strings.Fields(lines[2]); f[len(f)-1] != "-" {
		t.Errorf("StopPodSandbox row %q: want - where containerd has no figure", lines[2])
	}
}
