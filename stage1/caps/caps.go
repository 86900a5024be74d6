// Package caps is the part of the stage1 contract policy reads: the facts
// a backend states about itself and the isolation levels they are ordered
// by. It depends on nothing, so that policy links no agent, cgroup or
// D-Bus code; stage1 re-exports it.
package caps

// Isolation levels, ordered: a higher level isolates more.
const (
	IsolationHost       = 0 // chroot only, host namespaces (fly)
	IsolationNamespaces = 1 // Linux namespaces (nspawn)
	IsolationKernel     = 2 // own kernel (kvm)
)

// Capabilities are facts a backend states about itself. Callers (policy, the
// broker) read them before deciding; nothing matches a backend by name.
type Capabilities struct {
	// Isolation is one of the Isolation* levels.
	Isolation int `json:"isolation"`
	// KernelIsolated: pods run under their own kernel.
	KernelIsolated bool `json:"kernelIsolated"`
	// HostNetwork: the backend can run a pod in the host's network namespace.
	HostNetwork bool `json:"hostNetwork"`
	// PodNetwork: the backend can run a pod in its own network namespace.
	PodNetwork bool `json:"podNetwork"`
	// HostPID / HostIPC: the backend can share the host's PID / IPC namespace.
	HostPID bool `json:"hostPID"`
	HostIPC bool `json:"hostIPC"`
	// Privileged says what a privileged container gets: "host" (host
	// devices and capabilities), "pod" (all capabilities inside the pod's
	// namespaces), "guest" (privileged inside a VM only).
	Privileged string `json:"privileged"`
	// UserNamespaces: the backend can run a pod in a user namespace of
	// its own (the kubelet's hostUsers: false), with the ID mapping it is
	// given.
	UserNamespaces bool `json:"userNamespaces"`
	// NetworkBeforeStart: StartPod reads the pod's network (the
	// interfaces CNI ADD made in its namespace), so the broker sets it up
	// first; otherwise CNI ADD runs while the pod starts.
	NetworkBeforeStart bool `json:"networkBeforeStart,omitempty"`
	// LocalLayers: the pod's agent keeps its containers' writable layers
	// itself (in a VM's memory), so their usage comes from the agent,
	// whether the container runs or not; otherwise from the host.
	LocalLayers bool `json:"localLayers,omitempty"`
	// NoCheckpoint, when set, says why the backend's containers and pods
	// cannot be checkpointed or restored; empty: they can where CRIU
	// works.
	NoCheckpoint string `json:"noCheckpoint,omitempty"`
	// HostLogs: the daemon writes the pod's containers' CRI log files on
	// the host from their agent's log sessions (AppSpec.HostLog), and the
	// backend does not make their log directories reachable in the pod;
	// otherwise the agent writes them itself.
	HostLogs bool `json:"hostLogs,omitempty"`
	// Options are the pod options the backend takes from the policy
	// (a rule's or handler's `options:`), each with its check. The
	// policy refuses any other key, and a value its check refuses, when
	// it loads; none: the backend takes no options.
	Options []Option `json:"options,omitempty"`
	// WholePodCheckpoint: a checkpoint of one of the backend's
	// containers saves its whole pod (stage1.PodSaver: a VM with its
	// memory), without CRIU, and a pod of more than that one container
	// cannot be checkpointed; a container restored from it takes the pod
	// it is created in (stage1.PodRestorer).
	WholePodCheckpoint bool `json:"wholePodCheckpoint,omitempty"`
}

// Option is one pod option a backend takes: the backend reads its value
// when it starts a pod, parsing it as Check does.
type Option struct {
	// Name is the key in the policy's `options:`.
	Name string `json:"name"`
	// Doc says what the value is, for people: "the VM's vCPU count,
	// 1 to 64".
	Doc string `json:"doc"`
	// Check refuses a value the backend could not use, saying why in
	// words that follow the value ("want 1 to 64"); nil: any value.
	Check func(value string) error `json:"-"`
}

// Option returns the option called name, and whether the backend takes
// it.
func (c Capabilities) Option(name string) (Option, bool) {
	for _, o := range c.Options {
		if o.Name == name {
			return o, true
		}
	}
	return Option{}, false
}
