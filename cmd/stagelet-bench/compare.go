package main

import (
	"bufio"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/stagelet/stagelet/internal/atomicfile"
)

// Figures of other runs beside this one's: -save writes a run's medians
// ("measure<TAB>milliseconds" lines), -against NAME=FILE prints such a
// file's beside the run's, with the run's ratio to them. make bench saves
// containerd's run and sets it against stagelet's, and sets the figures
// recorded in bench/ (the previous release's) against both.
var (
	saveTo  = flag.String("save", "", "write the timed calls' medians to this file (measure<TAB>ms lines), for -against")
	against againstFlag
)

func init() {
	flag.Var(&against, "against", "NAME=FILE: print the medians FILE holds (as -save wrote them) beside this run's, with this run's ratio to them; repeatable. A missing FILE is skipped, saying so")
}

type againstFlag []string

func (a *againstFlag) String() string     { return strings.Join(*a, ",") }
func (a *againstFlag) Set(v string) error { *a = append(*a, v); return nil }

// callRow is one timed call of the report and its durations.
type callRow struct {
	label string
	ds    []time.Duration
}

// otherFigures are a named run's medians by measure.
type otherFigures struct {
	name string
	ms   map[string]float64
}

// readAgainst reads the files of -against.
func readAgainst() ([]otherFigures, error) {
	var out []otherFigures
	for _, a := range against {
		name, file, ok := strings.Cut(a, "=")
		if !ok || name == "" || file == "" {
			return nil, fmt.Errorf("-against %q: want NAME=FILE", a)
		}
		f, err := os.Open(file)
		if os.IsNotExist(err) {
			fmt.Fprintf(os.Stderr, "stagelet-bench: no figures of %s (%s): not compared\n", name, file)
			continue
		}
		if err != nil {
			return nil, err
		}
		m, err := parseFigures(f)
		f.Close()
		if err != nil {
			return nil, fmt.Errorf("%s: %w", file, err)
		}
		out = append(out, otherFigures{name: name, ms: m})
	}
	return out, nil
}

// parseFigures reads "measure<TAB>milliseconds" lines; # starts a comment.
func parseFigures(r io.Reader) (map[string]float64, error) {
	m := map[string]float64{}
	sc := bufio.NewScanner(r)
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		if strings.TrimSpace(line) == "" || strings.HasPrefix(line, "#") {
			continue
		}
		label, v, ok := strings.Cut(line, "\t")
		f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
		if !ok || err != nil {
			return nil, fmt.Errorf("line %d: want measure<TAB>milliseconds: %q", n, line)
		}
		m[label] = f
	}
	return m, sc.Err()
}

// printRows prints each row's median and p90, and for each other run its
// median of the same measure and this run's ratio to it.
func printRows(w io.Writer, rows []callRow, others []otherFigures) {
	fmt.Fprintf(w, "%-72s %10s %10s", "measure", "median", "p90")
	for _, o := range others {
		fmt.Fprintf(w, " %12s %7s", o.name, "ratio")
	}
	fmt.Fprintln(w)
	for _, r := range rows {
		med := median(r.ds)
		p90 := ""
		if len(r.ds) > 1 {
			p90 = ms(percentile(r.ds, 90))
		}
		fmt.Fprintf(w, "%-72s %10s %10s", r.label, ms(med), p90)
		for _, o := range others {
			v, ok := o.ms[strings.TrimSpace(r.label)]
			if !ok || v <= 0 {
				fmt.Fprintf(w, " %12s %7s", "-", "")
				continue
			}
			fmt.Fprintf(w, " %9.1f ms %6.2fx", v, float64(med)/float64(time.Millisecond)/v)
		}
		fmt.Fprintln(w)
	}
}

// saveFigures writes the rows' medians to -save's file.
func saveFigures(rows []callRow) error {
	if *saveTo == "" {
		return nil
	}
	var b strings.Builder
	for _, r := range rows {
		fmt.Fprintf(&b, "%s\t%.2f\n", strings.TrimSpace(r.label), float64(median(r.ds))/float64(time.Millisecond))
	}
	return atomicfile.Write(*saveTo, []byte(b.String()), 0o644)
}
