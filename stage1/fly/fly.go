// Package fly is the stage1 with the least isolation: the pod's agent runs
// on the host as a supervisor, in the host's PID namespace, in the host's
// IPC namespace when the pod asks for it (else one of the pod's own), and
// in the host's network (or the pod's network namespace when it has one),
// and starts each app with pivot_root into the app's root filesystem. The
// pod is a cgroup holding the agent and its apps; the agent is launched
// detached so that pods outlive the daemon.
//
// Every host resource a pod takes (its cgroup, the agent process) is
// recorded in the state handed to Persist before it is taken, so DestroyPod
// can release it after any crash.
package fly

import (
	"context"
	"errors"
	"fmt"
	"github.com/stagelet/stagelet/stage1/host"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"github.com/stagelet/stagelet/agent"
	"github.com/stagelet/stagelet/cgroups"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/stage1"
)

// Name is the stage1's registered name.
const Name = "fly"

// stateVersion is the version of the persisted state. Every version ever
// written stays readable: raising it means passing parseState's
// stage1.ParseState a stage1.Migration from the version before.
const stateVersion = 1

// Timeouts; variables so tests may shorten them.
var (
	// AgentReadyTimeout bounds how long StartPod waits for the agent to
	// answer.
	AgentReadyTimeout = 30 * time.Second
	// AgentExitGrace is how long Stop waits for the agent to exit beyond
	// the apps' stop timeout.
	AgentExitGrace = 10 * time.Second
)

// Backend is the fly stage1. It is stateless: everything about a pod is in
// the state it persists, so one Backend serves every pod concurrently.
type Backend struct {
	log      *slog.Logger
	launcher host.Launcher
}

var _ stage1.Backend = (*Backend)(nil)

// New returns the fly backend, starting agents with the plain launcher
// (the cgroupfs driver). The caller registers it (stage1.Register(fly.New(log))).
func New(log *slog.Logger) *Backend {
	return NewWithLauncher(log, nil)
}

// NewWithLauncher returns the fly backend starting agents with l; nil
// means the plain launcher (the cgroupfs driver).
func NewWithLauncher(log *slog.Logger, l host.Launcher) *Backend {
	log, l = host.BackendDefaults(log, l)
	return &Backend{log: log, launcher: l}
}

// Name implements stage1.Backend.
func (b *Backend) Name() string { return Name }

// Capabilities implements stage1.Backend: host isolation, host namespaces;
// no pod network yet.
func (b *Backend) Capabilities() stage1.Capabilities {
	return stage1.Capabilities{
		Isolation:   stage1.IsolationHost,
		HostNetwork: true,
		PodNetwork:  true,
		HostPID:     true,
		HostIPC:     true,
		Privileged:  "host",
	}
}

// state is what fly persists for a pod.
type state struct {
	Version int             `json:"version"`
	Cgroup  *cgroups.Cgroup `json:"cgroup,omitempty"`
	Socket  string          `json:"socket,omitempty"`
	Agent   *host.Process   `json:"agent,omitempty"`
}

func (s *state) marshal() []byte { return stage1.MarshalState(s) }

func parseState(b []byte) (*state, error) {
	var s state
	if err := stage1.ParseState(Name, b, stateVersion, &s); err != nil {
		return nil, err
	}
	return &s, nil
}

func socketPath(spec *stage1.PodSpec) string { return filepath.Join(spec.RunDir, "agent.sock") }

// launchName names a pod's agent to the launcher (and its systemd unit).
func launchName(id string) string { return host.LaunchName(id) }

// StartPod implements stage1.Backend. It records the pod cgroup and creates
// it, launches the agent in it, records the agent, and waits until the
// agent answers Info (at most AgentReadyTimeout, or ctx). Under a
// host.UnitLauncher (systemd) the pod cgroup is the agent's unit's,
// recorded once the agent runs; the unit is named after the pod, so a crash
// before that record is undone by DestroyPod all the same. On failure it
// kills what it started and removes the cgroup.
func (b *Backend) StartPod(ctx context.Context, spec *stage1.PodSpec, persist stage1.Persist) (_ stage1.Pod, retErr error) {
	log := b.log.With("pod", spec.ID)
	if spec.ID == "" || spec.RunDir == "" || spec.AgentBinary == "" {
		return nil, errdefs.InvalidArgument("fly: pod id, run dir and agent binary are required")
	}
	if spec.HostNetwork && spec.NetNSPath != "" {
		return nil, errdefs.InvalidArgument("fly: a pod in the host network has no network namespace (got %s)", spec.NetNSPath)
	}
	cg, err := host.PodCgroup(spec)
	if err != nil {
		return nil, fmt.Errorf("fly: pod cgroup: %w", err)
	}
	_, unitLaunch := b.launcher.(host.UnitLauncher)
	st := &state{Version: stateVersion, Cgroup: cg, Socket: socketPath(spec)}
	if err := persist(st.marshal()); err != nil {
		return nil, fmt.Errorf("fly: persist: %w", err)
	}
	defer func() {
		if retErr == nil {
			return
		}
		if err := b.release(context.WithoutCancel(ctx), st, launchName(spec.ID)); err != nil {
			log.Warn("fly: releasing a failed pod", "err", err)
		}
	}()
	if !unitLaunch {
		if err := cg.Create(); err != nil {
			return nil, fmt.Errorf("fly: %w", err)
		}
	}
	agentDir := filepath.Join(spec.RunDir, "agent")
	if err := os.MkdirAll(agentDir, 0o700); err != nil {
		return nil, fmt.Errorf("fly: %w", err)
	}
	// The agent's PID is known only once it runs; it starts inside the
	// recorded cgroup, so a crash before the next persist leaves it where
	// DestroyPod's cgroup kill finds it.
	proc, err := b.launcher.Launch(ctx, host.LaunchSpec{
		Name:    launchName(spec.ID),
		Path:    spec.AgentBinary,
		Args:    agentArgs(st.Socket, agentDir, spec.NetNSPath, spec.HostIPC),
		LogPath: filepath.Join(spec.RunDir, "agent.log"),
		Cgroup:  cg,
		Slice:   host.PodSlice(spec),
	})
	if err != nil {
		return nil, fmt.Errorf("fly: %w", err)
	}
	st.Agent = proc
	if unitLaunch {
		st.Cgroup = proc.Cgroup
	}
	if err := persist(st.marshal()); err != nil {
		return nil, fmt.Errorf("fly: persist: %w", err)
	}
	pod := b.newPod(spec, st)
	if err := waitReady(ctx, pod); err != nil {
		return nil, fmt.Errorf("fly: agent (log %s): %w", filepath.Join(spec.RunDir, "agent.log"), err)
	}
	log.Debug("fly pod started", "agentPID", proc.PID, "unit", proc.Unit, "cgroup", st.Cgroup.String())
	return pod, nil
}

// waitReady waits until the agent answers Info, the pod's process exits,
// or AgentReadyTimeout passes.
func waitReady(ctx context.Context, p *Pod) error {
	return host.WaitAgentReady(ctx, p.client.Info, p.st.Agent, AgentReadyTimeout, "the agent")
}

// RecoverPod implements stage1.Backend: the pod is back when its agent
// process (PID and start time) still runs and answers Info; otherwise the
// error wraps stage1.ErrPodGone.
func (b *Backend) RecoverPod(ctx context.Context, spec *stage1.PodSpec, stateBytes []byte) (stage1.Pod, error) {
	st, err := parseState(stateBytes)
	if err != nil {
		return nil, err
	}
	pod := b.newPod(spec, st)
	if err := host.CheckRecovered(ctx, st.Agent, "agent", pod.client.Info, host.ProbeTimeout); err != nil {
		return nil, fmt.Errorf("fly: pod %s: %w", spec.ID, err)
	}
	return pod, nil
}

// DestroyPod implements stage1.Backend: it kills the agent (if the recorded
// PID still names it), releases its systemd unit (under a UnitLauncher),
// kills every process left in the pod cgroup, and removes the cgroup and
// the agent socket. Idempotent. With no cgroup in the state (a crash before
// the first persist completed) it derives the cgroup from spec.
func (b *Backend) DestroyPod(ctx context.Context, spec *stage1.PodSpec, stateBytes []byte) error {
	st, err := host.StateForRelease(b.log, Name, spec.ID, stateBytes, parseState)
	if err != nil {
		return err
	}
	if st.Cgroup == nil && spec.ID != "" {
		if cg, err := host.PodCgroup(spec); err == nil {
			st.Cgroup = cg
		}
	}
	if st.Socket == "" && spec.RunDir != "" {
		st.Socket = socketPath(spec)
	}
	name := ""
	if spec.ID != "" {
		name = launchName(spec.ID)
	}
	return b.release(ctx, st, name)
}

// release kills and removes everything named in st, and the launcher's
// record of the agent launched under name ("": none), in host.Release's
// order.
func (b *Backend) release(ctx context.Context, st *state, name string) error {
	r := host.HostResources{
		Processes: []*host.Process{st.Agent},
		Launched:  []string{name},
		Cgroups:   []*cgroups.Cgroup{st.Cgroup},
	}
	if sock := st.Socket; sock != "" {
		r.Then = append(r.Then, host.ReleaseStep{What: "agent socket", Do: func() error {
			if err := os.Remove(sock); err != nil && !errors.Is(err, os.ErrNotExist) {
				return err
			}
			return nil
		}})
	}
	if err := host.Release(ctx, b.launcher, AgentExitGrace, r); err != nil {
		return fmt.Errorf("fly: %w", err)
	}
	return nil
}

// Pod is a running fly pod.
type Pod struct {
	// client reaches the agent while the pod starts or recovers; the
	// broker has its own connection (Agent).
	client *agent.Client
	id     string
	st     *state
	log    *slog.Logger
}

var _ stage1.Pod = (*Pod)(nil)

func (b *Backend) newPod(spec *stage1.PodSpec, st *state) *Pod {
	return &Pod{
		client: agent.NewClient(agent.UnixDialer(st.Socket)),
		id:     spec.ID,
		st:     st,
		log:    b.log.With("pod", spec.ID),
	}
}

// Agent implements stage1.Pod: the agent's unix socket; the agent runs on
// the host's file system, so container paths need no mapping.
func (p *Pod) Agent() stage1.AgentEndpoint {
	return stage1.AgentEndpoint{Dial: agent.UnixDialer(p.st.Socket)}
}

// State implements stage1.Pod.
func (p *Pod) State() []byte { return p.st.marshal() }

// Details implements stage1.Pod.
func (p *Pod) Details() map[string]string { return map[string]string{"stage1": Name} }

// Stop implements stage1.Pod: it asks the agent to stop every app (SIGTERM,
// timeout, SIGKILL) and exit, waits for the agent process to end (at most
// timeout plus AgentExitGrace, or ctx), then kills whatever remains in the
// pod cgroup. The cgroup itself stays until DestroyPod. Idempotent: a gone
// agent is fine.
func (p *Pod) Stop(ctx context.Context, timeout time.Duration, shutdown stage1.Shutdown) error {
	if err := host.StopHostPod(ctx, p.log, "the agent", p.st.Agent, []*cgroups.Cgroup{p.st.Cgroup}, shutdown, timeout, AgentExitGrace); err != nil {
		return fmt.Errorf("fly: %w", err)
	}
	return nil
}

// agentArgs is the agent's command line; with a pod network namespace the
// agent (and so every app) runs inside it, and a pod that does not share
// the host's IPC namespace gets one of its own.
func agentArgs(socket, stateDir, netns string, hostIPC bool) []string {
	args := []string{"agent", "--socket", socket, "--state-dir", stateDir}
	if netns != "" {
		args = append(args, "--netns", netns)
	}
	if !hostIPC {
		args = append(args, "--private-ipc")
	}
	return args
}
