package supervisor

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"syscall"
	"time"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/errdefs"
)

// ExecOutputLimit caps an exec's captured stdout and stderr together
// (api.ExecOutputLimit); the rest is read and dropped, as the kubelet's
// own output limit for probes does.
const ExecOutputLimit = api.ExecOutputLimit

// outputBudget is what an exec's streams may still keep, shared by both.
type outputBudget struct {
	mu   sync.Mutex
	left int
}

// take grants up to n bytes of the budget.
func (b *outputBudget) take(n int) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	n = min(n, b.left)
	b.left -= n
	return n
}

// capBuffer keeps what its budget grants of what is written to it and
// drops the rest.
type capBuffer struct {
	buf    bytes.Buffer
	budget *outputBudget
}

func (b *capBuffer) Write(p []byte) (int, error) {
	if n := b.budget.take(len(p)); n > 0 {
		b.buf.Write(p[:n])
	}
	return len(p), nil
}

// exec runs cmd in a running app's root, cgroup, user, capabilities and
// environment, and returns its output and exit code. With timeout > 0 the
// command is killed when the time is up and TimedOut is set. NotFound,
// InvalidArgument (empty command), FailedPrecondition (the app does not
// run; the command cannot be executed).
func (a *Agent) exec(ctx context.Context, id string, cmd []string, timeout time.Duration) (*api.ExecResult, error) {
	var deadline time.Time
	if timeout > 0 {
		deadline = time.Now().Add(timeout)
	}
	c, err := a.startExec(id, cmd, childIO{}, nil, deadline)
	if errors.Is(err, errdefs.ErrDeadlineExceeded) {
		// The time was up before the command ran: killed in its setup.
		return &api.ExecResult{ExitCode: 128 + int32(syscall.SIGKILL), TimedOut: true}, nil
	}
	if err != nil {
		return nil, fmt.Errorf("exec in %s: %w", id, err)
	}
	defer c.proc.Release()
	budget := &outputBudget{left: ExecOutputLimit}
	var stdout, stderr = &capBuffer{budget: budget}, &capBuffer{budget: budget}
	var copies sync.WaitGroup
	for _, s := range []struct {
		w io.Writer
		r *os.File
	}{{stdout, c.stdout}, {stderr, c.stderr}} {
		copies.Add(1)
		go func() {
			defer copies.Done()
			_, _ = io.Copy(s.w, s.r)
		}()
	}
	var expired <-chan time.Time
	if !deadline.IsZero() {
		t := time.NewTimer(time.Until(deadline))
		defer t.Stop()
		expired = t.C
	}
	timedOut := false
	var ws syscall.WaitStatus
	select {
	case ws = <-c.wait:
	case <-expired:
		timedOut = true
		_ = signalProc(c.proc, syscall.SIGKILL)
		ws = <-c.wait
	}
	drain(&copies, c.stdout, c.stderr)
	res := &api.ExecResult{
		Stdout:   stdout.buf.Bytes(),
		Stderr:   stderr.buf.Bytes(),
		ExitCode: exitCode(ws),
		TimedOut: timedOut,
	}
	a.log.DebugContext(ctx, "exec", "app", id, "cmd", cmd, "code", res.ExitCode, "timedOut", timedOut)
	return res, nil
}

// startExec starts cmd in a running app's namespaces, root, cgroup and
// credentials, with stdio as cio says, and returns once it runs. NotFound,
// InvalidArgument (empty command), FailedPrecondition (the app does not
// run; the command cannot be executed), DeadlineExceeded (deadline passed
// during its setup).
func (a *Agent) startExec(id string, cmd []string, cio childIO, size *api.TerminalSize, deadline time.Time) (*child, error) {
	if len(cmd) == 0 || cmd[0] == "" {
		return nil, errdefs.InvalidArgument("exec: empty command")
	}
	ap, err := a.get(id)
	if err != nil {
		return nil, err
	}
	ap.mu.Lock()
	running, pid, proc, spec := ap.st.State == api.StateRunning, ap.st.PID, ap.proc, ap.spec
	ap.mu.Unlock()
	if !running {
		return nil, errdefs.FailedPrecondition("app %s is not running", id)
	}
	return a.sys.start(&startSpec{app: spec, args: cmd, exec: true, pid: pid, appProc: proc, cio: cio, size: size, cg: ap.cg, deadline: deadline})
}
