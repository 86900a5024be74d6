package supervisor_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"maps"
	"net"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/agent/client"
	"github.com/stagelet/stagelet/agent/supervisor"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/logctx"
)

// toyRun: "cat" copies stdin to stdout, "sleep" waits for its end, "exit
// N" exits with N.
func toyRun(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) int32 {
	switch args[0] {
	case "cat":
		if stdin != nil {
			_, _ = io.Copy(stdout, stdin)
		}
	case "sleep":
		<-ctx.Done()
		return 137
	case "exit":
		return int32(len(args[1]))
	}
	return 0
}

// toyAgent is an agent over a Toy, served on in-memory streams; log
// (nil: none) receives its lines.
func toyAgent(t *testing.T, log io.Writer) (*supervisor.Toy, *client.Client) {
	t.Helper()
	h := slog.DiscardHandler
	if log != nil {
		h = slog.NewTextHandler(log, &slog.HandlerOptions{Level: slog.LevelDebug})
	}
	toy := &supervisor.Toy{Run: toyRun, Serve: func(port int32, conn net.Conn) {
		defer conn.Close()
		b, _ := io.ReadAll(conn)
		_, _ = conn.Write(bytes.ToUpper(b))
	}}
	a, err := supervisor.New(supervisor.Config{StateDir: t.TempDir(), Logger: slog.New(h), System: toy})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.StopAll(0) })
	return toy, client.NewClient(func(context.Context) (net.Conn, error) {
		mine, theirs := net.Pipe()
		go a.ServeConn(theirs)
		return mine, nil
	})
}

// TestToy: the agent's handling over the toy System, without root: a
// terminal, signals, sysctls checked as on Linux, a port-forward's
// half-close.
func TestToy(t *testing.T) {
	toy, c := toyAgent(t, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := c.Create(ctx, &api.AppSpec{ID: "a", Rootfs: t.TempDir(), Args: []string{"sleep"}}); err != nil {
		t.Fatal(err)
	}
	st, err := c.Start(ctx, "a")
	if err != nil || st.State != api.StateRunning || st.PID == 0 {
		t.Fatalf("start: %+v, %v", st, err)
	}
	if got := toy.Running(); len(got) != 1 || got[0] != "a" {
		t.Errorf("running %v", got)
	}

	// An exec on a terminal: its input echoes, its output is the terminal's.
	var out bytes.Buffer
	code, err := c.ExecStream(ctx, "a", []string{"cat"}, client.StreamIO{Stdin: strings.NewReader("hi\n"), Stdout: &out, TTY: true})
	if err != nil || code != 0 || !strings.Contains(out.String(), "hi") {
		t.Errorf("exec on a terminal: code %d, %v, output %q", code, err, out.String())
	}
	res, err := c.Exec(ctx, "a", []string{"exit", "abc"}, time.Second)
	if err != nil || res.ExitCode != 3 {
		t.Errorf("exec: %+v, %v", res, err)
	}

	if err := c.SetSysctls(ctx, map[string]string{"net.ipv4.ip_forward": "1"}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("a network sysctl: %v, want InvalidArgument", err)
	}
	want := map[string]string{"kernel.shmmax": "1000"}
	if err := c.SetSysctls(ctx, want); err != nil || !maps.Equal(toy.Sysctls(), want) {
		t.Errorf("IPC sysctls: %v, set %v", err, toy.Sysctls())
	}

	var back bytes.Buffer
	if err := c.PortForward(ctx, 80, struct {
		io.Reader
		io.Writer
	}{strings.NewReader("ping"), &back}); err != nil || back.String() != "PING" {
		t.Errorf("port-forward: %v, %q", err, back.String())
	}

	st, err = c.Stop(ctx, "a", time.Second)
	if err != nil || st.State != api.StateExited || st.ExitCode != 143 {
		t.Errorf("stop: %+v, %v (want exit 143, SIGTERM)", st, err)
	}
	if got := toy.Running(); len(got) != 0 {
		t.Errorf("running after stop: %v", got)
	}
	if _, err := c.Exec(ctx, "a", []string{"cat"}, time.Second); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Errorf("exec in an exited app: %v, want FailedPrecondition", err)
	}
}

// TestRequestIDInLog: the agent's lines of a request carry the ID of the
// CRI call the daemon's context names, and its refusals too.
func TestRequestIDInLog(t *testing.T) {
	var log lockedBuffer
	_, c := toyAgent(t, &log)
	ctx, cancel := context.WithTimeout(logctx.With(context.Background(), "req", "r-123"), 10*time.Second)
	defer cancel()
	if _, err := c.Create(ctx, &api.AppSpec{ID: "a", Rootfs: t.TempDir(), Args: []string{"sleep"}}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Create(ctx, &api.AppSpec{ID: "a", Rootfs: t.TempDir(), Args: []string{"sleep"}}); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Fatalf("second create: %v", err)
	}
	lines := strings.Split(log.String(), "\n")
	for _, msg := range []string{`msg="app created"`, `msg="request failed"`} {
		i := slices.IndexFunc(lines, func(l string) bool { return strings.Contains(l, msg) })
		if i < 0 || !strings.Contains(lines[i], "req=r-123") {
			t.Errorf("no line %s with req=r-123 in:\n%s", msg, log.String())
		}
	}
}
