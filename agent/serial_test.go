package agent

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/errdefs"
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

// TestSerialReconnect: a daemon that goes away (its connection closed at
// any point) is replaced by one that starts a new session with the same
// guest, whether or not the guest noticed the first one leave.
func TestSerialReconnect(t *testing.T) {
	for _, lazy := range []bool{false, true} {
		t.Run(map[bool]string{false: "disconnect-seen", true: "disconnect-unseen"}[lazy], func(t *testing.T) {
			path := serveSerial(t, lazy)
			for i := range 4 {
				d := NewSerialDialer(path, testSlog(t))
				c := NewClient(d.Dial)
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				for j := range 3 {
					if _, err := c.Info(ctx); err != nil {
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
	c := NewClient(d.Dial)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	errs := make(chan error, 50)
	for range 50 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := c.Info(ctx); err != nil {
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

func TestGuestCmdline(t *testing.T) {
	in := "console=ttyS0 stagelet.port=p0 stagelet.fs=fs stagelet.hostname=h stagelet.mac=02:00:00:00:00:01 " +
		"stagelet.ip=10.1.0.5/16 stagelet.ip=fd00::5/64 stagelet.route=0.0.0.0/0,10.1.0.1 stagelet.route=10.2.0.0/16, " +
		"stagelet.mtu=1400 stagelet.loglevel=debug -- agent guest stagelet.port=ignored"
	c, err := ParseGuestCmdline(in)
	if err != nil {
		t.Fatal(err)
	}
	if c.Port != "p0" || c.FSTag != "fs" || c.Hostname != "h" || c.MAC.String() != "02:00:00:00:00:01" ||
		len(c.IPs) != 2 || len(c.Routes) != 2 || c.Routes[1].Gw.IsValid() || c.MTU != 1400 || c.Probe {
		t.Fatalf("parsed %+v", c)
	}
	again, err := ParseGuestCmdline(joinWords(c.Cmdline()))
	if err != nil || again.Port != c.Port || again.Routes[0] != c.Routes[0] || again.IPs[1] != c.IPs[1] || again.LogLevel != c.LogLevel {
		t.Errorf("round trip: %+v, %v", again, err)
	}
	if _, err := ParseGuestCmdline("stagelet.ip=nonsense"); err == nil {
		t.Error("bad ip accepted")
	}
	tpl, err := ParseGuestCmdline(joinWords((&GuestConfig{Port: "p", Template: true, FSTag: "fs", FSType: FSVirtio9P}).Cmdline()))
	if err != nil || !tpl.Template || tpl.FSType != FSVirtio9P {
		t.Errorf("template and fstype round trip: %+v, %v", tpl, err)
	}
	if _, err := ParseGuestCmdline("stagelet.fstype=ext4"); err == nil {
		t.Error("unknown fstype accepted")
	}
	if d, _ := ParseGuestCmdline(""); d.Port != DefaultGuestPort {
		t.Errorf("default port %q", d.Port)
	}
}

func joinWords(w []string) string {
	s := ""
	for _, x := range w {
		s += x + " "
	}
	return s
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

// TestSetupOnce: OpSetup runs the agent's setup once; a second call, and
// any call to an agent without one, is FailedPrecondition. (An Agent made
// with New reaps every child of the test process: this one is not.)
func TestSetupOnce(t *testing.T) {
	var got []string
	a := &Agent{setup: func(r *api.Request) error {
		got = append(got, r.Guest)
		return nil
	}}
	if err := a.runSetup(&api.Request{Op: api.OpSetup, Guest: "stagelet.hostname=h"}); err != nil {
		t.Fatalf("first setup: %v", err)
	}
	if err := a.runSetup(&api.Request{Op: api.OpSetup, Guest: "stagelet.hostname=x"}); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Errorf("second setup: %v, want FailedPrecondition", err)
	}
	if len(got) != 1 || got[0] != "stagelet.hostname=h" {
		t.Errorf("setup ran with %q", got)
	}
	if err := (&Agent{}).runSetup(&api.Request{Op: api.OpSetup}); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Errorf("setup of an agent without one: %v, want FailedPrecondition", err)
	}
}
