package agent

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"time"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/errdefs"
)

// Dialer opens one stream to an agent.
type Dialer func(ctx context.Context) (net.Conn, error)

// UnixDialer dials the agent's unix socket at path, which may be longer
// than a socket address holds.
func UnixDialer(path string) Dialer {
	return func(ctx context.Context) (net.Conn, error) {
		return dialUnix(ctx, path)
	}
}

// Client calls an agent. It is safe for concurrent use: every call is its
// own stream.
type Client struct {
	dial Dialer
}

// NewClient returns a client that opens streams with dial.
func NewClient(dial Dialer) *Client { return &Client{dial: dial} }

// Call sends one request and returns the agent's response. Agent error codes
// come back as errdefs classes; a transport failure is ErrUnavailable.
func (c *Client) Call(ctx context.Context, req *api.Request) (*api.Response, error) {
	conn, err := c.dial(ctx)
	if err != nil {
		return nil, fmt.Errorf("agent: dial: %v: %w", err, errdefs.ErrUnavailable)
	}
	defer conn.Close()
	if dl, ok := ctx.Deadline(); ok {
		conn.SetDeadline(dl)
	}
	stop := context.AfterFunc(ctx, func() { conn.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	if err := json.NewEncoder(conn).Encode(req); err != nil {
		return nil, fmt.Errorf("agent: %s: send: %v: %w", req.Op, err, errdefs.ErrUnavailable)
	}
	var resp api.Response
	if err := json.NewDecoder(conn).Decode(&resp); err != nil {
		if ctx.Err() != nil {
			return nil, fmt.Errorf("agent: %s: %v: %w", req.Op, ctx.Err(), errdefs.ErrDeadlineExceeded)
		}
		return nil, fmt.Errorf("agent: %s: receive: %v: %w", req.Op, err, errdefs.ErrUnavailable)
	}
	if resp.Code != api.CodeOK {
		return &resp, errdefs.New(classOf(resp.Code), "%s", resp.Error)
	}
	return &resp, nil
}

func classOf(code string) error {
	switch code {
	case api.CodeNotFound:
		return errdefs.ErrNotFound
	case api.CodeAlreadyExists:
		return errdefs.ErrAlreadyExists
	case api.CodeInvalidArgument:
		return errdefs.ErrInvalidArgument
	case api.CodeFailedPrecondition:
		return errdefs.ErrFailedPrecondition
	case api.CodeDeadlineExceeded:
		return errdefs.ErrDeadlineExceeded
	default:
		return fmt.Errorf("agent internal error")
	}
}

// Info asks the agent who it is.
func (c *Client) Info(ctx context.Context) (*api.Info, error) {
	r, err := c.Call(ctx, &api.Request{Op: api.OpInfo})
	if err != nil {
		return nil, err
	}
	return r.Info, nil
}

// Create registers an app (not started).
func (c *Client) Create(ctx context.Context, spec *api.AppSpec) (*api.AppStatus, error) {
	r, err := c.Call(ctx, &api.Request{Op: api.OpCreate, ID: spec.ID, App: spec})
	if err != nil {
		return nil, err
	}
	return r.App, nil
}

// Start starts a created app.
func (c *Client) Start(ctx context.Context, id string) (*api.AppStatus, error) {
	r, err := c.Call(ctx, &api.Request{Op: api.OpStart, ID: id})
	if err != nil {
		return nil, err
	}
	return r.App, nil
}

// Stop sends SIGTERM, waits up to timeout, then SIGKILL; it returns once
// the app has exited.
func (c *Client) Stop(ctx context.Context, id string, timeout time.Duration) (*api.AppStatus, error) {
	r, err := c.Call(ctx, &api.Request{Op: api.OpStop, ID: id, Timeout: timeout})
	if err != nil {
		return nil, err
	}
	return r.App, nil
}

// Signal sends a signal to an app's process.
func (c *Client) Signal(ctx context.Context, id string, sig int) error {
	_, err := c.Call(ctx, &api.Request{Op: api.OpSignal, ID: id, Signal: sig})
	return err
}

// Remove forgets an app; idempotent.
func (c *Client) Remove(ctx context.Context, id string) error {
	_, err := c.Call(ctx, &api.Request{Op: api.OpRemove, ID: id})
	return err
}

// Status returns one app's status.
func (c *Client) Status(ctx context.Context, id string) (*api.AppStatus, error) {
	r, err := c.Call(ctx, &api.Request{Op: api.OpStatus, ID: id})
	if err != nil {
		return nil, err
	}
	return r.App, nil
}

// List returns every app's status.
func (c *Client) List(ctx context.Context) ([]*api.AppStatus, error) {
	r, err := c.Call(ctx, &api.Request{Op: api.OpList})
	if err != nil {
		return nil, err
	}
	return r.Apps, nil
}

// Exec runs cmd in an app's environment and waits for it (up to timeout, 0
// meaning no limit).
func (c *Client) Exec(ctx context.Context, id string, cmd []string, timeout time.Duration) (*api.ExecResult, error) {
	r, err := c.Call(ctx, &api.Request{Op: api.OpExec, ID: id, Cmd: cmd, Timeout: timeout})
	if err != nil {
		return nil, err
	}
	return r.Exec, nil
}

// ReopenLog reopens an app's log file (after the kubelet rotated it).
func (c *Client) ReopenLog(ctx context.Context, id string) error {
	_, err := c.Call(ctx, &api.Request{Op: api.OpReopenLog, ID: id})
	return err
}

// SetSysctls sets IPC sysctls in the pod's IPC namespace: InvalidArgument
// for a name the IPC namespace does not isolate.
func (c *Client) SetSysctls(ctx context.Context, sysctls map[string]string) error {
	_, err := c.Call(ctx, &api.Request{Op: api.OpSysctl, Sysctls: sysctls})
	return err
}

// Stats returns an app's usage, or the pod's for id "".
func (c *Client) Stats(ctx context.Context, id string) (*api.Stats, error) {
	r, err := c.Call(ctx, &api.Request{Op: api.OpStats, ID: id})
	if err != nil {
		return nil, err
	}
	return r.Stats, nil
}

// Shutdown stops every app (SIGTERM, timeout, SIGKILL) and ends the agent.
func (c *Client) Shutdown(ctx context.Context, timeout time.Duration) error {
	_, err := c.Call(ctx, &api.Request{Op: api.OpShutdown, Timeout: timeout})
	return err
}
