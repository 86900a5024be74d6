package supervisor

import (
	"encoding/json"
	"io"
	"net"
	"sync"
	"time"

	"github.com/stagelet/stagelet/agent/api"
)

// hub hands app events to the agent's subscribers (OpEvents streams).
type hub struct {
	mu   sync.Mutex
	subs map[*subscriber]struct{}
}

// subscriber is one OpEvents stream. ch holds the events not yet written;
// gone is closed when the agent drops the subscriber (it fell
// api.EventBuffer behind, or the client went away).
type subscriber struct {
	ch       chan api.Event
	gone     chan struct{}
	dropOnce sync.Once
}

func (s *subscriber) drop() { s.dropOnce.Do(func() { close(s.gone) }) }

func (h *hub) subscribe() *subscriber {
	s := &subscriber{ch: make(chan api.Event, api.EventBuffer), gone: make(chan struct{})}
	h.mu.Lock()
	if h.subs == nil {
		h.subs = map[*subscriber]struct{}{}
	}
	h.subs[s] = struct{}{}
	h.mu.Unlock()
	return s
}

func (h *hub) unsubscribe(s *subscriber) {
	h.mu.Lock()
	delete(h.subs, s)
	h.mu.Unlock()
	s.drop()
}

// publish queues an event for every subscriber without waiting: one whose
// buffer is full is dropped, never waited for.
func (h *hub) publish(typ string, st *api.AppStatus) {
	cp := *st
	ev := api.Event{Type: typ, App: &cp, Time: time.Now()}
	h.mu.Lock()
	defer h.mu.Unlock()
	for s := range h.subs {
		select {
		case s.ch <- ev:
		default:
			delete(h.subs, s)
			s.drop()
		}
	}
}

// serveEvents answers an OpEvents request on c: the snapshot of every app,
// then the events that follow it, until the client closes c, the agent
// drops the subscriber or the agent closes. Subscribing comes before the
// snapshot, so no change falls between them (one may show in both).
func (a *Agent) serveEvents(c net.Conn, in io.Reader) {
	s := a.events.subscribe()
	defer a.events.unsubscribe(s)
	enc := json.NewEncoder(c)
	if err := enc.Encode(&api.Response{Apps: a.list()}); err != nil {
		return
	}
	// The client sends nothing more: a read returns when it closes.
	go func() {
		io.Copy(io.Discard, in)
		a.events.unsubscribe(s)
	}()
	for {
		select {
		case ev := <-s.ch:
			if err := enc.Encode(&ev); err != nil {
				return
			}
		case <-s.gone:
			return
		case <-a.done:
			return
		}
	}
}
