// Package nspawn is the stage1 that isolates each pod with Linux namespaces
// under systemd-nspawn: one systemd-nspawn per pod, whose root is a small
// per-pod tree (mount points and the agent binary) and whose init (PID 1)
// is the pod's agent. The agent starts each app with pivot_root into the
// app's root filesystem, inside the pod's PID, IPC, UTS and mount
// namespaces and, unless the pod uses the host's, its network namespace.
//
// Host paths reach the agent through one propagating directory per pod:
// <RunDir>/mounts is made a shared mount and bound into the container at
// /mnt/stagelet, so that a bind mount the backend makes beneath it on the
// host after the pod started (a container's rootfs, its log directory, the
// sources of its mounts) appears inside the running pod. The agent's socket
// and records live in <RunDir>/agent, bound at /run/stagelet.
//
// systemd-nspawn runs with --register=no --keep-unit, started detached by
// the stage1 launcher so that pods outlive the daemon. With the plain
// launcher it runs inside the pod cgroup; on a v1 or hybrid host nspawn
// also moves itself and the container into payload/ and supervisor/
// children of its cgroup in the name=systemd and hybrid cgroup2
// hierarchies, which the cgroups package does not manage: the pod gets its
// own cgroup there too, joined by a /bin/sh shim that then execs nspawn
// (same PID), so nothing is created in the daemon's cgroups. The shim
// joins the pod's runtime memory cgroup as well (cgroups.RuntimeMemoryCgroup),
// and the agent makes its apps' memory cgroups beneath the pod's, bound
// into the pod: the pod's memory limit is its apps'. Where systemd
// is PID 1 (a host.UnitLauncher) nspawn is the main process of the
// pod's transient unit, which systemd supervises: --keep-unit makes nspawn
// use that unit and its cgroup (delegated), which is the pod cgroup in
// every hierarchy, so no shim and no cgroup of the backend's own are
// needed; --register=no keeps machined out of it. nspawn mounts the controllers read-only inside
// a cgroup namespace; the agent, as PID 1, remounts its own read-write to
// create the apps' cgroups.
//
// Every host resource a pod takes (cgroups, the shared mount, the nspawn
// process) is recorded through Persist before it is taken; DestroyPod
// finds the per-container binds by scanning the mount table beneath the
// recorded directory, so it releases everything after any crash.
package nspawn

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/stagelet/stagelet/internal/bindmount"
	"github.com/stagelet/stagelet/stage1/host"

	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/agent/client"
	"github.com/stagelet/stagelet/cgroups"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/lsm"
	"github.com/stagelet/stagelet/stage1"
)

// Name is the stage1's registered name.
const Name = "nspawn"

// stateVersion is the version of the persisted state. Every version ever
// written stays readable: raising it means passing parseState's
// stage1.ParseState a stage1.Migration from the version before.
// Version 2 keeps the resources in a ledger; version 1 had a field each.
const stateVersion = 2

// The roles of a pod's resources in its ledger, in the order StartPod
// takes them.
const (
	rolePodCgroup     = "pod cgroup"
	roleSystemdCgroup = "systemd cgroup"
	roleTree          = "stage1 tree"
	roleAgentDir      = "agent directory"
	roleMounts        = "shared mounts"
	roleLock          = "nspawn lock"
	rolePropagate     = "nspawn propagation directory"
	roleUnit          = "nspawn unit"
	roleNSpawn        = "systemd-nspawn"
	roleLeader        = "container init"
)

// migrations bring an older state up to stateVersion.
var migrations = map[int]stage1.Migration{
	1: stage1.Migration(host.ToLedger(
		host.LegacyField{Field: "cgroup", Kind: host.KindCgroup, Role: rolePodCgroup},
		host.LegacyField{Field: "systemdCgroup", Kind: host.KindCgroup, Role: roleSystemdCgroup},
		host.LegacyField{Field: "tree", Kind: host.KindDir, Role: roleTree},
		host.LegacyField{Field: "agentDir", Kind: host.KindDir, Role: roleAgentDir},
		host.LegacyField{Field: "mounts", Kind: host.KindDir, Role: roleMounts},
		host.LegacyField{Field: "nspawn", Kind: host.KindProcess, Role: roleNSpawn},
		host.LegacyField{Field: "leader", Kind: host.KindProcess, Role: roleLeader},
	)),
}

// Paths inside the pod.
const (
	// podAgent is where the agent binary is bound (read-only).
	podAgent = "/stagelet"
	// podAgentDir holds the agent's socket and records (<RunDir>/agent).
	podAgentDir = "/run/stagelet"
	// podMounts is the propagating directory (<RunDir>/mounts).
	podMounts = "/mnt/stagelet"
)

// Timeouts; variables so tests may shorten them.
var (
	// AgentReadyTimeout bounds how long StartPod waits for the agent to
	// answer.
	AgentReadyTimeout = 30 * time.Second
	// ExitGrace is how long Stop waits for systemd-nspawn to exit beyond
	// the apps' stop timeout, and how long teardown waits for killed
	// processes to go.
	ExitGrace = 10 * time.Second
)

// Backend is the nspawn stage1. It is stateless: everything about a pod is
// in the state it persists, so one Backend serves every pod concurrently.
type Backend struct {
	host.Base
}

var _ stage1.Backend = (*Backend)(nil)

var _ stage1.Collector = (*Backend)(nil)

// New returns the nspawn backend; the caller puts it in the broker's
// stage1.Registry under its Name. Whether systemd-nspawn is installed
// is checked by StartPod (FailedPrecondition), not here.
func New(log *slog.Logger) *Backend {
	return NewWithLauncher(log, nil)
}

// NewWithLauncher returns the nspawn backend starting systemd-nspawn with
// l; nil means the plain launcher (the cgroupfs driver).
func NewWithLauncher(log *slog.Logger, l host.Launcher) *Backend {
	return &Backend{Base: host.NewBase(log, l)}
}

// launchName names a pod's systemd-nspawn to the launcher (and its systemd
// unit).
func launchName(id string) string { return host.LaunchName(id) }

// Name implements stage1.Backend.
func (b *Backend) Name() string { return Name }

// Capabilities implements stage1.Backend. systemd-nspawn always gives the
// container its own PID and IPC namespaces, so host PID and IPC are not
// offered; the network is the host's or the pod's own. A privileged
// container gets every capability inside the pod's namespaces and the
// pod's minimal /dev, not the host's devices.
func (b *Backend) Capabilities() stage1.Capabilities {
	return stage1.Capabilities{
		Isolation:   stage1.IsolationNamespaces,
		HostNetwork: true,
		PodNetwork:  true,
		HostPID:     false,
		HostIPC:     false,
		Privileged:  "pod",
		// The pod in a user namespace of its own, its containers' files
		// idmapped.
		UserNamespaces: true,
	}
}

// state is what nspawn persists for a pod: its host resources in a
// ledger, and what Details says.
type state struct {
	Version int    `json:"version"`
	Machine string `json:"machine,omitempty"`
	// Network is "host", "netns" or "private", for Details.
	Network string `json:"network,omitempty"`
	// UserNS is the pod's user namespace mapping; nil: the host's.
	UserNS *stage1.IDMapping `json:"userNS,omitempty"`
	host.Ledger
}

// Cgroup is the pod cgroup; SystemdCgroup the pod's cgroup in the
// hierarchies where systemd-nspawn and the agent run outside it on a v1
// or hybrid host (systemdCgroup). The tree holds the stage1 root (tree/rootfs); the
// agent directory its socket and records; the shared mounts directory is
// bound into the pod, and every mount beneath it is the backend's. The
// leader is the container's PID 1 (the agent) as the host sees it.
func (s *state) cgroup() *cgroups.Cgroup        { return s.Cgroup(rolePodCgroup) }
func (s *state) systemdCgroup() *cgroups.Cgroup { return s.Cgroup(roleSystemdCgroup) }
func (s *state) tree() string                   { return s.Path(roleTree) }
func (s *state) agentDir() string               { return s.Path(roleAgentDir) }
func (s *state) mounts() string                 { return s.Path(roleMounts) }
func (s *state) nspawn() *host.Process          { return s.Process(roleNSpawn) }
func (s *state) leader() *host.Process          { return s.Process(roleLeader) }

// memoryApart reports whether systemd-nspawn and the agent are charged to
// a memory cgroup outside the pod's (systemdCgroup), the pod's memory
// cgroup then bound into the pod for the agent at podMemoryCgroup.
func (s *state) memoryApart() bool {
	scg := s.systemdCgroup()
	return scg != nil && scg.Paths["memory"] != ""
}

// podMemoryCgroup is where the pod's memory cgroup is bound beneath the
// shared mounts directory when memoryApart: a name no container ID takes.
const podMemoryCgroup = "cgroup.memory"

func (s *state) marshal() []byte { return stage1.MarshalState(s) }

func (s *state) socket() string {
	if s.agentDir() == "" {
		return ""
	}
	return filepath.Join(s.agentDir(), "agent.sock")
}

func parseState(b []byte) (*state, error) {
	var s state
	if err := stage1.ParseState(Name, b, stateVersion, &s, migrations); err != nil {
		return nil, err
	}
	return &s, nil
}

// layout is a pod's state with what follows from spec: its machine name,
// and its cgroups and directories recorded in the order StartPod takes
// them.
func layout(spec *stage1.PodSpec) *state {
	st := &state{Version: stateVersion, Machine: machineName(spec.ID)}
	if cg, err := cgroups.PodCgroup(spec.CgroupParent, spec.ID); err == nil {
		st.Record(host.Resource{Kind: host.KindCgroup, Role: rolePodCgroup, Cgroup: cg})
	}
	if cg, err := systemdCgroup(spec); err == nil {
		st.Record(host.Resource{Kind: host.KindCgroup, Role: roleSystemdCgroup, Cgroup: cg})
	}
	st.Record(host.Resource{Kind: host.KindDir, Role: roleTree, Path: filepath.Join(spec.RunDir, "stage1")})
	st.Record(host.Resource{Kind: host.KindDir, Role: roleAgentDir, Path: filepath.Join(spec.RunDir, "agent")})
	st.Record(host.Resource{Kind: host.KindDir, Role: roleMounts, Path: filepath.Join(spec.RunDir, "mounts")})
	return st
}

// leftovers records what systemd-nspawn leaves behind when it is killed:
// its lock of the tree (named by the device and inode of the directory it
// ran, so once the tree exists) and the propagation directory it made for
// the machine name, which is this pod's.
func (s *state) leftovers() {
	var fi unix.Stat_t
	if tree := s.tree(); tree != "" && unix.Stat(filepath.Join(tree, "rootfs"), &fi) == nil {
		s.Default(host.Resource{Kind: host.KindFile, Role: roleLock, Path: fmt.Sprintf("/run/systemd/nspawn/locks/inode-%d:%d", fi.Dev, fi.Ino)})
	}
	if m := s.Machine; m != "" && !strings.ContainsRune(m, '/') {
		s.Default(host.Resource{Kind: host.KindFile, Role: rolePropagate, Path: filepath.Join("/run/systemd/nspawn/propagate", m)})
	}
}

// machineName is the nspawn machine name of a pod: "stagelet-<id>" when
// that is a valid host name, else a stable shortened form.
func machineName(id string) string {
	valid := id != "" && len(id) <= 40
	for _, r := range id {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-') {
			valid = false
		}
	}
	if valid {
		return "stagelet-" + id
	}
	sum := sha256.Sum256([]byte(id))
	prefix := make([]rune, 0, 12)
	for _, r := range id {
		if len(prefix) == 12 {
			break
		}
		if r >= 'a' && r <= 'z' || r >= '0' && r <= '9' {
			prefix = append(prefix, r)
		}
	}
	return "stagelet-" + string(prefix) + "-" + hex.EncodeToString(sum[:8])
}

// validate refuses what this backend cannot do.
func validate(spec *stage1.PodSpec) error {
	if spec.ID == "" || spec.RunDir == "" || spec.AgentBinary == "" {
		return errdefs.InvalidArgument("nspawn: pod id, run dir and agent binary are required")
	}
	if spec.HostPID || spec.HostIPC {
		return errdefs.InvalidArgument("nspawn: pods cannot share the host's PID or IPC namespace")
	}
	if spec.HostNetwork && spec.NetNSPath != "" {
		return errdefs.InvalidArgument("nspawn: host network and network namespace %s are exclusive", spec.NetNSPath)
	}
	for _, p := range []string{spec.RunDir, spec.AgentBinary, spec.NetNSPath} {
		if strings.ContainsRune(p, ':') {
			return errdefs.InvalidArgument("nspawn: path %q: ':' separates systemd-nspawn's bind arguments", p)
		}
	}
	if !filepath.IsAbs(spec.RunDir) || !filepath.IsAbs(spec.AgentBinary) {
		return errdefs.InvalidArgument("nspawn: run dir and agent binary must be absolute paths")
	}
	if u := spec.UserNS; u != nil {
		if err := u.Check("nspawn"); err != nil {
			return err
		}
	}
	return nil
}

// nspawnEnv is systemd-nspawn's environment. On a pure cgroup v2 host it
// asks for the unified hierarchy inside the container too: nspawn picks
// the container's cgroup mode from the systemd version it finds in the
// image, and the stage1 tree holds no systemd, so it would otherwise mount
// cgroup v1 hierarchies that no controller can join, and the agent could
// not give apps their limits.
//
// It also turns off nspawn's own seccomp filter: the agent gives each app
// the filter the CRI asks for (RuntimeDefault, Localhost), and Unconfined
// means none, as in runc.
func nspawnEnv(pureV2 bool) []string {
	env := []string{"PATH=/usr/sbin:/usr/bin:/sbin:/bin", "SYSTEMD_SECCOMP=0"}
	if pureV2 {
		env = append(env, "SYSTEMD_NSPAWN_UNIFIED_HIERARCHY=1")
	}
	return env
}

// nspawnArgs is the systemd-nspawn command line of a pod.
func nspawnArgs(spec *stage1.PodSpec, st *state) []string {
	args := []string{
		"--quiet",
		"--register=no",
		"--keep-unit",
		// No .nspawn file of the administrator's changes a pod.
		"--settings=no",
		"--directory=" + filepath.Join(st.tree(), "rootfs"),
		"--machine=" + st.Machine,
		// The agent drops capabilities per app; privileged apps get
		// them all inside the pod's namespaces.
		"--capability=all",
		"--kill-signal=SIGTERM",
		"--console=pipe",
		"--resolv-conf=off",
		"--timezone=off",
		"--link-journal=no",
		"--bind-ro=" + spec.AgentBinary + ":" + podAgent,
		"--bind=" + st.agentDir() + ":" + podAgentDir,
		"--bind=" + st.mounts() + ":" + podMounts,
	}
	if u := spec.UserNS; u != nil {
		// The stage1 tree, the agent's directory and the pod cgroups
		// are the backend's to hand over to the pod's root (nspawn's own
		// chown takes only ranges of exactly 2^16 from a multiple of it);
		// the containers' files reach the pod idmapped.
		args = append(args, fmt.Sprintf("--private-users=%d:%d", u.HostID, u.Size), "--private-users-ownership=off")
	}
	if spec.SELinuxProcessLabel != "" && spec.SELinuxMountLabel != "" {
		// The agent, the pod's PID 1, runs unconfined at the pod's
		// level, so that its containers (confined at that level) may see
		// it as they would a pause process; nspawn's own file systems
		// (/dev, /run) get the pod's mount label.
		if agent, err := lsm.AgentSELinuxLabel(spec.SELinuxProcessLabel); err == nil {
			args = append(args, "--selinux-context="+agent, "--selinux-apifs-context="+spec.SELinuxMountLabel)
		}
	}
	switch {
	case spec.HostNetwork:
	case spec.NetNSPath != "" && spec.UserNS != nil:
		// systemd-nspawn cannot join a network namespace from inside the
		// user namespace it makes (the host owns it): it is started in
		// the pod's instead (inNetNS), and the container shares it.
	case spec.NetNSPath != "":
		args = append(args, "--network-namespace-path="+spec.NetNSPath)
	default:
		args = append(args, "--private-network")
	}
	args = append(args, podAgent, "agent",
		"--socket", podAgentDir+"/agent.sock",
		"--state-dir", podAgentDir+"/state")
	if st.memoryApart() {
		args = append(args, "--memory-cgroup", podMounts+"/"+podMemoryCgroup)
	}
	if spec.Hostname != "" {
		// Set by the agent, not by nspawn's --hostname: nspawn takes only
		// what systemd calls a valid hostname, and the kubelet gives
		// names it refuses (an FQDN ending in a dot where the cluster
		// domain is empty); the kernel takes any 64 bytes.
		args = append(args, "--hostname", spec.Hostname)
	}
	return args
}

func networkMode(spec *stage1.PodSpec) string {
	switch {
	case spec.HostNetwork:
		return "host"
	case spec.NetNSPath != "":
		return "netns"
	}
	return "private"
}

// makeTree creates the stage1 root: systemd-nspawn requires /usr and
// creates the other API mount points itself; the rest are mount points of
// the binds.
func makeTree(st *state) error {
	root := filepath.Join(st.tree(), "rootfs")
	for _, d := range []string{"usr", "proc", "sys", "dev", "run", "tmp", "etc", "mnt/stagelet"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			return err
		}
	}
	if err := os.Chmod(filepath.Join(root, "tmp"), 0o1777); err != nil {
		return err
	}
	f, err := os.OpenFile(filepath.Join(root, podAgent), os.O_CREATE|os.O_WRONLY, 0o755)
	if err != nil {
		return err
	}
	return f.Close()
}

// chownTree gives the stage1 root (every directory and file of the tree
// makeTree made) and the agent's directory to id, the pod's root in its
// user namespace.
func chownTree(st *state, id int) error {
	for _, root := range []string{filepath.Join(st.tree(), "rootfs"), st.agentDir()} {
		err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			return os.Lchown(p, id, id)
		})
		if err != nil {
			return err
		}
	}
	return nil
}

// StartPod implements stage1.Backend. In order, each recorded before it is
// taken: the pod cgroups, the stage1 tree, the shared mounts directory, the
// nspawn process (launched detached in the pod cgroup). It returns once the
// agent answers Info (at most AgentReadyTimeout, or ctx). Errors:
// InvalidArgument (a spec this backend cannot run), FailedPrecondition
// (systemd-nspawn missing), Unavailable or DeadlineExceeded (the agent did
// not come up; the nspawn log is named). Under a host.UnitLauncher the
// pod cgroup is nspawn's unit's, recorded once nspawn runs (the unit is
// named after the pod, so DestroyPod finds it after any crash). On failure
// it releases what it took.
func (b *Backend) StartPod(ctx context.Context, spec *stage1.PodSpec, persist stage1.Persist) (_ stage1.Pod, retErr error) {
	log := b.Log.With("pod", spec.ID)
	if err := validate(spec); err != nil {
		return nil, err
	}
	nspawnPath, err := exec.LookPath("systemd-nspawn")
	if err != nil {
		return nil, errdefs.FailedPrecondition("nspawn: systemd-nspawn is not installed: %w", err)
	}
	cg, err := cgroups.PodCgroup(spec.CgroupParent, spec.ID)
	if err != nil {
		return nil, fmt.Errorf("nspawn: pod cgroup: %w", err)
	}
	unitLaunch := b.UnitLaunch()
	st := layout(spec)
	save := func() error { return persist(st.marshal()) }
	st.Record(host.Resource{Kind: host.KindCgroup, Role: rolePodCgroup, Cgroup: cg})
	st.Network = networkMode(spec)
	st.UserNS = spec.UserNS
	if unitLaunch {
		// The unit's cgroup is nspawn's.
		st.Resources = slices.DeleteFunc(st.Resources, func(r host.Resource) bool { return r.Role == roleSystemdCgroup })
	}
	undo, err := host.Starting(ctx, log, Name, save, func(ctx context.Context) error { return b.release(ctx, st) })
	if err != nil {
		return nil, err
	}
	defer undo(&retErr)
	if err := prepareHost(st, cg, unitLaunch); err != nil {
		return nil, err
	}
	// What nspawn leaves behind if it is killed, and its unit, before it
	// runs.
	st.leftovers()
	if err := st.Take(host.Resource{Kind: host.KindUnit, Role: roleUnit, Name: launchName(spec.ID)}, save); err != nil {
		return nil, fmt.Errorf("nspawn: persist: %w", err)
	}

	launch, err := nspawnLaunch(spec, st, nspawnPath, cg, unitLaunch)
	if err != nil {
		return nil, err
	}
	proc, err := b.Launcher.Launch(ctx, launch)
	if err != nil {
		return nil, fmt.Errorf("nspawn: %w", err)
	}
	defer func() {
		if retErr != nil {
			retErr = keepLog(ctx, log, retErr, launch.LogPath, spec)
		}
	}()
	st.Record(host.Resource{Kind: host.KindProcess, Role: roleNSpawn, Process: proc})
	if unitLaunch {
		st.Record(host.Resource{Kind: host.KindCgroup, Role: rolePodCgroup, Cgroup: proc.Cgroup})
	}
	if err := save(); err != nil {
		return nil, fmt.Errorf("nspawn: persist: %w", err)
	}
	if u := st.UserNS; u != nil {
		// The agent, the pod's root, makes and limits its apps' cgroups
		// beneath the pod's.
		if err := st.cgroup().Chown(int(u.HostID), int(u.HostID)); err != nil {
			return nil, fmt.Errorf("nspawn: %w", err)
		}
	}
	pod := b.newPod(spec, st)
	if err := waitReady(ctx, pod); err != nil {
		return nil, fmt.Errorf("nspawn: agent: %w", err)
	}
	if leader, err := findLeader(proc.PID); err != nil {
		log.WarnContext(ctx, "nspawn: container leader not found; teardown relies on the pod cgroup", "err", err)
	} else {
		// Taken already (nspawn made it), so not saved on its own: the
		// broker records the pod's state once StartPod returns. A crash
		// in between leaves teardown to the pod cgroup, as above.
		st.Record(host.Resource{Kind: host.KindProcess, Role: roleLeader, Process: leader})
	}
	log.DebugContext(ctx, "nspawn pod started", "machine", st.Machine, "nspawnPID", proc.PID, "unit", proc.Unit, "cgroup", st.cgroup().String(), "network", st.Network)
	return pod, nil
}

// nspawnLaunch is how systemd-nspawn is started for a pod: in the pod's
// cgroup (or unit); for a pod with a user namespace, already inside the
// pod's network namespace (inNetNS); joining the cgroups of
// systemd-nspawn's own hierarchies first where it has them
// (systemdCgroup).
func nspawnLaunch(spec *stage1.PodSpec, st *state, nspawnPath string, cg *cgroups.Cgroup, unitLaunch bool) (host.LaunchSpec, error) {
	launch := host.LaunchSpec{
		Name:    launchName(spec.ID),
		Path:    nspawnPath,
		Args:    nspawnArgs(spec, st),
		Env:     nspawnEnv(cgroups.PureV2()),
		LogPath: filepath.Join(spec.RunDir, "nspawn.log"),
		Cgroup:  cg,
		Slice:   cgroups.SliceOf(spec.CgroupParent),
	}
	if spec.UserNS != nil && spec.NetNSPath != "" {
		var err error
		if launch, err = inNetNS(launch, spec.NetNSPath, unitLaunch); err != nil {
			return launch, err
		}
	}
	if scg := st.systemdCgroup(); scg != nil {
		launch = joinFirst(launch, scg)
	}
	return launch, nil
}

// prepareHost makes what a pod needs on the host before nspawn runs: its
// cgroups (the plain launcher's and systemd-nspawn's own), the stage1
// tree, the agent's state directory, owned by the pod's root in a user
// namespace, and the shared directory.
func prepareHost(st *state, cg *cgroups.Cgroup, unitLaunch bool) error {
	if !unitLaunch {
		if err := cg.Create(); err != nil {
			return fmt.Errorf("nspawn: %w", err)
		}
	}
	if scg := st.systemdCgroup(); scg != nil {
		if err := scg.Create(); err != nil {
			return fmt.Errorf("nspawn: %w", err)
		}
	}
	if err := makeTree(st); err != nil {
		return fmt.Errorf("nspawn: stage1 tree: %w", err)
	}
	if err := os.MkdirAll(filepath.Join(st.agentDir(), "state"), 0o700); err != nil {
		return fmt.Errorf("nspawn: %w", err)
	}
	if u := st.UserNS; u != nil {
		// The agent is the pod's root: its directory and the stage1 root
		// are its own.
		if err := chownTree(st, int(u.HostID)); err != nil {
			return fmt.Errorf("nspawn: %w", err)
		}
	}
	if err := st.shared().Prepare(); err != nil {
		return fmt.Errorf("nspawn: %w", err)
	}
	if st.memoryApart() {
		// Unmounted with the shared directory (Release).
		if err := bindmount.Bind(cg.Paths["memory"], filepath.Join(st.mounts(), podMemoryCgroup)); err != nil {
			return fmt.Errorf("nspawn: the pod's memory cgroup: %w", err)
		}
	}
	return nil
}

// logTail is how much of nspawn's log a start failure quotes.
const logTail = 1024

// keepLog keeps nspawn's log of a pod that failed to start in
// spec.FailedLogDir (the pod's run directory goes with the pod) and adds
// where it is, and its last lines, to err.
func keepLog(ctx context.Context, log *slog.Logger, err error, logPath string, spec *stage1.PodSpec) error {
	b, rerr := os.ReadFile(logPath)
	if rerr != nil {
		return fmt.Errorf("%w (systemd-nspawn's log %s: %v)", err, logPath, rerr)
	}
	tail := strings.TrimSpace(string(b[max(0, len(b)-logTail):]))
	if tail == "" {
		tail = "(empty)"
	}
	kept := logPath
	if spec.FailedLogDir != "" {
		kept = filepath.Join(spec.FailedLogDir, spec.ID+"-nspawn.log")
		if werr := os.MkdirAll(spec.FailedLogDir, 0o700); werr != nil {
			log.WarnContext(ctx, "nspawn: keeping the log of a failed pod", "err", werr)
		} else if werr := os.WriteFile(kept, b, 0o600); werr != nil {
			log.WarnContext(ctx, "nspawn: keeping the log of a failed pod", "err", werr)
		}
	}
	return fmt.Errorf("%w; systemd-nspawn's log, kept at %s, ends: %s", err, kept, tail)
}

// joinFirst wraps a launch so that the process first joins the cgroups of
// extra (hierarchies the cgroups package does not manage) and then execs
// the real command: same PID, so the recorded process stays valid.
func joinFirst(l host.LaunchSpec, extra *cgroups.Cgroup) host.LaunchSpec {
	const script = `while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"`
	args := []string{"-c", script, "sh"}
	seen := map[string]bool{}
	for _, d := range extra.Paths {
		if !seen[d] {
			seen[d] = true
			args = append(args, filepath.Join(d, "cgroup.procs"))
		}
	}
	args = append(args, "--", l.Path)
	l.Args = append(args, l.Args...)
	l.Path = "/bin/sh"
	return l
}

// inNetNS starts a launch in the network namespace netns: the unit's
// own setting under a UnitLauncher, else through nsenter, which joins it
// and execs the command (same PID).
func inNetNS(l host.LaunchSpec, netns string, unitLaunch bool) (host.LaunchSpec, error) {
	if unitLaunch {
		l.NetNS = netns
		return l, nil
	}
	nsenter, err := exec.LookPath("nsenter")
	if err != nil {
		return l, errdefs.FailedPrecondition("nspawn: a pod in a user namespace of its own needs nsenter (Debian: util-linux): %w", err)
	}
	l.Args = append([]string{"--net=" + netns, "--", l.Path}, l.Args...)
	l.Path = nsenter
	return l, nil
}

// findLeader returns the container's init: the child of systemd-nspawn.
func findLeader(nspawnPID int) (*host.Process, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", nspawnPID, nspawnPID))
	if err != nil {
		return nil, err
	}
	f := strings.Fields(string(b))
	if len(f) != 1 {
		return nil, fmt.Errorf("systemd-nspawn pid %d has children %v, want one", nspawnPID, f)
	}
	var pid int
	if _, err := fmt.Sscan(f[0], &pid); err != nil {
		return nil, err
	}
	return host.NewProcess(pid)
}

// waitReady waits until the agent answers Info, the pod's process exits,
// or AgentReadyTimeout passes.
func waitReady(ctx context.Context, p *Pod) error {
	return host.WaitAgentReady(ctx, p, p.st.nspawn(), AgentReadyTimeout, "systemd-nspawn")
}

// RecoverPod implements stage1.Backend: the pod is back when its
// systemd-nspawn process (PID and start time) still runs and the agent
// answers Info; otherwise the error wraps stage1.ErrPodGone (a container
// whose nspawn died is gone even if its init lingers: DestroyPod reaps it).
func (b *Backend) RecoverPod(ctx context.Context, spec *stage1.PodSpec, stateBytes []byte) (stage1.Pod, error) {
	return host.Recover(ctx, Name, spec, stateBytes, parseState, "systemd-nspawn", host.ProbeTimeout,
		func(st *state) (stage1.Pod, *host.Process) {
			return b.newPod(spec, st), st.nspawn()
		})
}

// DestroyPod implements stage1.Backend: it kills the container's init and
// systemd-nspawn (when the recorded PIDs still name them), releases
// nspawn's systemd unit (under a UnitLauncher), kills every process left in
// the pod cgroups, removes the cgroups, unmounts every mount
// beneath the pod's shared directory and the stage1 tree, and removes them,
// the agent's directory and nspawn's leftovers in /run/systemd/nspawn.
// Idempotent. What the state lacks (a crash before the first persist) is
// derived from spec.
func (b *Backend) DestroyPod(ctx context.Context, spec *stage1.PodSpec, stateBytes []byte) error {
	return host.Destroy(ctx, b.Log, Name, spec, stateBytes, parseState, func(st *state) {
		if spec.ID != "" && spec.RunDir != "" {
			def := layout(spec)
			if st.Machine == "" {
				st.Machine = def.Machine
			}
			for _, r := range def.Resources {
				st.Default(r)
			}
			st.Default(host.Resource{Kind: host.KindUnit, Role: roleUnit, Name: launchName(spec.ID)})
		}
		st.leftovers()
	}, b.release)
}

// release releases everything st's ledger names (host.Ledger.Release).
func (b *Backend) release(ctx context.Context, st *state) error {
	if err := st.Release(ctx, host.Releaser{Launcher: b.Launcher, Grace: ExitGrace}); err != nil {
		return fmt.Errorf("nspawn: %w", err)
	}
	return nil
}

// Pod is a running nspawn pod.
type Pod struct {
	dir host.SharedDir
	id  string
	st  *state
	log *slog.Logger
}

var _ stage1.Pod = (*Pod)(nil)

func (b *Backend) newPod(spec *stage1.PodSpec, st *state) *Pod {
	p := &Pod{id: spec.ID, st: st, log: b.Log.With("pod", spec.ID)}
	p.dir = st.shared()
	p.dir.UnbindSourcesOnStart = true
	p.dir.BindShared = p.bindShared
	return p
}

// Agent implements stage1.Pod: the agent's unix socket (bound into the
// container), and the pod's propagating directory for container paths.
func (p *Pod) Agent() stage1.AgentEndpoint {
	return stage1.AgentEndpoint{Dial: client.UnixDialer(p.st.socket()), Paths: p.dir}
}

// State implements stage1.Pod.
func (p *Pod) State() []byte { return p.st.marshal() }

// Details implements stage1.Pod.
func (p *Pod) Details() map[string]string {
	return map[string]string{"stage1": Name, "machine": p.st.Machine, "network": p.st.Network}
}

// Stop implements stage1.Pod: it asks the agent to stop every app
// (SIGTERM, timeout, SIGKILL) and exit, which ends the container; waits
// for systemd-nspawn to exit (at most timeout plus ExitGrace, or ctx);
// then kills whatever remains in the pod cgroups (systemd-nspawn leaves
// its container running when it is killed itself, so the cgroup is what
// ends it). Mounts, cgroups and the tree stay until DestroyPod.
// Idempotent: a gone pod is fine.
func (p *Pod) Stop(ctx context.Context, timeout time.Duration, shutdown stage1.Shutdown) error {
	cgs := []*cgroups.Cgroup{p.st.cgroup(), p.st.systemdCgroup()}
	if err := host.StopHostPod(ctx, p.log, "systemd-nspawn", p.st.nspawn(), cgs, shutdown, timeout, ExitGrace); err != nil {
		return fmt.Errorf("nspawn: %w", err)
	}
	return nil
}

var (
	_ stage1.AppCheckpointer = (*Pod)(nil)
	_ stage1.AppRestorer     = (*Pod)(nil)
)

// RestoreApp implements stage1.AppRestorer: criu, run from the app's
// cgroup in the pod's PID and cgroup namespaces, restores the app as a
// child of the agent, the PID namespace's init.
func (p *Pod) RestoreApp(ctx context.Context, r *stage1.AppRestore) (int, error) {
	pid, err := host.RestoreApp(ctx, p.st.cgroup(), r)
	if err != nil {
		return 0, fmt.Errorf("nspawn: restore %s: %w", r.Spec.ID, err)
	}
	return pid, nil
}

// FreezeApps implements stage1.AppCheckpointer: the apps' cgroups'
// freezer.
func (p *Pod) FreezeApps(ctx context.Context, ids []string) (func() error, error) {
	thaw, err := host.FreezeApps(ctx, p.st.cgroup(), ids)
	if err != nil {
		return nil, fmt.Errorf("nspawn: %w", err)
	}
	return thaw, nil
}

// CheckpointApp implements stage1.AppCheckpointer: criu, run on the node,
// saves the app's processes (s.PID is their first in the pod's PID
// namespace, whose PID 1 is the agent).
func (p *Pod) CheckpointApp(ctx context.Context, s *stage1.AppSave) (*stage1.AppImage, error) {
	img, err := host.CheckpointApp(ctx, p.st.cgroup(), 1, s)
	if err != nil {
		return nil, fmt.Errorf("nspawn: checkpoint %s: %w", s.ID, err)
	}
	return img, nil
}
