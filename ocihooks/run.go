package ocihooks

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/stagelet/stagelet/errdefs"
)

// outputTail is how much of a hook's output (stdout and stderr together,
// the end of it) a failure reports.
const outputTail = 4 << 10

// waitDelay bounds the wait for a hook's output once the hook has exited
// or was killed: a process it left in the background may hold its stdout
// open, and runc would wait for it forever.
const waitDelay = 2 * time.Second

// errTimeout is the cause of a hook's context that its timeout ended.
var errTimeout = errors.New("hook timeout")

// Run runs the hooks of stage, one after the other in order, in the
// runtime's (the calling daemon's) namespaces, with st as their stdin
// (see the package doc). stage must be one that runs in the runtime's
// namespaces (refused with ErrInvalidArgument otherwise: use
// RunInNamespaces).
//
// For a fatal stage, the first hook that fails ends Run with its error:
// ErrFailedPrecondition for a hook that could not be started or exited
// other than with status 0 (its path, stage, status and output in the
// message), ErrDeadlineExceeded for one that ran past its timeout, and
// ctx's error (wrapped with %w, not classed) when ctx ended first. For
// poststop, every hook runs whatever the others did, and the errors of
// those that failed are joined: the caller logs them.
//
// Each hook process (and what it started in its process group) is killed
// with SIGKILL when its timeout passes or ctx ends; Run returns only once
// the hook has been waited for. Run is safe for concurrent use.
func Run(ctx context.Context, stage Stage, hooks []Hook, st State) error {
	if stage.InContainer() || !stage.valid() {
		return errdefs.InvalidArgument("ocihooks: Run cannot run %q hooks: they run in the container's namespaces (RunInNamespaces)", stage)
	}
	return runAll(ctx, stage, hooks, st, (*exec.Cmd).Start)
}

// valid reports whether s is one of Stages.
func (s Stage) valid() bool {
	for _, k := range Stages {
		if s == k {
			return true
		}
	}
	return false
}

// runAll runs hooks in order, each started by start, as Run says.
func runAll(ctx context.Context, stage Stage, hooks []Hook, st State, start func(*exec.Cmd) error) error {
	stdin, err := json.Marshal(st)
	if err != nil {
		return fmt.Errorf("ocihooks: %s state: %w", stage, err)
	}
	var errs []error
	for i := range hooks {
		err := runOne(ctx, stage, i, &hooks[i], stdin, start)
		if err == nil {
			continue
		}
		if stage.Fatal() || ctx.Err() != nil {
			return err
		}
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// runOne runs hook i of stage to its end, as Run says.
func runOne(ctx context.Context, stage Stage, i int, h *Hook, stdin []byte, start func(*exec.Cmd) error) error {
	name := fmt.Sprintf("%s hook #%d (%s)", stage, i, h.Path)
	if err := validHook(h); err != nil {
		return errdefs.InvalidArgument("%s: %w", name, err)
	}
	hctx, cancel := hookContext(ctx, h)
	defer cancel()
	out := &tail{}
	cmd := command(hctx, h, stdin, out)
	if err := start(cmd); err != nil {
		if ctx.Err() != nil {
			return fmt.Errorf("%s: %w", name, ctx.Err())
		}
		return errdefs.FailedPrecondition("%s: %w", name, err)
	}
	err := cmd.Wait()
	if err == nil || (errors.Is(err, exec.ErrWaitDelay) && cmd.ProcessState.Success()) {
		return nil
	}
	return hookError(ctx, hctx, name, h, err, out)
}

// hookContext is ctx, ended by h's timeout (errTimeout its cause) if h
// has one.
func hookContext(ctx context.Context, h *Hook) (context.Context, context.CancelFunc) {
	if h.Timeout == nil {
		return context.WithCancel(ctx)
	}
	return context.WithTimeoutCause(ctx, time.Duration(*h.Timeout)*time.Second, errTimeout)
}

// command is the unstarted process of h: argv Args (Path when none), env
// exactly Env, stdin the state, stdout and stderr into out, in a process
// group of its own that is killed with SIGKILL when ctx ends.
func command(ctx context.Context, h *Hook, stdin []byte, out *tail) *exec.Cmd {
	cmd := exec.CommandContext(ctx, h.Path)
	if len(h.Args) > 0 {
		cmd.Args = h.Args
	}
	cmd.Env = append([]string{}, h.Env...) // never nil: nil inherits the daemon's
	cmd.Stdin = strings.NewReader(string(stdin))
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return killGroup(cmd.Process) }
	cmd.WaitDelay = waitDelay
	return cmd
}

// killGroup kills p's process group (p leads it) with SIGKILL.
func killGroup(p *os.Process) error {
	err := syscall.Kill(-p.Pid, syscall.SIGKILL)
	if errors.Is(err, syscall.ESRCH) {
		return os.ErrProcessDone
	}
	return err
}

// hookError classes the failure err of hook name, which hctx (derived from
// the caller's ctx) bounded.
func hookError(ctx, hctx context.Context, name string, h *Hook, err error, out *tail) error {
	switch {
	case ctx.Err() != nil:
		return fmt.Errorf("%s: killed: %w", name, ctx.Err())
	case errors.Is(context.Cause(hctx), errTimeout):
		return errdefs.New(errdefs.ErrDeadlineExceeded, "%s ran past its timeout of %ds and was killed; output: %q", name, *h.Timeout, out.String())
	}
	return errdefs.FailedPrecondition("%s failed: %w; output: %q", name, err, out.String())
}

// tail keeps the last outputTail bytes written to it. Safe for concurrent
// use.
type tail struct {
	mu  sync.Mutex
	buf []byte
}

func (t *tail) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	n := len(p)
	if n >= outputTail {
		p = p[n-outputTail:]
	}
	t.buf = append(t.buf, p...)
	if over := len(t.buf) - outputTail; over > 0 {
		t.buf = append(t.buf[:0], t.buf[over:]...)
	}
	return n, nil
}

// String is the kept output, invalid UTF-8 replaced.
func (t *tail) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return strings.ToValidUTF8(string(t.buf), "\uFFFD")
}
