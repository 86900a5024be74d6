package supervisor

import (
	"errors"
	"io"
	"os"
	"sync"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/agent/wire"
)

// appIO is a running app's stdio as attach sessions see it: its output,
// copied to every session attached, and its stdin (a pipe or its terminal)
// when it was created with one. Its methods are safe for concurrent use;
// a nil *appIO (an app recorded by an earlier agent) has no stdio.
type appIO struct {
	once bool // StdinOnce

	inMu sync.Mutex
	// stdin takes the sessions' input; nil when the app has none or it
	// was closed.
	stdin io.Writer
	tty   *terminal // the app's terminal; nil without one
	// stdinClosed: StdinOnce closed stdin after the first session.
	stdinClosed bool

	outMu sync.Mutex
	subs  map[*attachment]struct{}
}

func newAppIO(once bool) *appIO {
	return &appIO{once: once, subs: map[*attachment]struct{}{}}
}

// setStdin sets the app's stdin (nil: none) and terminal (nil: none).
func (o *appIO) setStdin(stdin io.Writer, tty *terminal) {
	o.inMu.Lock()
	defer o.inMu.Unlock()
	if stdin != nil {
		o.stdin = stdin
	}
	o.tty = tty
}

// hasStdin reports whether input can still be written.
func (o *appIO) hasStdin() bool {
	if o == nil {
		return false
	}
	o.inMu.Lock()
	defer o.inMu.Unlock()
	return o.stdin != nil
}

// terminal returns the app's terminal, nil when it has none.
func (o *appIO) terminal() *terminal {
	if o == nil {
		return nil
	}
	o.inMu.Lock()
	defer o.inMu.Unlock()
	return o.tty
}

// writeStdin writes p to the app's stdin; an app whose stdin is closed
// (or which has none) drops it.
func (o *appIO) writeStdin(p []byte) error {
	o.inMu.Lock()
	w := o.stdin
	o.inMu.Unlock()
	if w == nil {
		return nil
	}
	_, err := w.Write(p)
	if errors.Is(err, os.ErrClosed) {
		return nil // the app ended meanwhile
	}
	return err
}

// sessionInputEnded is called when an attach session whose input went to
// stdin stops sending it. With StdinOnce the app's stdin is closed: a
// pipe is closed, a terminal gets its end-of-file character. It reports
// whether stdin was closed.
func (o *appIO) sessionInputEnded() (bool, error) {
	if !o.once {
		return false, nil
	}
	o.inMu.Lock()
	defer o.inMu.Unlock()
	if o.stdinClosed || o.stdin == nil {
		return false, nil
	}
	o.stdinClosed = true
	w := o.stdin
	o.stdin = nil
	if o.tty != nil {
		return true, o.tty.endInput()
	}
	if c, ok := w.(io.Closer); ok {
		return true, c.Close()
	}
	return true, nil
}

// end is called once the app exited and its output was copied: the stdin
// pipe is closed and no more input is taken. Idempotent.
func (o *appIO) end() {
	if o == nil {
		return
	}
	o.inMu.Lock()
	w := o.stdin
	o.stdin = nil
	o.inMu.Unlock()
	if f, ok := w.(*os.File); ok {
		f.Close()
	}
}

// attachment is one attach session's share of the output.
type attachment struct {
	fw             *wire.Writer
	stdout, stderr bool
	// failed is closed when a write to the session failed; the session
	// ends.
	failed chan struct{}
	once   sync.Once
}

func (o *appIO) subscribe(s *attachment) {
	o.outMu.Lock()
	o.subs[s] = struct{}{}
	o.outMu.Unlock()
}

func (o *appIO) unsubscribe(s *attachment) {
	o.outMu.Lock()
	delete(o.subs, s)
	o.outMu.Unlock()
}

// broadcast sends p as frames of type typ to every session that wants
// them. A session whose write fails (or times out) is dropped.
func (o *appIO) broadcast(typ byte, p []byte) {
	o.outMu.Lock()
	defer o.outMu.Unlock()
	for s := range o.subs {
		if (typ == api.FrameStdout && !s.stdout) || (typ == api.FrameStderr && !s.stderr) {
			continue
		}
		if err := s.fw.Send(typ, p); err != nil {
			delete(o.subs, s)
			s.once.Do(func() { close(s.failed) })
		}
	}
}

// output returns a writer that broadcasts as frames of type typ; it never
// fails, so the app's log is never held up by a session.
func (o *appIO) output(typ byte) io.Writer { return outTee{o, typ} }

type outTee struct {
	o   *appIO
	typ byte
}

func (t outTee) Write(p []byte) (int, error) {
	t.o.broadcast(t.typ, p)
	return len(p), nil
}
