package livemove

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"

	"github.com/stagelet/stagelet/errdefs"
)

// The frames of a move, after the target was authenticated. From the
// target: Ready (it waits for the state), then Loaded (it holds the
// state, paused) or Fail. From the source: Data frames of the state, End
// (the state is complete, the source paused; a description of the send
// in JSON), then Go (the source stopped for good: the target may run),
// or Fail at any point.
const (
	FrameReady  byte = 'R'
	FrameData   byte = 'D'
	FrameEnd    byte = 'E'
	FrameLoaded byte = 'L'
	FrameGo     byte = 'G'
	FrameFail   byte = 'X'
)

// maxFrame bounds a frame's payload.
const maxFrame = 1 << 20

// chunk is the payload of the data frames SendStream writes.
const chunk = 256 << 10

// WriteFrame writes one frame of type typ.
func WriteFrame(w io.Writer, typ byte, payload []byte) error {
	if len(payload) > maxFrame {
		return fmt.Errorf("live move: a frame of %d bytes", len(payload))
	}
	var h [5]byte
	h[0] = typ
	binary.BigEndian.PutUint32(h[1:], uint32(len(payload)))
	if _, err := w.Write(h[:]); err != nil || len(payload) == 0 {
		return err
	}
	_, err := w.Write(payload)
	return err
}

// ReadFrame reads one frame. A Fail frame is returned as an error
// carrying the other side's message.
func ReadFrame(r io.Reader) (typ byte, payload []byte, err error) {
	var h [5]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return 0, nil, err
	}
	n := binary.BigEndian.Uint32(h[1:])
	if n > maxFrame {
		return 0, nil, errdefs.InvalidArgument("live move: a frame of %d bytes", n)
	}
	payload = make([]byte, n)
	if _, err := io.ReadFull(r, payload); err != nil {
		return 0, nil, err
	}
	if h[0] == FrameFail {
		return h[0], payload, &RemoteError{Msg: string(payload)}
	}
	return h[0], payload, nil
}

// Expect reads one frame, which must be of type want.
func Expect(r io.Reader, want byte) ([]byte, error) {
	typ, payload, err := ReadFrame(r)
	if err != nil {
		return nil, err
	}
	if typ != want {
		return nil, errdefs.InvalidArgument("live move: a frame %q where %q was due", typ, want)
	}
	return payload, nil
}

// RemoteError is the other side's failure, as its Fail frame said it.
type RemoteError struct{ Msg string }

func (e *RemoteError) Error() string { return "the other node: " + e.Msg }

// Fail tells the other side why this one gave up, as far as the
// connection still takes it.
func Fail(w io.Writer, err error) {
	msg := err.Error()
	if len(msg) > maxFrame {
		msg = msg[:maxFrame]
	}
	_ = WriteFrame(w, FrameFail, []byte(msg))
}

// SendStream sends what r reads, to its end, as data frames.
func SendStream(w io.Writer, r io.Reader) (int64, error) {
	buf := make([]byte, chunk)
	var n int64
	for {
		k, err := r.Read(buf)
		if k > 0 {
			if werr := WriteFrame(w, FrameData, buf[:k]); werr != nil {
				return n, werr
			}
			n += int64(k)
		}
		if errors.Is(err, io.EOF) {
			return n, nil
		}
		if err != nil {
			return n, err
		}
	}
}

// ReceiveStream writes the data frames r reads into w until the End
// frame, whose payload it returns.
func ReceiveStream(w io.Writer, r io.Reader) (end []byte, n int64, err error) {
	for {
		typ, payload, err := ReadFrame(r)
		if err != nil {
			return nil, n, err
		}
		switch typ {
		case FrameData:
			if _, err := w.Write(payload); err != nil {
				return nil, n, err
			}
			n += int64(len(payload))
		case FrameEnd:
			return payload, n, nil
		default:
			return nil, n, errdefs.InvalidArgument("live move: a frame %q within the state", typ)
		}
	}
}
