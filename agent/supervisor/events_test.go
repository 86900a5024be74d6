package supervisor

import (
	"testing"

	"github.com/stagelet/stagelet/agent/api"
)

// TestSlowSubscriberDropped: a subscriber that reads nothing is dropped
// once EventBuffer events wait for it; publishing never blocks, and the
// other subscribers keep every event.
func TestSlowSubscriberDropped(t *testing.T) {
	var h hub
	slow, fast := h.subscribe(), h.subscribe()
	got := 0
	for i := range api.EventBuffer + 10 {
		h.publish(api.EventStarted, &api.AppStatus{ID: "a", PID: i})
		select {
		case ev := <-fast.ch:
			if ev.App.PID != i {
				t.Fatalf("event %d carried PID %d", i, ev.App.PID)
			}
			got++
		default:
			t.Fatalf("the reading subscriber missed event %d", i)
		}
	}
	select {
	case <-slow.gone:
	default:
		t.Error("the subscriber that read nothing was not dropped")
	}
	select {
	case <-fast.gone:
		t.Error("the reading subscriber was dropped")
	default:
	}
	if got != api.EventBuffer+10 {
		t.Errorf("the reading subscriber got %d events", got)
	}
	h.unsubscribe(fast)
	h.unsubscribe(slow) // twice dropped is fine
	h.publish(api.EventExited, &api.AppStatus{ID: "a"})
	if len(h.subs) != 0 {
		t.Errorf("%d subscribers left", len(h.subs))
	}
}
