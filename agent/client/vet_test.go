package client

import (
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"
	"unicode"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/errdefs"
)

// TestVetResponse: each field of an answer is refused or replaced as its
// bound says, and the refusal is told by field and reason.
func TestVetResponse(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	future := now.Add(MaxClockAhead + time.Second)
	app := func(mutate ...func(*api.AppStatus)) *api.AppStatus {
		a := &api.AppStatus{ID: "a", State: api.StateExited, PID: 7, ExitCode: 1, Reason: api.ReasonError,
			CreatedAt: now.Add(-time.Hour), StartedAt: now.Add(-time.Minute), FinishedAt: now}
		for _, m := range mutate {
			m(a)
		}
		return a
	}
	stats := func(mutate func(*api.Stats)) *api.Stats {
		s := &api.Stats{Timestamp: now, CPUUsageNanos: 1, MemoryUsageBytes: 10, MemoryWorkingSet: 5, MemoryPageFaults: 3, MemoryMajorPageFault: 1, Pids: 2}
		mutate(s)
		return s
	}
	for _, tc := range []struct {
		name    string
		op      string
		resp    api.Response
		refused string // field/reason told; "" none
		fails   bool   // the answer is refused
		check   func(*api.Response) string
	}{
		{"an honest status", api.OpStop, api.Response{App: app()}, "", false, nil},
		{"no app", api.OpStop, api.Response{}, "app/missing", true, nil},
		{"another app", api.OpStatus, api.Response{App: app(func(a *api.AppStatus) { a.ID = "b" })}, "app.id/mismatch", true, nil},
		{"no such state", api.OpStart, api.Response{App: app(func(a *api.AppStatus) { a.State = "undead" })}, "app.state/invalid", true, nil},
		{"running without a PID", api.OpStart, api.Response{App: app(func(a *api.AppStatus) { a.State, a.PID = api.StateRunning, 0 })}, "app.pid/range", true, nil},
		{"PID past the kernel's", api.OpStart, api.Response{App: app(func(a *api.AppStatus) { a.PID = MaxPID + 1 })}, "app.pid/range", true, nil},
		{"exit code negative", api.OpStop, api.Response{App: app(func(a *api.AppStatus) { a.ExitCode = -1 })}, "app.exitCode/range", false,
			func(r *api.Response) string {
				return want(r.App.ExitCode == MaxExitCode, "exit code %d", r.App.ExitCode)
			}},
		{"exit code too large", api.OpStop, api.Response{App: app(func(a *api.AppStatus) { a.ExitCode = 256 })}, "app.exitCode/range", false,
			func(r *api.Response) string {
				return want(r.App.ExitCode == MaxExitCode, "exit code %d", r.App.ExitCode)
			}},
		{"reason not a word", api.OpStop, api.Response{App: app(func(a *api.AppStatus) { a.Reason = "OOM Killed" })}, "app.reason/invalid", false,
			func(r *api.Response) string { return want(r.App.Reason == api.ReasonError, "reason %q", r.App.Reason) }},
		{"reason too long", api.OpStop, api.Response{App: app(func(a *api.AppStatus) { a.Reason = strings.Repeat("R", MaxReason+1) })}, "app.reason/invalid", false, nil},
		{"message with control characters", api.OpStop, api.Response{App: app(func(a *api.AppStatus) { a.Message = "a\x1b[2Jb\nc\xff" })}, "app.message/control", false,
			func(r *api.Response) string {
				return want(r.App.Message == "a [2Jb c\uFFFD", "message %q", r.App.Message)
			}},
		{"message too long", api.OpStop, api.Response{App: app(func(a *api.AppStatus) { a.Message = "start" + strings.Repeat("é", MaxMessage) + "end" })}, "app.message/length", false,
			func(r *api.Response) string {
				m := r.App.Message
				return want(len(m) <= MaxMessage && strings.HasPrefix(m, "start") && strings.HasSuffix(m, "end") && !strings.ContainsRune(m, unicode.ReplacementChar), "message of %d bytes", len(m))
			}},
		{"finished in the future", api.OpStop, api.Response{App: app(func(a *api.AppStatus) { a.FinishedAt = future })}, "app.time/time", false,
			func(r *api.Response) string {
				return want(r.App.FinishedAt.Equal(now), "finished %v", r.App.FinishedAt)
			}},
		{"started before the epoch", api.OpStop, api.Response{App: app(func(a *api.AppStatus) { a.StartedAt = time.Unix(-5, 0) })}, "app.time/time", false, nil},
		{"finished before it started", api.OpStop, api.Response{App: app(func(a *api.AppStatus) { a.FinishedAt = a.StartedAt.Add(-time.Second) })}, "app.time/time", false,
			func(r *api.Response) string {
				return want(r.App.FinishedAt.Equal(r.App.StartedAt), "finished %v", r.App.FinishedAt)
			}},
		{"exited, never finished", api.OpStop, api.Response{App: app(func(a *api.AppStatus) { a.FinishedAt = time.Time{} })}, "app.time/missing", false, nil},
		{"too many apps", api.OpList, api.Response{Apps: manyApps(MaxApps + 1)}, "apps/length", true, nil},
		{"an app twice", api.OpList, api.Response{Apps: []*api.AppStatus{app(), app()}}, "app.id/invalid", true, nil},
		{"an app ID with a slash", api.OpList, api.Response{Apps: []*api.AppStatus{app(func(a *api.AppStatus) { a.ID = "../x" })}}, "app.id/invalid", true, nil},
		{"a null app", api.OpList, api.Response{Apps: []*api.AppStatus{nil}}, "apps/invalid", true, nil},
		{"no info", api.OpInfo, api.Response{}, "info/missing", true, nil},
		{"info without a PID", api.OpInfo, api.Response{Info: &api.Info{Version: 1}}, "info/range", true, nil},
		{"info with a terminal's escapes", api.OpInfo, api.Response{Info: &api.Info{PID: 1, Kernel: "6.1\x1b[0m"}}, "info/control", false, nil},
		{"no stats", api.OpStats, api.Response{}, "stats/missing", true, nil},
		{"negative CPU as unsigned", api.OpStats, api.Response{Stats: stats(func(s *api.Stats) { s.CPUUsageNanos = math.MaxUint64 })}, "stats/range", true, nil},
		{"more memory than a host", api.OpStats, api.Response{Stats: stats(func(s *api.Stats) { s.MemoryRSSBytes = MaxMemoryBytes + 1 })}, "stats/range", true, nil},
		{"more PIDs than the kernel", api.OpStats, api.Response{Stats: stats(func(s *api.Stats) { s.Pids = MaxPID + 1 })}, "stats/range", true, nil},
		{"more major faults than faults", api.OpStats, api.Response{Stats: stats(func(s *api.Stats) { s.MemoryMajorPageFault = 4 })}, "stats/range", true, nil},
		{"stats from the future", api.OpStats, api.Response{Stats: stats(func(s *api.Stats) { s.Timestamp = future })}, "stats/time", false,
			func(r *api.Response) string {
				return want(r.Stats.Timestamp.Equal(now), "timestamp %v", r.Stats.Timestamp)
			}},
		{"no exec result", api.OpExec, api.Response{}, "exec/missing", true, nil},
		{"exec output too long", api.OpExec, api.Response{Exec: &api.ExecResult{Stdout: make([]byte, api.ExecOutputLimit-1), Stderr: make([]byte, 10)}}, "exec/length", false,
			func(r *api.Response) string {
				return want(len(r.Exec.Stdout) == api.ExecOutputLimit-1 && len(r.Exec.Stderr) == 1, "output %d+%d", len(r.Exec.Stdout), len(r.Exec.Stderr))
			}},
		{"exec exit code", api.OpExec, api.Response{Exec: &api.ExecResult{ExitCode: 1 << 20}}, "exec/range", false, nil},
		{"no restore pipes", api.OpRestore, api.Response{}, "restore/missing", true, nil},
		{"restore descriptor", api.OpRestore, api.Response{Restore: &api.RestoreIO{PID: 3, Stdout: -1, Stderr: 2}}, "restore/range", true, nil},
		{"an error's text", api.OpStop, api.Response{Code: api.CodeNotFound, Error: strings.Repeat("x\r", MaxError)}, "error/control", false,
			func(r *api.Response) string { return want(len(r.Error) <= MaxError, "error of %d bytes", len(r.Error)) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var told []string
			c := NewClient(nil, OnRefusal(func(field, reason string, n int) { told = append(told, field+"/"+reason) }))
			resp := tc.resp
			err := c.vetResponse(&api.Request{Op: tc.op, ID: "a"}, &resp, now)
			if tc.fails != (err != nil) {
				t.Fatalf("err = %v, want refused: %v", err, tc.fails)
			}
			if err != nil && (!errors.Is(err, errdefs.ErrUnavailable) || !errors.Is(err, ErrUntrusted)) {
				t.Errorf("err = %v, want Unavailable and ErrUntrusted", err)
			}
			if tc.refused == "" && len(told) > 0 || tc.refused != "" && (len(told) == 0 || told[0] != tc.refused) {
				t.Errorf("told %v, want %q first", told, tc.refused)
			}
			if tc.check != nil {
				if msg := tc.check(&resp); msg != "" {
					t.Error(msg)
				}
			}
		})
	}
}

func want(ok bool, format string, args ...any) string {
	if ok {
		return ""
	}
	return fmt.Sprintf("got "+format, args...)
}

func manyApps(n int) []*api.AppStatus {
	out := make([]*api.AppStatus, n)
	for i := range out {
		out[i] = &api.AppStatus{ID: fmt.Sprint("a", i), State: api.StateCreated}
	}
	return out
}

// TestVetEvent: events of no known type, or without a good app, are
// dropped; the rest are taken with their times made good.
func TestVetEvent(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	for _, tc := range []struct {
		name string
		ev   api.Event
		ok   bool
	}{
		{"exited", api.Event{Type: api.EventExited, App: &api.AppStatus{ID: "a", State: api.StateExited, FinishedAt: now}, Time: now}, true},
		{"no such type", api.Event{Type: "teleported", App: &api.AppStatus{ID: "a", State: api.StateExited}}, false},
		{"no app", api.Event{Type: api.EventStarted}, false},
		{"a bad app", api.Event{Type: api.EventStarted, App: &api.AppStatus{ID: "a", State: api.StateRunning, PID: -3}}, false},
		{"from the future", api.Event{Type: api.EventCreated, App: &api.AppStatus{ID: "a", State: api.StateCreated}, Time: now.Add(time.Hour)}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := NewClient(nil)
			ev := tc.ev
			if got := c.vetEvent(&ev, now); got != tc.ok {
				t.Fatalf("taken: %v, want %v", got, tc.ok)
			}
			if tc.ok && ev.Time.After(now.Add(MaxClockAhead)) {
				t.Errorf("time %v taken", ev.Time)
			}
		})
	}
}

// TestEventBudget: a burst of EventBurst, then EventRate a second.
func TestEventBudget(t *testing.T) {
	start := time.Unix(1000, 0)
	b := newEventBudget(start)
	for i := range EventBurst {
		if d := b.take(start); d != 0 {
			t.Fatalf("event %d of the burst waits %v", i, d)
		}
	}
	for _, tc := range []struct {
		at   time.Duration
		wait time.Duration
	}{
		{0, time.Second / EventRate},                       // the burst is spent
		{time.Second / EventRate, time.Second / EventRate}, // one token came, and was owed
		{time.Second, 0},                                   // a second later, plenty
	} {
		if d := b.take(start.Add(tc.at)); d != tc.wait {
			t.Errorf("at %v: wait %v, want %v", tc.at, d, tc.wait)
		}
	}
}

// TestCapReader: a reader fails past its bound, not before.
func TestCapReader(t *testing.T) {
	r := &capReader{r: strings.NewReader("0123456789"), left: 4}
	b := make([]byte, 10)
	if n, err := r.Read(b); n != 4 || err != nil {
		t.Fatalf("read %d, %v", n, err)
	}
	if _, err := r.Read(b); !errors.Is(err, errTooLarge) {
		t.Fatalf("past the bound: %v", err)
	}
}
