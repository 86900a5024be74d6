package supervisor_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/testutil"
)

var criLine = regexp.MustCompile(`^\S+ (stdout|stderr) [FP] (.*)$`)

// logSink collects what a log session writes.
type logSink struct {
	mu    sync.Mutex
	b     strings.Builder
	fails int // the next frames' writes fail
}

func (s *logSink) write(p []byte) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.fails > 0 {
		s.fails--
		return errors.New("the test's write fails")
	}
	s.b.Write(p)
	return nil
}

func (s *logSink) contents() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []string
	for _, l := range strings.Split(strings.TrimSuffix(s.b.String(), "\n"), "\n") {
		if m := criLine.FindStringSubmatch(l); m != nil {
			out = append(out, m[2])
		} else if l != "" {
			out = append(out, "BAD LINE "+l)
		}
	}
	return out
}

// TestHostLogSession: an app created with HostLog writes no file; its
// lines come on the log session in CRI format, none lost when a session
// fails to write a frame (the next session gets it again), and the
// session ends once the app exited and all was written. Its output,
// more than the agent holds, waits for the session, opened after it
// started.
func TestHostLogSession(t *testing.T) {
	ta := startAgent(t)
	logPath := filepath.Join(t.TempDir(), "never", "a.log")
	const n = 15000 // more than the agent buffers: the app waits for the session
	ta.run(&api.AppSpec{ID: "a", Rootfs: makeRootfs(t), Args: []string{"sh", "-c", fmt.Sprintf("i=0; while [ $i -lt %d ]; do echo line $i; echo err $i >&2; i=$((i+1)); done", n)}, Env: []string{"PATH=/bin"}, LogPath: logPath, HostLog: true})

	sink := &logSink{fails: 1}
	err := ta.c.Logs(ctx(t), "a", sink.write)
	if err == nil || !strings.Contains(err.Error(), "the test's write fails") {
		t.Fatalf("first session: %v", err)
	}
	if err := ta.c.Logs(ctx(t), "a", sink.write); err != nil {
		t.Fatalf("second session: %v", err)
	}
	got := sink.contents()
	var outs, errs []string
	for _, l := range got {
		switch {
		case strings.HasPrefix(l, "line "):
			outs = append(outs, l)
		case strings.HasPrefix(l, "err "):
			errs = append(errs, l)
		default:
			t.Fatalf("unexpected line %q", l)
		}
	}
	if len(outs) != n || len(errs) != n {
		t.Fatalf("got %d stdout and %d stderr lines, want %d each", len(outs), len(errs), n)
	}
	for i := range n {
		if outs[i] != fmt.Sprintf("line %d", i) || errs[i] != fmt.Sprintf("err %d", i) {
			t.Fatalf("line %d: %q, %q", i, outs[i], errs[i])
		}
	}
	if st := ta.waitExited("a"); st.ExitCode != 0 {
		t.Errorf("app: %+v", st)
	}
	if _, err := os.Stat(logPath); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the agent touched the log path: %v", err)
	}
	// Everything was delivered: a new session ends at once.
	if err := ta.c.Logs(ctx(t), "a", sink.write); err != nil {
		t.Errorf("session after the end: %v", err)
	}
	if len(sink.contents()) != 2*n {
		t.Errorf("a session after the end sent lines again")
	}
	if err := ta.c.ReopenLog(ctx(t), "a"); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Errorf("reopen of a host log: %v", err)
	}
}

// TestHostLogSessionReplaced: a second session replaces the first (a
// daemon that restarted), and removing the app ends it even with lines
// not taken.
func TestHostLogSessionReplaced(t *testing.T) {
	ta := startAgent(t)
	ta.run(&api.AppSpec{ID: "a", Rootfs: makeRootfs(t), Args: []string{"sh", "-c", "echo first; exec sleep 1000"}, Env: []string{"PATH=/bin"}, LogPath: "/never/a.log", HostLog: true})
	first := &logSink{}
	c1, cancel1 := context.WithCancel(ctx(t))
	defer cancel1()
	s1 := make(chan error, 1)
	go func() { s1 <- ta.c.Logs(c1, "a", first.write) }()
	waitLines(t, first, 1)
	second := &logSink{}
	s2 := make(chan error, 1)
	go func() { s2 <- ta.c.Logs(ctx(t), "a", second.write) }()
	if err := <-s1; !errors.Is(err, errdefs.ErrUnavailable) {
		t.Errorf("replaced session: %v", err)
	}
	if err := ta.c.Remove(ctx(t), "a"); err != nil {
		t.Fatal(err)
	}
	if err := <-s2; err != nil {
		t.Errorf("session of a removed app: %v", err)
	}
	// The first session's acknowledgement of its line may not have
	// reached the agent before the second replaced it: that line comes
	// again (at least once), and nothing else does.
	if got := second.contents(); len(got) > 1 || len(got) == 1 && got[0] != "first" {
		t.Errorf("second session got %q; at most the first session's line again", got)
	}
	if err := ta.c.Logs(ctx(t), "a", second.write); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("session of a removed app: %v", err)
	}
	ta.run(&api.AppSpec{ID: "b", Rootfs: makeRootfs(t), Args: []string{"true"}, Env: []string{"PATH=/bin"}})
	if err := ta.c.Logs(ctx(t), "b", second.write); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Errorf("session of an app writing its own log: %v", err)
	}
}

func waitLines(t *testing.T, s *logSink, n int) {
	t.Helper()
	testutil.WaitFor(t, 20*time.Second, fmt.Sprintf("%d log lines", n), func() (bool, string) {
		got := s.contents()
		return len(got) >= n, strings.Join(got, "|")
	})
}
