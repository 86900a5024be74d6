package tracing

import (
	"testing"
	"time"
)

// Spans that lie within the call keep their times; spans on a clock that
// lags (or leads) are moved, together, to the middle of the call.
func TestAlign(t *testing.T) {
	sent := time.Unix(1000, 0)
	received := sent.Add(100 * time.Millisecond)
	inside := []Finished{
		{Name: "handle.x", Start: sent.Add(10 * time.Millisecond), End: sent.Add(90 * time.Millisecond)},
		{Name: "app.y", Start: sent.Add(20 * time.Millisecond), End: sent.Add(30 * time.Millisecond)},
	}
	want := []Finished{inside[0], inside[1]}
	Align(inside, sent, received)
	for i := range inside {
		if !inside[i].Start.Equal(want[i].Start) || !inside[i].End.Equal(want[i].End) {
			t.Errorf("a span within the call was moved: %+v", inside[i])
		}
	}
	lag := 900 * time.Millisecond
	behind := []Finished{
		{Name: "handle.x", Start: sent.Add(10*time.Millisecond - lag), End: sent.Add(70*time.Millisecond - lag)},
		{Name: "app.y", Start: sent.Add(20*time.Millisecond - lag), End: sent.Add(30*time.Millisecond - lag)},
	}
	Align(behind, sent, received)
	// 10..70 ms (middle 40) onto the call's middle, 50 ms: 20..80 ms.
	if got := behind[0].Start.Sub(sent); got != 20*time.Millisecond {
		t.Errorf("handle.x starts %v after the call, want 20ms", got)
	}
	if got := behind[0].End.Sub(behind[0].Start); got != 60*time.Millisecond {
		t.Errorf("handle.x lasts %v, want its 60ms", got)
	}
	if got := behind[1].Start.Sub(behind[0].Start); got != 10*time.Millisecond {
		t.Errorf("app.y starts %v after handle.x, want its 10ms", got)
	}
	if Align(nil, sent, received) != nil {
		t.Error("no spans gave some")
	}
}
