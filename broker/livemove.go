package broker

import (
	"context"
	"errors"
	"fmt"
	"net"

	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/livemove"
	"github.com/stagelet/stagelet/stage1"
	"github.com/stagelet/stagelet/stage1/podconn"
)

// A pod whose stage1 saves it whole moves live when it asks to
// (AnnotationCheckpoint "live") and this node offers live moves
// (Options.LiveAddress): CheckpointContainer then writes an archive that
// holds, in place of the pod's state, its description and a ticket
// (package livemove), and the pod runs on. The archive goes where any
// checkpoint goes (a checkpoint image, a pod on the other node naming
// it); the container created from it there takes the ticket to this
// node at StartContainer, and the pod streams over the connection the
// two authenticated, pausing only for the last of it. The source's pod
// is then gone (its containers exited), the target's runs. A ticket is
// good once, for livemove.OfferTTL, and while the pod runs here.

// AnnotationCheckpoint on a pod says how CheckpointContainer saves it:
// "live" for a live move.
const AnnotationCheckpoint = "stagelet.io/checkpoint"

// movesLive tells whether pod p asks to move live. InvalidArgument for
// another value of the annotation.
func (b *Broker) movesLive(p *pod) (bool, error) {
	b.mu.Lock()
	v, ok := p.rec.Config.Annotations[AnnotationCheckpoint]
	b.mu.Unlock()
	switch {
	case !ok:
		return false, nil
	case v == "live":
		return true, nil
	}
	return false, errdefs.InvalidArgument("pod %s: annotation %s=%q: want \"live\", or none", p.id(), AnnotationCheckpoint, v)
}

// offerLive describes h's pod into dir, with the ticket of a new offer.
// FailedPrecondition when this node offers no live moves, the stage1
// cannot move a pod live, or the pod cannot move (its reason).
func (b *Broker) offerLive(ctx context.Context, h *podconn.Pod, dir string) (*livemove.Offer, error) {
	if b.opts.LiveAddress == "" {
		return nil, errdefs.FailedPrecondition("the pod asks to move live (annotation %s: live), and this node offers no live moves: set checkpoint.live_address", AnnotationCheckpoint)
	}
	sender, ok := h.Pod.(stage1.PodSender)
	if !ok {
		return nil, errdefs.FailedPrecondition("the pod asks to move live (annotation %s: live), and its stage1 cannot move one live", AnnotationCheckpoint)
	}
	if err := sender.DescribePod(ctx, dir); err != nil {
		return nil, err
	}
	o, err := livemove.NewOffer(b.opts.LiveAddress, livemove.OfferTTL, b.log)
	if err != nil {
		return nil, err
	}
	if err := livemove.WriteTicket(dir, o.Ticket()); err != nil {
		o.Close()
		return nil, err
	}
	return o, nil
}

// serveLive waits, in the background, for offer's target and streams
// pod p (handle h) to it; a newer offer of the pod withdraws this one.
// Once the target runs the pod, the pod here is gone.
func (b *Broker) serveLive(p *pod, c *container, h *podconn.Pod, o *livemove.Offer) {
	b.mu.Lock()
	if old := p.offer; old != nil {
		old.Close()
	}
	p.offer = o
	b.mu.Unlock()
	go func() {
		ctx := context.Background()
		defer func() {
			b.mu.Lock()
			if p.offer == o {
				p.offer = nil
			}
			b.mu.Unlock()
		}()
		conn, err := o.Accept(ctx)
		if err != nil {
			b.log.InfoContext(ctx, "live move offer withdrawn", "pod", p.id(), "address", o.Ticket().Address, "err", err)
			return
		}
		defer conn.Close()
		if err := b.sendLive(ctx, p, c, h, conn); err != nil {
			livemove.Fail(conn, err)
			b.log.WarnContext(ctx, "live move failed", "pod", p.id(), "to", conn.RemoteAddr(), "err", err)
		}
	}()
}

// sendLive streams pod p to the target at the end of conn. The pod's
// container is kept from other calls meanwhile.
func (b *Broker) sendLive(ctx context.Context, p *pod, c *container, h *podconn.Pod, conn net.Conn) error {
	c.op.Lock()
	defer c.op.Unlock()
	b.mu.Lock()
	running := p.handle == h
	b.mu.Unlock()
	if !running {
		return errdefs.FailedPrecondition("pod %s stopped since its checkpoint", p.id())
	}
	sender := h.Pod.(stage1.PodSender) // offerLive checked
	mctx, cancel := context.WithTimeout(ctx, restoreTimeout)
	defer cancel()
	// A pod that moved has its agent gone here: not a death, which its
	// watch would report first. One that did not move is followed again
	// (from a full status).
	b.unwatch(p)
	saved, err := sender.SendPod(mctx, conn)
	if err != nil {
		b.mu.Lock()
		stillHere := p.handle == h
		b.mu.Unlock()
		if stillHere {
			b.watch(p, h)
		}
		return err
	}
	moved := fmt.Sprintf("the pod moved live to %s", conn.RemoteAddr())
	b.podGone(ctx, p, h, errors.New(moved), moved)
	b.log.InfoContext(ctx, "pod moved live", "pod", p.id(), "container", c.rec.ID, "to", conn.RemoteAddr(),
		"bytes", saved.Bytes, "paused", saved.Downtime, "took", saved.Total)
	return nil
}

// withdrawOffer withdraws pod p's live move offer, if any.
func (b *Broker) withdrawOffer(p *pod) {
	b.mu.Lock()
	o := p.offer
	p.offer = nil
	b.mu.Unlock()
	if o != nil {
		o.Close()
	}
}

// dialLive, for a checkpoint in dir that holds a live move's ticket,
// connects to the move's source: the connection and h's pod as the
// stage1.PodReceiver that takes it. Nil when dir holds a saved pod.
// FailedPrecondition when h's stage1 takes no live moves; the ticket's
// errors (livemove.Dial).
func (b *Broker) dialLive(ctx context.Context, h *podconn.Pod, dir string) (stage1.PodReceiver, net.Conn, error) {
	t, ok, err := livemove.ReadTicket(dir)
	if err != nil || !ok {
		return nil, nil, err
	}
	r, ok := h.Pod.(stage1.PodReceiver)
	if !ok {
		return nil, nil, errdefs.FailedPrecondition("the checkpoint is of a pod moving live, and this pod's stage1 cannot take one")
	}
	conn, err := livemove.Dial(ctx, *t)
	if err != nil {
		return nil, nil, err
	}
	return r, conn, nil
}
