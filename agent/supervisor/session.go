package supervisor

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"sync"
	"syscall"
	"time"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/agent/wire"
	"github.com/stagelet/stagelet/errdefs"
)

// Sessions: exec with streamed stdio, attach, port-forward (see package
// api for the frames). Each is opened by its request, which checks what it
// asks and takes what it needs; an error is the response. Once opened,
// the agent answers OK and serves frames until the session ends.

const (
	// sessionWriteTimeout bounds one write of an app's output to an
	// attach session: a client that reads nothing for this long is
	// detached, so that it never holds up the app, whose output also goes
	// to its log.
	sessionWriteTimeout = 10 * time.Second
	// dialTimeout bounds connecting to a forwarded port.
	dialTimeout = 10 * time.Second
)

// sessionRunner serves an opened session's frames.
type sessionRunner func(fw *wire.Writer, fr *wire.Reader)

func isSession(op string) bool {
	switch op {
	case api.OpExecStream, api.OpAttach, api.OpPortForward, api.OpLogs:
		return true
	}
	return false
}

// serveSession opens the session req asks for on c (in reads c, with what
// the request decoder had buffered), answers, and serves its frames.
func (a *Agent) serveSession(c net.Conn, in io.Reader, req *api.Request) {
	ctx := requestContext(req)
	var run sessionRunner
	var err error
	switch req.Op {
	case api.OpExecStream:
		run, err = a.openExec(ctx, req)
	case api.OpAttach:
		run, err = a.openAttach(ctx, req)
	case api.OpPortForward:
		run, err = a.openPortForward(ctx, req)
	case api.OpLogs:
		run, err = a.openLogs(ctx, req)
	}
	if err != nil {
		resp := wire.ErrorResponse(err)
		lvl := slog.LevelDebug
		if resp.Code == api.CodeInternal {
			lvl = slog.LevelWarn
		}
		a.log.Log(ctx, lvl, "session refused", "op", req.Op, "app", req.ID, "code", resp.Code, "err", err)
		if err := json.NewEncoder(c).Encode(resp); err != nil {
			a.log.DebugContext(ctx, "reply", "op", req.Op, "err", err)
		}
		return
	}
	if err := json.NewEncoder(c).Encode(&api.Response{}); err != nil {
		// The session still runs: it finds the client gone and ends.
		a.log.DebugContext(ctx, "reply", "op", req.Op, "err", err)
	}
	run(wire.NewWriter(c), wire.NewReader(in))
}

// openExec starts a command in a running app with the stdio the request
// asks for. NotFound, InvalidArgument, FailedPrecondition, as exec.
func (a *Agent) openExec(ctx context.Context, req *api.Request) (sessionRunner, error) {
	var stdio api.Stdio
	if req.Stdio != nil {
		stdio = *req.Stdio
	}
	if stdio.TTY && stdio.Stderr {
		return nil, errdefs.InvalidArgument("exec: a terminal has no stderr of its own")
	}
	c, err := a.startExec(req.ID, req.Cmd, childIO{stdin: stdio.Stdin, tty: stdio.TTY}, stdio.Size, time.Time{})
	if err != nil {
		return nil, fmt.Errorf("exec in %s: %w", req.ID, err)
	}
	return func(fw *wire.Writer, fr *wire.Reader) { a.runExec(ctx, req.ID, req.Cmd, c, stdio, fw, fr) }, nil
}

// runExec copies the command's output to the client and the client's
// input to the command until the command exits, then sends its exit code.
// A client that goes away (its stream fails) has the command killed.
func (a *Agent) runExec(ctx context.Context, id string, cmd []string, c *child, stdio api.Stdio, fw *wire.Writer, fr *wire.Reader) {
	var procMu sync.Mutex
	exited := false
	kill := func() {
		procMu.Lock()
		defer procMu.Unlock()
		if !exited {
			_ = signalProc(c.proc, syscall.SIGKILL)
		}
	}
	defer func() {
		procMu.Lock()
		exited = true
		c.proc.Release()
		procMu.Unlock()
	}()

	out := func(typ byte, want bool) io.Writer {
		if !want {
			return io.Discard
		}
		return failWriter{fw.Stream(typ), kill}
	}
	var copies sync.WaitGroup
	copyOut := func(w io.Writer, r io.Reader) {
		copies.Add(1)
		go func() {
			defer copies.Done()
			_, _ = io.Copy(w, r)
		}()
	}
	if c.pty != nil {
		copyOut(out(api.FrameStdout, stdio.Stdout), c.pty)
	} else {
		copyOut(out(api.FrameStdout, stdio.Stdout), c.stdout)
		copyOut(out(api.FrameStderr, stdio.Stderr), c.stderr)
	}
	go a.execInput(c, stdio, fr, kill)

	ws := <-c.wait
	drain(&copies, c.outputs()...)
	if c.stdin != nil {
		c.stdin.Close()
	}
	code := exitCode(ws)
	if err := fw.SendJSON(api.FrameEnd, api.SessionEnd{ExitCode: code}); err != nil {
		a.log.DebugContext(ctx, "exec session: send the exit code", "app", id, "err", err)
	}
	a.log.DebugContext(ctx, "exec session", "app", id, "cmd", cmd, "tty", stdio.TTY, "code", code)
}

// execInput applies the client's frames to an exec'd command: input,
// its end, terminal size. When the client's stream fails the command is
// killed (after the session ended, kill does nothing).
func (a *Agent) execInput(c *child, stdio api.Stdio, fr *wire.Reader, kill func()) {
	var stdin io.Writer
	switch {
	case c.pty != nil && stdio.Stdin:
		stdin = c.pty
	case c.stdin != nil:
		stdin = c.stdin
	}
	for {
		typ, p, err := fr.Next()
		if err != nil {
			kill()
			return
		}
		switch typ {
		case api.FrameStdin:
			if stdin != nil {
				_, _ = stdin.Write(p) // a command that stopped reading drops it
			}
		case api.FrameEOF:
			if stdin == nil {
				continue
			}
			if c.pty != nil {
				_ = c.pty.endInput()
			} else {
				c.stdin.Close()
			}
			stdin = nil
		case api.FrameResize:
			if c.pty != nil {
				var size api.TerminalSize
				if json.Unmarshal(p, &size) == nil {
					_ = c.pty.resize(size)
				}
			}
		}
	}
}

// failWriter calls onErr when a write fails.
type failWriter struct {
	w     io.Writer
	onErr func()
}

func (f failWriter) Write(p []byte) (int, error) {
	n, err := f.w.Write(p)
	if err != nil {
		f.onErr()
	}
	return n, err
}

// openAttach checks that the app runs. NotFound, FailedPrecondition (not
// running).
func (a *Agent) openAttach(ctx context.Context, req *api.Request) (sessionRunner, error) {
	ap, err := a.get(req.ID)
	if err != nil {
		return nil, err
	}
	ap.mu.Lock()
	running, aio, exited := ap.st.State == api.StateRunning, ap.io, ap.exited
	ap.mu.Unlock()
	if !running || aio == nil {
		return nil, errdefs.FailedPrecondition("app %s is not running", req.ID)
	}
	var stdio api.Stdio
	if req.Stdio != nil {
		stdio = *req.Stdio
	}
	return func(fw *wire.Writer, fr *wire.Reader) { a.runAttach(ctx, req.ID, aio, exited, stdio, fw, fr) }, nil
}

// runAttach copies the app's output to the client, and the client's
// input to the app's stdin, until the app exits (its output copied), the
// client detaches or goes away. The client detaches by ending its input,
// except from an app with StdinOnce and no terminal: its stdin is closed
// and the session lasts until the app exits, as in containerd.
func (a *Agent) runAttach(ctx context.Context, id string, aio *appIO, exited <-chan struct{}, stdio api.Stdio, fw *wire.Writer, fr *wire.Reader) {
	fw.WriteTimeout = sessionWriteTimeout
	tty := aio.terminal()
	sub := &attachment{fw: fw, stdout: stdio.Stdout, stderr: stdio.Stderr && tty == nil, failed: make(chan struct{})}
	aio.subscribe(sub)
	defer aio.unsubscribe(sub)

	detach := make(chan struct{})
	gone := make(chan struct{})
	go func() {
		useStdin := stdio.Stdin && aio.hasStdin()
		for {
			typ, p, err := fr.Next()
			if err != nil {
				if useStdin {
					if _, err := aio.sessionInputEnded(); err != nil {
						a.log.WarnContext(ctx, "attach: close stdin", "app", id, "err", err)
					}
				}
				close(gone)
				return
			}
			switch typ {
			case api.FrameStdin:
				if useStdin {
					if err := aio.writeStdin(p); err != nil {
						a.log.DebugContext(ctx, "attach: stdin", "app", id, "err", err)
					}
				}
			case api.FrameEOF:
				if !useStdin {
					continue
				}
				useStdin = false
				closed, err := aio.sessionInputEnded()
				if err != nil {
					a.log.WarnContext(ctx, "attach: close stdin", "app", id, "err", err)
				}
				if !closed || tty != nil {
					close(detach)
				}
			case api.FrameResize:
				if tty != nil {
					var size api.TerminalSize
					if json.Unmarshal(p, &size) == nil {
						_ = tty.resize(size)
					}
				}
			}
		}
	}()
	how := "app exited"
	select {
	case <-exited: // the monitor closes it once the output is copied
	case <-detach:
		how = "detached"
	case <-gone:
		a.log.DebugContext(ctx, "attach session: the client went away", "app", id)
		return
	case <-sub.failed:
		a.log.DebugContext(ctx, "attach session: the client does not read; detached", "app", id)
		return
	}
	aio.unsubscribe(sub) // no output after the end frame
	if err := fw.SendJSON(api.FrameEnd, api.SessionEnd{}); err != nil {
		a.log.DebugContext(ctx, "attach session: send the end", "app", id, "err", err)
	}
	a.log.DebugContext(ctx, "attach session", "app", id, "ended", how)
}

// openPortForward connects to port on the loopback of the network
// namespace the agent runs in (the pod's): 127.0.0.1 first, then ::1.
// InvalidArgument (bad port), FailedPrecondition (nothing accepts).
func (a *Agent) openPortForward(ctx context.Context, req *api.Request) (sessionRunner, error) {
	if req.Port <= 0 || req.Port > 65535 {
		return nil, errdefs.InvalidArgument("port-forward: bad port %d", req.Port)
	}
	conn, err := a.sys.dialPort(req.Port)
	if err != nil {
		return nil, err
	}
	return func(fw *wire.Writer, fr *wire.Reader) { a.runPortForward(ctx, conn, fw, fr) }, nil
}

// runPortForward copies bytes both ways until the client closes its
// stream. The end of either side's data is passed on as a half-close.
func (a *Agent) runPortForward(ctx context.Context, conn net.Conn, fw *wire.Writer, fr *wire.Reader) {
	defer conn.Close()
	down := make(chan struct{})
	go func() {
		defer close(down)
		if _, err := io.Copy(fw.Stream(api.FrameData), conn); err != nil {
			a.log.DebugContext(ctx, "port-forward: from the pod", "err", err)
		}
		_ = fw.Send(api.FrameEOF, nil)
	}()
	for {
		typ, p, err := fr.Next()
		if err != nil {
			break // the client closed the session
		}
		switch typ {
		case api.FrameData:
			if _, err := conn.Write(p); err != nil {
				a.log.DebugContext(ctx, "port-forward: to the pod", "err", err)
			}
		case api.FrameEOF:
			if hc, ok := conn.(interface{ CloseWrite() error }); ok {
				_ = hc.CloseWrite()
			}
		}
	}
	conn.Close()
	<-down
}
