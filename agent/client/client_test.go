package client_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/agent/client"
	"github.com/stagelet/stagelet/agent/supervisor"
	"github.com/stagelet/stagelet/agent/transport"
	"github.com/stagelet/stagelet/agent/wire"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/logctx"
)

// The client is tested against the agent itself (supervisor.Agent over
// its Toy System: the agent's request handling, with goroutines for
// processes), served on a unix socket or a socketpair, and against peers
// that misbehave on purpose.

// toyRun is the toy System's command line: "cat" copies stdin to stdout,
// "ready" writes "ready" and waits to be killed, "sleep" waits to be
// killed, "exit S" exits with the length of S.
func toyRun(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) int32 {
	switch args[0] {
	case "cat":
		if stdin != nil {
			_, _ = io.Copy(stdout, stdin)
		}
	case "ready":
		_, _ = io.WriteString(stdout, "ready")
		<-ctx.Done()
		return 137
	case "sleep":
		<-ctx.Done()
		return 137
	case "exit":
		return int32(len(args[1]))
	}
	return 0
}

// newAgent returns an agent over a Toy System, not served yet; its apps
// are stopped when the test ends.
func newAgent(t *testing.T) *supervisor.Agent {
	t.Helper()
	toy := &supervisor.Toy{Run: toyRun, Serve: func(port int32, conn net.Conn) {
		defer conn.Close()
		b, _ := io.ReadAll(conn)
		_, _ = conn.Write(bytes.ToUpper(b))
	}}
	a, err := supervisor.New(supervisor.Config{StateDir: t.TempDir(), Logger: slog.New(slog.DiscardHandler), System: toy})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		a.StopAll(0)
		a.Close()
	})
	return a
}

// serveUnix serves a on a unix socket at sock, as a pod's agent listens,
// until the test ends; the channel is closed once Serve returned (its
// listener closed).
func serveUnix(t *testing.T, a *supervisor.Agent, sock string) <-chan struct{} {
	t.Helper()
	l, err := transport.ListenUnix(sock)
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan struct{})
	var serr error
	go func() {
		defer close(served)
		serr = a.Serve(l)
	}()
	t.Cleanup(func() {
		a.Close()
		<-served
		if serr != nil {
			t.Errorf("serve: %v", serr)
		}
	})
	return served
}

// unixAgent is an agent served on a unix socket in the test's directory,
// and a client that dials it.
func unixAgent(t *testing.T) (*supervisor.Agent, *client.Client) {
	t.Helper()
	a := newAgent(t)
	sock := filepath.Join(t.TempDir(), "agent.sock")
	serveUnix(t, a, sock)
	return a, client.NewClient(client.UnixDialer(sock))
}

// socketpair returns the two ends of a connected unix stream socket.
func socketpair() (net.Conn, net.Conn, error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, nil, err
	}
	var ends [2]net.Conn
	for i, fd := range fds {
		f := os.NewFile(uintptr(fd), "socketpair")
		ends[i], err = net.FileConn(f)
		f.Close()
		if err != nil {
			if i == 1 {
				ends[0].Close()
			} else {
				unix.Close(fds[1])
			}
			return nil, nil, err
		}
	}
	return ends[0], ends[1], nil
}

// pairDialer opens every stream as a socketpair whose other end a's
// ServeConn answers; dialled (if not nil) gets the agent's end.
func pairDialer(a *supervisor.Agent, dialled func(agentEnd net.Conn)) client.Dialer {
	return func(context.Context) (net.Conn, error) {
		mine, theirs, err := socketpair()
		if err != nil {
			return nil, err
		}
		if dialled != nil {
			dialled(theirs)
		}
		go a.ServeConn(theirs)
		return mine, nil
	}
}

// peer is a client whose every stream is a socketpair whose other end
// serve answers, given the request it read: an agent that behaves as
// serve says.
func peer(serve func(c net.Conn, in io.Reader, req *api.Request)) *client.Client {
	return client.NewClient(func(context.Context) (net.Conn, error) {
		mine, theirs, err := socketpair()
		if err != nil {
			return nil, err
		}
		go func() {
			defer theirs.Close()
			dec := json.NewDecoder(theirs)
			var req api.Request
			if dec.Decode(&req) != nil {
				return
			}
			serve(theirs, io.MultiReader(dec.Buffered(), theirs), &req)
		}()
		return mine, nil
	})
}

// testContext bounds what a test waits for: no step of these tests takes
// more than a fraction of it, so a hang fails the test instead of
// holding it until go test's timeout.
func testContext(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// app is the spec of an app running args, with a rootfs of its own.
func app(t *testing.T, id string, args ...string) *api.AppSpec {
	return &api.AppSpec{ID: id, Rootfs: t.TempDir(), Args: args}
}

// TestConnect: a client reaches an agent on its unix socket, also at a
// path longer than a socket address holds, and learns who it is.
func TestConnect(t *testing.T) {
	for _, tc := range []struct {
		name string
		dir  func(t *testing.T) string
	}{
		{"short path", func(t *testing.T) string { return t.TempDir() }},
		{"long path", func(t *testing.T) string {
			d := filepath.Join(t.TempDir(), strings.Repeat("d", 110))
			if err := os.Mkdir(d, 0o700); err != nil {
				t.Fatal(err)
			}
			return d
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := testContext(t)
			sock := filepath.Join(tc.dir(t), "agent.sock")
			serveUnix(t, newAgent(t), sock)
			info, err := client.NewClient(client.UnixDialer(sock)).Info(ctx)
			if err != nil {
				t.Fatalf("info at %s (%d bytes): %v", sock, len(sock), err)
			}
			if info.Version != api.Version || info.PID != os.Getpid() || info.Kernel != "toy" || info.StartedAt.IsZero() {
				t.Errorf("info %+v", info)
			}
		})
	}
}

// TestRoundTrip: an app's life through the client's calls, each a
// request and its response on a stream of its own, the answers decoded
// into what the calls return.
func TestRoundTrip(t *testing.T) {
	ctx := testContext(t)
	_, c := unixAgent(t)
	spec := app(t, "a", "sleep")
	st, err := c.Create(ctx, spec)
	if err != nil || st.ID != "a" || st.State != api.StateCreated || st.CreatedAt.IsZero() {
		t.Fatalf("create: %+v, %v", st, err)
	}
	if st, err = c.Start(ctx, "a"); err != nil || st.State != api.StateRunning || st.PID == 0 {
		t.Fatalf("start: %+v, %v", st, err)
	}
	if got, err := c.Status(ctx, "a"); err != nil || got.State != api.StateRunning || got.PID != st.PID {
		t.Errorf("status: %+v, %v (started as %+v)", got, err, st)
	}
	if apps, err := c.List(ctx); err != nil || len(apps) != 1 || apps[0].ID != "a" {
		t.Errorf("list: %+v, %v", apps, err)
	}
	if res, err := c.Exec(ctx, "a", []string{"exit", "four"}, time.Minute); err != nil || res.ExitCode != 4 || res.TimedOut {
		t.Errorf("exec: %+v, %v", res, err)
	}
	var out bytes.Buffer
	code, err := c.ExecStream(ctx, "a", []string{"cat"}, client.StreamIO{Stdin: strings.NewReader("round trip"), Stdout: &out})
	if err != nil || code != 0 || out.String() != "round trip" {
		t.Errorf("exec stream: %d, %v, output %q", code, err, out.String())
	}
	var back bytes.Buffer
	if err := c.PortForward(ctx, 80, struct {
		io.Reader
		io.Writer
	}{strings.NewReader("ping"), &back}); err != nil || back.String() != "PING" {
		t.Errorf("port-forward: %v, %q", err, back.String())
	}
	if s, err := c.Stats(ctx, "a"); err != nil || s.Pids != 1 || s.Timestamp.IsZero() {
		t.Errorf("stats: %+v, %v", s, err)
	}
	if st, err := c.Update(ctx, "a", api.Resources{CPUShares: 512}); err != nil || st.ID != "a" {
		t.Errorf("update: %+v, %v", st, err)
	}
	if st, err = c.Stop(ctx, "a", time.Second); err != nil || st.State != api.StateExited || st.FinishedAt.IsZero() {
		t.Errorf("stop: %+v, %v", st, err)
	}
	for range 2 { // idempotent
		if err := c.Remove(ctx, "a"); err != nil {
			t.Errorf("remove: %v", err)
		}
	}
	if apps, err := c.List(ctx); err != nil || len(apps) != 0 {
		t.Errorf("list after remove: %+v, %v", apps, err)
	}
	if err := c.Shutdown(ctx, time.Second); err != nil {
		t.Errorf("shutdown: %v", err)
	}
}

// TestRequestCarriesCallID: a request carries the ID of the CRI call its
// context serves, unless the caller set one.
func TestRequestCarriesCallID(t *testing.T) {
	ctx := testContext(t)
	got := make(chan *api.Request, 2)
	c := peer(func(c net.Conn, _ io.Reader, req *api.Request) {
		got <- req
		_ = json.NewEncoder(c).Encode(&api.Response{Info: &api.Info{Version: api.Version, PID: 1}})
	})
	if _, err := c.Info(logctx.With(ctx, "req", "r-1")); err != nil {
		t.Fatal(err)
	}
	if req := <-got; req.Op != api.OpInfo || req.RequestID != "r-1" {
		t.Errorf("request %+v, want op info with ID r-1", req)
	}
	if _, err := c.Call(logctx.With(ctx, "req", "r-1"), &api.Request{Op: api.OpList, RequestID: "own"}); err != nil {
		t.Fatal(err)
	}
	if req := <-got; req.RequestID != "own" {
		t.Errorf("request %+v, want the caller's ID kept", req)
	}
}

// TestErrorClasses: what the agent refuses comes back of the class the
// agent gave it, with the agent's words, for calls and for sessions the
// agent does not open.
func TestErrorClasses(t *testing.T) {
	ctx := testContext(t)
	_, c := unixAgent(t)
	if _, err := c.Create(ctx, app(t, "running", "sleep")); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Start(ctx, "running"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Create(ctx, app(t, "created", "sleep")); err != nil {
		t.Fatal(err)
	}
	again := app(t, "running", "sleep")
	for _, tc := range []struct {
		name  string
		call  func() error
		class error
		text  string
	}{
		{"status of an unknown app", func() error { _, err := c.Status(ctx, "nope"); return err }, errdefs.ErrNotFound, `app "nope" not found`},
		{"create twice", func() error { _, err := c.Create(ctx, again); return err }, errdefs.ErrAlreadyExists, `app "running" already exists`},
		{"create without a rootfs", func() error { _, err := c.Create(ctx, &api.AppSpec{ID: "x", Args: []string{"sleep"}}); return err }, errdefs.ErrInvalidArgument, "no rootfs"},
		{"unknown operation", func() error { _, err := c.Call(ctx, &api.Request{Op: "frobnicate"}); return err }, errdefs.ErrInvalidArgument, `unknown operation "frobnicate"`},
		{"start a running app", func() error { _, err := c.Start(ctx, "running"); return err }, errdefs.ErrFailedPrecondition, "app running is running"},
		{"setup of an agent that awaits none", func() error { return c.Setup(ctx, nil, time.Now(), nil) }, errdefs.ErrFailedPrecondition, "awaits no setup"},
		{"network sysctl", func() error { return c.SetSysctls(ctx, map[string]string{"net.ipv4.ip_forward": "1"}) }, errdefs.ErrInvalidArgument, "net.ipv4.ip_forward"},
		{"exec session in an unknown app", func() error {
			_, err := c.ExecStream(ctx, "nope", []string{"cat"}, client.StreamIO{})
			return err
		}, errdefs.ErrNotFound, `app "nope" not found`},
		{"attach to an app not started", func() error { return c.Attach(ctx, "created", client.StreamIO{Stdout: io.Discard}) }, errdefs.ErrFailedPrecondition, "app created is not running"},
		{"port-forward to a bad port", func() error { return c.PortForward(ctx, 70000, struct{ io.ReadWriter }{}) }, errdefs.ErrInvalidArgument, "bad port 70000"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.call()
			if err == nil || !errors.Is(err, tc.class) || !strings.Contains(err.Error(), tc.text) {
				t.Errorf("%v, want %v saying %q", err, tc.class, tc.text)
			}
			if errors.Is(err, errdefs.ErrUnavailable) {
				t.Errorf("%v: a refusal reads as the agent gone", err)
			}
		})
	}
}

// TestUnknownCodeUnclassed: an error code the client does not know (an
// agent newer than the daemon) or Internal is an error of no class, with
// the agent's words, never a success.
func TestUnknownCodeUnclassed(t *testing.T) {
	ctx := testContext(t)
	for _, code := range []string{api.CodeInternal, "Unauthenticated"} {
		c := peer(func(c net.Conn, _ io.Reader, _ *api.Request) {
			_ = json.NewEncoder(c).Encode(&api.Response{Code: code, Error: "it broke"})
		})
		resp, err := c.Call(ctx, &api.Request{Op: api.OpInfo})
		if err == nil || err.Error() != "it broke" || resp == nil || resp.Code != code {
			t.Errorf("code %s: %+v, %v", code, resp, err)
		}
		for _, class := range []error{errdefs.ErrNotFound, errdefs.ErrAlreadyExists, errdefs.ErrInvalidArgument,
			errdefs.ErrFailedPrecondition, errdefs.ErrPermissionDenied, errdefs.ErrUnavailable,
			errdefs.ErrUnimplemented, errdefs.ErrDeadlineExceeded} {
			if errors.Is(err, class) {
				t.Errorf("code %s: %v is %v", code, err, class)
			}
		}
	}
}

// TestSessionEndCarriesClass: a session the agent ends with an error
// (SessionEnd's code) returns that error's class.
func TestSessionEndCarriesClass(t *testing.T) {
	ctx := testContext(t)
	c := peer(func(c net.Conn, _ io.Reader, _ *api.Request) {
		_ = json.NewEncoder(c).Encode(&api.Response{})
		fw := wire.NewWriter(c)
		_ = fw.Send(api.FrameStdout, []byte("partial"))
		_ = fw.SendJSON(api.FrameEnd, api.SessionEnd{Code: api.CodeFailedPrecondition, Error: "the app exited"})
	})
	var out bytes.Buffer
	_, err := c.ExecStream(ctx, "a", []string{"cat"}, client.StreamIO{Stdout: &out})
	if !errors.Is(err, errdefs.ErrFailedPrecondition) || err.Error() != "the app exited" || out.String() != "partial" {
		t.Errorf("exec: %v, output %q", err, out.String())
	}
}

// watcher runs Watch on its own goroutine and hands over what it gets.
type watcher struct {
	snapshot chan []*api.AppStatus
	events   chan *api.Event
	done     chan error
}

func watch(ctx context.Context, c *client.Client) *watcher {
	w := &watcher{snapshot: make(chan []*api.AppStatus, 1), events: make(chan *api.Event, 64), done: make(chan error, 1)}
	go func() {
		w.done <- c.Watch(ctx, func(apps []*api.AppStatus) { w.snapshot <- apps }, func(ev *api.Event) { w.events <- ev })
	}()
	return w
}

// next waits for the next event.
func (w *watcher) next(t *testing.T, ctx context.Context) *api.Event {
	t.Helper()
	select {
	case ev := <-w.events:
		return ev
	case err := <-w.done:
		t.Fatalf("watch ended before the event: %v", err)
	case <-ctx.Done():
		t.Fatal("no event")
	}
	return nil
}

// end waits for Watch to return.
func (w *watcher) end(t *testing.T, ctx context.Context) error {
	t.Helper()
	select {
	case err := <-w.done:
		return err
	case <-ctx.Done():
		t.Fatal("watch did not return")
	}
	return nil
}

// TestWatch: a subscription gets every app, then each change after it
// in order, until its context ends (Watch then returns nil).
func TestWatch(t *testing.T) {
	ctx := testContext(t)
	_, c := unixAgent(t)
	if _, err := c.Create(ctx, app(t, "a", "sleep")); err != nil {
		t.Fatal(err)
	}
	wctx, stop := context.WithCancel(ctx)
	w := watch(wctx, c)
	select {
	case apps := <-w.snapshot:
		if len(apps) != 1 || apps[0].ID != "a" || apps[0].State != api.StateCreated {
			t.Errorf("snapshot %+v", apps)
		}
	case err := <-w.done:
		t.Fatalf("watch: %v", err)
	case <-ctx.Done():
		t.Fatal("no snapshot")
	}
	if _, err := c.Create(ctx, app(t, "b", "exit", "xy")); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Start(ctx, "b"); err != nil {
		t.Fatal(err)
	}
	want := []struct{ typ, id, state string }{
		{api.EventCreated, "b", api.StateCreated},
		{api.EventStarted, "b", api.StateRunning},
		{api.EventExited, "b", api.StateExited},
	}
	for _, exp := range want {
		ev := w.next(t, ctx)
		if ev.Type != exp.typ || ev.App.ID != exp.id || ev.App.State != exp.state || ev.Time.IsZero() {
			t.Errorf("event %s %+v, want %s of %s (%s)", ev.Type, ev.App, exp.typ, exp.id, exp.state)
		}
		if ev.Type == api.EventExited && ev.App.ExitCode != 2 {
			t.Errorf("exit event %+v, want exit code 2", ev.App)
		}
	}
	if err := c.Remove(ctx, "b"); err != nil {
		t.Fatal(err)
	}
	if ev := w.next(t, ctx); ev.Type != api.EventRemoved || ev.App.ID != "b" {
		t.Errorf("event %s %+v, want b removed", ev.Type, ev.App)
	}
	stop()
	if err := w.end(t, ctx); err != nil {
		t.Errorf("watch whose context ended: %v, want nil", err)
	}
}

// TestWatchRefused: an agent that has no events refuses the subscription
// (InvalidArgument) before any snapshot; a stream that breaks the
// protocol ends it as the agent gone.
func TestWatchRefused(t *testing.T) {
	ctx := testContext(t)
	for _, tc := range []struct {
		name  string
		serve func(c net.Conn)
		class error
	}{
		{"no events", func(c net.Conn) {
			_ = json.NewEncoder(c).Encode(wire.ErrorResponse(errdefs.InvalidArgument("unknown operation %q", api.OpEvents)))
		}, errdefs.ErrInvalidArgument},
		{"event without an app", func(c net.Conn) {
			enc := json.NewEncoder(c)
			_ = enc.Encode(&api.Response{})
			_ = enc.Encode(&api.Event{Type: api.EventStarted})
		}, errdefs.ErrUnavailable},
		{"not JSON", func(c net.Conn) {
			_ = json.NewEncoder(c).Encode(&api.Response{})
			_, _ = io.WriteString(c, "}{")
		}, errdefs.ErrUnavailable},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := peer(func(c net.Conn, in io.Reader, req *api.Request) {
				if req.Op != api.OpEvents {
					return
				}
				tc.serve(c)
				_, _ = io.Copy(io.Discard, in) // until the client closes
			})
			snapshots := 0
			err := c.Watch(ctx, func([]*api.AppStatus) { snapshots++ }, func(ev *api.Event) { t.Errorf("event %+v", ev) })
			if !errors.Is(err, tc.class) {
				t.Errorf("watch: %v, want %v", err, tc.class)
			}
			want := 1
			if tc.class == errdefs.ErrInvalidArgument {
				want = 0
			}
			if snapshots != want {
				t.Errorf("%d snapshots, want %d", snapshots, want)
			}
		})
	}
}

// TestPeerGoesAway: when the agent goes, or never was, a call fails
// promptly with ErrUnavailable, long before its context ends; a call
// whose context is cancelled while the agent is silent returns at once.
func TestPeerGoesAway(t *testing.T) {
	ctx := testContext(t)
	prompt := func(t *testing.T, err error, want error) {
		t.Helper()
		if !errors.Is(err, want) {
			t.Errorf("%v, want %v", err, want)
		}
		if ctx.Err() != nil {
			t.Errorf("%v came only when the test's context ended", err)
		}
	}

	t.Run("no agent on the socket", func(t *testing.T) {
		c := client.NewClient(client.UnixDialer(filepath.Join(t.TempDir(), "agent.sock")))
		_, err := c.Info(ctx)
		prompt(t, err, errdefs.ErrUnavailable)
	})

	t.Run("agent stopped serving", func(t *testing.T) {
		a := newAgent(t)
		sock := filepath.Join(t.TempDir(), "agent.sock")
		served := serveUnix(t, a, sock)
		c := client.NewClient(client.UnixDialer(sock))
		if _, err := c.Info(ctx); err != nil {
			t.Fatal(err)
		}
		if err := c.Shutdown(ctx, 0); err != nil {
			t.Fatal(err)
		}
		select {
		case <-served:
		case <-ctx.Done():
			t.Fatal("the agent did not stop serving after its shutdown")
		}
		_, err := c.Info(ctx)
		prompt(t, err, errdefs.ErrUnavailable)
	})

	t.Run("agent closes before it answers", func(t *testing.T) {
		c := peer(func(net.Conn, io.Reader, *api.Request) {})
		_, err := c.Status(ctx, "a")
		prompt(t, err, errdefs.ErrUnavailable)
	})

	t.Run("agent answers half a response", func(t *testing.T) {
		c := peer(func(c net.Conn, _ io.Reader, _ *api.Request) { _, _ = io.WriteString(c, `{"app":{"id":`) })
		_, err := c.Status(ctx, "a")
		prompt(t, err, errdefs.ErrUnavailable)
	})

	t.Run("silent agent, context cancelled", func(t *testing.T) {
		read := make(chan struct{})
		c := peer(func(_ net.Conn, in io.Reader, _ *api.Request) {
			close(read)
			_, _ = io.Copy(io.Discard, in) // answers nothing, until the client closes
		})
		cctx, cancel := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() {
			_, err := c.Status(cctx, "a")
			done <- err
		}()
		select {
		case <-read:
		case <-ctx.Done():
			t.Fatal("the request did not come")
		}
		cancel()
		select {
		case err := <-done:
			// A cancelled call is Canceled (the caller went away),
			// neither the agent's fault nor a deadline.
			if !errors.Is(err, context.Canceled) || errors.Is(err, errdefs.ErrDeadlineExceeded) || errors.Is(err, errdefs.ErrUnavailable) {
				t.Fatalf("a call whose context was cancelled: %v, want Canceled", err)
			}
		case <-ctx.Done():
			t.Fatal("the call did not return once its context was cancelled")
		}
	})

	t.Run("agent goes during a session", func(t *testing.T) {
		a := newAgent(t)
		c := client.NewClient(pairDialer(a, nil))
		if _, err := c.Create(ctx, app(t, "a", "sleep")); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Start(ctx, "a"); err != nil {
			t.Fatal(err)
		}
		ends := make(chan net.Conn, 1)
		sc := client.NewClient(pairDialer(a, func(agentEnd net.Conn) { ends <- agentEnd }))
		running := &signalWriter{c: make(chan struct{})}
		done := make(chan error, 1)
		go func() {
			_, err := sc.ExecStream(ctx, "a", []string{"ready"}, client.StreamIO{Stdout: running})
			done <- err
		}()
		agentEnd := <-ends
		select {
		case <-running.c:
		case err := <-done:
			t.Fatalf("exec ended before the agent went: %v", err)
		case <-ctx.Done():
			t.Fatal("the exec did not start")
		}
		agentEnd.Close()
		select {
		case err := <-done:
			prompt(t, err, errdefs.ErrUnavailable)
		case <-ctx.Done():
			t.Fatal("the exec did not return after the agent went")
		}
	})

	t.Run("agent goes during a subscription", func(t *testing.T) {
		a, c := unixAgent(t)
		w := watch(ctx, c)
		select {
		case <-w.snapshot:
		case err := <-w.done:
			t.Fatalf("watch: %v", err)
		case <-ctx.Done():
			t.Fatal("no snapshot")
		}
		a.Close()
		prompt(t, w.end(t, ctx), errdefs.ErrUnavailable)
	})
}

// TestCallDeadline: a call whose context's deadline passes before the
// agent answers returns then, as DeadlineExceeded: the agent is slow,
// not gone (the broker takes ErrUnavailable for an agent gone, and a pod
// whose agent is gone for a pod gone).
func TestCallDeadline(t *testing.T) {
	ctx := testContext(t)
	c := peer(func(_ net.Conn, in io.Reader, _ *api.Request) {
		_, _ = io.Copy(io.Discard, in) // answers nothing, until the client closes
	})
	for range 20 {
		cctx, cancel := context.WithTimeout(ctx, 5*time.Millisecond)
		_, err := c.Status(cctx, "a")
		cancel()
		if ctx.Err() != nil {
			t.Fatal("the call did not return at its deadline")
		}
		// The stream's deadline is the context's, and its timer may
		// fire first: still the deadline, never the agent gone.
		if !errors.Is(err, errdefs.ErrDeadlineExceeded) {
			t.Fatalf("a call past its deadline: %v, want DeadlineExceeded", err)
		}
	}
}

// signalWriter closes c at its first write.
type signalWriter struct {
	c    chan struct{}
	once sync.Once
}

func (w *signalWriter) Write(p []byte) (int, error) {
	w.once.Do(func() { close(w.c) })
	return len(p), nil
}
