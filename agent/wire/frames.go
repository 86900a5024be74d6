// Package wire is how the agent's protocol (package api) travels on a
// stream, for both of its ends: the session frames that follow a JSON
// request and response, the error codes a response carries, and the
// server's side of exec, attach and port-forward sessions for another
// implementation of the agent (a test double).
package wire

import (
	"bufio"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"sync"
	"time"

	"github.com/stagelet/stagelet/agent/api"
)

// chunk is the most payload one frame carries when a writer splits
// a longer write.
const chunk = 32 << 10

// Writer writes session frames (see package api) to a stream. Writes
// are serialised, so several copiers may share one writer.
type Writer struct {
	mu   sync.Mutex
	w    io.Writer
	hdr  [5]byte
	conn net.Conn // when set, every write is bounded by writeTimeout
	// WriteTimeout bounds one frame's write on a net.Conn; zero means
	// no bound. Set it before the first Send.
	WriteTimeout time.Duration
}

// NewWriter returns a writer of frames to w; when w is a net.Conn,
// WriteTimeout applies.
func NewWriter(w io.Writer) *Writer {
	fw := &Writer{w: w}
	if c, ok := w.(net.Conn); ok {
		fw.conn = c
	}
	return fw
}

// Send sends p as frames of type typ (at least one frame, so an empty p
// sends an empty frame).
func (fw *Writer) Send(typ byte, p []byte) error {
	fw.mu.Lock()
	defer fw.mu.Unlock()
	if fw.conn != nil && fw.WriteTimeout > 0 {
		fw.conn.SetWriteDeadline(time.Now().Add(fw.WriteTimeout))
	}
	for first := true; first || len(p) > 0; first = false {
		n := min(len(p), chunk)
		fw.hdr[0] = typ
		binary.BigEndian.PutUint32(fw.hdr[1:], uint32(n))
		if _, err := fw.w.Write(fw.hdr[:]); err != nil {
			return err
		}
		if n > 0 {
			if _, err := fw.w.Write(p[:n]); err != nil {
				return err
			}
		}
		p = p[n:]
	}
	return nil
}

// SendJSON sends v, JSON-encoded, as one frame of type typ.
func (fw *Writer) SendJSON(typ byte, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return fw.Send(typ, b)
}

// Stream returns an io.Writer sending every write as frames of type typ.
func (fw *Writer) Stream(typ byte) io.Writer { return stream{fw, typ} }

type stream struct {
	fw  *Writer
	typ byte
}

func (s stream) Write(p []byte) (int, error) {
	if err := s.fw.Send(s.typ, p); err != nil {
		return 0, err
	}
	return len(p), nil
}

// Reader reads session frames from a stream. It is used by one
// goroutine.
type Reader struct {
	r   *bufio.Reader
	buf []byte
	// afterJSON: the stream starts with the newline json.Encoder ends
	// the request or response with.
	afterJSON bool
}

// NewReader reads the frames that follow a JSON request or response
// on r (whose newline it skips).
func NewReader(r io.Reader) *Reader {
	return &Reader{r: bufio.NewReaderSize(r, chunk+5), afterJSON: true}
}

// Next returns the next frame. The payload is valid until the next call.
// A frame longer than api.MaxFramePayload is an error.
func (fr *Reader) Next() (byte, []byte, error) {
	if fr.afterJSON {
		fr.afterJSON = false
		if b, err := fr.r.Peek(1); err == nil && b[0] == '\n' {
			fr.r.Discard(1)
		}
	}
	var hdr [5]byte
	if _, err := io.ReadFull(fr.r, hdr[:]); err != nil {
		return 0, nil, err
	}
	n := binary.BigEndian.Uint32(hdr[1:])
	if n > api.MaxFramePayload {
		return 0, nil, fmt.Errorf("frame of %d bytes exceeds the limit of %d", n, api.MaxFramePayload)
	}
	if cap(fr.buf) < int(n) {
		fr.buf = make([]byte, n)
	}
	p := fr.buf[:n]
	if _, err := io.ReadFull(fr.r, p); err != nil {
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return 0, nil, err
	}
	return hdr[0], p, nil
}
