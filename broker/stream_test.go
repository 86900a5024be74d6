package broker

import (
	"bytes"
	"context"
	"io"
	"strings"
	"testing"

	"github.com/stagelet/stagelet/errdefs"
)

// TestStreamingSessions: exec, attach and port-forward reach the pod's
// stage1 for running containers and ready pods only; a session the agent
// refuses because the app exited brings the record up to date.
func TestStreamingSessions(t *testing.T) {
	e := newEnv(t)
	b := e.broker(t)
	ctx := context.Background()
	pid, err := b.RunPod(ctx, podCfg("x"))
	if err != nil {
		t.Fatal(err)
	}
	cid, err := b.CreateContainer(ctx, pid, ctrCfg("c"))
	if err != nil {
		t.Fatal(err)
	}
	wantClass(t, b.CheckRunning(ctx, cid), errdefs.ErrFailedPrecondition)
	_, err = b.Exec(ctx, cid, []string{"true"}, StreamIO{Stdout: io.Discard})
	wantClass(t, err, errdefs.ErrFailedPrecondition)
	if err := b.StartContainer(ctx, cid); err != nil {
		t.Fatal(err)
	}
	if err := b.CheckRunning(ctx, cid); err != nil {
		t.Fatal(err)
	}
	wantClass(t, b.CheckRunning(ctx, "nosuch-container"), errdefs.ErrNotFound)

	var out bytes.Buffer
	code, err := b.Exec(ctx, cid[:12], []string{"sh", "-c", "echo out; cat -; exit 2"}, StreamIO{Stdin: strings.NewReader("in"), Stdout: &out})
	if err != nil || code != 2 || out.String() != "out\nin" {
		t.Fatalf("exec: code %d, err %v, out %q", code, err, out.String())
	}
	_, err = b.Exec(ctx, cid, nil, StreamIO{Stdout: &out})
	wantClass(t, err, errdefs.ErrInvalidArgument)

	// An app reading its stdin once: the session lasts until it exits,
	// its output copied.
	cat := ctrCfg("cat")
	cat.Command, cat.Args, cat.Stdin, cat.StdinOnce = []string{"cat"}, nil, true, true
	catID, err := b.CreateContainer(ctx, pid, cat)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.StartContainer(ctx, catID); err != nil {
		t.Fatal(err)
	}
	out.Reset()
	if err := b.Attach(ctx, catID, StreamIO{Stdin: strings.NewReader("typed"), Stdout: &out}); err != nil || out.String() != "typed" {
		t.Fatalf("attach: %v %q", err, out.String())
	}

	if err := b.CheckPodReady(ctx, pid); err != nil {
		t.Fatal(err)
	}
	var back bytes.Buffer
	pf := struct {
		io.Reader
		io.Writer
	}{strings.NewReader("ping"), &back}
	if err := b.PortForward(ctx, pid, 8080, pf); err != nil || back.String() != "port 8080: ping" {
		t.Fatalf("port-forward: %v %q", err, back.String())
	}
	wantClass(t, b.PortForward(ctx, pid, 0, pf), errdefs.ErrInvalidArgument)
	wantClass(t, b.PortForward(ctx, "nosuch-pod", 80, pf), errdefs.ErrNotFound)

	// The app exits behind the record's back: the agent's refusal
	// updates the record.
	e.be.Pod(pid).Exit(cid, 3)
	_, err = b.Exec(ctx, cid, []string{"true"}, StreamIO{Stdout: &out})
	wantClass(t, err, errdefs.ErrFailedPrecondition)
	b.mu.Lock()
	state := b.ctrs[cid].rec.State
	b.mu.Unlock()
	if state != ContainerExited {
		t.Fatalf("record after the refusal: %s", state)
	}
	wantClass(t, b.CheckRunning(ctx, cid), errdefs.ErrFailedPrecondition)

	if err := b.StopPod(ctx, pid); err != nil {
		t.Fatal(err)
	}
	wantClass(t, b.CheckPodReady(ctx, pid), errdefs.ErrFailedPrecondition)
	wantClass(t, b.PortForward(ctx, pid, 80, pf), errdefs.ErrFailedPrecondition)
}
