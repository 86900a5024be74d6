// Package ocihooks runs a container's OCI lifecycle hooks (runtime-spec
// config.md, "POSIX-platform Hooks") as runc does, for a runtime that has
// no OCI bundle: stagelet's agent creates containers from its own spec, so
// hooks that NRI plugins inject are run by the daemon, through this
// package, at the points of stagelet's lifecycle that stand for runc's.
//
// A hook runs as runc's libcontainer/configs Command.Run runs it: its argv
// is Args (Args[0] is argv[0]; Path alone when Args is empty), its
// environment is exactly Env (nothing is inherited from the daemon), the
// container's state (specs.State) is its stdin as JSON, and its stdout and
// stderr are kept (the last 4 KiB of both) for the error of a hook that
// fails. Timeout, in seconds, ends it with SIGKILL. Unlike runc, a hook
// runs in a process group of its own, and the whole group is killed on a
// timeout or when the caller's context ends: Run returns once the hook has
// been waited for, and leaves nothing of a killed hook running.
//
// Stages, and what the caller does around each (runc: libcontainer's
// process_linux.go procHooks, rootfs_linux.go, standard_init_linux.go,
// container_linux.go postStart, state_linux.go runPoststopHooks):
//
//   - prestart (deprecated) then createRuntime: in the runtime's (the
//     daemon's) namespaces, with Run, once the container's init exists
//     (state pid set) and before its command runs. runc runs them with
//     status "creating" before pivot_root; stagelet's daemon learns of the
//     container only once the agent has created it, so it passes
//     "created". runc accepts prestart and runs it right before
//     createRuntime, and so does this package.
//   - createContainer: in the container's namespaces, with RunInNamespaces,
//     after createRuntime and before the container's command starts.
//   - startContainer: in the container's namespaces, with RunInNamespaces.
//     runc runs it from the container's init right before it execs the
//     command; the agent starts the command here, so the daemon runs it
//     just before asking the agent to start, with status "created".
//   - poststart: in the runtime's namespaces, with Run, after the command
//     started (status "running"). A failure is fatal: runc (postStart in
//     container_linux.go) kills the container and fails the start, as
//     runtime-spec's runtime.md lifecycle step 9 requires.
//   - poststop: in the runtime's namespaces, with Run, after the container
//     is deleted (status "stopped"). A failure is logged, not returned to
//     the kubelet: runtime.md step 13 says the remaining hooks and the
//     lifecycle continue, and Run does run the remaining hooks (runc stops
//     at the first failing one).
//
// Every stage but poststop is fatal (Stage.Fatal): the first hook that
// fails ends Run, and the caller stops the container and fails the CRI
// call. What RunInNamespaces joins, and why the hook's file must be the
// runtime's own, is said at RunInNamespaces.
package ocihooks

import (
	"fmt"
	"path/filepath"

	"github.com/opencontainers/runtime-spec/specs-go"

	"github.com/stagelet/stagelet/errdefs"
)

// Hook is one hook, as runtime-spec's config.json holds it.
type Hook = specs.Hook

// Hooks are a container's hooks by stage, as runtime-spec's config.json
// holds them.
type Hooks = specs.Hooks

// State is the container's state a hook reads on its stdin (runtime-spec
// runtime.md, "State").
type State = specs.State

// Stage is a point of the container's lifecycle at which hooks run; its
// value is the key of its hooks in config.json.
type Stage string

// The stages, in the order of the lifecycle.
const (
	Prestart        Stage = "prestart" // deprecated; runs right before createRuntime
	CreateRuntime   Stage = "createRuntime"
	CreateContainer Stage = "createContainer"
	StartContainer  Stage = "startContainer"
	Poststart       Stage = "poststart"
	Poststop        Stage = "poststop"
)

// Fatal reports whether a failing hook of stage s fails the container's
// lifecycle operation (and stops the container): all stages but poststop,
// whose failures are warnings (runtime-spec runtime.md, "Lifecycle").
func (s Stage) Fatal() bool { return s != Poststop }

// InContainer reports whether hooks of stage s run in the container's
// namespaces (RunInNamespaces) rather than the runtime's (Run).
func (s Stage) InContainer() bool { return s == CreateContainer || s == StartContainer }

// Stages are the stages in the order they run.
var Stages = []Stage{Prestart, CreateRuntime, CreateContainer, StartContainer, Poststart, Poststop}

// Of returns h's hooks of stage s; a nil h has none.
func (s Stage) Of(h *Hooks) []Hook {
	if h == nil {
		return nil
	}
	switch s {
	case Prestart:
		//lint:ignore SA1019 deprecated, and still run as runc runs it
		return h.Prestart
	case CreateRuntime:
		return h.CreateRuntime
	case CreateContainer:
		return h.CreateContainer
	case StartContainer:
		return h.StartContainer
	case Poststart:
		return h.Poststart
	case Poststop:
		return h.Poststop
	}
	return nil
}

// Validate refuses hooks that no stage could run, with ErrInvalidArgument
// naming the first: a path that is not absolute, or a timeout that is not
// greater than zero (runtime-spec: "If set, timeout MUST be greater than
// zero"; runc would kill such a hook at once). Whether the path exists or
// can be executed is not checked: runc finds out when it runs the hook,
// and so does Run. Deprecated prestart hooks are accepted, as runc
// accepts them. A nil h is valid.
func Validate(h *Hooks) error {
	for _, s := range Stages {
		for i, hook := range s.Of(h) {
			if err := validHook(&hook); err != nil {
				return errdefs.InvalidArgument("hooks.%s[%d]: %w", s, i, err)
			}
		}
	}
	return nil
}

// validHook is Validate's check of one hook.
func validHook(h *Hook) error {
	if !filepath.IsAbs(h.Path) {
		return fmt.Errorf("path %q is not absolute", h.Path)
	}
	if h.Timeout != nil && *h.Timeout <= 0 {
		return fmt.Errorf("timeout %d is not greater than zero", *h.Timeout)
	}
	return nil
}
