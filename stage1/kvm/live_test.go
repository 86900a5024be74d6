package kvm

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/agent/client"
	"github.com/stagelet/stagelet/livemove"
)

// TestSendPodTargetFailsAfterStream: a target that takes the whole
// stream of a live move and then fails to load it (its Fail in place of
// Loaded) leaves the source's VM running on, from the pause qemu holds it
// in after a completed migration: its app keeps its PID and answers exec.
func TestSendPodTargetFailsAfterStream(t *testing.T) {
	b := testBackend(t)
	tn := newTestNet(t)
	ns, _ := tn.podNet(t, fmt.Sprintf("sndf%d", os.Getpid()))
	vp := startVM(t, b, ns, nil)
	p := vp.pod.Pod.(*Pod)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()

	c := client.NewClient(p.dial)
	app, before := startMovableApp(ctx, t, c)

	source, target := net.Pipe()
	defer source.Close()
	const why = "the test's target cannot load the VM"
	streamed := make(chan int64, 1)
	go func() {
		defer target.Close()
		if err := livemove.WriteFrame(target, livemove.FrameReady, nil); err != nil {
			streamed <- -1
			return
		}
		_, n, err := livemove.ReceiveStream(io.Discard, target)
		if err != nil {
			streamed <- -1
			return
		}
		livemove.Fail(target, errors.New(why))
		streamed <- n
	}()
	_, err := p.SendPod(ctx, source)
	if err == nil || !strings.Contains(err.Error(), why) {
		t.Fatalf("SendPod to a target that failed after the stream: %v", err)
	}
	if n := <-streamed; n <= 0 {
		t.Fatalf("the target did not get the whole stream (%d bytes)", n)
	}
	q, err := p.dialQMP(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer q.Close()
	if st, err := q.status(ctx); err != nil || st != "running" {
		t.Errorf("the source's VM after the failed move: %q, %v", st, err)
	}
	after, err := c.Status(ctx, app.ID)
	if err != nil || after.State != api.StateRunning || after.PID != before.PID {
		t.Errorf("the app after the failed move: %+v, %v; before: %+v", after, err, before)
	}
	if res, err := c.Exec(ctx, app.ID, []string{"/init", "version"}, 30*time.Second); err != nil || res.ExitCode != 0 {
		t.Errorf("exec after the failed move: %+v, %v", res, err)
	}
}
