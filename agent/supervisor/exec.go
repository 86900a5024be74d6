package supervisor

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/errdefs"
)

// ExecOutputLimit caps an exec's captured stdout and stderr together, so
// that the whole ExecSync reply stays under the kubelet's 16 MiB gRPC
// receive limit; the rest is read and dropped, as the kubelet's own
// output limit for probes does.
const ExecOutputLimit = 12 << 20

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
func (a *Agent) exec(id string, cmd []string, timeout time.Duration) (*api.ExecResult, error) {
	var deadline time.Time
	if timeout > 0 {
		deadline = time.Now().Add(timeout)
	}
	c, ap, ps, err := a.spawnExec(id, cmd, childIO{}, nil)
	if err != nil {
		return nil, err
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
	if !deadline.IsZero() {
		c.sync.SetDeadline(deadline)
	}
	herr := a.handshake(c, ps, ap.cg, id)
	timedOut := false
	var ws syscall.WaitStatus
	if herr != nil {
		_ = signalProc(c.proc, syscall.SIGKILL)
		ws = <-c.wait
		drain(&copies, c.stdout, c.stderr)
		if !errors.Is(herr, errdefs.ErrDeadlineExceeded) {
			// What the child wrote before it died says why (a Go
			// runtime's fatal error, say).
			if out := bytes.TrimSpace(stderr.buf.Bytes()); len(out) > 0 {
				herr = fmt.Errorf("%w; exit code %d, stderr: %s", herr, exitCode(ws), out[:min(len(out), 2048)])
			}
			return nil, fmt.Errorf("exec in %s: %w", id, herr)
		}
		timedOut = true
	} else {
		var expired <-chan time.Time
		if !deadline.IsZero() {
			t := time.NewTimer(time.Until(deadline))
			defer t.Stop()
			expired = t.C
		}
		select {
		case ws = <-c.wait:
		case <-expired:
			timedOut = true
			_ = signalProc(c.proc, syscall.SIGKILL)
			ws = <-c.wait
		}
		drain(&copies, c.stdout, c.stderr)
	}
	res := &api.ExecResult{
		Stdout:   stdout.buf.Bytes(),
		Stderr:   stderr.buf.Bytes(),
		ExitCode: exitCode(ws),
		TimedOut: timedOut,
	}
	a.log.Debug("exec", "app", id, "cmd", cmd, "code", res.ExitCode, "timedOut", timedOut)
	return res, nil
}

// spawnExec starts `agent exec-init` for cmd in a running app's mount, UTS
// and PID namespaces, with stdio as cio says, and returns the child before
// its handshake, with the app and the spec to send it. NotFound,
// InvalidArgument (empty command), FailedPrecondition (the app does not
// run).
func (a *Agent) spawnExec(id string, cmd []string, cio childIO, size *api.TerminalSize) (*child, *app, *procSpec, error) {
	if len(cmd) == 0 || cmd[0] == "" {
		return nil, nil, nil, errdefs.InvalidArgument("exec: empty command")
	}
	ap, err := a.get(id)
	if err != nil {
		return nil, nil, nil, err
	}
	ap.mu.Lock()
	running, pid, proc, spec := ap.st.State == api.StateRunning, ap.st.PID, ap.proc, ap.spec
	ap.mu.Unlock()
	if !running {
		return nil, nil, nil, errdefs.FailedPrecondition("app %s is not running", id)
	}
	// Hold the app's mount (and UTS) namespace open, then check the
	// app's process still exists: its pid cannot have been reused yet.
	mnt, err := os.Open("/proc/" + strconv.Itoa(pid) + "/ns/mnt")
	if err != nil {
		return nil, nil, nil, errdefs.FailedPrecondition("app %s is not running (%v)", id, err)
	}
	defer mnt.Close()
	extra := []*os.File{mnt}
	if spec.OwnUTS() {
		uts, err := os.Open("/proc/" + strconv.Itoa(pid) + "/ns/uts")
		if err != nil {
			return nil, nil, nil, errdefs.FailedPrecondition("app %s is not running (%v)", id, err)
		}
		defer uts.Close()
		extra = append(extra, uts)
	}
	if err := proc.Signal(syscall.Signal(0)); err != nil {
		return nil, nil, nil, errdefs.FailedPrecondition("app %s is not running", id)
	}

	spawn := func() (*child, error) {
		return a.spawn(cmdExecInit, &syscall.SysProcAttr{Setsid: true}, cio, extra...)
	}
	var c *child
	if spec.PIDNamespace == api.PIDNamespaceContainer || spec.PIDNamespace == api.PIDNamespaceTarget {
		pidns, err := os.Open("/proc/" + strconv.Itoa(pid) + "/ns/pid")
		if err != nil {
			return nil, nil, nil, errdefs.FailedPrecondition("app %s is not running (%v)", id, err)
		}
		defer pidns.Close()
		err = forkInPIDNamespace(pidns, func() error {
			var err error
			c, err = spawn()
			return err
		})
		if err != nil {
			return nil, nil, nil, err
		}
	} else if c, err = spawn(); err != nil {
		return nil, nil, nil, err
	}
	ps := &procSpec{App: spec, Args: cmd, JoinUTS: spec.OwnUTS(), TTY: cio.tty, Size: size}
	return c, ap, ps, nil
}
