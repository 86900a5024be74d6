package wire

import (
	"bytes"
	"encoding/binary"
	"io"
	"strings"
	"testing"

	"github.com/stagelet/stagelet/agent/api"
)

func TestFrames(t *testing.T) {
	var b bytes.Buffer
	b.WriteString("\n") // what json.Encoder leaves after the response
	fw := NewWriter(&b)
	big := bytes.Repeat([]byte("0123456789"), 10000)
	if err := fw.Send(api.FrameStdout, big); err != nil {
		t.Fatal(err)
	}
	if err := fw.Send(api.FrameEOF, nil); err != nil {
		t.Fatal(err)
	}
	if err := fw.SendJSON(api.FrameEnd, api.SessionEnd{ExitCode: 7}); err != nil {
		t.Fatal(err)
	}
	fr := NewReader(&b)
	var got []byte
	frames := 0
	for {
		typ, p, err := fr.Next()
		if err != nil {
			t.Fatal(err)
		}
		if typ != api.FrameStdout {
			if typ != api.FrameEOF || len(p) != 0 {
				t.Fatalf("frame %q %q after the output", typ, p)
			}
			break
		}
		if len(p) > chunk {
			t.Fatalf("frame of %d bytes, chunks are %d", len(p), chunk)
		}
		frames++
		got = append(got, p...)
	}
	if !bytes.Equal(got, big) || frames != (len(big)+chunk-1)/chunk {
		t.Errorf("read %d bytes in %d frames, wrote %d", len(got), frames, len(big))
	}
	if typ, p, err := fr.Next(); err != nil || typ != api.FrameEnd || string(p) != `{"exitCode":7}` {
		t.Errorf("end frame: %q %q %v", typ, p, err)
	}
	if _, _, err := fr.Next(); err != io.EOF {
		t.Errorf("after the last frame: %v", err)
	}

	// A frame longer than the limit is refused before it is read.
	var hdr [5]byte
	hdr[0] = api.FrameData
	binary.BigEndian.PutUint32(hdr[1:], api.MaxFramePayload+1)
	if _, _, err := NewReader(bytes.NewReader(hdr[:])).Next(); err == nil || !strings.Contains(err.Error(), "exceeds the limit") {
		t.Errorf("oversized frame: %v", err)
	}
	// A stream that ends inside a frame is an error, not a clean end.
	if _, _, err := NewReader(bytes.NewReader([]byte{api.FrameData, 0, 0, 0, 9, 'x'})).Next(); err != io.ErrUnexpectedEOF {
		t.Errorf("truncated frame: %v", err)
	}
}
