// Package stage1 defines the one interface every isolation backend (a
// "stage1", after rkt) implements, the capability facts a backend declares so
// that policy can decide without knowing backends by name, and the
// versioned state every backend persists (the bookkeeping the host-side
// backends share is package stage1/host). A backend owns a pod's
// isolation only: the connection to the pod's agent is the broker's
// (package stage1/podconn, over the protocol client agent/client), given
// an AgentEndpoint.
//
// Implementations live in stage1/<name> and import this package, never
// broker, cri or policy.
package stage1

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"time"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/stage1/caps"
)

// Isolation levels, ordered: a higher level isolates more (caps holds
// them, for policy).
const (
	IsolationHost       = caps.IsolationHost
	IsolationNamespaces = caps.IsolationNamespaces
	IsolationKernel     = caps.IsolationKernel
)

// Capabilities are facts a backend states about itself (see caps).
type Capabilities = caps.Capabilities

// Option is a pod option a backend declares in its Capabilities (see
// caps).
type Option = caps.Option

// PodSpec is what a backend needs to start a pod. Paths are host paths.
type PodSpec struct {
	ID        string
	Name      string
	Namespace string
	UID       string
	Hostname  string
	// RunDir is a directory private to this pod on the run root (volatile:
	// sockets, the agent's files). It exists when StartPod is called.
	RunDir string
	// CgroupParent is where the pod's cgroup goes: an absolute cgroup path,
	// or a relative one resolved beneath the daemon's own cgroup.
	CgroupParent string
	// NetNSPath is the pod's network namespace; empty means the host's.
	NetNSPath   string
	HostNetwork bool
	HostPID     bool
	HostIPC     bool
	// Options are backend options from the policy decision (e.g. VM memory).
	Options map[string]string
	// NetSysctls are the pod's network sysctls (net.*). The broker sets
	// them in NetNSPath; a backend whose pod has a network stack of its
	// own (a VM's kernel) sets them there too.
	NetSysctls map[string]string
	// UserNS puts the pod in a user namespace of its own with this ID
	// mapping (the kubelet's hostUsers: false); nil: the host's. Only for
	// a backend whose Capabilities say UserNamespaces.
	UserNS *IDMapping
	// Resources are the pod's total limits as the kubelet gives them
	// (the sum of its containers'); zero means unknown. A backend that
	// sizes the pod (a VM) uses them when Options give no size.
	Resources PodResources
	// CgroupMemoryLimit, when set, is the memory limit (bytes, 0: none)
	// of the cgroup the pod would run under, for a pod that has none yet
	// to read it from (stagelet policy explain); nil: read it from
	// CgroupParent's.
	CgroupMemoryLimit *uint64
	// AgentBinary is the stagelet binary to run as the pod's agent.
	AgentBinary string
	// SELinuxProcessLabel and SELinuxMountLabel are the pod's SELinux
	// labels (both set where SELinux gives the pod a level): a backend
	// whose agent runs under the node's kernel as the pod's PID 1 runs it
	// at the pod's level, where its containers may see it, and labels the
	// file systems it makes for the pod with the mount label.
	SELinuxProcessLabel, SELinuxMountLabel string
	// FailedLogDir is where a backend keeps what explains a pod that
	// failed to start (its launcher's log, as <ID>-<what>.log): RunDir
	// goes with the failed pod. Empty: nothing is kept.
	FailedLogDir string
}

// IDMapping maps a pod's user and group IDs 0 to Size-1 to the host's
// HostID to HostID+Size-1 (the same for users and groups).
type IDMapping struct {
	HostID uint32
	Size   uint32
}

// MinUserNSSize is the fewest IDs a pod's user namespace maps: a
// container's files and users may use any 16-bit ID (65534 is nobody).
const MinUserNSSize = 65536

// Check refuses a mapping a backend cannot make: fewer than
// MinUserNSSize IDs, from host ID 0 (the host's root), or past 32 bits.
// InvalidArgument names the backend.
func (m IDMapping) Check(backend string) error {
	if m.HostID == 0 || m.Size < MinUserNSSize || uint64(m.HostID)+uint64(m.Size) > 1<<32-1 {
		return errdefs.InvalidArgument("%s: user namespace mapping of %d IDs from host ID %d: want at least %d IDs from a host ID above 0, within 32 bits", backend, m.Size, m.HostID, MinUserNSSize)
	}
	return nil
}

// PodResources are a pod's total limits, as the kubelet sends them: the
// sum of its containers' limits (or its pod-level limits), and apart from
// them the RuntimeClass overhead (overhead.podFixed) it adds to the pod's
// cgroup.
type PodResources struct {
	MemoryLimit int64 // bytes
	CPUQuota    int64 // microseconds per CPUPeriod
	CPUPeriod   int64 // microseconds
	// CPUShares are the pod's CPU requests as cgroup v1 shares.
	CPUShares int64
	// OverheadMemory is the RuntimeClass overhead's memory (bytes).
	OverheadMemory int64
}

// ContainerSpec is an app to create in a pod. Rootfs, mount sources and
// LogPath are host paths; the backend maps them to what its agent sees.
type ContainerSpec struct {
	api.AppSpec
	// PCIDevices are host PCI devices (addresses, "0000:01:00.0") bound to
	// vfio-pci that the container's pod is given: a VM's backend passes
	// them through to its guest. Only for a KernelIsolated stage1.
	PCIDevices []string
	// ImageID is the ID of the container's image ("sha256:<hex>"): a VM's
	// backend may give its guest the image as a disk (Rootfs stays the
	// host's root file system of it).
	ImageID string
}

// Persist stores a backend's opaque state with the pod record. A backend
// calls it before it takes each host resource, so that after a crash
// DestroyPod finds everything that may have been taken.
type Persist func(state []byte) error

// Backend is one stage1.
type Backend interface {
	// Name is the stage1's registered name ("fly", "nspawn", "kvm").
	Name() string
	// Capabilities are the facts policy reads.
	Capabilities() Capabilities
	// StartPod creates the pod's isolation and starts its agent; it returns
	// once the agent answers. On failure it has released what it took.
	StartPod(ctx context.Context, spec *PodSpec, persist Persist) (Pod, error)
	// RecoverPod reattaches to a pod after a daemon restart from the state
	// last persisted. It returns ErrPodGone (wrapped) when the pod's
	// isolation no longer runs; DestroyPod is then still to be called.
	RecoverPod(ctx context.Context, spec *PodSpec, state []byte) (Pod, error)
	// DestroyPod stops whatever still runs and releases every host resource
	// named in state. Idempotent: resources already gone are not errors.
	DestroyPod(ctx context.Context, spec *PodSpec, state []byte) error
}

// ErrPodGone says a pod's isolation (its agent) no longer runs.
var ErrPodGone = fmt.Errorf("pod is gone")

// Pod is a running pod's isolation, as its backend holds it. The broker
// owns the connection to the agent inside it (every container call, the
// event subscription, exec, attach and port-forward sessions: package
// stage1/podconn); Agent tells it how to reach the agent and how a
// container's host paths reach the pod.
type Pod interface {
	// State is the backend's opaque, versioned state to persist.
	State() []byte
	// Details are the backend's runtime choices (e.g. accelerator),
	// shown in verbose status.
	Details() map[string]string
	// Agent is how the pod's agent is reached.
	Agent() AgentEndpoint
	// Stop stops every app and the pod's isolation: it asks the agent
	// through shutdown (the broker's connection) to stop every app
	// (SIGTERM, timeout, SIGKILL) and exit, waits for the isolation to
	// end, and kills what remains. Idempotent. The pod's host resources
	// stay until DestroyPod.
	Stop(ctx context.Context, timeout time.Duration, shutdown Shutdown) error
}

// AppCheckpointer is a Pod whose running apps can be saved.
// CheckpointApp saves the processes of app s.ID, whose first process the
// pod's agent numbers s.PID, leaving them running, as CRIU images in the
// empty directory s.Dir. FailedPrecondition when they cannot be saved
// (criu's reason); NotFound when the pod has no such process.
//
// FreezeApps pauses the processes of apps ids and returns the function
// that resumes them, so that what is saved of them (their processes,
// their layers) is of one moment; CheckpointApp leaves a paused app
// paused.
type AppCheckpointer interface {
	CheckpointApp(ctx context.Context, s *AppSave) (*AppImage, error)
	FreezeApps(ctx context.Context, ids []string) (thaw func() error, err error)
}

// AppSave is an app to save.
type AppSave struct {
	// CRIU is the criu binary to save it with (one that works on this
	// kernel).
	CRIU string
	// ID is the app, PID its first process as its pod's agent numbers it.
	ID  string
	PID int
	// Dir is the empty directory its images go to.
	Dir string
}

// AppImage is what a dump of an app left out of its images, shared with
// the rest of its pod, for its restore to give back.
type AppImage struct {
	// Net and PID: the pod's network namespace, and its PID namespace
	// (an app sharing it, not its init), are the restored app's.
	Net bool `json:"net,omitempty"`
	PID bool `json:"pid,omitempty"`
	// PIDs, with PID, are the app's processes' PIDs in the pod's PID
	// namespace: its restore gives them back, so they must be free.
	PIDs []int `json:"pids,omitempty"`
	// Mounts are the mounts of file systems the app did not mount whole.
	Mounts []ExternalMount `json:"mounts,omitempty"`
	// Stdio are the app's standard streams that were pipes, by file
	// descriptor: CRIU's names of them ("pipe:[INODE]").
	Stdio map[int]string `json:"stdio,omitempty"`
}

// ExternalMount is a mount an app's images leave out.
type ExternalMount struct {
	// Point is where the app has it.
	Point string `json:"point"`
	// Device is the node's device node the mount shows (a bind of
	// /dev/null: a device, or a masked file); empty: one of the
	// container's mounts, at Point in its spec.
	Device string `json:"device,omitempty"`
	// Cgroup, for a mount of a cgroup hierarchy (the app's own cgroup,
	// shown at /sys/fs/cgroup), is the hierarchy's controllers as
	// /proc/PID/cgroup names them ("memory", "cpu,cpuacct",
	// "name=systemd"; "" for cgroup2): the restored app gets its own
	// cgroup in that hierarchy there.
	Cgroup *string `json:"cgroup,omitempty"`
}

// AppRestorer is a Pod whose apps can be restored from CRIU images (an
// AppCheckpointer's). RestoreApp restores app r.ID, created in the pod
// and readied by its agent (r.IO), as a child of the agent, and returns
// its PID as the agent numbers it. FailedPrecondition when it cannot be
// restored (criu's reason).
type AppRestorer interface {
	RestoreApp(ctx context.Context, r *AppRestore) (int, error)
}

// AppRestore is an app to restore.
type AppRestore struct {
	// CRIU is the criu binary to restore it with.
	CRIU string
	// Spec is the app as created, with host paths (its rootfs, holding
	// the checkpoint's writable layer, and its mounts' sources).
	Spec *api.AppSpec
	// Images is the directory of CRIU's images, Image what they left out.
	Images string
	Image  *AppImage
	// IO is where the agent takes the restored app's output.
	IO *api.RestoreIO
	// InAgent runs argv as a restorer child of the pod's agent
	// (api.OpRestoreRun: in the app's cgroup, the app's output pipes as
	// fds 3 and 4, the agent's network namespace as fd 5), for a pod
	// where only the agent's own descendants end as its children.
	InAgent func(ctx context.Context, argv []string) error
}

// Shutdown asks a pod's agent to stop every app (SIGTERM, timeout,
// SIGKILL) and exit. ErrUnavailable: the agent is gone already.
type Shutdown func(ctx context.Context, timeout time.Duration) error

// AgentEndpoint is how a pod's agent is reached.
type AgentEndpoint struct {
	// Dial opens one stream to the agent (a call, an event subscription
	// or a session), whatever its transport: a unix socket, a VM's serial
	// port.
	Dial func(ctx context.Context) (net.Conn, error)
	// Paths makes a container's host paths reachable in the pod; nil: the
	// agent sees the host's files as they are (fly).
	Paths ContainerPaths
}

// ContainerPaths makes the host paths of a container (its rootfs, log
// directory, mount sources) reachable by an agent that runs behind a
// namespace or VM boundary (SharedDir).
type ContainerPaths interface {
	// Share makes spec's host paths reachable in the pod and returns the
	// spec with the paths the agent sees them at. known tells whether the
	// agent already knows a container: what a create that did not finish
	// left is replaced. On failure nothing stays shared.
	Share(ctx context.Context, spec *ContainerSpec, known func(context.Context, string) (bool, error)) (*ContainerSpec, error)
	// Started is told that a container started: what the app holds in
	// its own namespace by then may be dropped on the host.
	Started(id string) error
	// Unshare undoes Share. Idempotent.
	Unshare(id string) error
}

// HostStatser is an optional interface of a Pod whose cost on the host is
// not what its agent sees (a VM: memory the guest touched, qemu's own):
// the pod's figures are HostStats, with the process count from the agent.
type HostStatser interface {
	HostStats() (*api.Stats, error)
}

// PodPlanner is an optional interface of a Backend that decides how it
// would run a pod from the pod's spec alone, before anything is taken:
// PlanPod returns that decision in words for people (stagelet policy
// explain, logs), or the error StartPod would refuse the pod with (its
// class and its message). StartPod makes the same decision. PlanPod
// takes no host resource; it may read the limits of the cgroup the pod
// would run under (spec.CgroupParent, unless spec.CgroupMemoryLimit says
// them).
type PodPlanner interface {
	PlanPod(spec *PodSpec) (string, error)
}

// PodResizer is an optional interface of a Pod whose backend sizes the
// pod itself (a VM): UpdatePodResources checks the pod's new total limits
// against what it was given, FailedPrecondition when they do not fit. A
// pod without it lives in a cgroup beneath the one the kubelet sizes, and
// takes any new total.
type PodResizer interface {
	UpdatePodResources(ctx context.Context, r PodResources) error
}

// Collector is an optional interface of a Backend whose pods take host
// resources beyond the pod cgroups the daemon searches itself after a
// restart: Collect releases those of pods no record names (keep tells
// which pods have one: what a lost record leaves) and returns those pods'
// IDs, with an error for what it could not release (left as it is).
type Collector interface {
	Collect(ctx context.Context, keep func(podID string) bool) ([]string, error)
}

// NodeInformer is an optional interface of a Backend: facts about how it
// runs on this node (the accelerator a VM stage1 uses, say), shown in the
// CRI Status info. NodeInfo may take as long as a first probe.
type NodeInformer interface {
	NodeInfo(ctx context.Context) map[string]string
}

// VMReporter is an optional interface of a Backend that runs pods in
// VMs restored from templates: what it counted since the daemon started,
// for metrics. It answers from memory, at once, and probes nothing.
type VMReporter interface {
	VMStats() VMStats
}

// VMStats are a VM stage1's figures since the daemon started.
type VMStats struct {
	// TemplateHits: pods' VMs restored from a template that was there;
	// TemplateMisses: pods' VMs that waited for a template to be built
	// (their own build or one under way).
	TemplateHits, TemplateMisses uint64
	// TemplateBuilds and TemplateBuildFailures: template builds that
	// finished, and those that failed.
	TemplateBuilds, TemplateBuildFailures uint64
	// Accelerator pods' VMs use ("kvm", "tcg"); "" until chosen (the
	// first pod or the start-up probe chooses it).
	Accelerator string
}

// Registry is the set of backends a broker runs pods with, by name. The
// daemon builds it from its configuration; tests build their own.
type Registry map[string]Backend

// ErrNewerState says a pod's backend state was written by a newer
// stagelet: this one refuses to act on it (the pod is left as it is),
// rather than misreading it.
// It is a FailedPrecondition.
var ErrNewerState = fmt.Errorf("state written by a newer stagelet: %w", errdefs.ErrFailedPrecondition)

// ParseState is a helper for backends: it decodes state b (MarshalState's,
// with a "version" field) into s after checking its version against
// want, the newest the backend writes. Empty b leaves s as it is (nothing
// was persisted). A version above want is ErrNewerState; bad JSON is
// InvalidArgument. An older version is brought up to want by the
// backend's migrations, one version at a time (migrate[n] turns a state
// of version n into one of version n+1, as a JSON object); a version with
// no way up is InvalidArgument.
func ParseState(backend string, b []byte, want int, s any, migrate ...map[int]Migration) error {
	if len(b) == 0 {
		return nil
	}
	var v struct {
		Version int `json:"version"`
	}
	if err := json.Unmarshal(b, &v); err != nil {
		return errdefs.New(errdefs.ErrInvalidArgument, "%s: bad state: %w", backend, err)
	}
	if v.Version > want {
		return fmt.Errorf("%s: state version %d is newer than this stagelet's %d: %w", backend, v.Version, want, ErrNewerState)
	}
	if v.Version < want {
		var obj map[string]any
		if err := json.Unmarshal(b, &obj); err != nil {
			return errdefs.New(errdefs.ErrInvalidArgument, "%s: bad state: %w", backend, err)
		}
		for n := v.Version; n < want; n++ {
			var m Migration
			for _, ms := range migrate {
				if f, ok := ms[n]; ok {
					m = f
				}
			}
			if m == nil {
				return fmt.Errorf("%s: state version %d cannot be read (no migration to %d), want %d: %w", backend, n, n+1, want, errdefs.ErrInvalidArgument)
			}
			if err := m(obj); err != nil {
				return errdefs.New(errdefs.ErrInvalidArgument, "%s: migrate state from version %d to %d: %w", backend, n, n+1, err)
			}
			obj["version"] = n + 1
		}
		var err error
		if b, err = json.Marshal(obj); err != nil {
			return errdefs.New(errdefs.ErrInvalidArgument, "%s: migrated state: %w", backend, err)
		}
	}
	if err := json.Unmarshal(b, s); err != nil {
		return errdefs.New(errdefs.ErrInvalidArgument, "%s: bad state: %w", backend, err)
	}
	return nil
}

// A Migration turns a backend's state of one version, decoded as a JSON
// object, into the next version's in place (ParseState sets "version").
type Migration func(state map[string]any) error

// MarshalState is a helper for backends: versioned JSON state.
func MarshalState(v any) []byte {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err) // state types are plain structs
	}
	return b
}
