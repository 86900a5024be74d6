package stage1

import (
	"context"
	"fmt"
	"io"
	"time"

	"github.com/stagelet/stagelet/agent"
	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/errdefs"
)

// PathMapper turns a host path into the path the pod's agent sees it at. It
// fails (ErrInvalidArgument) for a path the agent cannot reach.
type PathMapper func(hostPath string) (string, error)

// IdentityPaths is the PathMapper of a backend whose agent sees the host's
// file system (fly).
func IdentityPaths(p string) (string, error) { return p, nil }

// AgentPod implements every container method of Pod by calling the pod's
// agent, mapping host paths in a ContainerSpec with MapPaths; exec, attach
// and port-forward sessions run over the same agent connection, whatever
// its transport. Backends embed it and add State, Details and Stop. It holds no state of its own beyond
// the client; it is safe for concurrent use.
type AgentPod struct {
	*agent.Client
	// MapPaths maps host paths to agent paths; nil means identity.
	MapPaths PathMapper
}

// NewAgentPod returns an AgentPod talking through c.
func NewAgentPod(c *agent.Client, mapPaths PathMapper) AgentPod {
	return AgentPod{Client: c, MapPaths: mapPaths}
}

func (p *AgentPod) mapPath(s string) (string, error) {
	if s == "" || p.MapPaths == nil {
		return s, nil
	}
	m, err := p.MapPaths(s)
	if err != nil {
		return "", err
	}
	return m, nil
}

// CreateContainer maps the spec's Rootfs, mount sources and LogPath and
// registers the app with the agent. The caller's spec is not modified.
func (p *AgentPod) CreateContainer(ctx context.Context, spec *ContainerSpec) (*api.AppStatus, error) {
	if spec == nil || spec.ID == "" {
		return nil, errdefs.InvalidArgument("create container: no id")
	}
	app := spec.AppSpec
	var err error
	if app.Rootfs, err = p.mapPath(app.Rootfs); err != nil {
		return nil, fmt.Errorf("container %s: rootfs: %w", app.ID, err)
	}
	if app.LogPath, err = p.mapPath(app.LogPath); err != nil {
		return nil, fmt.Errorf("container %s: log: %w", app.ID, err)
	}
	if len(app.Mounts) > 0 {
		app.Mounts = append([]api.Mount(nil), app.Mounts...)
		for i := range app.Mounts {
			if app.Mounts[i].Source, err = p.mapPath(app.Mounts[i].Source); err != nil {
				return nil, fmt.Errorf("container %s: mount %s: %w", app.ID, app.Mounts[i].Destination, err)
			}
		}
	}
	return p.Client.Create(ctx, &app)
}

// UpdateContainerResources changes an app's limits in its agent.
func (p *AgentPod) UpdateContainerResources(ctx context.Context, id string, r api.Resources) error {
	_, err := p.Client.Update(ctx, id, r)
	return err
}

// StartContainer starts a created app.
func (p *AgentPod) StartContainer(ctx context.Context, id string) (*api.AppStatus, error) {
	return p.Client.Start(ctx, id)
}

// SetSysctls sets IPC sysctls through the agent, which runs in the pod's
// IPC namespace.
func (p *AgentPod) SetSysctls(ctx context.Context, sysctls map[string]string) error {
	return p.Client.SetSysctls(ctx, sysctls)
}

// StopContainer sends SIGTERM, waits up to timeout, then SIGKILL; an
// exited app is returned as it is.
func (p *AgentPod) StopContainer(ctx context.Context, id string, timeout time.Duration) (*api.AppStatus, error) {
	return p.Client.Stop(ctx, id, timeout)
}

// RemoveContainer forgets an app. Idempotent: an unknown app is not an
// error.
func (p *AgentPod) RemoveContainer(ctx context.Context, id string) error {
	err := p.Client.Remove(ctx, id)
	if errdefs.IsNotFound(err) {
		return nil
	}
	return err
}

// ContainerStatus returns an app's status; ErrNotFound for an unknown one.
func (p *AgentPod) ContainerStatus(ctx context.Context, id string) (*api.AppStatus, error) {
	return p.Client.Status(ctx, id)
}

// ListContainers returns every app's status.
func (p *AgentPod) ListContainers(ctx context.Context) ([]*api.AppStatus, error) {
	return p.Client.List(ctx)
}

// ExecSync runs cmd in an app and waits up to timeout (0: no limit).
func (p *AgentPod) ExecSync(ctx context.Context, id string, cmd []string, timeout time.Duration) (*api.ExecResult, error) {
	return p.Client.Exec(ctx, id, cmd, timeout)
}

// ReopenLog reopens an app's log file.
func (p *AgentPod) ReopenLog(ctx context.Context, id string) error {
	return p.Client.ReopenLog(ctx, id)
}

// ExecStream runs cmd in an app with streamed stdio; see
// agent.Client.ExecStream.
func (p *AgentPod) ExecStream(ctx context.Context, id string, cmd []string, sio StreamIO) (int32, error) {
	return p.Client.ExecStream(ctx, id, cmd, sio)
}

// Attach connects sio to a running app's stdio; see agent.Client.Attach.
func (p *AgentPod) Attach(ctx context.Context, id string, sio StreamIO) error {
	return p.Client.Attach(ctx, id, sio)
}

// PortForward connects stream to port inside the pod, through its agent;
// see agent.Client.PortForward.
func (p *AgentPod) PortForward(ctx context.Context, port int32, stream io.ReadWriter) error {
	return p.Client.PortForward(ctx, port, stream)
}
