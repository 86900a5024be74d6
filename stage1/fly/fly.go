// Package fly is the stage1 with the least isolation: the pod's agent runs
// on the host as a supervisor, in the host's PID namespace, in the host's
// IPC namespace when the pod asks for it (else one of the pod's own), and
// in the host's network (or the pod's network namespace when it has one),
// and starts each app with pivot_root into the app's root filesystem. The
// pod is a cgroup holding the agent and its apps; the agent is launched
// detached so that pods outlive the daemon. On a cgroup v1 host the agent
// is charged to a memory cgroup of the runtime's instead
// (cgroups.RuntimeMemoryCgroup) and makes its apps' memory cgroups beneath
// the pod's: the pod's memory limit is its apps'.
//
// Every host resource a pod takes (its cgroup, the agent's unit and
// process, its socket) is recorded in the pod's ledger (host.Ledger), in
// the state handed to Persist, before it is taken, so that DestroyPod
// releases it after any crash.
package fly

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"github.com/stagelet/stagelet/stage1/host"

	"github.com/stagelet/stagelet/agent/client"
	"github.com/stagelet/stagelet/cgroups"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/stage1"
)

// Name is the stage1's registered name.
const Name = "fly"

// stateVersion is the version of the persisted state. Every version ever
// written stays readable: raising it means passing parseState's
// stage1.ParseState a stage1.Migration from the version before.
// Version 2 keeps the resources in a ledger; version 1 had a field each.
const stateVersion = 2

// The roles of a pod's resources in its ledger.
const (
	rolePodCgroup     = "pod cgroup"
	roleRuntimeMemory = "runtime memory cgroup"
	roleSocket        = "agent socket"
	roleUnit          = "agent unit"
	roleAgent         = "agent"
)

// migrations bring an older state up to stateVersion.
var migrations = map[int]stage1.Migration{
	1: stage1.Migration(host.ToLedger(
		host.LegacyField{Field: "cgroup", Kind: host.KindCgroup, Role: rolePodCgroup},
		host.LegacyField{Field: "socket", Kind: host.KindFile, Role: roleSocket},
		host.LegacyField{Field: "agent", Kind: host.KindProcess, Role: roleAgent},
	)),
}

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
	host.Base
}

var _ stage1.Backend = (*Backend)(nil)

var _ stage1.Collector = (*Backend)(nil)

// New returns the fly backend, starting agents with the plain launcher
// (the cgroupfs driver). The caller puts it in the broker's
// stage1.Registry under its Name.
func New(log *slog.Logger) *Backend {
	return NewWithLauncher(log, nil)
}

// NewWithLauncher returns the fly backend starting agents with l; nil
// means the plain launcher (the cgroupfs driver).
func NewWithLauncher(log *slog.Logger, l host.Launcher) *Backend {
	return &Backend{Base: host.NewBase(log, l)}
}

// Collect implements stage1.Collector: under the systemd driver, the
// units of pods no record names (host.CollectUnits); otherwise their
// runtime memory cgroups once empty (their pod cgroups, and the agents in
// them, are the broker's to collect).
func (b *Backend) Collect(ctx context.Context, keep func(podID string) bool) ([]string, error) {
	if b.UnitLaunch() {
		return host.CollectUnits(ctx, b.Launcher, keep)
	}
	done, err := cgroups.CollectEmptyPodCgroups(cgroups.RuntimeMemoryParent(), keep)
	if err != nil {
		return done, fmt.Errorf("fly: %w", err)
	}
	return done, nil
}

// Name implements stage1.Backend.
func (b *Backend) Name() string { return Name }

// Capabilities implements stage1.Backend: host isolation; the host's
// namespaces, or the pod's network and IPC namespaces.
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
	Version int `json:"version"`
	host.Ledger
}

func (s *state) cgroup() *cgroups.Cgroup        { return s.Cgroup(rolePodCgroup) }
func (s *state) runtimeMemory() *cgroups.Cgroup { return s.Cgroup(roleRuntimeMemory) }
func (s *state) socket() string                 { return s.Path(roleSocket) }
func (s *state) agent() *host.Process           { return s.Process(roleAgent) }

func (s *state) marshal() []byte { return stage1.MarshalState(s) }

func parseState(b []byte) (*state, error) {
	var s state
	if err := stage1.ParseState(Name, b, stateVersion, &s, migrations); err != nil {
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
	log := b.Log.With("pod", spec.ID)
	if spec.ID == "" || spec.RunDir == "" || spec.AgentBinary == "" {
		return nil, errdefs.InvalidArgument("fly: pod id, run dir and agent binary are required")
	}
	if spec.HostNetwork && spec.NetNSPath != "" {
		return nil, errdefs.InvalidArgument("fly: a pod in the host network has no network namespace (got %s)", spec.NetNSPath)
	}
	cg, err := cgroups.PodCgroup(spec.CgroupParent, spec.ID)
	if err != nil {
		return nil, fmt.Errorf("fly: pod cgroup: %w", err)
	}
	unitLaunch := b.UnitLaunch()
	st := &state{Version: stateVersion}
	save := func() error { return persist(st.marshal()) }
	st.Record(host.Resource{Kind: host.KindCgroup, Role: rolePodCgroup, Cgroup: cg})
	var mem *cgroups.Cgroup
	if !unitLaunch {
		if mem = cgroups.RuntimeMemoryCgroup(spec.CgroupParent, spec.ID); mem != nil {
			st.Record(host.Resource{Kind: host.KindCgroup, Role: roleRuntimeMemory, Cgroup: mem})
		}
	}
	st.Record(host.Resource{Kind: host.KindFile, Role: roleSocket, Path: socketPath(spec)})
	undo, err := host.Starting(ctx, log, Name, save, func(ctx context.Context) error { return b.release(ctx, st) })
	if err != nil {
		return nil, err
	}
	defer undo(&retErr)
	agentDir := filepath.Join(spec.RunDir, "agent")
	if err := os.MkdirAll(agentDir, 0o700); err != nil {
		return nil, fmt.Errorf("fly: %w", err)
	}
	if !unitLaunch {
		if err := cg.Create(); err != nil {
			return nil, fmt.Errorf("fly: %w", err)
		}
	}
	args := agentArgs(st.socket(), agentDir, spec.NetNSPath, spec.HostIPC)
	if mem != nil {
		if err := mem.Create(); err != nil {
			return nil, fmt.Errorf("fly: %w", err)
		}
		args = append(args, "--memory-cgroup", cg.Paths["memory"])
	}
	// The agent's PID is known only once it runs; it starts inside the
	// recorded cgroup (or unit), so a crash before the next persist leaves
	// it where DestroyPod finds it.
	if err := st.Take(host.Resource{Kind: host.KindUnit, Role: roleUnit, Name: launchName(spec.ID)}, save); err != nil {
		return nil, fmt.Errorf("fly: persist: %w", err)
	}
	proc, err := b.Launcher.Launch(ctx, host.LaunchSpec{
		Name:    launchName(spec.ID),
		Path:    spec.AgentBinary,
		Args:    args,
		LogPath: filepath.Join(spec.RunDir, "agent.log"),
		Cgroup:  cgroups.WithMemory(cg, mem),
		Slice:   cgroups.SliceOf(spec.CgroupParent),
	})
	if err != nil {
		return nil, fmt.Errorf("fly: %w", err)
	}
	st.Record(host.Resource{Kind: host.KindProcess, Role: roleAgent, Process: proc})
	if unitLaunch {
		st.Record(host.Resource{Kind: host.KindCgroup, Role: rolePodCgroup, Cgroup: proc.Cgroup})
	}
	if err := save(); err != nil {
		return nil, fmt.Errorf("fly: persist: %w", err)
	}
	pod := b.newPod(spec, st)
	if err := waitReady(ctx, pod); err != nil {
		return nil, fmt.Errorf("fly: agent (log %s): %w", filepath.Join(spec.RunDir, "agent.log"), err)
	}
	log.DebugContext(ctx, "fly pod started", "agentPID", proc.PID, "unit", proc.Unit, "cgroup", st.cgroup().String())
	return pod, nil
}

// waitReady waits until the agent answers Info, the pod's process exits,
// or AgentReadyTimeout passes.
func waitReady(ctx context.Context, p *Pod) error {
	return host.WaitAgentReady(ctx, p, p.st.agent(), AgentReadyTimeout, "the agent")
}

// RecoverPod implements stage1.Backend: the pod is back when its agent
// process (PID and start time) still runs and answers Info; otherwise the
// error wraps stage1.ErrPodGone.
func (b *Backend) RecoverPod(ctx context.Context, spec *stage1.PodSpec, stateBytes []byte) (stage1.Pod, error) {
	return host.Recover(ctx, Name, spec, stateBytes, parseState, "agent", host.ProbeTimeout,
		func(st *state) (stage1.Pod, *host.Process) {
			return b.newPod(spec, st), st.agent()
		})
}

// DestroyPod implements stage1.Backend: it releases every resource of
// the pod's ledger (host.Ledger.Release: the agent killed when its
// record still names it, its unit released, the pod cgroup emptied and
// removed, the socket removed). Idempotent. What the state lacks (a crash
// before the first persist, an unreadable record) is derived from spec.
func (b *Backend) DestroyPod(ctx context.Context, spec *stage1.PodSpec, stateBytes []byte) error {
	return host.Destroy(ctx, b.Log, Name, spec, stateBytes, parseState, func(st *state) {
		if spec.ID != "" {
			if cg, err := cgroups.PodCgroup(spec.CgroupParent, spec.ID); err == nil {
				st.Default(host.Resource{Kind: host.KindCgroup, Role: rolePodCgroup, Cgroup: cg})
			}
			if mem := cgroups.RuntimeMemoryCgroup(spec.CgroupParent, spec.ID); mem != nil && !b.UnitLaunch() {
				st.Default(host.Resource{Kind: host.KindCgroup, Role: roleRuntimeMemory, Cgroup: mem})
			}
			st.Default(host.Resource{Kind: host.KindUnit, Role: roleUnit, Name: launchName(spec.ID)})
		}
		if spec.RunDir != "" {
			st.Default(host.Resource{Kind: host.KindFile, Role: roleSocket, Path: socketPath(spec)})
		}
	}, b.release)
}

// release releases everything st's ledger names.
func (b *Backend) release(ctx context.Context, st *state) error {
	if err := st.Release(ctx, host.Releaser{Launcher: b.Launcher, Grace: AgentExitGrace}); err != nil {
		return fmt.Errorf("fly: %w", err)
	}
	return nil
}

// Pod is a running fly pod.
type Pod struct {
	id  string
	st  *state
	log *slog.Logger
}

var _ stage1.Pod = (*Pod)(nil)

func (b *Backend) newPod(spec *stage1.PodSpec, st *state) *Pod {
	return &Pod{
		id:  spec.ID,
		st:  st,
		log: b.Log.With("pod", spec.ID),
	}
}

// Agent implements stage1.Pod: the agent's unix socket; the agent runs on
// the host's file system, so container paths need no mapping.
func (p *Pod) Agent() stage1.AgentEndpoint {
	return stage1.AgentEndpoint{Dial: client.UnixDialer(p.st.socket())}
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
	if err := host.StopHostPod(ctx, p.log, "the agent", p.st.agent(), []*cgroups.Cgroup{p.st.cgroup(), p.st.runtimeMemory()}, shutdown, timeout, AgentExitGrace); err != nil {
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

var (
	_ stage1.AppCheckpointer = (*Pod)(nil)
	_ stage1.AppRestorer     = (*Pod)(nil)
)

// RestoreApp implements stage1.AppRestorer: criu, run by the agent as its
// child (the agent is in the node's PID namespace, not its init), leaves
// the restored app to the agent.
func (p *Pod) RestoreApp(ctx context.Context, r *stage1.AppRestore) (int, error) {
	pid, err := host.RestoreAppInAgent(ctx, p.st.cgroup(), r)
	if err != nil {
		return 0, fmt.Errorf("fly: restore %s: %w", r.Spec.ID, err)
	}
	return pid, nil
}

// FreezeApps implements stage1.AppCheckpointer: the apps' cgroups'
// freezer.
func (p *Pod) FreezeApps(ctx context.Context, ids []string) (func() error, error) {
	thaw, err := host.FreezeApps(ctx, p.st.cgroup(), ids)
	if err != nil {
		return nil, fmt.Errorf("fly: %w", err)
	}
	return thaw, nil
}

// CheckpointApp implements stage1.AppCheckpointer: criu saves the app's
// processes (s.PID is their first, numbered by the node, as the agent runs
// in the node's PID namespace).
func (p *Pod) CheckpointApp(ctx context.Context, s *stage1.AppSave) (*stage1.AppImage, error) {
	img, err := host.CheckpointApp(ctx, p.st.cgroup(), 0, s)
	if err != nil {
		return nil, fmt.Errorf("fly: checkpoint %s: %w", s.ID, err)
	}
	return img, nil
}
