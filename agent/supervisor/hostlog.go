package supervisor

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"sync"
	"time"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/agent/wire"
	"github.com/stagelet/stagelet/errdefs"
)

// An app with AppSpec.HostLog has its CRI log lines, formatted by criLog
// as for a file, kept in a logBuffer for the daemon to write on the host:
// an OpLogs session takes them. A byte is delivered once the daemon
// acknowledged it (FrameLogAck), which it does after writing it to the
// file: until then it stays in the buffer, and a new session (the daemon
// restarted, or the pod moved) is sent it again. Nothing is lost when the
// daemon dies; the lines it wrote but had not acknowledged are written a
// second time.

// shutdownLogGrace is how long, past its stop timeout, a shutdown waits
// for the daemon to take the apps' last lines before the agent exits
// without them.
const shutdownLogGrace = 5 * time.Second

// logBufferSize bounds the bytes an app's log buffer holds unacknowledged:
// a writer waits (and the app's pipe fills) while it is full.
const logBufferSize = 1 << 20

var errLogEnded = errors.New("the app's log is discarded")

// logBuffer is an app's unacknowledged CRI log lines. Writers append whole
// lines; one reader at a time (a newer one replaces it) takes them from
// the oldest unacknowledged byte on and acknowledges them. Safe for
// concurrent use.
type logBuffer struct {
	mu sync.Mutex
	// data holds the bytes from offset base on; base is how much was
	// acknowledged.
	data []byte
	base int64
	max  int
	// ended: no more lines come (the app's output was drained);
	// discarded: the app was removed, its lines are dropped; unwaited:
	// the agent shuts down, and the app's exit waits no more for the
	// daemon (a session may still take what is left).
	ended, discarded, unwaited bool
	// reader is the generation of the attached reader.
	reader uint64
	// changed is closed, and replaced, at every change.
	changed chan struct{}
}

func newLogBuffer(max int) *logBuffer {
	return &logBuffer{max: max, changed: make(chan struct{})}
}

// signalLocked wakes whoever waits for a change.
func (b *logBuffer) signalLocked() {
	close(b.changed)
	b.changed = make(chan struct{})
}

// write appends line (a whole CRI line), waiting while the buffer is
// full: back-pressure on the app's output. It fails once the buffer was
// discarded or ended.
func (b *logBuffer) write(line []byte) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	for {
		if b.discarded || b.ended {
			return errLogEnded
		}
		if len(b.data) == 0 || len(b.data)+len(line) <= b.max {
			break
		}
		ch := b.changed
		b.mu.Unlock()
		<-ch
		b.mu.Lock()
	}
	b.data = append(b.data, line...)
	b.signalLocked()
	return nil
}

// end says no more lines come; a reader's session ends once it took and
// acknowledged the rest. Idempotent.
func (b *logBuffer) end() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if !b.ended {
		b.ended = true
		b.signalLocked()
	}
}

// discard drops what the buffer holds and what would come (the app is
// removed): a blocked writer returns, a reader's session ends. Idempotent.
func (b *logBuffer) discard() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.discarded, b.ended = true, true
	b.base += int64(len(b.data))
	b.data = nil
	b.signalLocked()
}

// delivered waits until everything written was acknowledged, after the
// end (the app's exit is recorded once the daemon wrote its last lines,
// as it is once a log file was written), or until the buffer is
// discarded or unwaited.
func (b *logBuffer) delivered() {
	b.mu.Lock()
	defer b.mu.Unlock()
	for !b.discarded && !b.unwaited && len(b.data) > 0 {
		ch := b.changed
		b.mu.Unlock()
		<-ch
		b.mu.Lock()
	}
}

// unwait makes delivered return: the agent shuts down. Idempotent.
func (b *logBuffer) unwait() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.unwaited = true
	b.signalLocked()
}

// attach makes a new reader the buffer's only one and returns its
// generation and the offset it starts from: the oldest unacknowledged
// byte. The reader before it is told (take reports it replaced).
func (b *logBuffer) attach() (gen uint64, from int64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.reader++
	b.signalLocked()
	return b.reader, b.base
}

// take returns the whole lines from offset sent on (at most limit bytes,
// a copy) for reader gen; or done once the output ended and everything
// was acknowledged; or replaced when a newer reader attached. With none
// of these it returns a channel closed at the next change.
func (b *logBuffer) take(gen uint64, sent int64, limit int) (p []byte, done, replaced bool, wait <-chan struct{}) {
	b.mu.Lock()
	defer b.mu.Unlock()
	switch {
	case gen != b.reader:
		return nil, false, true, nil
	case b.ended && len(b.data) == 0:
		return nil, true, false, nil
	}
	off := sent - b.base
	if off < 0 || off > int64(len(b.data)) {
		off = 0 // cannot happen: a reader is sent from base on
	}
	rest := b.data[off:]
	if len(rest) == 0 {
		return nil, false, false, b.changed
	}
	if len(rest) > limit {
		rest = rest[:limit]
		// Only whole lines (a line is shorter than limit), so that
		// the daemon may reopen its file between two frames.
		if i := bytes.LastIndexByte(rest, '\n'); i >= 0 {
			rest = rest[:i+1]
		}
	}
	return append([]byte(nil), rest...), false, false, nil
}

// ack drops the next n bytes, which reader gen's daemon wrote. An ack of
// a replaced reader, or of more than the buffer holds, is ignored.
func (b *logBuffer) ack(gen uint64, n uint64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if gen != b.reader || n == 0 || n > uint64(len(b.data)) {
		return
	}
	k := copy(b.data, b.data[n:])
	b.data = b.data[:k]
	b.base += int64(n)
	b.signalLocked()
}

// bufferedCRILog is the CRI log writer of an app with HostLog: its lines
// go to b.
func bufferedCRILog(b *logBuffer) *criLog { return &criLog{mem: b, now: time.Now} }

// openAppLog is the CRI log writer of app ap: its buffer for the daemon,
// or its file.
func openAppLog(ap *app) (*criLog, error) {
	if ap.hlog != nil {
		return bufferedCRILog(ap.hlog), nil
	}
	return openCRILog(ap.spec.LogPath)
}

// openLogs checks that the app exists and keeps its log for the daemon.
// NotFound, FailedPrecondition (the app writes its own log file).
func (a *Agent) openLogs(ctx context.Context, req *api.Request) (sessionRunner, error) {
	ap, err := a.get(req.ID)
	if err != nil {
		return nil, err
	}
	if ap.hlog == nil {
		return nil, errdefs.FailedPrecondition("app %s writes its own log file: it was not created with a log for the host", req.ID)
	}
	return func(fw *wire.Writer, fr *wire.Reader) { a.runLogs(ctx, req.ID, ap.hlog, fw, fr) }, nil
}

// runLogs sends the app's log lines as FrameLog frames, from the oldest
// unacknowledged one, and takes the client's acknowledgements, until the
// app's output ended and all of it was acknowledged (then a FrameEnd),
// the client goes away, or a newer session replaces this one.
func (a *Agent) runLogs(ctx context.Context, id string, b *logBuffer, fw *wire.Writer, fr *wire.Reader) {
	gen, sent := b.attach()
	gone := make(chan struct{})
	go func() {
		defer close(gone)
		for {
			typ, p, err := fr.Next()
			if err != nil {
				return
			}
			if typ == api.FrameLogAck && len(p) == 8 {
				b.ack(gen, binary.BigEndian.Uint64(p))
			}
		}
	}()
	for {
		p, done, replaced, wait := b.take(gen, sent, api.MaxLogFrame)
		switch {
		case replaced:
			a.log.DebugContext(ctx, "log session replaced by a newer one", "app", id)
			return
		case done:
			if err := fw.SendJSON(api.FrameEnd, api.SessionEnd{}); err != nil {
				a.log.DebugContext(ctx, "log session: send the end", "app", id, "err", err)
			}
			a.log.DebugContext(ctx, "log session: the app's output ended, all of it delivered", "app", id)
			return
		case p != nil:
			if err := fw.Send(api.FrameLog, p); err != nil {
				a.log.DebugContext(ctx, "log session: the client went away", "app", id, "err", err)
				return
			}
			sent += int64(len(p))
			continue
		}
		select {
		case <-wait:
		case <-gone:
			a.log.DebugContext(ctx, "log session: the client went away", "app", id)
			return
		}
	}
}
