package host

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/stagelet/stagelet/stage1"
)

// StateForRelease reads a pod's state for DestroyPod with the backend's
// parse. A state a newer stagelet wrote is returned as its error: what it
// names is that stagelet's to release. An unreadable one is logged and
// replaced by the zero state, which the backend then fills from its
// naming convention (a crash before the first persist leaves none).
func StateForRelease[S any](ctx context.Context, log *slog.Logger, backend, podID string, b []byte, parse func([]byte) (*S, error)) (*S, error) {
	st, err := parse(b)
	if errors.Is(err, stage1.ErrNewerState) {
		return nil, err
	}
	if err != nil {
		log.WarnContext(ctx, backend+": unreadable pod state; releasing by convention", "pod", podID, "err", err)
		return new(S), nil
	}
	return st, nil
}

// Destroy is a backend's DestroyPod over its state: the state read for
// release (StateForRelease: a state a newer stagelet wrote is refused, an
// unreadable one is replaced by the zero state), completed by fill with
// what the pod's naming convention derives for what it lacks (a crash
// before the first persist), then released.
func Destroy[S any](ctx context.Context, log *slog.Logger, backend string, spec *stage1.PodSpec, b []byte,
	parse func([]byte) (*S, error), fill func(*S), release func(context.Context, *S) error) error {
	st, err := StateForRelease(ctx, log, backend, spec.ID, b, parse)
	if err != nil {
		return err
	}
	fill(st)
	return release(ctx, st)
}

// Recover is a backend's RecoverPod for a pod whose isolation is one host
// process: the state is read, open makes the pod of it and names that
// process, and the pod is back when the process still runs (PID and start
// time) and its agent answers Info within timeout.
// Otherwise the error wraps stage1.ErrPodGone (what names the process).
func Recover[S any, P stage1.Pod](ctx context.Context, backend string, spec *stage1.PodSpec, b []byte, parse func([]byte) (*S, error),
	what string, timeout time.Duration, open func(*S) (P, *Process)) (P, error) {
	var none P
	st, err := parse(b)
	if err != nil {
		return none, err
	}
	pod, proc := open(st)
	if err := CheckRecovered(ctx, proc, what, pod, timeout); err != nil {
		return none, fmt.Errorf("%s: pod %s: %w", backend, spec.ID, err)
	}
	return pod, nil
}
