package client_test

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"io"
	"net"
	"strings"
	"testing"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/agent/client"
	"github.com/stagelet/stagelet/agent/wire"
	"github.com/stagelet/stagelet/errdefs"
)

// TestLogsAcksAndRefusals: each frame of whole lines is written, then
// acknowledged with its size; a frame that is not whole lines is refused
// before it is written.
func TestLogsAcksAndRefusals(t *testing.T) {
	ctx := testContext(t)
	acks := make(chan uint64, 4)
	frames := []string{"a F one\n", "a F two\nb F three\n", "a P cut"}
	c := peer(func(c net.Conn, in io.Reader, _ *api.Request) {
		_ = json.NewEncoder(c).Encode(&api.Response{})
		fw, fr := wire.NewWriter(c), wire.NewReader(in)
		for _, f := range frames {
			if fw.Send(api.FrameLog, []byte(f)) != nil {
				return
			}
			typ, p, err := fr.Next()
			if err != nil || typ != api.FrameLogAck || len(p) != 8 {
				return
			}
			acks <- binary.BigEndian.Uint64(p)
		}
	})
	var got strings.Builder
	err := c.Logs(ctx, "a", func(p []byte) error { got.Write(p); return nil })
	if !errors.Is(err, client.ErrUntrusted) || !errors.Is(err, errdefs.ErrUnavailable) {
		t.Errorf("a frame cut inside a line: %v", err)
	}
	if got.String() != frames[0]+frames[1] {
		t.Errorf("written %q", got.String())
	}
	if a, b := <-acks, <-acks; a != uint64(len(frames[0])) || b != uint64(len(frames[1])) {
		t.Errorf("acknowledged %d and %d bytes", a, b)
	}
}
