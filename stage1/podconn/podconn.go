// Package podconn is a running pod as the daemon drives it: a backend's
// stage1.Pod and the connection to its agent, the protocol client
// (package agent/client) with what the pod's AgentEndpoint adds around
// its calls: the backend's ContainerPaths around container calls, and
// the backend's own figures for the whole pod (stage1.HostStatser). The
// broker holds its pods as Pod; the conformance suite (stage1test) and
// the backends' tests drive pods through it the same way. A backend only
// tells how to reach its agent and how a container's host paths reach
// the pod; the calls are the same for every stage1, and written once
// here.
//
// It links neither D-Bus nor a backend's host bookkeeping (stage1/host):
// the broker imports it.
package podconn

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/agent/client"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/stage1"
)

// Conn calls a pod's agent. It holds no state beyond its endpoint but the
// writers of the logs it writes on the host (hostlog.go); it is safe for
// concurrent use (every call is its own stream). The embedded
// client's calls (Info, Watch, Stats, ExecStream, Attach, PortForward,
// Shutdown) are used as they are; the container calls below add the
// mapping of host paths.
type Conn struct {
	*client.Client
	paths stage1.ContainerPaths
	log   *slog.Logger
	logs  hostLogs
}

// New returns a connection to the agent ep describes. log receives what
// goes wrong after a call succeeded (nil: slog.Default()); opts configure
// the protocol client (client.OnRefusal).
func New(ep stage1.AgentEndpoint, log *slog.Logger, opts ...client.Option) *Conn {
	if log == nil {
		log = slog.Default()
	}
	return &Conn{Client: client.NewClient(ep.Dial, opts...), paths: ep.Paths, log: log}
}

// Connect returns a connection to pod's agent.
func Connect(pod stage1.Pod, log *slog.Logger, opts ...client.Option) *Conn {
	return New(pod.Agent(), log, opts...)
}

// CreateContainer makes the spec's rootfs, log directory and mount
// sources reachable in the pod (through the endpoint's ContainerPaths)
// and registers the app with the agent under the paths it sees them at.
// With HostLog its log is written on the host from then on (FollowLog).
// The caller's spec is not modified. On failure what was shared is
// undone.
func (c *Conn) CreateContainer(ctx context.Context, spec *stage1.ContainerSpec) (*api.AppStatus, error) {
	if spec == nil || spec.ID == "" {
		return nil, errdefs.InvalidArgument("create container: no id")
	}
	if c.paths == nil {
		app := spec.AppSpec
		st, err := c.Client.Create(ctx, &app)
		if err == nil && spec.HostLog {
			c.FollowLog(spec.ID, spec.LogPath)
		}
		return st, err
	}
	inPod, err := c.paths.Share(ctx, spec, c.known)
	if err != nil {
		return nil, err
	}
	app := inPod.AppSpec
	st, err := c.Client.Create(ctx, &app)
	if err != nil {
		if uerr := c.paths.Unshare(spec.ID); uerr != nil {
			err = errors.Join(err, fmt.Errorf("undoing what was shared: %w", uerr))
		}
		return nil, err
	}
	if spec.HostLog {
		// Before the app starts: its output waits for the session.
		c.FollowLog(spec.ID, spec.LogPath)
	}
	return st, nil
}

// known tells whether the agent knows a container.
func (c *Conn) known(ctx context.Context, id string) (bool, error) {
	_, err := c.Client.Status(ctx, id)
	switch {
	case err == nil:
		return true, nil
	case errdefs.IsNotFound(err):
		return false, nil
	}
	return false, err
}

// StartContainer starts a created app; the endpoint's ContainerPaths then
// drops what the started app no longer needs on the host. The app runs
// either way: what cannot be dropped is logged and stays until
// RemoveContainer.
func (c *Conn) StartContainer(ctx context.Context, id string) (*api.AppStatus, error) {
	st, err := c.Client.Start(ctx, id)
	if err != nil || c.paths == nil {
		return st, err
	}
	if err := c.paths.Started(id); err != nil {
		c.log.WarnContext(ctx, "container started; the host's binds of its mount sources stay until it is removed", "container", id, "err", err)
	}
	return st, nil
}

// RestoreContainer starts a created app from a checkpoint: the agent
// readies it, restore makes the restored process (given where its
// output goes) a child of the agent and returns its PID in the agent's
// namespace, and the agent adopts it. When restore fails the app exits
// with its error as message, and that error is returned.
func (c *Conn) RestoreContainer(ctx context.Context, id string, restore func(*api.RestoreIO) (int, error)) (*api.AppStatus, error) {
	r, err := c.Client.Call(ctx, &api.Request{Op: api.OpRestore, ID: id})
	if err != nil {
		return nil, err
	}
	if r.Restore == nil {
		return nil, fmt.Errorf("restore %s: the agent gave no pipes: %w", id, errdefs.ErrUnavailable)
	}
	pid, rerr := restore(r.Restore)
	req := &api.Request{Op: api.OpAdopt, ID: id, PID: pid}
	if rerr != nil {
		req.PID, req.Message = 0, rerr.Error()
	}
	// Also when ctx ended: the agent must hear how the restore ended.
	actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	r, err = c.Client.Call(actx, req)
	if rerr != nil {
		return nil, rerr
	}
	if err != nil {
		return nil, err
	}
	if c.paths != nil {
		if err := c.paths.Started(id); err != nil {
			c.log.WarnContext(ctx, "container restored; the host's binds of its mount sources stay until it is removed", "container", id, "err", err)
		}
	}
	return r.App, nil
}

// RunRestorer runs cmd, the restorer of app id's restore under way, as a
// child of the agent (OpRestoreRun), and returns once it exited:
// FailedPrecondition with its output when it failed.
func (c *Conn) RunRestorer(ctx context.Context, id string, cmd []string) error {
	var timeout time.Duration
	if d, ok := ctx.Deadline(); ok {
		timeout = time.Until(d)
	}
	_, err := c.Client.Call(ctx, &api.Request{Op: api.OpRestoreRun, ID: id, Cmd: cmd, Timeout: timeout})
	return err
}

// StopContainer sends SIGTERM, waits up to timeout, then SIGKILL; an
// exited app is returned as it is.
func (c *Conn) StopContainer(ctx context.Context, id string, timeout time.Duration) (*api.AppStatus, error) {
	return c.Client.Stop(ctx, id, timeout)
}

// RemoveContainer forgets an app, then undoes what was shared for it.
// Idempotent: an unknown app is not an error.
func (c *Conn) RemoveContainer(ctx context.Context, id string) error {
	if err := c.ForgetContainer(ctx, id); err != nil {
		return err
	}
	return c.UnshareContainer(id)
}

// ForgetContainer removes an app from the agent, stopping it if it runs;
// what was shared for it stays until UnshareContainer. Idempotent.
func (c *Conn) ForgetContainer(ctx context.Context, id string) error {
	if err := c.Client.Remove(ctx, id); err != nil && !errdefs.IsNotFound(err) {
		return err
	}
	c.StopLog(id)
	return nil
}

// UnshareContainer undoes what was shared for a container the agent
// forgot (its binds into the pod). Idempotent.
func (c *Conn) UnshareContainer(id string) error {
	if c.paths == nil {
		return nil
	}
	return c.paths.Unshare(id)
}

// ContainerStatus returns an app's status; ErrNotFound for an unknown one.
func (c *Conn) ContainerStatus(ctx context.Context, id string) (*api.AppStatus, error) {
	return c.Client.Status(ctx, id)
}

// ListContainers returns every app's status.
func (c *Conn) ListContainers(ctx context.Context) ([]*api.AppStatus, error) {
	return c.Client.List(ctx)
}

// UpdateContainerResources changes a created or running app's limits
// (zero fields stay).
func (c *Conn) UpdateContainerResources(ctx context.Context, id string, r api.Resources) error {
	_, err := c.Client.Update(ctx, id, r)
	return err
}

// ExecSync runs cmd in an app and waits up to timeout (0: no limit).
func (c *Conn) ExecSync(ctx context.Context, id string, cmd []string, timeout time.Duration) (*api.ExecResult, error) {
	return c.Client.Exec(ctx, id, cmd, timeout)
}

// ReopenLog reopens an app's log file: on the host when the daemon
// writes it (HostLog), otherwise the agent's.
func (c *Conn) ReopenLog(ctx context.Context, id string) error {
	if handled, err := c.reopenHostLog(id); handled {
		return err
	}
	return c.Client.ReopenLog(ctx, id)
}

// PodStats are the whole pod's figures: the agent's, or, for a pod whose
// cost on the host is not what its agent sees (a VM: stage1.HostStatser),
// the host's with the agent's process count. When the host's figures
// cannot be read the agent's are returned (logged).
func (c *Conn) PodStats(ctx context.Context, pod stage1.Pod) (*api.Stats, error) {
	inPod, err := c.Client.Stats(ctx, "")
	hs, ok := pod.(stage1.HostStatser)
	if !ok {
		return inPod, err
	}
	host, herr := hs.HostStats()
	if herr != nil {
		if err != nil {
			return nil, err
		}
		c.log.DebugContext(ctx, "the pod's host figures", "err", herr)
		return inPod, nil
	}
	if inPod != nil {
		host.Pids = inPod.Pids
	}
	return host, nil
}

// Pod is a running pod as the broker holds it: the backend's isolation
// (State, Details, Agent) and the connection to its agent (every call of
// Conn).
type Pod struct {
	stage1.Pod
	*Conn
}

// Open returns pod with a connection to its agent.
func Open(pod stage1.Pod, log *slog.Logger, opts ...client.Option) *Pod {
	return &Pod{Pod: pod, Conn: Connect(pod, log, opts...)}
}

// Stop stops every app and the pod's isolation, its agent asked to shut
// down over the connection (stage1.Pod's Stop); the logs written on the
// host take the apps' last lines while they stop, and are closed after.
func (p *Pod) Stop(ctx context.Context, timeout time.Duration) error {
	err := p.Pod.Stop(ctx, timeout, p.Conn.Shutdown)
	p.Conn.StopLogs()
	return err
}

// Stats are a container's figures, or the whole pod's (PodStats) for id
// "".
func (p *Pod) Stats(ctx context.Context, id string) (*api.Stats, error) {
	if id == "" {
		return p.Conn.PodStats(ctx, p.Pod)
	}
	return p.Conn.Client.Stats(ctx, id)
}
