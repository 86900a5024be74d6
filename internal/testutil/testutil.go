// Package testutil holds what the project's tests share: the gate for
// tests that change the host, the wait for a condition, unpacking a tar
// stream, the counter the checkpoint tests save and restore, and a field
// of a daemon log line. Only tests (and stagelet-bench) import it.
package testutil

import (
	"os"
	"testing"
	"time"
)

// NeedRoot skips t unless it runs as root and without -short; what says
// what the test does to the host ("creates network namespaces"), so that
// `go test -short` as root (make unit) creates nothing on the host.
func NeedRoot(t testing.TB, what string) {
	t.Helper()
	if testing.Short() {
		t.Skipf("-short: skipped, it %s", what)
	}
	if os.Geteuid() != 0 {
		t.Skipf("needs root: it %s", what)
	}
}

// WaitFor polls cond, more slowly as it goes (1 ms doubling to 50 ms),
// until it holds, and fails t when timeout passes first, with what and the
// last detail cond gave. Tests wait on conditions, never on fixed sleeps.
func WaitFor(t testing.TB, timeout time.Duration, what string, cond func() (ok bool, detail string)) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	delay := time.Millisecond
	for {
		ok, last := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			if last != "" {
				t.Fatalf("timed out after %v waiting for %s (last: %s)", timeout, what, last)
			}
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(delay) // polling a condition with nothing to block on
		if delay < 50*time.Millisecond {
			delay *= 2
		}
	}
}

// Holds adapts a condition without detail to WaitFor.
func Holds(cond func() bool) func() (bool, string) {
	return func() (bool, string) { return cond(), "" }
}

// NoError adapts a condition that reports its last error to WaitFor.
func NoError(cond func() (bool, error)) func() (bool, string) {
	return func() (bool, string) {
		ok, err := cond()
		if err != nil {
			return ok, err.Error()
		}
		return ok, ""
	}
}
