package cri

import (
	"io"
	"testing"
	"time"

	"k8s.io/cri-streaming/pkg/streaming/remotecommand"

	"github.com/stagelet/stagelet/agent/api"
)

// TestStreamIO: streams the client did not open stay nil (not typed nils
// the agent would then ask for), and terminal sizes are relayed until stop.
func TestStreamIO(t *testing.T) {
	var in io.Reader
	var out, errOut io.WriteCloser
	sio, stop := streamIO(in, out, errOut, false, nil)
	stop()
	if sio.Stdin != nil || sio.Stdout != nil || sio.Stderr != nil || sio.Resize != nil {
		t.Fatalf("absent streams: %+v", sio)
	}
	resize := make(chan remotecommand.TerminalSize, 1)
	resize <- remotecommand.TerminalSize{Width: 80, Height: 24}
	sio, stop = streamIO(in, out, errOut, true, resize)
	defer stop()
	select {
	case got := <-sio.Resize:
		if got != (api.TerminalSize{Width: 80, Height: 24}) {
			t.Errorf("relayed size %+v", got)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no size relayed")
	}
	close(resize)
}
