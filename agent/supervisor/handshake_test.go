package supervisor

import (
	"bytes"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/agent/api"
)

// syncPair is a connected unix stream pair: the agent's end as a
// net.Conn, the child's as a raw descriptor.
func syncPair(t *testing.T) (net.Conn, int) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(fds[0]), "agent")
	defer f.Close()
	c, err := net.FileConn(f)
	if err != nil {
		t.Fatal(err)
	}
	return c, fds[1]
}

// The child's socket closes at execve. When the child left bytes of the
// spec unread, the agent sees a connection reset rather than EOF; after
// "exec" was reported that is still the command running, not a failure.
func TestHandshakeExecAfterUnreadBytes(t *testing.T) {
	for _, tc := range []struct {
		name   string
		report []syncMsg
		ok     bool
	}{
		{"exec", []syncMsg{{Warn: "w"}, {Exec: true}}, true},
		{"died before exec", []syncMsg{{Warn: "w"}}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			conn, childFD := syncPair(t)
			done := make(chan []byte, 1)
			go func() {
				// Read one byte of the spec only, report, close.
				b := make([]byte, 1)
				_, _ = unix.Read(childFD, b)
				var out bytes.Buffer
				for _, m := range tc.report {
					_ = json.NewEncoder(&out).Encode(m)
				}
				_, _ = unix.Write(childFD, out.Bytes())
				unix.Close(childFD)
				done <- b
			}()
			l := &linuxSystem{log: slog.New(slog.DiscardHandler)}
			spec := &procSpec{App: &api.AppSpec{ID: "x"}, Args: []string{"true"}}
			err := l.handshake(&child{sync: conn}, spec, nil, "x")
			if b := <-done; b[0] != '{' {
				t.Fatalf("the child read %q first, not the spec", b)
			}
			if tc.ok && err != nil {
				t.Fatalf("handshake: %v", err)
			}
			if !tc.ok && (err == nil || !strings.Contains(err.Error(), "init died during setup")) {
				t.Fatalf("handshake of a child that died before exec: %v", err)
			}
		})
	}
}

// The spec is sent without a trailing newline, so a child whose decoder
// stops at the closing brace has read everything.
func TestHandshakeSpecHasNoTrailer(t *testing.T) {
	conn, childFD := syncPair(t)
	spec := &procSpec{App: &api.AppSpec{ID: "x"}, Args: []string{"true"}}
	got := make(chan error, 1)
	go func() {
		l := &linuxSystem{log: slog.New(slog.DiscardHandler)}
		got <- l.handshake(&child{sync: conn}, spec, nil, "x")
	}()
	want, err := json.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, len(want))
	for n := 0; n < len(buf); {
		m, err := unix.Read(childFD, buf[n:])
		if err != nil || m == 0 {
			unix.Close(childFD)
			t.Fatalf("read spec: %d, %v", m, err)
		}
		n += m
	}
	if !bytes.Equal(buf, want) {
		unix.Close(childFD)
		t.Fatalf("spec on the wire:\n%s\nwant\n%s", buf, want)
	}
	var m syncMsg
	m.Exec = true
	b, _ := json.Marshal(m)
	_, _ = unix.Write(childFD, b)
	// Nothing may follow the spec: with the child's end still open, a
	// non-blocking read finds the queue empty.
	var extra error
	if err := unix.SetNonblock(childFD, true); err != nil {
		extra = err
	} else if n, err := unix.Read(childFD, make([]byte, 1)); err != unix.EAGAIN {
		extra = fmt.Errorf("bytes after the spec: %d, %v", n, err)
	}
	unix.Close(childFD)
	if extra != nil {
		t.Fatal(extra)
	}
	if err := <-got; err != nil {
		t.Fatalf("handshake: %v", err)
	}
}
