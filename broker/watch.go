package broker

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/stage1/podconn"
)

// The broker learns what happens in a pod from its agent's events: one
// subscription per ready pod (follow), whose first message is a full
// status (resync). Status and list calls then answer from the records
// alone.
const (
	// resubscribeMin and resubscribeMax bound the wait before subscribing
	// again after a stream ended while the agent still answers (it
	// dropped the broker for reading too slowly, or the transport broke).
	resubscribeMin = 50 * time.Millisecond
	resubscribeMax = 2 * time.Second
	// agentGoneTimeout bounds the one call that tells a dead agent from
	// a broken stream.
	agentGoneTimeout = 2 * time.Second
	// legacyPollInterval is how often an agent without events (started
	// by an older daemon, still running after an upgrade) is polled by
	// its follower, off the status path.
	legacyPollInterval = 2 * time.Second
)

// watch starts following a ready pod's agent and returns a channel closed
// once the agent's full status was applied to the records (or following
// ended first). It replaces an earlier follower of the pod.
func (b *Broker) watch(p *pod, h *podconn.Pod) <-chan struct{} {
	ctx, cancel := context.WithCancel(context.Background())
	b.mu.Lock()
	prev := p.unwatch
	p.unwatch = cancel
	b.mu.Unlock()
	if prev != nil {
		prev()
	}
	synced := make(chan struct{})
	b.followers.Add(1)
	go func() {
		defer b.followers.Done()
		b.follow(ctx, p, h, synced)
	}()
	return synced
}

// unwatch stops following the pod's agent: before the pod is stopped on
// purpose, so that its agent going away is not taken for a death.
func (b *Broker) unwatch(p *pod) {
	b.mu.Lock()
	cancel := p.unwatch
	p.unwatch = nil
	b.mu.Unlock()
	if cancel != nil {
		cancel()
	}
}

// follow subscribes to the agent's events until ctx ends or the agent is
// gone, which it reports at once (podGone): the stream's end is the
// signal, no list call is needed. A stream that ends while the agent
// still answers is subscribed again, starting from a new full status.
func (b *Broker) follow(ctx context.Context, p *pod, h *podconn.Pod, synced chan struct{}) {
	var once sync.Once
	markSynced := func() { once.Do(func() { close(synced) }) }
	defer markSynced()
	id := p.id()
	if info, err := h.Info(ctx); err == nil {
		b.mu.Lock()
		p.agent = info
		b.mu.Unlock()
	}
	wait := resubscribeMin
	for {
		err := h.Watch(ctx,
			func(apps []*api.AppStatus) {
				b.resync(ctx, p, h, apps)
				markSynced()
			},
			func(ev *api.Event) {
				wait = resubscribeMin
				b.applyEvent(ctx, p, ev)
			})
		if ctx.Err() != nil {
			return
		}
		if errors.Is(err, errdefs.ErrInvalidArgument) {
			b.log.WarnContext(ctx, "the pod's agent sends no events (an older stagelet started it); polling it instead", "pod", id, "every", legacyPollInterval, "err", err)
			b.poll(ctx, p, h, markSynced)
			return
		}
		b.obs.AgentDisconnected(p.rec.Stage1) // its Stage1 never changes
		if b.agentGone(ctx, p, h, err) {
			return
		}
		b.log.DebugContext(ctx, "subscribing to the pod's agent again", "pod", id, "err", err)
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		wait = min(2*wait, resubscribeMax)
	}
}

// agentGone tells whether the agent whose event stream ended (why) still
// answers; when it does not, the pod is marked gone. It also says true
// when ctx ended meanwhile.
func (b *Broker) agentGone(ctx context.Context, p *pod, h *podconn.Pod, why error) bool {
	ictx, cancel := context.WithTimeout(ctx, agentGoneTimeout)
	_, err := h.Info(ictx)
	cancel()
	if ctx.Err() != nil {
		return true
	}
	if err == nil || !errors.Is(err, errdefs.ErrUnavailable) {
		return false
	}
	b.podGone(ctx, p, h, why, "")
	return true
}

// poll follows an agent that has no events by listing its apps.
func (b *Broker) poll(ctx context.Context, p *pod, h *podconn.Pod, synced func()) {
	t := time.NewTicker(legacyPollInterval)
	defer t.Stop()
	for {
		actx, cancel := context.WithTimeout(ctx, agentTimeout)
		apps, err := h.ListContainers(actx)
		cancel()
		if ctx.Err() != nil {
			return
		}
		switch {
		case err == nil:
			b.resync(ctx, p, h, apps)
			synced()
		case errors.Is(err, errdefs.ErrUnavailable):
			b.podGone(ctx, p, h, err, "")
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// resync applies the agent's full status to every container of the pod.
// A container the records say runs but the agent does not list is asked
// about once more before it is marked gone: the list may predate a create
// that finished since.
func (b *Broker) resync(ctx context.Context, p *pod, h *podconn.Pod, apps []*api.AppStatus) {
	byID := make(map[string]*api.AppStatus, len(apps))
	for _, a := range apps {
		byID[a.ID] = a
	}
	for _, c := range b.containersOf(p.id()) {
		if st, ok := byID[c.rec.ID]; ok {
			b.applyAppStatus(ctx, c, st)
			continue
		}
		b.mu.Lock()
		live := c.rec.State == ContainerRunning
		b.mu.Unlock()
		if !live {
			continue
		}
		actx, cancel := context.WithTimeout(ctx, agentTimeout)
		st, err := h.ContainerStatus(actx, c.rec.ID)
		cancel()
		switch {
		case err == nil:
			b.applyAppStatus(ctx, c, st)
		case errdefs.IsNotFound(err):
			b.markGone(ctx, c, "the pod's agent no longer knows the container")
		}
	}
}

// applyEvent applies one event of the pod's agent to the container's
// record. Events for containers whose creation has not finished are left
// to the create call, which records what the agent answered.
func (b *Broker) applyEvent(ctx context.Context, p *pod, ev *api.Event) {
	if ev.Type == api.EventRemoved {
		return // only the broker removes containers
	}
	b.mu.Lock()
	c := b.ctrs[ev.App.ID]
	b.mu.Unlock()
	if c == nil || c.rec.PodID != p.id() {
		return
	}
	select {
	case <-c.created:
		if c.err != nil {
			return
		}
	default:
		return
	}
	b.applyAppStatus(ctx, c, ev.App)
}
