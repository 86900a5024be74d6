// Package client is the daemon's side of the agent protocol (package
// api): Client makes the protocol's calls over one stream each, whatever
// transport a Dialer opens. It is the protocol client only: it knows
// nothing of stage1s, pods' host paths or the broker. What a backend adds
// around the calls (a container's host paths made reachable in the pod,
// the pod's own figures) is package stage1/podconn's.
package client

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/agent/transport"
	"github.com/stagelet/stagelet/agent/wire"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/logctx"
	"github.com/stagelet/stagelet/tracing"
)

// Dialer opens one stream to an agent.
type Dialer func(ctx context.Context) (net.Conn, error)

// UnixDialer dials the agent's unix socket at path, which may be longer
// than a socket address holds.
func UnixDialer(path string) Dialer {
	return func(ctx context.Context) (net.Conn, error) {
		return transport.DialUnix(ctx, path)
	}
}

// Client calls an agent. It is safe for concurrent use: every call is its
// own stream. What the agent answers is checked where it is decoded
// (vet.go): the client hands on nothing its bounds refuse.
type Client struct {
	dial      Dialer
	onRefusal Refused
}

// NewClient returns a client that opens streams with dial.
func NewClient(dial Dialer, opts ...Option) *Client {
	c := &Client{dial: dial}
	for _, o := range opts {
		o(c)
	}
	return c
}

// Call sends one request and returns the agent's response. Agent error codes
// come back as errdefs classes; a transport failure is ErrUnavailable, and
// so is an answer the client refuses (wrapping ErrUntrusted).
func (c *Client) Call(ctx context.Context, req *api.Request) (_ *api.Response, err error) {
	var call trace.SpanContext
	if traced(req.Op) {
		var span trace.Span
		ctx, span = tracing.Start(ctx, "agent."+req.Op)
		if req.ID != "" {
			span.SetAttributes(attribute.String("stagelet.app", req.ID))
		}
		defer func() { tracing.End(span, err) }()
		req.TraceParent = tracing.TraceParent(ctx)
		if req.TraceParent != "" {
			call = span.SpanContext()
		}
	}
	conn, resp, _, err := c.roundTrip(ctx, req, call)
	if conn != nil {
		conn.Close()
	}
	return resp, err
}

// traced tells whether a call to the agent is a span of its own: not
// Info, which a pod's start polls (its wait is the caller's span), and
// not the status path's reads.
func traced(op string) bool {
	switch op {
	case api.OpInfo, api.OpStatus, api.OpList, api.OpStats:
		return false
	}
	return true
}

// roundTrip opens a stream, sends req and reads the response. It returns
// the stream (nil when it failed before a response) and a reader of what
// follows the response on it. The stream's deadline is ctx's for the
// exchange and cleared after it. The request carries the ID of the CRI
// call ctx serves, for the agent's log lines. The response is at most
// maxResponse(req.Op) bytes and checked (vetResponse) before it is
// returned; the spans it carries are exported when they belong beneath
// call, the daemon's span of a traced and sampled call (zero otherwise),
// dropped otherwise.
func (c *Client) roundTrip(ctx context.Context, req *api.Request, call trace.SpanContext) (net.Conn, *api.Response, io.Reader, error) {
	if req.RequestID == "" {
		req.RequestID = logctx.Value(ctx, "req")
	}
	conn, err := c.dial(ctx)
	if err != nil {
		if ctx.Err() != nil {
			return nil, nil, nil, ended(ctx, req.Op+": dial")
		}
		return nil, nil, nil, errdefs.New(errdefs.ErrUnavailable, "agent: dial: %w", err)
	}
	if dl, ok := ctx.Deadline(); ok {
		conn.SetDeadline(dl)
	}
	stop := context.AfterFunc(ctx, func() { conn.SetDeadline(time.Unix(1, 0)) })
	fail := func(err error) (net.Conn, *api.Response, io.Reader, error) {
		stop()
		conn.Close()
		return nil, nil, nil, err
	}
	// Before the write: the agent may handle the request before this
	// goroutine runs again, and its spans must fit between sent and
	// received.
	sent := time.Now()
	if err := json.NewEncoder(conn).Encode(req); err != nil {
		if endedBy(ctx, err) {
			return fail(ended(ctx, req.Op))
		}
		return fail(errdefs.New(errdefs.ErrUnavailable, "agent: %s: send: %w", req.Op, err))
	}
	dec := json.NewDecoder(&capReader{r: conn, left: maxResponse(req.Op)})
	var resp api.Response
	if err := dec.Decode(&resp); err != nil {
		if errors.Is(err, errTooLarge) {
			return fail(c.refuse(req.Op, FieldResponse, ReasonSize, fmt.Sprintf("larger than %d bytes", maxResponse(req.Op))))
		}
		if endedBy(ctx, err) {
			return fail(ended(ctx, req.Op))
		}
		return fail(errdefs.New(errdefs.ErrUnavailable, "agent: %s: receive: %w", req.Op, err))
	}
	stop() // when ctx ended meanwhile, a session on the stream ends with it
	received := time.Now()
	// The agent's own spans of the call, beneath its span, on this
	// clock (a VM's may be off).
	for reason, n := range tracing.Import(tracing.Call{Span: call, Sent: sent, Received: received}, resp.Spans) {
		c.refused(FieldSpans, reason, n)
	}
	resp.Spans = nil
	if err := c.vetResponse(req, &resp, received); err != nil {
		return fail(err)
	}
	if resp.Code != api.CodeOK {
		conn.Close()
		return nil, &resp, nil, errdefs.New(wire.ClassOf(resp.Code), "%s", resp.Error)
	}
	conn.SetDeadline(time.Time{})
	return conn, &resp, io.MultiReader(dec.Buffered(), conn), nil
}

// endedBy reports whether err, of an exchange on a stream whose deadline
// is ctx's, is ctx's end: ctx is done, or the stream's deadline (set from
// ctx) passed, which its timer may tell before ctx's own does. Taking
// that for the agent being gone would have the broker declare a slow
// agent's pod gone.
func endedBy(ctx context.Context, err error) bool {
	return ctx.Err() != nil || errors.Is(err, os.ErrDeadlineExceeded)
}

// ended is the error of an exchange ctx ended: Canceled when the caller
// went away, DeadlineExceeded at its deadline.
func ended(ctx context.Context, op string) error {
	if errors.Is(ctx.Err(), context.Canceled) {
		return fmt.Errorf("agent: %s: %w", op, context.Canceled)
	}
	return errdefs.New(errdefs.ErrDeadlineExceeded, "agent: %s: %w", op, context.DeadlineExceeded)
}

// Info asks the agent who it is.
func (c *Client) Info(ctx context.Context) (*api.Info, error) {
	r, err := c.Call(ctx, &api.Request{Op: api.OpInfo})
	if err != nil {
		return nil, err
	}
	return r.Info, nil
}

// Create registers an app (not started).
func (c *Client) Create(ctx context.Context, spec *api.AppSpec) (*api.AppStatus, error) {
	r, err := c.Call(ctx, &api.Request{Op: api.OpCreate, ID: spec.ID, App: spec})
	if err != nil {
		return nil, err
	}
	return r.App, nil
}

// Start starts a created app.
func (c *Client) Start(ctx context.Context, id string) (*api.AppStatus, error) {
	r, err := c.Call(ctx, &api.Request{Op: api.OpStart, ID: id})
	if err != nil {
		return nil, err
	}
	return r.App, nil
}

// Stop sends SIGTERM, waits up to timeout, then SIGKILL; it returns once
// the app has exited.
func (c *Client) Stop(ctx context.Context, id string, timeout time.Duration) (*api.AppStatus, error) {
	r, err := c.Call(ctx, &api.Request{Op: api.OpStop, ID: id, Timeout: timeout})
	if err != nil {
		return nil, err
	}
	return r.App, nil
}

// Signal sends a signal to an app's process.
func (c *Client) Signal(ctx context.Context, id string, sig int) error {
	_, err := c.Call(ctx, &api.Request{Op: api.OpSignal, ID: id, Signal: sig})
	return err
}

// Remove forgets an app; idempotent.
func (c *Client) Remove(ctx context.Context, id string) error {
	_, err := c.Call(ctx, &api.Request{Op: api.OpRemove, ID: id})
	return err
}

// Status returns one app's status.
func (c *Client) Status(ctx context.Context, id string) (*api.AppStatus, error) {
	r, err := c.Call(ctx, &api.Request{Op: api.OpStatus, ID: id})
	if err != nil {
		return nil, err
	}
	return r.App, nil
}

// List returns every app's status.
func (c *Client) List(ctx context.Context) ([]*api.AppStatus, error) {
	r, err := c.Call(ctx, &api.Request{Op: api.OpList})
	if err != nil {
		return nil, err
	}
	return r.Apps, nil
}

// Exec runs cmd in an app's environment and waits for it (up to timeout, 0
// meaning no limit).
func (c *Client) Exec(ctx context.Context, id string, cmd []string, timeout time.Duration) (*api.ExecResult, error) {
	r, err := c.Call(ctx, &api.Request{Op: api.OpExec, ID: id, Cmd: cmd, Timeout: timeout})
	if err != nil {
		return nil, err
	}
	return r.Exec, nil
}

// ReopenLog reopens an app's log file (after the kubelet rotated it).
func (c *Client) ReopenLog(ctx context.Context, id string) error {
	_, err := c.Call(ctx, &api.Request{Op: api.OpReopenLog, ID: id})
	return err
}

// SetSysctls sets IPC sysctls in the pod's IPC namespace: InvalidArgument
// for a name the IPC namespace does not isolate.
func (c *Client) SetSysctls(ctx context.Context, sysctls map[string]string) error {
	_, err := c.Call(ctx, &api.Request{Op: api.OpSysctl, Sysctls: sysctls})
	return err
}

// Setup gives a guest restored from a template its identity: guest is its
// configuration as stagelet.* kernel parameters (GuestConfig.Cmdline),
// now the host's clock, seed entropy for its random number generator.
func (c *Client) Setup(ctx context.Context, guest []string, now time.Time, seed []byte) error {
	_, err := c.Call(ctx, &api.Request{Op: api.OpSetup, Guest: strings.Join(guest, " "), Time: now.UnixNano(), Seed: seed})
	return err
}

// Stats returns an app's usage, or the pod's for id "".
func (c *Client) Stats(ctx context.Context, id string) (*api.Stats, error) {
	r, err := c.Call(ctx, &api.Request{Op: api.OpStats, ID: id})
	if err != nil {
		return nil, err
	}
	return r.Stats, nil
}

// Shutdown stops every app (SIGTERM, timeout, SIGKILL) and ends the agent.
func (c *Client) Shutdown(ctx context.Context, timeout time.Duration) error {
	_, err := c.Call(ctx, &api.Request{Op: api.OpShutdown, Timeout: timeout})
	return err
}

// Update changes a created or running app's limits (zero fields stay):
// NotFound, InvalidArgument, FailedPrecondition.
func (c *Client) Update(ctx context.Context, id string, r api.Resources) (*api.AppStatus, error) {
	resp, err := c.Call(ctx, &api.Request{Op: api.OpUpdate, ID: id, Resources: &r})
	if err != nil {
		return nil, err
	}
	return resp.App, nil
}

// Watch subscribes to the agent's app events (OpEvents): snapshot is
// called once with every app, then event with each change after it, in
// order, on the caller's goroutine, until ctx ends (Watch returns nil) or
// the stream does: ErrUnavailable when the agent went away or dropped the
// subscription because it was read too slowly (subscribe again), the
// agent's error otherwise (InvalidArgument from an agent that has no
// events).
func (c *Client) Watch(ctx context.Context, snapshot func([]*api.AppStatus), event func(*api.Event)) error {
	conn, resp, rd, err := c.roundTrip(ctx, &api.Request{Op: api.OpEvents}, trace.SpanContext{})
	if err != nil {
		return err
	}
	defer conn.Close()
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	defer stop()
	snapshot(resp.Apps)
	in := &capReader{r: rd}
	dec := json.NewDecoder(in)
	budget := newEventBudget(time.Now())
	for {
		var ev api.Event
		in.left = MaxEvent
		if err := dec.Decode(&ev); err != nil {
			if ctx.Err() != nil {
				return nil
			}
			if errors.Is(err, errTooLarge) {
				return c.refuse(api.OpEvents, FieldEvent, ReasonSize, fmt.Sprintf("an event larger than %d bytes", MaxEvent))
			}
			return errdefs.New(errdefs.ErrUnavailable, "agent: events: %w", err)
		}
		if ev.App == nil {
			c.refused(FieldEvent, ReasonMissing, 1)
			return fmt.Errorf("agent: events: an event without an app: %w", errdefs.ErrUnavailable)
		}
		if wait := budget.take(time.Now()); wait > 0 {
			c.refused(FieldEvents, ReasonRate, 1)
			if !sleep(ctx, wait) {
				return nil
			}
		}
		if c.vetEvent(&ev, time.Now()) {
			event(&ev)
		}
	}
}

// sleep waits d or until ctx ends: false when it did.
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// StreamIO are the streams of an exec or attach session. Nil streams are
// not used: without Stdin no input is sent, without Stdout or Stderr that
// output is not asked for.
type StreamIO struct {
	Stdin  io.Reader
	Stdout io.Writer
	Stderr io.Writer
	// TTY: the exec'd command runs on a terminal (its output comes on
	// Stdout); for attach, the app's own setting decides.
	TTY bool
	// Resize delivers terminal sizes; nil means none.
	Resize <-chan api.TerminalSize
}

func (s *StreamIO) stdio() *api.Stdio {
	return &api.Stdio{Stdin: s.Stdin != nil, Stdout: s.Stdout != nil, Stderr: s.Stderr != nil, TTY: s.TTY}
}

// ExecStream runs cmd in a running app with its stdio connected to sio
// and returns its exit code once it exited and its output was copied.
// Stdin is read until it ends (its end is passed on: a terminal gets its
// end-of-file character); the caller unblocks a pending read by closing
// it after the call. Ending ctx ends the session, and the agent kills the
// command. NotFound, InvalidArgument, FailedPrecondition (the app does not
// run, the command cannot be executed), ErrUnavailable (the agent went
// away).
func (c *Client) ExecStream(ctx context.Context, id string, cmd []string, sio StreamIO) (int32, error) {
	end, err := c.session(ctx, &api.Request{Op: api.OpExecStream, ID: id, Cmd: cmd, Stdio: sio.stdio()}, &sio)
	if err != nil {
		return 0, err
	}
	return end.ExitCode, nil
}

// Attach connects sio to a running app's stdio until the app exits (and
// its output was copied), Stdin ends (the client detaches; an app with
// StdinOnce and no terminal then has its stdin closed and the session
// lasts until it exits) or ctx ends (detaching). NotFound,
// FailedPrecondition (not running), ErrUnavailable.
func (c *Client) Attach(ctx context.Context, id string, sio StreamIO) error {
	_, err := c.session(ctx, &api.Request{Op: api.OpAttach, ID: id, Stdio: sio.stdio()}, &sio)
	return err
}

// session runs an exec or attach session and returns how it ended.
func (c *Client) session(ctx context.Context, req *api.Request, sio *StreamIO) (*api.SessionEnd, error) {
	conn, _, in, err := c.roundTrip(ctx, req, trace.SpanContext{})
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	defer stop()
	fw := wire.NewWriter(conn)
	done := make(chan struct{})
	defer close(done)
	if sio.Stdin != nil {
		go func() {
			_, _ = io.Copy(fw.Stream(api.FrameStdin), sio.Stdin)
			_ = fw.Send(api.FrameEOF, nil)
		}()
	}
	if sio.Resize != nil {
		go func() {
			for {
				select {
				case size, ok := <-sio.Resize:
					if !ok {
						return
					}
					if fw.SendJSON(api.FrameResize, size) != nil {
						return
					}
				case <-done:
					return
				}
			}
		}()
	}
	fr := wire.NewReader(in)
	for {
		typ, p, err := fr.Next()
		if err != nil {
			if ctx.Err() != nil {
				return nil, fmt.Errorf("agent: %s: %w", req.Op, ctx.Err())
			}
			return nil, errdefs.New(errdefs.ErrUnavailable, "agent: %s: session: %w", req.Op, err)
		}
		var w io.Writer
		switch typ {
		case api.FrameStdout:
			w = sio.Stdout
		case api.FrameStderr:
			w = sio.Stderr
		case api.FrameEnd:
			var end api.SessionEnd
			if err := json.Unmarshal(p, &end); err != nil {
				return nil, errdefs.New(errdefs.ErrUnavailable, "agent: %s: bad end of session: %w", req.Op, err)
			}
			c.vetSessionEnd(&end)
			if end.Code != api.CodeOK {
				return &end, errdefs.New(wire.ClassOf(end.Code), "%s", end.Error)
			}
			return &end, nil
		}
		if w != nil {
			if _, err := w.Write(p); err != nil {
				return nil, fmt.Errorf("agent: %s: client stream: %w", req.Op, err)
			}
		}
	}
}

// PortForwardLinger is how long a port-forward waits for the pod's side to
// finish once the client's side ended (as socat and containerd do): a
// server that never answers a half-closed connection does not hold the
// session forever.
const PortForwardLinger = 5 * time.Second

// PortForward connects stream to TCP port on the loopback of the pod's
// network namespace, dialled by the agent inside the pod, and copies
// bytes both ways until the pod's side ends (then the caller closes
// stream), or the client's side ended and the pod's side followed within
// PortForwardLinger, or ctx ends. InvalidArgument (bad port),
// FailedPrecondition (nothing accepts connections on the port),
// ErrUnavailable.
func (c *Client) PortForward(ctx context.Context, port int32, stream io.ReadWriter) error {
	req := &api.Request{Op: api.OpPortForward, Port: port}
	conn, _, in, err := c.roundTrip(ctx, req, trace.SpanContext{})
	if err != nil {
		return err
	}
	defer conn.Close()
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	defer stop()
	fw := wire.NewWriter(conn)
	up := make(chan struct{})
	go func() {
		defer close(up)
		_, _ = io.Copy(fw.Stream(api.FrameData), stream)
		_ = fw.Send(api.FrameEOF, nil)
	}()
	down := make(chan error, 1)
	go func() {
		fr := wire.NewReader(in)
		for {
			typ, p, err := fr.Next()
			if err != nil {
				if ctx.Err() != nil {
					err = ctx.Err()
				} else {
					err = errdefs.New(errdefs.ErrUnavailable, "session: %w", err)
				}
				down <- fmt.Errorf("agent: %s: %w", req.Op, err)
				return
			}
			switch typ {
			case api.FrameData:
				if _, err := stream.Write(p); err != nil {
					down <- fmt.Errorf("agent: %s: client stream: %w", req.Op, err)
					return
				}
			case api.FrameEOF:
				down <- nil
				return
			}
		}
	}()
	select {
	case err := <-down:
		return err
	case <-up:
	}
	t := time.NewTimer(PortForwardLinger)
	defer t.Stop()
	select {
	case err := <-down:
		return err
	case <-t.C:
		return nil
	}
}
