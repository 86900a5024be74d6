package agent

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/stagelet/stagelet/agent/api"
)

func TestFrames(t *testing.T) {
	var b bytes.Buffer
	b.WriteString("\n") // what json.Encoder leaves after the response
	fw := newFrameWriter(&b)
	big := bytes.Repeat([]byte("0123456789"), 10000)
	if err := fw.write(api.FrameStdout, big); err != nil {
		t.Fatal(err)
	}
	if err := fw.write(api.FrameEOF, nil); err != nil {
		t.Fatal(err)
	}
	if err := fw.writeJSON(api.FrameEnd, api.SessionEnd{ExitCode: 7}); err != nil {
		t.Fatal(err)
	}
	fr := newFrameReader(&b)
	var got []byte
	frames := 0
	for {
		typ, p, err := fr.read()
		if err != nil {
			t.Fatal(err)
		}
		if typ != api.FrameStdout {
			if typ != api.FrameEOF || len(p) != 0 {
				t.Fatalf("frame %q %q after the output", typ, p)
			}
			break
		}
		if len(p) > frameChunk {
			t.Fatalf("frame of %d bytes, chunks are %d", len(p), frameChunk)
		}
		frames++
		got = append(got, p...)
	}
	if !bytes.Equal(got, big) || frames != (len(big)+frameChunk-1)/frameChunk {
		t.Errorf("read %d bytes in %d frames, wrote %d", len(got), frames, len(big))
	}
	if typ, p, err := fr.read(); err != nil || typ != api.FrameEnd || string(p) != `{"exitCode":7}` {
		t.Errorf("end frame: %q %q %v", typ, p, err)
	}
	if _, _, err := fr.read(); err != io.EOF {
		t.Errorf("after the last frame: %v", err)
	}

	// A frame longer than the limit is refused before it is read.
	var hdr [5]byte
	hdr[0] = api.FrameData
	binary.BigEndian.PutUint32(hdr[1:], api.MaxFramePayload+1)
	if _, _, err := newFrameReader(bytes.NewReader(hdr[:])).read(); err == nil || !strings.Contains(err.Error(), "exceeds the limit") {
		t.Errorf("oversized frame: %v", err)
	}
	// A stream that ends inside a frame is an error, not a clean end.
	if _, _, err := newFrameReader(bytes.NewReader([]byte{api.FrameData, 0, 0, 0, 9, 'x'})).read(); err != io.ErrUnexpectedEOF {
		t.Errorf("truncated frame: %v", err)
	}
}

// TestPortForwardOverSerial: a session runs over the serial transport of
// a kvm pod (yamux streams over one byte stream) as over a unix socket:
// the agent's port-forward, with half-closes both ways.
func TestPortForwardOverSerial(t *testing.T) {
	old := helloInterval
	helloInterval = 20 * time.Millisecond
	t.Cleanup(func() { helloInterval = old })
	port, path := newFakePort(t, false)
	l := NewSerialListener(port, testSlog(t))
	// The session needs nothing of the agent but its log: no reaper,
	// which would reap this test process's other children.
	a := &Agent{log: testSlog(t), done: make(chan struct{})}
	served := make(chan error, 1)
	go func() { served <- a.Serve(l) }()
	t.Cleanup(func() {
		a.Close()
		if err := <-served; err != nil {
			t.Errorf("serve: %v", err)
		}
	})

	srv, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	go func() {
		for {
			c, err := srv.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				b, _ := io.ReadAll(c)
				fmt.Fprintf(c, "%d bytes", len(b))
			}()
		}
	}()

	d := NewSerialDialer(path, testSlog(t))
	t.Cleanup(func() { d.Close() })
	c := NewClient(d.Dial)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var got bytes.Buffer
	stream := struct {
		io.Reader
		io.Writer
	}{bytes.NewReader(make([]byte, 300000)), &got}
	if err := c.PortForward(ctx, int32(srv.Addr().(*net.TCPAddr).Port), stream); err != nil {
		t.Fatal(err)
	}
	if got.String() != "300000 bytes" {
		t.Errorf("the pod's side answered %q", got.String())
	}
}
