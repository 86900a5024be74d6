package transport

// The serial transport carries the agent protocol over one byte stream
// that outlives the daemon's connections to it: a VM's virtio-serial port,
// whose host side is a unix socket served by qemu. Each connection of the
// daemon to that socket is a session: a handshake, then a yamux session in
// which every agent call is one stream.
//
// A daemon may die in the middle of a session and a new one connect later,
// while bytes of the old session are still in flight in either direction.
// The handshake resynchronises both ends on a fresh nonce:
//
//	host:  "\nSTAGELET-HELLO <nonce>\n", repeated until answered
//	guest: "\nSTAGELET-READY <nonce>\n", once per nonce
//	host:  "STAGELET-GO <nonce>\n", then the yamux client starts
//	guest: the yamux server starts on the bytes after that line
//
// Lines that are not part of the current handshake are skipped by both
// ends. A hello that reaches a guest still in an old session starts with
// '\n', which is no valid yamux version byte, so the old session ends and
// the guest goes back to reading handshake lines; the host repeats its
// hello until the guest answers. The guest answers a nonce once, so the
// host reads nothing but yamux frames after the answer it waits for.

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"sync"
	"time"

	"github.com/hashicorp/yamux"
)

const (
	helloPrefix = "STAGELET-HELLO "
	readyPrefix = "STAGELET-READY "
	goPrefix    = "STAGELET-GO "
	// maxLine bounds a handshake line; longer runs of bytes are skipped.
	maxLine = 128
)

// Timings of the handshake; variables so tests may shorten them.
var (
	// helloInterval is how often the host repeats its hello.
	helloInterval = 100 * time.Millisecond
	// idlePoll is the longest wait of the guest between two reads of a
	// port whose host side is not connected (reads then return EOF at
	// once).
	idlePoll = 50 * time.Millisecond
)

func yamuxConfig(log *slog.Logger) *yamux.Config {
	cfg := yamux.DefaultConfig()
	// A session ends when the host side disconnects (EOF) or the stream
	// is corrupted; keepalives would only add traffic to an idle VM.
	cfg.EnableKeepAlive = false
	cfg.ConnectionWriteTimeout = 30 * time.Second
	cfg.LogOutput = nil
	cfg.Logger = yamuxLogger{log}
	return cfg
}

// yamuxLogger sends yamux's own messages to slog at debug level.
type yamuxLogger struct{ log *slog.Logger }

func (l yamuxLogger) Print(v ...any) { l.log.Debug(fmt.Sprint(v...), "component", "yamux") }
func (l yamuxLogger) Printf(format string, v ...any) {
	l.log.Debug(fmt.Sprintf(format, v...), "component", "yamux")
}
func (l yamuxLogger) Println(v ...any) { l.log.Debug(fmt.Sprint(v...), "component", "yamux") }

// readLine reads one line from r a byte at a time (never past the '\n'),
// returning it without the newline. A line longer than maxLine is
// returned truncated and flagged.
func readLine(r io.Reader) (line []byte, long bool, err error) {
	var b [1]byte
	for {
		n, err := r.Read(b[:])
		if n == 1 {
			if b[0] == '\n' {
				return line, long, nil
			}
			if len(line) < maxLine {
				line = append(line, b[0])
			} else {
				long = true
			}
			continue
		}
		if err != nil {
			return line, long, err
		}
	}
}

// --- guest side -------------------------------------------------------

// SerialListener serves the agent protocol on the guest's end of a serial
// port: it runs the handshake whenever a host connects, then accepts the
// host's yamux streams, across any number of host connections. Accept
// returns the streams of whichever session is current. It implements
// net.Listener for Agent.Serve.
type SerialListener struct {
	port Port
	log  *slog.Logger

	conns chan net.Conn
	done  chan struct{}
	once  sync.Once

	mu   sync.Mutex
	sess *yamux.Session // current session, nil between sessions
}

var _ net.Listener = (*SerialListener)(nil)

// Port is the guest's end of a serial line: an open virtio-serial port
// device (*os.File). Read returns io.EOF while no host is connected; a
// read deadline interrupts a pending Read.
type Port interface {
	io.ReadWriteCloser
	SetReadDeadline(time.Time) error
}

// NewSerialListener starts serving on port. The listener owns port and
// closes it on Close.
func NewSerialListener(port Port, log *slog.Logger) *SerialListener {
	if log == nil {
		log = slog.Default()
	}
	l := &SerialListener{port: port, log: log, conns: make(chan net.Conn), done: make(chan struct{})}
	go l.run()
	return l
}

// Accept returns the next stream a host opened; net.ErrClosed once the
// listener is closed.
func (l *SerialListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

// Close stops accepting, ends the current session (after its streams
// closed, at most a second, so that answers in flight reach the host) and
// closes the port. Idempotent.
func (l *SerialListener) Close() error {
	l.once.Do(func() {
		close(l.done)
		l.mu.Lock()
		sess := l.sess
		l.mu.Unlock()
		if sess != nil {
			deadline := time.Now().Add(time.Second)
			for sess.NumStreams() > 0 && time.Now().Before(deadline) {
				time.Sleep(10 * time.Millisecond) // waiting on the host to close its streams
			}
			sess.Close()
		}
		l.port.Close()
	})
	return nil
}

// Addr implements net.Listener.
func (l *SerialListener) Addr() net.Addr {
	if f, ok := l.port.(interface{ Name() string }); ok {
		return serialAddr(f.Name())
	}
	return serialAddr("serial")
}

type serialAddr string

func (a serialAddr) Network() string { return "virtio-serial" }
func (a serialAddr) String() string  { return string(a) }

func (l *SerialListener) closed() bool {
	select {
	case <-l.done:
		return true
	default:
		return false
	}
}

// run alternates between the handshake and a session until Close.
func (l *SerialListener) run() {
	for !l.closed() {
		if err := l.handshake(); err != nil {
			if !l.closed() {
				l.log.Warn("serial handshake", "err", err)
			}
			return
		}
		l.serveSession()
	}
}

// handshake reads lines until a host's GO for a nonce this side answered.
// While no host is connected the port reads EOF at once: it then waits a
// little and reads again.
func (l *SerialListener) handshake() error {
	var nonce []byte
	idle := time.Millisecond
	for !l.closed() {
		line, long, err := readLine(l.port)
		if errors.Is(err, io.EOF) {
			// No host connected (or it went away mid-line).
			nonce = nil
			select {
			case <-l.done:
				return nil
			case <-time.After(idle): // polling the port for a host
			}
			if idle < idlePoll {
				idle *= 2
			}
			continue
		}
		if err != nil {
			// Not expected from a port; keep serving rather than
			// leave the guest unreachable.
			l.log.Warn("serial port read", "err", err)
			l.port.SetReadDeadline(time.Time{})
			nonce = nil
			select {
			case <-l.done:
				return nil
			case <-time.After(idlePoll):
			}
			continue
		}
		idle = time.Millisecond
		if long {
			continue
		}
		switch {
		case bytes.HasPrefix(line, []byte(helloPrefix)):
			n := line[len(helloPrefix):]
			if nonce != nil && bytes.Equal(n, nonce) {
				continue // answered already: the host stops repeating
			}
			nonce = append([]byte(nil), n...)
			// The leading newline ends whatever an old session left
			// half-written on the line (a yamux GoAway).
			if _, err := l.port.Write([]byte("\n" + readyPrefix + string(nonce) + "\n")); err != nil {
				l.log.Debug("serial handshake: answer", "err", err)
				nonce = nil
			}
		case bytes.HasPrefix(line, []byte(goPrefix)):
			if nonce != nil && bytes.Equal(line[len(goPrefix):], nonce) {
				l.log.Info("host connected", "session", string(nonce))
				return nil
			}
		}
	}
	return nil
}

// serveSession runs one yamux session until it ends (the host went away
// or a new host's hello broke the stream).
func (l *SerialListener) serveSession() {
	conn := &portConn{f: l.port}
	sess, err := yamux.Server(conn, yamuxConfig(l.log))
	if err != nil {
		l.log.Warn("serial session", "err", err)
		return
	}
	l.mu.Lock()
	l.sess = sess
	l.mu.Unlock()
	defer func() {
		l.mu.Lock()
		l.sess = nil
		l.mu.Unlock()
		sess.Close()
		conn.reset()
	}()
	for {
		s, err := sess.Accept()
		if err != nil {
			if !l.closed() {
				l.log.Info("host session ended", "err", err)
			}
			return
		}
		select {
		case l.conns <- s:
		case <-l.done:
			s.Close()
			return
		}
	}
}

// portConn lends the port to one yamux session: closing it interrupts the
// session's pending read (a past read deadline) instead of closing the
// port, which the next session reuses after reset.
type portConn struct {
	f Port
}

func (c *portConn) Read(b []byte) (int, error)  { return c.f.Read(b) }
func (c *portConn) Write(b []byte) (int, error) { return c.f.Write(b) }
func (c *portConn) Close() error {
	c.f.SetReadDeadline(time.Unix(1, 0))
	return nil
}
func (c *portConn) reset() { c.f.SetReadDeadline(time.Time{}) }

// --- host side --------------------------------------------------------

// SerialDialer is the host's end of a VM's serial port: the unix socket
// qemu serves for it. It keeps one session and opens one yamux stream per
// call; when the session is gone (first use, a VM that closed it, a
// previous daemon's) it connects again and runs the handshake. Safe for
// concurrent use.
type SerialDialer struct {
	path string
	log  *slog.Logger

	mu   sync.Mutex
	conn net.Conn
	sess *yamux.Session
}

// NewSerialDialer returns a dialer for the serial socket at path; it does
// not connect yet.
func NewSerialDialer(path string, log *slog.Logger) *SerialDialer {
	if log == nil {
		log = slog.Default()
	}
	return &SerialDialer{path: path, log: log}
}

// Dial opens one stream to the agent, connecting first if needed. It is a
// Dialer.
func (d *SerialDialer) Dial(ctx context.Context) (net.Conn, error) {
	sess, err := d.session(ctx)
	if err != nil {
		return nil, err
	}
	s, err := sess.OpenStream()
	if err != nil {
		return nil, fmt.Errorf("serial %s: open stream: %w", d.path, err)
	}
	return s, nil
}

// Connected reports whether a session is up.
func (d *SerialDialer) Connected() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.sess != nil && !d.sess.IsClosed()
}

// Close ends the session and the connection; a later Dial connects again.
// Idempotent.
func (d *SerialDialer) Close() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.closeLocked()
	return nil
}

func (d *SerialDialer) closeLocked() {
	if d.sess != nil {
		d.sess.Close()
		d.sess = nil
	}
	if d.conn != nil {
		d.conn.Close()
		d.conn = nil
	}
}

func (d *SerialDialer) session(ctx context.Context) (*yamux.Session, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.sess != nil && !d.sess.IsClosed() {
		return d.sess, nil
	}
	d.closeLocked()
	conn, err := DialUnix(ctx, d.path)
	if err != nil {
		return nil, fmt.Errorf("serial %s: %w", d.path, err)
	}
	nonce, err := hostHandshake(ctx, conn)
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("serial %s: handshake: %w", d.path, err)
	}
	sess, err := yamux.Client(conn, yamuxConfig(d.log))
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("serial %s: %w", d.path, err)
	}
	d.conn, d.sess = conn, sess
	d.log.DebugContext(ctx, "serial session started", "socket", d.path, "session", nonce)
	return sess, nil
}

// hostHandshake runs the host's side of the handshake on a fresh
// connection; on success the next bytes either way are yamux's.
func hostHandshake(ctx context.Context, conn net.Conn) (string, error) {
	var raw [8]byte
	if _, err := rand.Read(raw[:]); err != nil {
		return "", err
	}
	nonce := hex.EncodeToString(raw[:])
	if dl, ok := ctx.Deadline(); ok {
		conn.SetDeadline(dl)
	}
	stop := context.AfterFunc(ctx, func() { conn.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	defer conn.SetDeadline(time.Time{})

	answered := make(chan struct{})
	var writeErr error
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		hello := []byte("\n" + helloPrefix + nonce + "\n")
		t := time.NewTicker(helloInterval)
		defer t.Stop()
		for {
			if _, err := conn.Write(hello); err != nil {
				writeErr = err
				return
			}
			select {
			case <-answered:
				return
			case <-t.C:
			}
		}
	}()
	want := []byte(readyPrefix + nonce)
	var readErr error
	for {
		line, _, err := readLine(conn)
		if err != nil {
			readErr = err
			break
		}
		// A suffix: the guest's answer may follow the remains of an
		// old session's frame on the same line.
		if bytes.HasSuffix(line, want) {
			break
		}
	}
	close(answered)
	wg.Wait() // no hello is written after the GO below
	if readErr != nil {
		if ctx.Err() != nil {
			return "", fmt.Errorf("%w (no answer from the guest)", ctx.Err())
		}
		return "", readErr
	}
	if writeErr != nil {
		return "", writeErr
	}
	if _, err := conn.Write([]byte(goPrefix + nonce + "\n")); err != nil {
		return "", err
	}
	return nonce, nil
}
