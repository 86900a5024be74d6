package testutil

import (
	"errors"
	"testing"
	"time"
)

func TestWaitForHolds(t *testing.T) {
	n := 0
	WaitFor(t, time.Second, "the third poll", func() (bool, string) {
		n++
		return n == 3, ""
	})
	if n != 3 {
		t.Fatalf("polled %d times, want 3", n)
	}
}

// fakeTB records a failure instead of ending the test.
type fakeTB struct {
	testing.TB
	failed string
}

func (f *fakeTB) Helper() {}
func (f *fakeTB) Fatalf(format string, args ...any) {
	f.failed = format
	panic(f)
}

func TestWaitForTimesOut(t *testing.T) {
	f := &fakeTB{TB: t}
	func() {
		defer func() {
			if r := recover(); r != nil && r != any(f) {
				panic(r)
			}
		}()
		WaitFor(f, 20*time.Millisecond, "never", NoError(func() (bool, error) { return false, errors.New("not yet") }))
	}()
	if f.failed == "" {
		t.Fatal("WaitFor returned although the condition never held")
	}
}

func TestAdapters(t *testing.T) {
	if ok, d := Holds(func() bool { return true })(); !ok || d != "" {
		t.Errorf("Holds: %v %q", ok, d)
	}
	if ok, d := NoError(func() (bool, error) { return false, errors.New("boom") })(); ok || d != "boom" {
		t.Errorf("NoError: %v %q", ok, d)
	}
}

func TestLogField(t *testing.T) {
	line := `time=2026-12-07T22:49:37Z level=INFO msg="taken" bytes=81150899 downtime=442ms sourcePaused=159ms`
	for key, want := range map[string]string{"bytes": "81150899", "downtime": "442ms", "paused": "", "level": "INFO"} {
		if got := LogField(line, key); got != want {
			t.Errorf("LogField(%q) = %q, want %q", key, got, want)
		}
	}
}
