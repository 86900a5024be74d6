package broker

import (
	"context"
	"io"

	"github.com/stagelet/stagelet/agent/client"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/stage1/podconn"
)

// Streaming sessions: exec with streamed stdio, attach and port-forward.
// The pod's stage1 runs them over its agent's channel, so they work the
// same in every stage1 (port-forward dials inside the pod, also in a VM).
// A session holds no broker lock and no operation lock: it runs beside
// the pod's lifecycle calls and ends when its container or pod stops.

// CheckRunning returns nil when the container's record says it runs:
// NotFound, FailedPrecondition. It answers from memory, for the CRI calls
// that hand out a streaming URL.
func (b *Broker) CheckRunning(ctx context.Context, id string) error {
	_, _, _, err := b.runningContainer(ctx, id)
	return err
}

// CheckPodReady returns nil when the pod is ready: NotFound,
// FailedPrecondition. It answers from memory.
func (b *Broker) CheckPodReady(ctx context.Context, podID string) error {
	_, _, err := b.readyPod(ctx, podID)
	return err
}

// StreamIO are the streams of an exec or attach session.
type StreamIO = client.StreamIO

// Exec runs cmd in a running container with its stdio connected to sio
// and returns its exit code. InvalidArgument (empty command), NotFound,
// FailedPrecondition (not running, the command cannot be executed),
// Unavailable (the pod's agent went away).
func (b *Broker) Exec(ctx context.Context, id string, cmd []string, sio StreamIO) (int32, error) {
	if err := CheckCommand("cmd", cmd); err != nil {
		return 0, err
	}
	c, p, h, err := b.runningContainer(ctx, id)
	if err != nil {
		return 0, err
	}
	code, err := h.ExecStream(ctx, c.rec.ID, cmd, sio)
	if err != nil {
		b.refreshAfterSession(p, c, err)
		return 0, err
	}
	return code, nil
}

// Attach connects sio to a running container's stdio until it exits or
// the client detaches. NotFound, FailedPrecondition, Unavailable.
func (b *Broker) Attach(ctx context.Context, id string, sio StreamIO) error {
	c, p, h, err := b.runningContainer(ctx, id)
	if err != nil {
		return err
	}
	err = h.Attach(ctx, c.rec.ID, sio)
	b.refreshAfterSession(p, c, err)
	return err
}

// PortForward connects stream to a TCP port of a ready pod, dialled inside
// the pod's network namespace by its agent. NotFound, InvalidArgument
// (bad port), FailedPrecondition (not ready, nothing accepts on the port),
// Unavailable.
func (b *Broker) PortForward(ctx context.Context, podID string, port int32, stream io.ReadWriter) error {
	if port <= 0 || port > 65535 {
		return errdefs.InvalidArgument("port: %d is not a TCP port", port)
	}
	_, h, err := b.readyPod(ctx, podID)
	if err != nil {
		return err
	}
	return h.PortForward(ctx, port, stream)
}

// readyPod returns a ready pod with its handle.
func (b *Broker) readyPod(ctx context.Context, podID string) (*pod, *podconn.Pod, error) {
	p, err := b.lookupPod(podID)
	if err != nil {
		return nil, nil, err
	}
	if err := waitCreated(ctx, p.created); err != nil {
		return nil, nil, err
	}
	if p.err != nil {
		return nil, nil, errdefs.NotFound("pod sandbox %q not found", podID)
	}
	h, err := b.podHandle(p)
	if err != nil {
		return nil, nil, err
	}
	return p, h, nil
}

// refreshAfterSession brings a container's record up to date when its
// agent refused a session because the app no longer runs; the session's
// own context may have ended, so the refresh has its own.
func (b *Broker) refreshAfterSession(p *pod, c *container, err error) {
	if err == nil {
		return
	}
	ctx, cancel := agentCtx(context.Background(), agentTimeout)
	defer cancel()
	b.refreshOnRefusal(ctx, p, c, err)
}
