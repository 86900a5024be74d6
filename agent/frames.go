package agent

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

// frameChunk is the most payload one frame carries when a writer splits
// a longer write.
const frameChunk = 32 << 10

// frameWriter writes session frames (see package api) to a stream. Writes
// are serialised, so several copiers may share one writer.
type frameWriter struct {
	mu   sync.Mutex
	w    io.Writer
	hdr  [5]byte
	conn net.Conn // when set, every write is bounded by writeTimeout
	// writeTimeout bounds one frame's write; zero means no bound.
	writeTimeout time.Duration
}

func newFrameWriter(w io.Writer) *frameWriter {
	fw := &frameWriter{w: w}
	if c, ok := w.(net.Conn); ok {
		fw.conn = c
	}
	return fw
}

// write sends p as frames of type typ (at least one frame, so an empty p
// sends an empty frame).
func (fw *frameWriter) write(typ byte, p []byte) error {
	fw.mu.Lock()
	defer fw.mu.Unlock()
	if fw.conn != nil && fw.writeTimeout > 0 {
		fw.conn.SetWriteDeadline(time.Now().Add(fw.writeTimeout))
	}
	for first := true; first || len(p) > 0; first = false {
		n := min(len(p), frameChunk)
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

// writeJSON sends v, JSON-encoded, as one frame of type typ.
func (fw *frameWriter) writeJSON(typ byte, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return fw.write(typ, b)
}

// streamWriter is an io.Writer sending every write as frames of one type.
type streamWriter struct {
	fw  *frameWriter
	typ byte
}

func (s streamWriter) Write(p []byte) (int, error) {
	if err := s.fw.write(s.typ, p); err != nil {
		return 0, err
	}
	return len(p), nil
}

// frameReader reads session frames from a stream. It is used by one
// goroutine.
type frameReader struct {
	r   *bufio.Reader
	buf []byte
	// afterJSON: the stream starts with the newline json.Encoder ends
	// the request or response with.
	afterJSON bool
}

// newFrameReader reads the frames that follow a JSON request or response
// on r (whose newline it skips).
func newFrameReader(r io.Reader) *frameReader {
	return &frameReader{r: bufio.NewReaderSize(r, frameChunk+5), afterJSON: true}
}

// read returns the next frame. The payload is valid until the next call.
// A frame longer than api.MaxFramePayload is an error.
func (fr *frameReader) read() (byte, []byte, error) {
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
