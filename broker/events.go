package broker

import (
	"sync"
	"time"
)

// Event types: what happened to a container, or to a pod sandbox (the
// event's ContainerID is then the pod's ID), as the CRI's
// GetContainerEvents names them.
const (
	EventCreated = "created"
	EventStarted = "started"
	EventStopped = "stopped"
	EventDeleted = "deleted"
)

// SubscriberBuffer is how many events a subscriber may fall behind before
// the broker drops it.
const SubscriberBuffer = 1024

// ContainerEvent is one change, with the pod's status and its containers'
// records as they were right after it.
type ContainerEvent struct {
	Type        string
	ContainerID string
	Pod         PodStatus
	Containers  []ContainerRecord
	At          time.Time
}

// Subscription receives the broker's events in order. Dropped is closed
// when the broker dropped the subscriber for falling SubscriberBuffer
// events behind (what remains in C is still delivered).
type Subscription struct {
	C       <-chan ContainerEvent
	Dropped <-chan struct{}

	ch      chan ContainerEvent
	dropped chan struct{}
	once    sync.Once
	b       *Broker
}

// Subscribe returns a subscription to every event from now on; Close it
// when done.
func (b *Broker) Subscribe() *Subscription {
	n := b.subBuffer
	if n == 0 {
		n = SubscriberBuffer
	}
	s := &Subscription{ch: make(chan ContainerEvent, n), dropped: make(chan struct{}), b: b}
	s.C, s.Dropped = s.ch, s.dropped
	b.subsMu.Lock()
	if b.subs == nil {
		b.subs = map[*Subscription]struct{}{}
	}
	b.subs[s] = struct{}{}
	b.nsubs.Add(1)
	b.subsMu.Unlock()
	return s
}

// Close ends the subscription. Idempotent.
func (s *Subscription) Close() {
	s.b.subsMu.Lock()
	if _, ok := s.b.subs[s]; ok {
		delete(s.b.subs, s)
		s.b.nsubs.Add(-1)
	}
	s.b.subsMu.Unlock()
	s.once.Do(func() { close(s.dropped) })
}

// publishLocked hands an event about a container (or, with c nil, about
// the pod) to every subscriber, without waiting for any: one whose buffer
// is full is dropped with a log line. Called with b.mu held, in the same
// critical section as the change, so that subscribers see the changes of
// a container in the order they were made.
func (b *Broker) publishLocked(typ string, p *pod, c *container) {
	b.nriPublishLocked(typ, p, c)
	if b.nsubs.Load() == 0 {
		return
	}
	ev := ContainerEvent{Type: typ, At: time.Now(), ContainerID: p.rec.ID}
	ev.Pod = PodStatus{Record: *p.rec, Ready: p.rec.State == PodReady && p.handle != nil}
	if c != nil {
		ev.ContainerID = c.rec.ID
	}
	for _, oc := range b.ctrs {
		if oc.rec.PodID == p.rec.ID && oc.rec.State != ContainerCreating {
			ev.Containers = append(ev.Containers, *oc.rec)
		}
	}
	if c != nil && typ == EventDeleted {
		ev.Containers = append(ev.Containers, *c.rec) // its last record
	}
	b.subsMu.Lock()
	defer b.subsMu.Unlock()
	for s := range b.subs {
		select {
		case s.ch <- ev:
		default:
			delete(b.subs, s)
			b.nsubs.Add(-1)
			s.once.Do(func() { close(s.dropped) })
			b.log.Warn("dropped a container event subscriber that fell behind", "buffered", cap(s.ch))
		}
	}
}
