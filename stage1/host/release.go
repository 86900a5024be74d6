package host

import (
	"context"
	"errors"
	"fmt"
	"github.com/stagelet/stagelet/stage1"
	"log/slog"
	"syscall"
	"time"

	"github.com/stagelet/stagelet/cgroups"
)

// HostResources are the host resources of one pod a backend releases:
// what its state names, or what its naming convention derives when the
// state is lost. Release frees them in one order for every stage1.
type HostResources struct {
	// Processes the backend launched (an agent, systemd-nspawn and its
	// container's init, qemu, virtiofsd), when their records still name
	// them.
	Processes []*Process
	// Launched are the launcher's names of those processes: their
	// transient units under a UnitLauncher.
	Launched []string
	// Cgroups hold the pod's processes and whatever they started.
	Cgroups []*cgroups.Cgroup
	// Then are the backend's own resources (a tap, a shared directory, a
	// tree and its locks), released in order after every process is gone.
	Then []ReleaseStep
}

// ReleaseStep releases one resource of a backend's own.
type ReleaseStep struct {
	What string // for errors: "pod network", "shared directory", ...
	Do   func() error
}

// Release frees r, idempotently (what is already gone is not an error),
// going on past a failed step and returning every failure:
//
//  1. SIGKILL to each process whose record still names it;
//  2. each launched unit released (stopped, its record dropped);
//  3. each cgroup emptied (every process in it killed);
//  4. each process reaped, at most grace apiece;
//  5. each cgroup removed;
//  6. the backend's own steps, in order.
//
// Nothing is removed while a process of the pod may still use it. Waits
// are bounded by grace and by ctx.
func Release(ctx context.Context, launcher Launcher, grace time.Duration, r HostResources) error {
	var errs []error
	for _, p := range r.Processes {
		if p == nil {
			continue
		}
		if err := p.Signal(syscall.SIGKILL); err != nil && !errors.Is(err, ErrProcessGone) {
			errs = append(errs, fmt.Errorf("kill pid %d: %w", p.PID, err))
		}
	}
	for _, name := range r.Launched {
		if name == "" {
			continue
		}
		wctx, cancel := context.WithTimeout(ctx, grace)
		err := ReleaseLaunched(wctx, launcher, name)
		cancel()
		if err != nil {
			errs = append(errs, err)
		}
	}
	for _, cg := range r.Cgroups {
		if cg == nil {
			continue
		}
		if err := cg.Kill(); err != nil {
			errs = append(errs, err)
		}
	}
	for _, p := range r.Processes {
		if p == nil {
			continue
		}
		// It was in a cgroup just emptied, so it is dead: make sure it
		// is reaped (when this daemon is its parent).
		wctx, cancel := context.WithTimeout(ctx, grace)
		err := p.Wait(wctx)
		cancel()
		if err != nil {
			errs = append(errs, fmt.Errorf("pid %d did not exit: %w", p.PID, err))
		}
	}
	for _, cg := range r.Cgroups {
		if cg == nil {
			continue
		}
		if err := cg.Delete(); err != nil {
			errs = append(errs, err)
		}
	}
	for _, s := range r.Then {
		if err := s.Do(); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", s.What, err))
		}
	}
	return errors.Join(errs...)
}

// StateForRelease reads a pod's state for DestroyPod with the backend's
// parse. A state a newer stagelet wrote is returned as its error: what it
// names is that stagelet's to release. An unreadable one is logged and
// replaced by the zero state, which the backend then fills from its
// naming convention (a crash before the first persist leaves none).
func StateForRelease[S any](log *slog.Logger, backend, podID string, b []byte, parse func([]byte) (*S, error)) (*S, error) {
	st, err := parse(b)
	if errors.Is(err, stage1.ErrNewerState) {
		return nil, err
	}
	if err != nil {
		log.Warn(backend+": unreadable pod state; releasing by convention", "pod", podID, "err", err)
		return new(S), nil
	}
	return st, nil
}
