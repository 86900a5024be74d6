package host

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"syscall"
	"time"

	"github.com/stagelet/stagelet/cgroups"
	"github.com/stagelet/stagelet/internal/mountsafe"
)

// Kind is what sort of host resource a ledger entry is, which says how it
// is released.
type Kind string

// The kinds every backend shares. A backend may add its own, released by
// a function it gives Release (Releaser.Custom).
const (
	// KindCgroup is a cgroup (Cgroup): emptied (every process in it
	// killed), then removed.
	KindCgroup Kind = "cgroup"
	// KindUnit is the launcher's record of a process it launched under
	// Name (a transient unit under a UnitLauncher): released.
	KindUnit Kind = "unit"
	// KindProcess is a process (Process, PID and start time): SIGKILLed
	// when its record still names it, then reaped.
	KindProcess Kind = "process"
	// KindDir is a directory of the pod's (Path): every mount beneath it
	// detached, then removed, never across a mount
	// (mountsafe.RemoveUnmounted).
	KindDir Kind = "dir"
	// KindFile is a file, or an empty directory, made for the pod by
	// another program (Path): removed.
	KindFile Kind = "file"
)

// Resource is one host resource of a pod, recorded before it is taken.
type Resource struct {
	Kind Kind `json:"kind"`
	// Role names the resource among the pod's ("pod cgroup", "agent",
	// "tree"): the backend finds it by its role, and taking a role again
	// replaces what the ledger had for it.
	Role    string          `json:"role"`
	Path    string          `json:"path,omitempty"`
	Name    string          `json:"name,omitempty"`
	NetNS   string          `json:"netns,omitempty"`
	Cgroup  *cgroups.Cgroup `json:"cgroup,omitempty"`
	Process *Process        `json:"process,omitempty"`
}

// Ledger is the ordered list of a pod's host resources, kept in the
// backend's state: a backend records each resource (Take, which persists)
// before it takes it, so that after a failed start or a crash at any
// point Release finds everything that may have been taken.
type Ledger struct {
	Resources []Resource `json:"resources,omitempty"`
}

// Take records r, replacing the resource of the same role (which keeps
// its place in the order), and persists the ledger with persist before
// the caller takes r.
func (l *Ledger) Take(r Resource, persist func() error) error {
	l.Record(r)
	return persist()
}

// Record is Take without persisting: for a resource whose loss after a
// crash another record covers (the process of a unit already recorded),
// or a state that is persisted next anyway.
func (l *Ledger) Record(r Resource) {
	if i := l.index(r.Role); i >= 0 {
		l.Resources[i] = r
		return
	}
	l.Resources = append(l.Resources, r)
}

func (l *Ledger) index(role string) int {
	return slices.IndexFunc(l.Resources, func(r Resource) bool { return r.Role == role })
}

// Get returns the resource of role; ok is false when there is none.
func (l *Ledger) Get(role string) (Resource, bool) {
	if i := l.index(role); i >= 0 {
		return l.Resources[i], true
	}
	return Resource{}, false
}

// Process is the process of role, nil when there is none.
func (l *Ledger) Process(role string) *Process {
	r, _ := l.Get(role)
	return r.Process
}

// Cgroup is the cgroup of role, nil when there is none.
func (l *Ledger) Cgroup(role string) *cgroups.Cgroup {
	r, _ := l.Get(role)
	return r.Cgroup
}

// Path is the path of role, "" when there is none.
func (l *Ledger) Path(role string) string {
	r, _ := l.Get(role)
	return r.Path
}

// Default records r unless the ledger has its role: what a pod's naming
// convention derives, for a state that lost it (a crash before the first
// persist, an unreadable record).
func (l *Ledger) Default(r Resource) {
	if r.Role == "" || l.index(r.Role) >= 0 {
		return
	}
	switch {
	case r.Kind == KindCgroup && r.Cgroup == nil, r.Kind == KindProcess && r.Process == nil,
		(r.Kind == KindDir || r.Kind == KindFile) && r.Path == "", r.Kind == KindUnit && r.Name == "":
		return
	}
	l.Resources = append(l.Resources, r)
}

// Releaser is how a ledger's resources are released.
type Releaser struct {
	// Launcher released the units it launched.
	Launcher Launcher
	// Grace bounds each wait: a unit's release, a process's exit.
	Grace time.Duration
	// Custom releases the backend's own kinds (a tap in a network
	// namespace), in the reverse order of taking, after every process is
	// gone. Idempotent: what is gone is not an error.
	Custom map[Kind]func(ctx context.Context, r Resource) error
}

// Release frees every resource, idempotently (what is already gone is not
// an error), going on past a failure and returning them all. First what
// may run: each recorded process SIGKILLed, each unit released, each
// cgroup emptied, each process reaped. Then, in the reverse order of
// taking, the rest: cgroups removed, directories removed without crossing
// a mount, files removed, the backend's own kinds. Nothing is removed
// while a process of the pod may still use it. Waits are bounded by the
// Releaser's Grace and by ctx.
func (l *Ledger) Release(ctx context.Context, rel Releaser) error {
	var errs []error
	of := func(k Kind) []Resource {
		var out []Resource
		for _, r := range l.Resources {
			if r.Kind == k {
				out = append(out, r)
			}
		}
		return out
	}
	for _, r := range of(KindProcess) {
		if r.Process == nil {
			continue
		}
		if err := r.Process.Signal(syscall.SIGKILL); err != nil && !errors.Is(err, ErrProcessGone) {
			errs = append(errs, fmt.Errorf("%s: kill pid %d: %w", r.Role, r.Process.PID, err))
		}
	}
	for _, r := range of(KindUnit) {
		if r.Name == "" || rel.Launcher == nil {
			continue
		}
		wctx, cancel := context.WithTimeout(ctx, rel.Grace)
		err := ReleaseLaunched(wctx, rel.Launcher, r.Name)
		cancel()
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", r.Role, err))
		}
	}
	for _, r := range of(KindCgroup) {
		if r.Cgroup == nil {
			continue
		}
		if err := r.Cgroup.Kill(); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", r.Role, err))
		}
	}
	for _, r := range of(KindProcess) {
		if r.Process == nil {
			continue
		}
		// It was SIGKILLed, or in a cgroup just emptied: make sure it is
		// reaped (when this daemon is its parent).
		wctx, cancel := context.WithTimeout(ctx, rel.Grace)
		err := r.Process.Wait(wctx)
		cancel()
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: pid %d did not exit: %w", r.Role, r.Process.PID, err))
		}
	}
	for i := len(l.Resources) - 1; i >= 0; i-- {
		r := l.Resources[i]
		if r.Kind == KindProcess || r.Kind == KindUnit {
			continue // done above
		}
		if err := releaseOne(ctx, rel, r); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", r.Role, err))
		}
	}
	return errors.Join(errs...)
}

// releaseOne releases a resource that is neither a process nor a unit:
// a cgroup, a directory (never through a mount), a file, or a kind the
// backend releases itself (rel.Custom).
func releaseOne(ctx context.Context, rel Releaser, r Resource) error {
	switch r.Kind {
	case KindCgroup:
		if r.Cgroup != nil {
			return r.Cgroup.Delete()
		}
	case KindDir:
		if r.Path != "" {
			return mountsafe.RemoveUnmounted(r.Path)
		}
	case KindFile:
		if r.Path != "" {
			if err := os.Remove(r.Path); err != nil && !errors.Is(err, os.ErrNotExist) {
				return err
			}
		}
	default:
		f := rel.Custom[r.Kind]
		if f == nil {
			return fmt.Errorf("no way to release a resource of kind %q", r.Kind)
		}
		return f(ctx, r)
	}
	return nil
}

// LegacyField names where a backend's state from before its ledger kept
// one resource: a JSON field, and the kind and role it becomes.
type LegacyField struct {
	Field string
	Kind  Kind
	Role  string
}

// ToLedger is the migration of a backend's state from before its ledger:
// it moves each field into the ledger ("resources"), in the order given,
// which is to be the order the backend took them in. A field that is
// absent or null is skipped. A path field must be a string.
func ToLedger(fields ...LegacyField) func(state map[string]any) error {
	return func(m map[string]any) error {
		res, _ := m["resources"].([]any)
		for _, f := range fields {
			v, ok := m[f.Field]
			delete(m, f.Field)
			if !ok || v == nil {
				continue
			}
			r := map[string]any{"kind": string(f.Kind), "role": f.Role}
			switch f.Kind {
			case KindCgroup:
				r["cgroup"] = v
			case KindProcess:
				r["process"] = v
			case KindDir, KindFile:
				s, ok := v.(string)
				if !ok {
					return fmt.Errorf("field %q: a path is a string, not %T", f.Field, v)
				}
				if s == "" {
					continue
				}
				r["path"] = s
			default:
				s, ok := v.(string)
				if !ok {
					return fmt.Errorf("field %q: a name is a string, not %T", f.Field, v)
				}
				if s == "" {
					continue
				}
				r["name"] = s
			}
			res = append(res, r)
		}
		m["resources"] = res
		return nil
	}
}

// Starting begins a pod's start: it persists the pod's first record with
// save and returns what StartPod defers with its named error, which, when
// the start fails, releases everything recorded (release), logging what
// cannot be.
func Starting(ctx context.Context, log *slog.Logger, backend string, save func() error, release func(context.Context) error) (func(*error), error) {
	if err := save(); err != nil {
		return nil, fmt.Errorf("%s: persist: %w", backend, err)
	}
	return func(failed *error) {
		if *failed == nil {
			return
		}
		if err := release(context.WithoutCancel(ctx)); err != nil {
			log.WarnContext(ctx, backend+": releasing a failed pod", "err", err)
		}
	}, nil
}
