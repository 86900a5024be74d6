// Package preflight decides what a node can run and says why not: one
// check per thing the stage1s need (cgroups, systemd, systemd-nspawn,
// qemu and its accelerator, CNI, user namespaces, CDI, CRIU, disk space,
// set-aside records), each with a status and the facts behind it, and for
// each stage1 whether it can run here. `stagelet doctor` prints a report;
// the daemon computes one after recovery and shows it in verbose Status
// (crictl info).
package preflight

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"
)

// Status grades a check.
type Status string

const (
	OK   Status = "ok"   // as the stage1s want it
	Info Status = "info" // a fact, nothing to do
	Warn Status = "warn" // works, worse (slower, fewer features)
	Fail Status = "fail" // the stage1s in Blocks cannot run
)

// Check is one fact about the node.
type Check struct {
	Name   string `json:"name"`
	Status Status `json:"status"`
	Detail string `json:"detail"`
	// Blocks are the stage1s a failed check keeps from running ("*":
	// every one).
	Blocks []string `json:"blocks,omitempty"`
}

// Report is every check, and what follows for the stage1s.
type Report struct {
	Checks []Check `json:"checks"`
	// Stage1s maps each stage1 this binary carries to "" when it can run
	// here, else why not.
	Stage1s       map[string]string `json:"stage1s"`
	DefaultStage1 string            `json:"defaultStage1"`
}

// CanRunDefault reports whether the node's default stage1 can run.
func (r *Report) CanRunDefault() bool {
	why, ok := r.Stage1s[r.DefaultStage1]
	return ok && why == ""
}

// Prober runs one check.
type Prober func(ctx context.Context) Check

// Run runs the probes in order and works out which stage1s can run.
func Run(ctx context.Context, stage1s []string, defaultStage1 string, probes []Prober) *Report {
	r := &Report{Stage1s: map[string]string{}, DefaultStage1: defaultStage1}
	for _, s := range stage1s {
		r.Stage1s[s] = ""
	}
	for _, p := range probes {
		c := p(ctx)
		r.Checks = append(r.Checks, c)
		if c.Status != Fail {
			continue
		}
		for s := range r.Stage1s {
			if (slices.Contains(c.Blocks, s) || slices.Contains(c.Blocks, "*")) && r.Stage1s[s] == "" {
				r.Stage1s[s] = c.Name + ": " + c.Detail
			}
		}
	}
	if _, ok := r.Stage1s[defaultStage1]; !ok && defaultStage1 != "" {
		r.Stage1s[defaultStage1] = "this binary has no such stage1"
	}
	return r
}

// WriteText prints one line per check, then one per stage1.
func (r *Report) WriteText(w io.Writer) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	for _, c := range r.Checks {
		fmt.Fprintf(tw, "%s\t%s\t%s\n", c.Status, c.Name, oneLine(c.Detail))
	}
	names := make([]string, 0, len(r.Stage1s))
	for s := range r.Stage1s {
		names = append(names, s)
	}
	slices.Sort(names)
	for _, s := range names {
		st, why := OK, "can run here"
		if r.Stage1s[s] != "" {
			st, why = Fail, "cannot run: "+r.Stage1s[s]
		}
		if s == r.DefaultStage1 {
			why += " (the default stage1)"
		}
		fmt.Fprintf(tw, "%s\tstage1 %s\t%s\n", st, s, oneLine(why))
	}
	return tw.Flush()
}

// WriteJSON prints the report as JSON, for tools.
func (r *Report) WriteJSON(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(r)
}

// Info flattens the report for verbose Status: "preflight.<check>" →
// "<status>: <detail>", and "preflight.stage1.<name>".
func (r *Report) Info() map[string]string {
	out := map[string]string{}
	for _, c := range r.Checks {
		out["preflight."+c.Name] = string(c.Status) + ": " + c.Detail
	}
	for s, why := range r.Stage1s {
		if why == "" {
			why = "can run here"
		} else {
			why = "cannot run: " + why
		}
		out["preflight.stage1."+s] = why
	}
	return out
}

func oneLine(s string) string { return strings.Join(strings.Fields(s), " ") }
