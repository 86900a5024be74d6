package supervisor

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"time"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/errdefs"
)

// A restore from CRIU images is done outside the agent, by whoever holds
// the images and a criu that runs there (the daemon, on the node): the
// agent readies the app (OpRestore: the pipes its output goes into), the
// restorer makes the process a child of the agent (in a pod whose PID
// namespace's init the agent is, a restore detached from the restorer
// leaves it so), then the agent adopts it (OpAdopt) and the app runs as
// if it had started here.

// restoreTimeout bounds a restore: an app that is not adopted by then
// (its restorer died) is exited, and what runs in its cgroup killed.
const restoreTimeout = 10 * time.Minute

// pendingRestore is a restore under way: the agent's pipes for the
// restored process's output, and the timer that ends a forgotten one.
type pendingRestore struct {
	stdout, stderr [2]*os.File // read and write ends
	timer          *time.Timer
}

func (r *pendingRestore) close() {
	r.timer.Stop()
	for _, f := range []*os.File{r.stdout[0], r.stdout[1], r.stderr[0], r.stderr[1]} {
		f.Close()
	}
}

// prepareRestore readies created app id for a restore. NotFound,
// FailedPrecondition (not created; shutting down; an app with a terminal
// or stdin, whose restore is not supported).
func (a *Agent) prepareRestore(ctx context.Context, id string) (*api.RestoreIO, error) {
	var out *api.RestoreIO
	_, err := a.beginStart(id, func(ap *app) error {
		if ap.spec.TTY || ap.spec.Stdin {
			return errdefs.FailedPrecondition("app %s: an app with a terminal or stdin cannot be restored", id)
		}
		r := &pendingRestore{}
		var files []*os.File
		for _, p := range []*[2]*os.File{&r.stdout, &r.stderr} {
			rd, wr, err := os.Pipe()
			if err != nil {
				for _, f := range files {
					f.Close()
				}
				return fmt.Errorf("restore %s: %w", id, err)
			}
			p[0], p[1] = rd, wr
			files = append(files, rd, wr)
		}
		r.timer = time.AfterFunc(restoreTimeout, func() {
			a.abortRestore(context.Background(), ap, fmt.Sprintf("not restored within %v", restoreTimeout))
		})
		ap.restore = r
		out = &api.RestoreIO{PID: os.Getpid(), Stdout: int(r.stdout[1].Fd()), Stderr: int(r.stderr[1].Fd())}
		return nil
	})
	if err != nil {
		return nil, err
	}
	a.log.InfoContext(ctx, "app awaits its restore", "app", id)
	return out, nil
}

// takeRestore ends ap's restore under way, if any, and returns it.
func (ap *app) takeRestore() *pendingRestore {
	ap.mu.Lock()
	defer ap.mu.Unlock()
	r := ap.restore
	ap.restore = nil
	return r
}

// abortRestore fails ap's restore under way, if any, with message why:
// what the restore left in the app's cgroup is killed and the app exits.
func (a *Agent) abortRestore(ctx context.Context, ap *app, why string) {
	r := ap.takeRestore()
	if r == nil {
		return
	}
	r.close()
	if ap.cg != nil {
		if err := ap.cg.Kill(); err != nil {
			a.log.WarnContext(ctx, "kill what a failed restore left", "app", ap.id, "err", err)
		}
	}
	_ = a.failEarly(ctx, ap, errdefs.FailedPrecondition("restore: %s", why))
}

// adopt ends app id's restore: pid is the restored process, a child of
// the agent by now, or 0 when the restore failed (why says why). NotFound,
// FailedPrecondition (no restore under way; pid is not the agent's child:
// the app is then exited).
func (a *Agent) adopt(ctx context.Context, id string, pid int, why string) (*api.AppStatus, error) {
	ap, err := a.get(id)
	if err != nil {
		return nil, err
	}
	if pid <= 0 {
		if why == "" {
			why = "the restorer gave no reason"
		}
		ap.mu.Lock()
		pending := ap.restore != nil
		ap.mu.Unlock()
		if !pending {
			return nil, errdefs.FailedPrecondition("app %s has no restore under way", id)
		}
		a.abortRestore(ctx, ap, why)
		return ap.status(), nil
	}
	r := ap.takeRestore()
	if r == nil {
		return nil, errdefs.FailedPrecondition("app %s has no restore under way", id)
	}
	r.timer.Stop()
	// The restored process holds its own ends; the agent's would keep
	// its output open past its exit.
	r.stdout[1].Close()
	r.stderr[1].Close()
	fail := func(err error) (*api.AppStatus, error) {
		r.stdout[0].Close()
		r.stderr[0].Close()
		if ap.cg != nil {
			_ = ap.cg.Kill()
		}
		err = a.failEarly(ctx, ap, err)
		return ap.status(), err
	}
	lg, err := openAppLog(ap)
	if err != nil {
		return fail(errdefs.FailedPrecondition("%w", err))
	}
	proc, wait, err := a.sys.adopt(pid)
	if err != nil {
		lg.close()
		return fail(err)
	}
	a.running(ctx, ap, lg, &child{proc: proc, pid: pid, wait: wait, stdout: r.stdout[0], stderr: r.stderr[0]})
	a.log.InfoContext(ctx, "app restored", "app", id, "pid", pid)
	return ap.status(), nil
}

// runRestorer runs cmd, the restorer of app id's restore under way, for a
// pod where a restored process is the agent's only if its restorer is
// (the agent is not its PID namespace's init): as the agent's child, in
// the app's cgroup, with the write ends of the app's output pipes as fds
// 3 and 4 and the agent's network namespace as fd 5. The restore goes on
// with OpAdopt. NotFound, FailedPrecondition (no restore under way; the
// restorer failed: its output), DeadlineExceeded (timeout, when not 0).
func (a *Agent) runRestorer(ctx context.Context, id string, cmd []string, timeout time.Duration) (*api.ExecResult, error) {
	ap, err := a.get(id)
	if err != nil {
		return nil, err
	}
	ap.mu.Lock()
	r := ap.restore
	ap.mu.Unlock()
	if r == nil {
		return nil, errdefs.FailedPrecondition("app %s has no restore under way", id)
	}
	netns, err := os.Open("/proc/self/ns/net")
	if err != nil {
		return nil, fmt.Errorf("restore %s: %w", id, err)
	}
	defer netns.Close()
	if timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, timeout)
		defer cancel()
	}
	res, err := a.sys.runRestorer(ctx, ap.cg, cmd, []*os.File{r.stdout[1], r.stderr[1], netns})
	if err != nil {
		return res, err
	}
	if res.ExitCode != 0 {
		return res, errdefs.FailedPrecondition("restore %s: %s exited with %d: %s", id, cmd[0], res.ExitCode, bytes.TrimSpace(res.Stdout))
	}
	return res, nil
}
