package broker

import (
	"time"

	"github.com/opencontainers/runtime-spec/specs-go"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/devices"
	"github.com/stagelet/stagelet/internal/lsm"
	"github.com/stagelet/stagelet/stage1"
)

// PodMetadata identifies a pod for the kubelet.
type PodMetadata struct {
	Name      string `json:"name"`
	Namespace string `json:"namespace"`
	UID       string `json:"uid"`
	Attempt   uint32 `json:"attempt"`
}

// DNSConfig is the pod's resolver configuration.
type DNSConfig struct {
	Servers  []string `json:"servers,omitempty"`
	Searches []string `json:"searches,omitempty"`
	Options  []string `json:"options,omitempty"`
}

// PortMapping is one hostPort.
type PortMapping struct {
	Protocol      string `json:"protocol"`
	ContainerPort int32  `json:"containerPort"`
	HostPort      int32  `json:"hostPort"`
	HostIP        string `json:"hostIp,omitempty"`
}

// PodConfig is the broker's view of a CRI PodSandboxConfig.
type PodConfig struct {
	Metadata     PodMetadata       `json:"metadata"`
	Hostname     string            `json:"hostname,omitempty"`
	LogDirectory string            `json:"logDirectory,omitempty"`
	DNS          *DNSConfig        `json:"dns,omitempty"`
	PortMappings []PortMapping     `json:"portMappings,omitempty"`
	Labels       map[string]string `json:"labels,omitempty"`
	Annotations  map[string]string `json:"annotations,omitempty"`
	CgroupParent string            `json:"cgroupParent,omitempty"`
	HostNetwork  bool              `json:"hostNetwork,omitempty"`
	HostPID      bool              `json:"hostPID,omitempty"`
	HostIPC      bool              `json:"hostIPC,omitempty"`
	Privileged   bool              `json:"privileged,omitempty"`
	Sysctls      map[string]string `json:"sysctls,omitempty"`
	// Resources are the pod's total limits (CRI LinuxPodSandboxConfig
	// resources), nil when the kubelet gives none; Overhead is its
	// RuntimeClass overhead (CRI overhead), which the kubelet adds to the
	// pod's cgroup, nil when none.
	Resources      *Resources `json:"resources,omitempty"`
	Overhead       *Resources `json:"overhead,omitempty"`
	RuntimeHandler string     `json:"runtimeHandler,omitempty"`
	// UserNS puts the pod in a user namespace of its own with this
	// mapping (hostUsers: false); nil: the host's.
	UserNS *stage1.IDMapping `json:"userNS,omitempty"`
	// SELinux are the parts of the pod's SELinux context it asks for
	// (nil: none given); its containers start from the context it gets.
	SELinux *SELinuxOptions `json:"selinux,omitempty"`
}

// KeyValue is one environment variable, order kept.
type KeyValue struct {
	Key   string `json:"key"`
	Value string `json:"value"`
}

// Mount is one CRI mount.
type Mount struct {
	ContainerPath  string `json:"containerPath"`
	HostPath       string `json:"hostPath"`
	Readonly       bool   `json:"readonly,omitempty"`
	SelinuxRelabel bool   `json:"selinuxRelabel,omitempty"`
	// Propagation: "private", "rslave" or "rshared".
	Propagation string `json:"propagation,omitempty"`
	// RecursiveReadonly makes the mounts beneath a read-only mount
	// read-only too; Readonly alone covers the top mount only.
	RecursiveReadonly bool `json:"recursiveReadonly,omitempty"`
	// Image, instead of HostPath, mounts an image's root filesystem
	// read-only (an image volume); ImageSubPath is the part of it to
	// mount.
	Image        string `json:"image,omitempty"`
	ImageSubPath string `json:"imageSubPath,omitempty"`
	// UserImage is Image as the pod's author wrote it (CRI
	// UserSpecifiedImage), when the caller says: the name the signature
	// policy looks the image up by.
	UserImage string `json:"userImage,omitempty"`
	// NoSuid, NoDev and NoExec are the bind mount's flags of those names
	// (CRI mount_options).
	NoSuid bool `json:"nosuid,omitempty"`
	NoDev  bool `json:"nodev,omitempty"`
	NoExec bool `json:"noexec,omitempty"`
}

// Resources are a container's limits (CRI LinuxContainerResources).
type Resources struct {
	CPUPeriod   int64 `json:"cpuPeriod,omitempty"`
	CPUQuota    int64 `json:"cpuQuota,omitempty"`
	CPUShares   int64 `json:"cpuShares,omitempty"`
	MemoryLimit int64 `json:"memoryLimit,omitempty"`
	OOMScoreAdj int64 `json:"oomScoreAdj,omitempty"`
	// CpusetCpus and CpusetMems are cpuset lists ("0-3,6"): the CPUs and
	// memory nodes a container may use (a container's only).
	CpusetCpus string `json:"cpusetCpus,omitempty"`
	CpusetMems string `json:"cpusetMems,omitempty"`
	// OOMGroup: an OOM kill in the container kills all of its processes
	// (cgroup v2's memory.oom.group).
	OOMGroup bool `json:"oomGroup,omitempty"`
}

// Types of a SecurityProfile, as the CRI names them.
const (
	ProfileRuntimeDefault = "RuntimeDefault"
	ProfileUnconfined     = "Unconfined"
	ProfileLocalhost      = "Localhost"
)

// SecurityProfile is a seccomp or AppArmor profile choice. An empty Type
// means none was asked for, which is unconfined. LocalhostRef names the
// profile of type Localhost: an absolute path of a seccomp profile on the
// node, the name of a loaded AppArmor profile.
type SecurityProfile struct {
	Type         string `json:"type,omitempty"`
	LocalhostRef string `json:"localhostRef,omitempty"`
}

// SELinuxOptions are the parts of a SELinux context the container asks
// for; empty parts come from the policy.
type SELinuxOptions struct {
	User  string `json:"user,omitempty"`
	Role  string `json:"role,omitempty"`
	Type  string `json:"type,omitempty"`
	Level string `json:"level,omitempty"`
}

// Security is a container's security context.
type Security struct {
	Privileged         bool    `json:"privileged,omitempty"`
	RunAsUser          *int64  `json:"runAsUser,omitempty"`
	RunAsUsername      string  `json:"runAsUsername,omitempty"`
	RunAsGroup         *int64  `json:"runAsGroup,omitempty"`
	SupplementalGroups []int64 `json:"supplementalGroups,omitempty"`
	// StrictGroups (supplementalGroupsPolicy: Strict) leaves out the
	// groups the image's /etc/group gives the user: the app has its
	// group and SupplementalGroups only.
	StrictGroups   bool `json:"strictGroups,omitempty"`
	ReadonlyRootfs bool `json:"readonlyRootfs,omitempty"`
	NoNewPrivs     bool `json:"noNewPrivs,omitempty"`
	// PIDMode is the container's PID namespace: "container" (its own),
	// "pod" (shared with the pod's containers) or "node" (the host's).
	PIDMode string `json:"pidMode,omitempty"`
	// PIDTarget is the container whose PID namespace PIDMode "target"
	// joins (kubectl debug --target).
	PIDTarget string `json:"pidTarget,omitempty"`
	// UserNS is the user namespace mapping the container asks for: its
	// pod's (nil: the host's, as the pod's must then be).
	UserNS           *stage1.IDMapping `json:"userNS,omitempty"`
	AddCapabilities  []string          `json:"addCapabilities,omitempty"`
	DropCapabilities []string          `json:"dropCapabilities,omitempty"`
	// Seccomp and AppArmor are the profiles asked for; SELinux the parts
	// of the SELinux context (nil: none given).
	Seccomp  SecurityProfile `json:"seccomp,omitzero"`
	AppArmor SecurityProfile `json:"apparmor,omitzero"`
	SELinux  *SELinuxOptions `json:"selinux,omitempty"`
	// MaskedPaths and ReadonlyPaths are what the kubelet asks to hide and
	// to make read-only; nil means the runtime's defaults, except in a
	// pod with its own user namespace, where both nil mean none (the
	// kubelet's procMount Unmasked). Privileged containers get neither.
	MaskedPaths   []string `json:"maskedPaths,omitempty"`
	ReadonlyPaths []string `json:"readonlyPaths,omitempty"`
}

// ContainerMetadata identifies a container within its pod.
type ContainerMetadata struct {
	Name    string `json:"name"`
	Attempt uint32 `json:"attempt"`
}

// ContainerConfig is the broker's view of a CRI ContainerConfig.
type ContainerConfig struct {
	Metadata ContainerMetadata `json:"metadata"`
	Image    string            `json:"image"`
	// UserImage is the image as the pod's author wrote it (CRI
	// UserSpecifiedImage), when the caller says; Image may be the ID the
	// caller resolved it to.
	UserImage  string     `json:"userImage,omitempty"`
	Command    []string   `json:"command,omitempty"`
	Args       []string   `json:"args,omitempty"`
	WorkingDir string     `json:"workingDir,omitempty"`
	Env        []KeyValue `json:"env,omitempty"`
	Mounts     []Mount    `json:"mounts,omitempty"`
	// Devices are the host's device nodes the container is given.
	Devices []devices.Request `json:"devices,omitempty"`
	// CDIDevices are fully qualified CDI device names (CDI_devices); the
	// cdi.k8s.io/* annotations name more.
	CDIDevices  []string          `json:"cdiDevices,omitempty"`
	Labels      map[string]string `json:"labels,omitempty"`
	Annotations map[string]string `json:"annotations,omitempty"`
	LogPath     string            `json:"logPath,omitempty"`
	Stdin       bool              `json:"stdin,omitempty"`
	StdinOnce   bool              `json:"stdinOnce,omitempty"`
	TTY         bool              `json:"tty,omitempty"`
	Resources   Resources         `json:"resources"`
	Security    Security          `json:"security"`
}

// Pod states.
const (
	PodCreating = "creating" // record written, resources being taken
	PodReady    = "ready"
	PodNotReady = "notready"
)

// Container PID modes.
const (
	PIDModeContainer = "container"
	PIDModePod       = "pod"
	PIDModeNode      = "node"
	PIDModeTarget    = "target"
)

// Container states.
const (
	ContainerCreating = "creating"
	ContainerCreated  = "created"
	ContainerRunning  = "running"
	ContainerExited   = "exited"
	ContainerUnknown  = "unknown"
)

// recordVersion is the version of the persisted records below.
const recordVersion = 1

// PodRecord is what the broker persists for a pod.
type PodRecord struct {
	Version    int       `json:"version"`
	ID         string    `json:"id"`
	State      string    `json:"state"`
	Config     PodConfig `json:"config"`
	ConfigHash string    `json:"configHash"`
	Stage1     string    `json:"stage1"`
	// Rule and Options come from the policy decision; Reasons say why,
	// and ChosenBy names what chose the stage1 in the end.
	Rule     string            `json:"rule,omitempty"`
	ChosenBy string            `json:"chosenBy,omitempty"`
	Options  map[string]string `json:"options,omitempty"`
	// PrivilegedWithoutHostDevices: the pod's privileged containers do
	// not get the host's devices (its runtime handler says so).
	PrivilegedWithoutHostDevices bool     `json:"privilegedWithoutHostDevices,omitempty"`
	Reasons                      []string `json:"reasons,omitempty"`
	// SELinux are the pod's labels (lsm.PodSELinuxLabels): the pod holds
	// their MCS level from RunPodSandbox to its removal, and its
	// containers run at it. Empty where SELinux gives none.
	SELinux      lsm.Labels `json:"selinux,omitzero"`
	BackendState []byte     `json:"backendState,omitempty"`
	RunDir       string     `json:"runDir"`
	// NetNS is the pod's network namespace (recorded before it is made);
	// empty for pods in the host network. IPs are from CNI.
	NetNS     string    `json:"netns,omitempty"`
	IPs       []string  `json:"ips,omitempty"`
	CreatedAt time.Time `json:"createdAt"`
	// Gone is set when the pod's agent was found dead.
	Gone bool `json:"gone,omitempty"`
	// NetworkReleased: CNI DEL of the pod's attachment succeeded (when it
	// stopped); only its netns is left, removed with the pod.
	NetworkReleased bool `json:"networkReleased,omitempty"`
}

// ContainerRecord is what the broker persists for a container.
type ContainerRecord struct {
	Version    int             `json:"version"`
	ID         string          `json:"id"`
	PodID      string          `json:"podId"`
	State      string          `json:"state"`
	Config     ContainerConfig `json:"config"`
	ConfigHash string          `json:"configHash"`
	ImageID    string          `json:"imageId"`
	// ImageName is the reference the container was created from.
	ImageName string `json:"imageName"`
	// VolumeImageIDs are the images its image volumes mount: in use, as
	// ImageID is.
	VolumeImageIDs []string `json:"volumeImageIds,omitempty"`
	// Hooks are the OCI hooks NRI plugins gave the container
	// (broker/hooks.go), and OCIAnnotations the annotations its hooks
	// see: its own, as plugins adjusted them.
	Hooks          *specs.Hooks      `json:"hooks,omitempty"`
	OCIAnnotations map[string]string `json:"ociAnnotations,omitempty"`
	// Dir holds the container's rootfs mount and its writable layer.
	Dir        string       `json:"dir"`
	Rootfs     string       `json:"rootfs,omitempty"`
	LogPath    string       `json:"logPath,omitempty"`
	App        *api.AppSpec `json:"app,omitempty"`
	CreatedAt  time.Time    `json:"createdAt"`
	StartedAt  time.Time    `json:"startedAt,omitzero"`
	FinishedAt time.Time    `json:"finishedAt,omitzero"`
	ExitCode   int32        `json:"exitCode"`
	Reason     string       `json:"reason,omitempty"`
	Message    string       `json:"message,omitempty"`
	// Restore, for a container created from a checkpoint archive, is what
	// its start restores.
	Restore *RestoreRecord `json:"restore,omitempty"`
}

// RestoreRecord is the checkpoint a container was created from.
type RestoreRecord struct {
	// Archive is the checkpoint archive's path or the checkpoint image's
	// reference, Images the directory of
	// its CRIU images (under the container's Dir), Image what the images
	// leave out, for the stage1.
	Archive string           `json:"archive"`
	Images  string           `json:"images"`
	Image   *stage1.AppImage `json:"image"`
	// Pod, for a checkpoint of a whole pod (a VM's), is what it saved:
	// Images is then the stage1's image of the pod.
	Pod *PodImage `json:"pod,omitempty"`
}
