// Package stage1 defines the one interface every isolation backend (a
// "stage1", after rkt) implements, the capability facts a backend declares so
// that policy can decide without knowing backends by name, the registry of
// backends by name, and the bookkeeping every backend shares (talking to the
// pod's agent, launching detached host processes).
//
// Implementations live in stage1/<name> and import this package, never
// broker, cri or policy.
package stage1

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"sort"
	"sync"
	"time"

	"github.com/stagelet/stagelet/agent"
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
	// Resources are the pod's total limits as the kubelet gives them
	// (the sum of its containers'); zero means unknown. A backend that
	// sizes the pod (a VM) uses them when Options give no size.
	Resources PodResources
	// AgentBinary is the stagelet binary to run as the pod's agent.
	AgentBinary string
	// FailedLogDir is where a backend keeps what explains a pod that
	// failed to start (its launcher's log, as <ID>-<what>.log): RunDir
	// goes with the failed pod. Empty: nothing is kept.
	FailedLogDir string
}

// PodResources are a pod's total limits.
type PodResources struct {
	MemoryLimit int64 // bytes
	CPUQuota    int64 // microseconds per CPUPeriod
	CPUPeriod   int64 // microseconds
}

// ContainerSpec is an app to create in a pod. Rootfs, mount sources and
// LogPath are host paths; the backend maps them to what its agent sees.
type ContainerSpec struct {
	api.AppSpec
}

// StreamIO are the streams of an exec or attach session.
type StreamIO = agent.StreamIO

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

// Pod is a running pod: its isolation plus the agent inside it. Container
// calls carry errdefs classes (NotFound for an unknown container).
type Pod interface {
	// State is the backend's opaque, versioned state to persist.
	State() []byte
	// Info asks the agent who it is; an error means it does not answer.
	Info(ctx context.Context) (*api.Info, error)
	// Info about the backend's runtime choices (e.g. accelerator), shown in
	// verbose status.
	Details() map[string]string

	CreateContainer(ctx context.Context, spec *ContainerSpec) (*api.AppStatus, error)
	StartContainer(ctx context.Context, id string) (*api.AppStatus, error)
	// StopContainer sends SIGTERM, waits up to timeout, then SIGKILL.
	// Idempotent on an exited container.
	StopContainer(ctx context.Context, id string, timeout time.Duration) (*api.AppStatus, error)
	// RemoveContainer forgets the app in the agent; idempotent.
	RemoveContainer(ctx context.Context, id string) error
	ContainerStatus(ctx context.Context, id string) (*api.AppStatus, error)
	ListContainers(ctx context.Context) ([]*api.AppStatus, error)
	// UpdateContainerResources changes a created or running container's
	// cgroup limits (zero fields stay), in the pod's agent: on the host
	// for fly and nspawn, in the guest for a VM.
	UpdateContainerResources(ctx context.Context, id string, r api.Resources) error
	// Watch subscribes to the agent's app events, as agent.Client.Watch:
	// snapshot gets every app, then event each change, until ctx ends
	// (nil) or the stream does (ErrUnavailable: the agent went away, or
	// dropped a subscriber that read too slowly).
	Watch(ctx context.Context, snapshot func([]*api.AppStatus), event func(*api.Event)) error
	ExecSync(ctx context.Context, id string, cmd []string, timeout time.Duration) (*api.ExecResult, error)
	ReopenLog(ctx context.Context, id string) error
	// Stats of one container, or of the whole pod for id "".
	Stats(ctx context.Context, id string) (*api.Stats, error)
	// SetSysctls sets sysctls the pod's IPC namespace isolates
	// (kernel.shm*, kernel.msg*, kernel.sem, fs.mqueue.*) there, before
	// any container starts. InvalidArgument for any other name.
	SetSysctls(ctx context.Context, sysctls map[string]string) error

	// ExecStream runs cmd in a running container with its stdio
	// connected to sio and returns its exit code, as
	// agent.Client.ExecStream.
	ExecStream(ctx context.Context, id string, cmd []string, sio StreamIO) (int32, error)
	// Attach connects sio to a running container's stdio, as
	// agent.Client.Attach.
	Attach(ctx context.Context, id string, sio StreamIO) error
	// PortForward connects stream to a TCP port on the loopback of the
	// pod's network namespace (the host's for a pod in the host network),
	// dialled from inside the pod, as agent.Client.PortForward.
	PortForward(ctx context.Context, port int32, stream io.ReadWriter) error

	// Stop stops every app (SIGTERM, timeout, SIGKILL) and the pod's
	// isolation. Idempotent. The pod's host resources stay until
	// DestroyPod.
	Stop(ctx context.Context, timeout time.Duration) error
}

// PodResizer is an optional interface of a Pod whose backend sizes the
// pod itself (a VM): UpdatePodResources checks the pod's new total limits
// against what it was given, FailedPrecondition when they do not fit. A
// pod without it lives in a cgroup beneath the one the kubelet sizes, and
// takes any new total.
type PodResizer interface {
	UpdatePodResources(ctx context.Context, r PodResources) error
}

// NodeInformer is an optional interface of a Backend: facts about how it
// runs on this node (the accelerator a VM stage1 uses, say), shown in the
// CRI Status info. NodeInfo may take as long as a first probe.
type NodeInformer interface {
	NodeInfo(ctx context.Context) map[string]string
}

var (
	regMu    sync.RWMutex
	registry = map[string]Backend{}
)

// Register adds a backend under its name; registering a name twice panics.
func Register(b Backend) {
	regMu.Lock()
	defer regMu.Unlock()
	if _, dup := registry[b.Name()]; dup {
		panic("stage1: duplicate backend " + b.Name())
	}
	registry[b.Name()] = b
}

// Get returns the backend registered under name.
func Get(name string) (Backend, bool) {
	regMu.RLock()
	defer regMu.RUnlock()
	b, ok := registry[name]
	return b, ok
}

// Names lists the registered backends, sorted.
func Names() []string {
	regMu.RLock()
	defer regMu.RUnlock()
	names := make([]string, 0, len(registry))
	for n := range registry {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// Registry is a set of backends by name, for callers that want their own
// set (tests) instead of the process-wide one.
type Registry map[string]Backend

// Default returns the process-wide registry as a Registry.
func Default() Registry {
	regMu.RLock()
	defer regMu.RUnlock()
	r := Registry{}
	for n, b := range registry {
		r[n] = b
	}
	return r
}

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
		return fmt.Errorf("%s: bad state: %v: %w", backend, err, errdefs.ErrInvalidArgument)
	}
	if v.Version > want {
		return fmt.Errorf("%s: state version %d is newer than this stagelet's %d: %w", backend, v.Version, want, ErrNewerState)
	}
	if v.Version < want {
		var obj map[string]any
		if err := json.Unmarshal(b, &obj); err != nil {
			return fmt.Errorf("%s: bad state: %v: %w", backend, err, errdefs.ErrInvalidArgument)
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
				return fmt.Errorf("%s: migrate state from version %d to %d: %v: %w", backend, n, n+1, err, errdefs.ErrInvalidArgument)
			}
			obj["version"] = n + 1
		}
		var err error
		if b, err = json.Marshal(obj); err != nil {
			return fmt.Errorf("%s: migrated state: %v: %w", backend, err, errdefs.ErrInvalidArgument)
		}
	}
	if err := json.Unmarshal(b, s); err != nil {
		return fmt.Errorf("%s: bad state: %v: %w", backend, err, errdefs.ErrInvalidArgument)
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
