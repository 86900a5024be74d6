package transport

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/agent/wire"
)

// fakePort is the guest's end of a virtio-serial port whose host side is
// a unix socket, as qemu serves it: one host connection at a time; while
// none is connected reads return EOF and writes are dropped; bytes of a
// connection that ended may still be read after a new one started.
type fakePort struct {
	mu        sync.Mutex
	cond      *sync.Cond
	buf       []byte
	host      net.Conn // current connection, nil when none
	deadline  time.Time
	closed    bool
	lazyClose bool // a host that goes away is not noticed while another connects
}

func newFakePort(t *testing.T, lazy bool) (*fakePort, string) {
	t.Helper()
	p := &fakePort{lazyClose: lazy}
	p.cond = sync.NewCond(&p.mu)
	path := filepath.Join(t.TempDir(), "ctl.sock")
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close(); p.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			p.mu.Lock()
			p.host = c
			p.cond.Broadcast()
			p.mu.Unlock()
			b := make([]byte, 4096)
			for {
				n, err := c.Read(b)
				p.mu.Lock()
				p.buf = append(p.buf, b[:n]...)
				if err != nil && p.host == c {
					if !p.lazyClose {
						p.host = nil
					}
				}
				p.cond.Broadcast()
				p.mu.Unlock()
				if err != nil {
					c.Close()
					break
				}
			}
		}
	}()
	// Deadlines need a wake-up.
	go func() {
		for {
			time.Sleep(5 * time.Millisecond) // a clock for the fake's deadlines
			p.mu.Lock()
			closed := p.closed
			p.cond.Broadcast()
			p.mu.Unlock()
			if closed {
				return
			}
		}
	}()
	return p, path
}

func (p *fakePort) Read(b []byte) (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for {
		switch {
		case p.closed:
			return 0, os.ErrClosed
		case !p.deadline.IsZero() && time.Now().After(p.deadline):
			return 0, os.ErrDeadlineExceeded
		case len(p.buf) > 0:
			n := copy(b, p.buf)
			p.buf = p.buf[n:]
			return n, nil
		case p.host == nil:
			return 0, io.EOF
		}
		p.cond.Wait()
	}
}

func (p *fakePort) Write(b []byte) (int, error) {
	p.mu.Lock()
	h := p.host
	p.mu.Unlock()
	if h != nil {
		h.Write(b) // a failed write is data lost, as with qemu
	}
	return len(b), nil
}

func (p *fakePort) SetReadDeadline(t time.Time) error {
	p.mu.Lock()
	p.deadline = t
	p.cond.Broadcast()
	p.mu.Unlock()
	return nil
}

func (p *fakePort) Close() error {
	p.mu.Lock()
	p.closed = true
	p.cond.Broadcast()
	p.mu.Unlock()
	return nil
}

func serveSerial(t *testing.T, lazy bool) string {
	t.Helper()
	old := helloInterval
	helloInterval = 20 * time.Millisecond
	t.Cleanup(func() { helloInterval = old })
	port, path := newFakePort(t, lazy)
	l := NewSerialListener(port, testSlog(t))
	t.Cleanup(func() { l.Close() })
	// A stand-in for the agent (a real Agent would reap the test
	// process's other children): one JSON request, one answer per stream.
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				var req api.Request
				if err := json.NewDecoder(c).Decode(&req); err != nil {
					return
				}
				json.NewEncoder(c).Encode(&api.Response{Info: &api.Info{Version: api.Version}})
			}()
		}
	}()
	return path
}

// info makes one call on a stream of dial, as the daemon's client does:
// one JSON request, one response.
func info(ctx context.Context, dial func(context.Context) (net.Conn, error)) error {
	c, err := dial(ctx)
	if err != nil {
		return err
	}
	defer c.Close()
	if dl, ok := ctx.Deadline(); ok {
		c.SetDeadline(dl)
	}
	if err := json.NewEncoder(c).Encode(&api.Request{Op: api.OpInfo}); err != nil {
		return err
	}
	var resp api.Response
	if err := json.NewDecoder(c).Decode(&resp); err != nil {
		return err
	}
	if resp.Info == nil || resp.Info.Version != api.Version {
		return fmt.Errorf("answer %+v", resp)
	}
	return nil
}

// TestSerialReconnect: a daemon that goes away (its connection closed at
// any point) is replaced by one that starts a new session with the same
// guest, whether or not the guest noticed the first one leave.
func TestSerialReconnect(t *testing.T) {
	for _, lazy := range []bool{false, true} {
		t.Run(map[bool]string{false: "disconnect-seen", true: "disconnect-unseen"}[lazy], func(t *testing.T) {
			path := serveSerial(t, lazy)
			for i := range 4 {
				d := NewSerialDialer(path, testSlog(t))
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				for j := range 3 {
					if err := info(ctx, d.Dial); err != nil {
						t.Fatalf("host #%d, call #%d: %v", i+1, j+1, err)
					}
				}
				// Leave a stream open mid-call, as a killed daemon does.
				if i%2 == 0 {
					s, err := d.Dial(ctx)
					if err != nil {
						t.Fatal(err)
					}
					s.Write([]byte(`{"op":`))
				}
				cancel()
				d.Close()
			}
		})
	}
}

// TestSerialConcurrent: many calls share one session.
func TestSerialConcurrent(t *testing.T) {
	path := serveSerial(t, false)
	d := NewSerialDialer(path, testSlog(t))
	defer d.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	errs := make(chan error, 50)
	for range 50 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := info(ctx, d.Dial); err != nil {
				errs <- err
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if !d.Connected() {
		t.Error("no session after the calls")
	}
}

func testSlog(t *testing.T) *slog.Logger {
	if testing.Verbose() {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.DiscardHandler)
}

// TestHostHandshakeSkipsGarbage: the guest's answer may follow bytes an
// old session left on the line; the host finds it and sends GO.
func TestHostHandshakeSkipsGarbage(t *testing.T) {
	host, guest := net.Pipe()
	defer host.Close()
	defer guest.Close()
	go func() {
		line, _, err := readLine(guest) // the hello's leading newline
		for err == nil && len(line) == 0 {
			line, _, err = readLine(guest)
		}
		if err != nil {
			return
		}
		nonce := string(line[len(helloPrefix):])
		go io.Copy(io.Discard, guest) // later hellos, then GO
		guest.Write([]byte("\x00\x03\x00\x00junk" + readyPrefix + nonce + "\n"))
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := hostHandshake(ctx, host); err != nil {
		t.Fatal(err)
	}
}

// TestPortForwardOverSerial: a session runs over the serial transport (yamux
// streams over one byte stream) as over a unix socket: a port-forward's
// frames, with half-closes both ways.
func TestPortForwardOverSerial(t *testing.T) {
	old := helloInterval
	helloInterval = 20 * time.Millisecond
	t.Cleanup(func() { helloInterval = old })
	port, path := newFakePort(t, false)
	l := NewSerialListener(port, testSlog(t))
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				dec := json.NewDecoder(c)
				var req api.Request
				if dec.Decode(&req) != nil {
					return
				}
				_ = wire.ServePortSession(c, io.MultiReader(dec.Buffered(), c), func(stream io.ReadWriter) {
					b, _ := io.ReadAll(stream)
					fmt.Fprintf(stream, "%d bytes", len(b))
				})
			}()
		}
	}()

	d := NewSerialDialer(path, testSlog(t))
	t.Cleanup(func() { d.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := d.Dial(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(30 * time.Second))
	if err := json.NewEncoder(c).Encode(&api.Request{Op: api.OpPortForward, Port: 1}); err != nil {
		t.Fatal(err)
	}
	dec := json.NewDecoder(c)
	var resp api.Response
	if err := dec.Decode(&resp); err != nil || resp.Code != api.CodeOK {
		t.Fatalf("answer %+v, %v", resp, err)
	}
	fw := wire.NewWriter(c)
	go func() {
		_, _ = io.Copy(fw.Stream(api.FrameData), bytes.NewReader(make([]byte, 300000)))
		_ = fw.Send(api.FrameEOF, nil)
	}()
	fr := wire.NewReader(io.MultiReader(dec.Buffered(), c))
	var got bytes.Buffer
	for {
		typ, p, err := fr.Next()
		if err != nil {
			t.Fatalf("after %q: %v", got.String(), err)
		}
		if typ == api.FrameEOF {
			break
		}
		got.Write(p)
	}
	if got.String() != "300000 bytes" {
		t.Errorf("the pod's side answered %q", got.String())
	}
}
