package guestinit

import (
	"bufio"
	"io"
	"log/slog"
	"net"
	"path/filepath"
	"testing"
)

// chanListener accepts the connections sent on it.
type chanListener struct {
	conns chan net.Conn
	done  chan struct{}
}

func (l *chanListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}
func (l *chanListener) Close() error   { close(l.done); return nil }
func (l *chanListener) Addr() net.Addr { return &net.UnixAddr{Name: "chan", Net: "unix"} }

// TestRoutingListener: streams go to the VM's init's own supervisor until
// a pod agent is set, then to the pod agent, both ways, each on a
// connection of its own, and a stream's end ends it.
func TestRoutingListener(t *testing.T) {
	inner := &chanListener{conns: make(chan net.Conn), done: make(chan struct{})}
	l := &routingListener{Listener: inner, log: slog.New(slog.DiscardHandler)}
	defer l.Close()

	host, guest := net.Pipe()
	go func() { inner.conns <- guest }()
	got, err := l.Accept()
	if err != nil || got != guest {
		t.Fatalf("before a pod agent: Accept = %v, %v; want the stream itself", got, err)
	}
	host.Close()

	// A pod agent that answers each line with "pod: " and the line.
	sock := filepath.Join(t.TempDir(), "agent.sock")
	al, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer al.Close()
	go func() {
		for {
			c, err := al.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				line, _ := bufio.NewReader(c).ReadString('\n')
				io.WriteString(c, "pod: "+line)
			}()
		}
	}()
	l.nested.Store(&nested{socket: sock, done: make(chan struct{})})
	accepted := make(chan net.Conn, 1)
	go func() {
		c, _ := l.Accept() // returns only when the inner listener closes
		accepted <- c
	}()
	for _, msg := range []string{"info\n", "start\n"} {
		host, guest := net.Pipe()
		inner.conns <- guest
		if _, err := io.WriteString(host, msg); err != nil {
			t.Fatal(err)
		}
		reply, err := io.ReadAll(host)
		if err != nil || string(reply) != "pod: "+msg {
			t.Errorf("through the pod agent: %q, %v; want %q", reply, err, "pod: "+msg)
		}
		host.Close()
	}
	select {
	case c := <-accepted:
		t.Fatalf("a stream reached the VM's init's supervisor once the pod agent ran: %v", c)
	default:
	}
}

func TestTailBuffer(t *testing.T) {
	b := &tailBuffer{max: 8}
	io.WriteString(b, "first line\n")
	io.WriteString(b, "err: x\n")
	// The last 8 bytes, "\nerr: x\n", trimmed.
	if got := b.String(); got != "err: x" {
		t.Errorf("tail = %q", got)
	}
}
