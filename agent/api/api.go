// Package api is the wire protocol between the stagelet daemon (through a
// stage1 backend) and the agent running inside a pod. It is the same for
// every stage1: the agent is the fly supervisor on the host, the init of an
// nspawn container, or PID 1 of a VM.
//
// Transport: every call is one stream (a unix socket connection, or a
// multiplexed stream over a VM's serial port). The client writes one
// Request as a JSON document, the agent answers with one Response and
// closes the stream. Paths in an AppSpec are as the agent sees them.
//
// Sessions (OpExecStream, OpAttach, OpPortForward) start the same way; when
// their Response carries no error the stream goes on in frames, each a
// type byte, a big-endian uint32 payload length and the payload:
//
//	client → agent: FrameStdin, FrameEOF (no more stdin), FrameResize
//	                (exec, attach); FrameData, FrameEOF (port-forward)
//	agent → client: FrameStdout, FrameStderr, then one FrameEnd (exec,
//	                attach); FrameData, FrameEOF (port-forward)
//
// OpLogs is a session too: FrameLog, then one FrameEnd, from the agent;
// FrameLogAck from the client.
//
// Closing the stream ends a session: the agent kills an exec'd command
// whose client went away, detaches an attach and closes a forwarded
// connection. Neither side depends on the transport's half-close.
//
// OpEvents is a subscription: its Response carries every app (Apps), and
// the stream goes on with one Event per JSON document, each a change that
// happened after that snapshot, until either side closes it. An agent
// closes a subscriber that falls EventBuffer events behind; the client
// subscribes again and starts from a new snapshot.
package api

import (
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/stagelet/stagelet/internal/rlimit"
	"github.com/stagelet/stagelet/tracing"
)

// Version of the protocol; bumped on incompatible changes.
const Version = 1

// Operations.
const (
	OpInfo      = "info"      // -> Response.Info
	OpCreate    = "create"    // Request.App -> Response.App
	OpStart     = "start"     // Request.ID -> Response.App
	OpStop      = "stop"      // Request.ID, Request.Timeout: SIGTERM, wait, SIGKILL -> Response.App
	OpSignal    = "signal"    // Request.ID, Request.Signal
	OpRemove    = "remove"    // Request.ID; idempotent
	OpStatus    = "status"    // Request.ID -> Response.App
	OpList      = "list"      // -> Response.Apps
	OpExec      = "exec"      // Request.ID, Request.Cmd, Request.Timeout -> Response.Exec
	OpReopenLog = "reopenlog" // Request.ID
	OpStats     = "stats"     // Request.ID ("" = the whole pod) -> Response.Stats
	OpShutdown  = "shutdown"  // Request.Timeout: stop every app, then the agent exits
	OpSysctl    = "sysctl"    // Request.Sysctls: IPC sysctls, set in the pod's IPC namespace
	OpEvents    = "events"    // -> Response.Apps, then Events until either side closes
	OpUpdate    = "update"    // Request.ID, Request.Resources: change a created or running app's limits -> Response.App

	// Sessions: frames follow a successful Response.
	OpExecStream  = "execstream"  // Request.ID, Request.Cmd, Request.Stdio: run a command with its stdio streamed
	OpAttach      = "attach"      // Request.ID, Request.Stdio: connect to a running app's stdio
	OpPortForward = "portforward" // Request.Port: a TCP connection to the pod's loopback
	// OpSetup gives a guest restored from a template its pod's identity:
	// Request.Guest (stagelet.* kernel parameters: hostname, network,
	// shared directory), Request.Time (the host's clock) and Request.Seed
	// (entropy). Once per guest; FailedPrecondition otherwise.
	OpSetup = "setup"
	// OpRestore readies a created app for a restore from CRIU images, done
	// by whoever holds them: Request.ID -> Response.Restore, the pipes its
	// output goes into. The app is starting until OpAdopt.
	OpRestore = "restore"
	// OpRestoreRun runs the restorer of a restore under way, where the
	// agent must be its parent for the restored process to be its child:
	// Request.ID, Request.Cmd, Request.Timeout -> Response.Exec. It runs
	// in the app's cgroup with the write ends of the app's output pipes
	// as fds 3 and 4 and the agent's network namespace as fd 5.
	OpRestoreRun = "restorerun"
	// OpAdopt ends a restore: Request.ID, Request.PID, the restored
	// process, by now a child of the agent -> Response.App, running; or
	// Request.PID 0 and Request.Message, why the restore failed: the app
	// is then exited (code 128) with that message.
	OpAdopt = "adopt"
	// OpMountShare mounts the pod's shared directory in a guest that did
	// not mount it at boot, before the first app whose paths are on it
	// is created. Idempotent; FailedPrecondition from an agent that has
	// no such directory to mount.
	OpMountShare = "mountshare"
	// OpNetwork gives a running guest its pod's network anew, as a VM
	// restored into another pod needs: Request.Guest (stagelet.* kernel
	// parameters: MAC, addresses, routes, MTU, hostname). The interface's
	// earlier addresses and routes go. FailedPrecondition from an agent
	// that is no VM's.
	OpNetwork = "network"
	// OpRename gives app Request.ID the ID Request.NewID -> Response.App:
	// a VM restored into another pod keeps its apps, which the daemon
	// there knows by other IDs. NotFound, AlreadyExists.
	OpRename = "rename"
	// OpLogs is the session of an app created with AppSpec.HostLog:
	// Request.ID. The agent sends its CRI log lines as FrameLog frames,
	// each of whole lines, from the oldest the client has not
	// acknowledged; the client acknowledges each frame once it wrote it
	// (FrameLogAck). Once the app's output ended and every byte was
	// acknowledged, one FrameEnd. One session at a time per app: a new
	// one replaces the one before (which ends without FrameEnd), and is
	// sent again what that one had not acknowledged. NotFound,
	// FailedPrecondition (the app writes its own log file).
	OpLogs = "logs"
	// OpPutFiles writes Request.Files, a tree the daemon copies into the
	// agent's side (a kubelet volume, a file it gives every container),
	// as its guest volume Files.Name, replacing what an earlier call put
	// there in steps a reader never sees half done (files.go).
	OpPutFiles = "putfiles"
	// OpTermination reads an exited app's termination message: Request.ID
	// -> Response.Termination, the last MaxTerminationMessage bytes of
	// the file of its MountMessage mount.
	OpTermination = "termination"
)

// Frame types of a session.
const (
	FrameStdin  byte = 'i' // client → agent: bytes for the command's stdin
	FrameStdout byte = 'o' // agent → client: the command's stdout (a terminal's output)
	FrameStderr byte = 'e' // agent → client: the command's stderr
	FrameResize byte = 'w' // client → agent: TerminalSize as JSON
	FrameData   byte = 'd' // port-forward bytes, both ways
	FrameEOF    byte = 'z' // the sender sends no more stdin (or port-forward data)
	FrameEnd    byte = 'x' // agent → client: SessionEnd as JSON; the last frame
	// FrameLog carries whole CRI log lines (OpLogs), agent → client;
	// FrameLogAck, client → agent, acknowledges the bytes of the frames
	// written since the last one, as a big-endian uint64 count.
	FrameLog    byte = 'l'
	FrameLogAck byte = 'a'
)

// MaxFramePayload bounds a frame's payload; a longer frame is a protocol
// error.
const MaxFramePayload = 1 << 20

// MaxLogFrame bounds a FrameLog's payload: whole CRI lines, each shorter
// (the longest is 16 KiB and its header).
const MaxLogFrame = 32 << 10

// Request is one call to the agent.
type Request struct {
	// RequestID is the daemon's ID of the CRI call the request serves;
	// the agent's log lines of the request carry it (as req=).
	RequestID string `json:"requestId,omitempty"`
	// TraceParent is the W3C trace context of the daemon's span for this
	// call, when its trace is sampled: the agent's spans of the request
	// go beneath it and come back in Response.Spans.
	TraceParent string        `json:"traceparent,omitempty"`
	Op          string        `json:"op"`
	ID          string        `json:"id,omitempty"`
	App         *AppSpec      `json:"app,omitempty"`
	Signal      int           `json:"signal,omitempty"`
	Timeout     time.Duration `json:"timeout,omitempty"` // 0 means none
	Cmd         []string      `json:"cmd,omitempty"`
	// Sysctls are name → value ("kernel.shm_rmid_forced" or
	// "kernel/shm_rmid_forced"); only those the IPC namespace isolates.
	Sysctls map[string]string `json:"sysctls,omitempty"`
	// Stdio says which streams an exec or attach session carries.
	Stdio *Stdio `json:"stdio,omitempty"`
	// Port is the TCP port a port-forward session connects to.
	Port int32 `json:"port,omitempty"`
	// Resources are an app's new limits (OpUpdate); zero fields stay as
	// they are.
	Resources *Resources `json:"resources,omitempty"`
	// PID and Message are OpAdopt's.
	PID     int    `json:"pid,omitempty"`
	Message string `json:"message,omitempty"`
	// Guest, Time (Unix nanoseconds) and Seed are OpSetup's.
	Guest string `json:"guest,omitempty"`
	Time  int64  `json:"time,omitempty"`
	Seed  []byte `json:"seed,omitempty"`
	// NewID is OpRename's.
	NewID string `json:"newId,omitempty"`
	// Files is OpPutFiles'.
	Files *FileTree `json:"files,omitempty"`
}

// Stdio is the shape of an exec or attach session.
type Stdio struct {
	Stdin  bool `json:"stdin,omitempty"`
	Stdout bool `json:"stdout,omitempty"`
	Stderr bool `json:"stderr,omitempty"`
	// TTY: an exec'd command runs on a terminal of its own (its output
	// comes as FrameStdout); for attach it must match the app's TTY.
	TTY bool `json:"tty,omitempty"`
	// Size is a terminal's initial size (exec with TTY); nil means the
	// kernel's default.
	Size *TerminalSize `json:"size,omitempty"`
}

// TerminalSize is a terminal's size in characters.
type TerminalSize struct {
	Width  uint16 `json:"width"`
	Height uint16 `json:"height"`
}

// SessionEnd is how an exec or attach session ended: an exec'd command's
// exit code, or an error (Code, Error as in Response) when the session
// failed after it started.
type SessionEnd struct {
	ExitCode int32  `json:"exitCode"`
	Code     string `json:"code,omitempty"`
	Error    string `json:"error,omitempty"`
}

// Error classes carried in Response.Code; the client maps them back to
// errdefs classes.
const (
	CodeOK                 = ""
	CodeNotFound           = "NotFound"
	CodeAlreadyExists      = "AlreadyExists"
	CodeInvalidArgument    = "InvalidArgument"
	CodeFailedPrecondition = "FailedPrecondition"
	CodeDeadlineExceeded   = "DeadlineExceeded"
	CodeInternal           = "Internal"
)

// Event types: what happened to an app.
const (
	EventCreated = "created"
	EventStarted = "started"
	EventExited  = "exited" // App.ExitCode, Reason (OOMKilled, ...), FinishedAt
	EventRemoved = "removed"
)

// EventBuffer is how many events an agent holds for a subscriber that does
// not read them before it drops the subscriber.
const EventBuffer = 1024

// Event is a change to an app, sent on an OpEvents stream.
type Event struct {
	Type string `json:"type"`
	// App is the app's status after the change (for EventRemoved, its
	// last one).
	App *AppStatus `json:"app"`
	// Time is when the agent saw the change.
	Time time.Time `json:"time"`
}

// Response is the agent's answer.
type Response struct {
	Code  string       `json:"code,omitempty"`
	Error string       `json:"error,omitempty"`
	Info  *Info        `json:"info,omitempty"`
	App   *AppStatus   `json:"app,omitempty"`
	Apps  []*AppStatus `json:"apps,omitempty"`
	Exec  *ExecResult  `json:"exec,omitempty"`
	Stats *Stats       `json:"stats,omitempty"`
	// Restore is OpRestore's.
	Restore *RestoreIO `json:"restore,omitempty"`
	// Spans are the agent's spans of a traced request (Request.TraceParent),
	// for the daemon to export: the agent talks to no collector.
	Spans []tracing.Finished `json:"spans,omitempty"`
	// Termination is OpTermination's.
	Termination []byte `json:"termination,omitempty"`
}

// RestoreIO is where a restored app's output goes: the write ends of
// pipes the agent reads, as its file descriptors Stdout and Stderr in its
// process PID (in the agent's PID namespace), for the restorer to open
// as /proc/<PID>/fd/<N> and hand the restored process.
type RestoreIO struct {
	PID    int `json:"pid"`
	Stdout int `json:"stdout"`
	Stderr int `json:"stderr"`
}

// AppCgroup is the name of app id's cgroup, beneath the agent's.
func AppCgroup(id string) string { return "app-" + id }

// Info describes the agent and the environment it runs in.
type Info struct {
	Version   int       `json:"version"`
	PID       int       `json:"pid"`
	Kernel    string    `json:"kernel"` // uname -r as the agent sees it
	StartedAt time.Time `json:"startedAt"`
	// Features are what the agent does beyond Version's protocol
	// (FeatureGuestVolumes); an agent of an earlier daemon has none.
	Features []string `json:"features,omitempty"`
}

// Mount is one bind mount into an app's root.
type Mount struct {
	Source      string `json:"source"`
	Destination string `json:"destination"`
	Readonly    bool   `json:"readonly,omitempty"`
	// Propagation: "private" (default), "rslave" or "rshared".
	Propagation string `json:"propagation,omitempty"`
	// RecursiveReadonly: with Readonly, the mounts beneath the source
	// are read-only too; Readonly alone makes the top mount read-only.
	RecursiveReadonly bool `json:"recursiveReadonly,omitempty"`
	// NoSuid, NoDev and NoExec are the bind mount's flags of those names.
	NoSuid bool `json:"nosuid,omitempty"`
	NoDev  bool `json:"nodev,omitempty"`
	NoExec bool `json:"noexec,omitempty"`
	// Kind says where Source is (MountPath, MountGuest, MountCopy,
	// MountMessage); for every kind but MountPath, Source is a guest
	// volume's name (ValidVolumeName), which the agent resolves.
	Kind string `json:"kind,omitempty"`
	// Mode, UID and GID are the mode and owner the agent gives the
	// directory of a MountGuest volume, or the file of a MountMessage
	// one, when it makes it.
	Mode uint32 `json:"mode,omitempty"`
	UID  uint32 `json:"uid,omitempty"`
	GID  uint32 `json:"gid,omitempty"`
}

// Resources are the app's cgroup limits; zero means unlimited/default.
type Resources struct {
	CPUShares   int64 `json:"cpuShares,omitempty"`
	CPUQuota    int64 `json:"cpuQuota,omitempty"`  // microseconds per period
	CPUPeriod   int64 `json:"cpuPeriod,omitempty"` // microseconds
	MemoryLimit int64 `json:"memoryLimit,omitempty"`
	PidsLimit   int64 `json:"pidsLimit,omitempty"`
	OOMScoreAdj int   `json:"oomScoreAdj,omitempty"`
	// CpusetCpus and CpusetMems are cpuset lists ("0-3,6").
	CpusetCpus string `json:"cpusetCpus,omitempty"`
	CpusetMems string `json:"cpusetMems,omitempty"`
	// OOMGroup: an OOM kill takes every process of the app (cgroup v2's
	// memory.oom.group); cgroup v1 refuses it.
	OOMGroup bool `json:"oomGroup,omitempty"`
	// MemorySwap is the memory and swap the app may use together, as
	// OCI's memory.swap (-1: unlimited); on cgroup v2 it needs a
	// MemoryLimit (memory.swap.max is the difference).
	MemorySwap int64 `json:"memorySwap,omitempty"`
	// MemoryReservation is the memory the system's reclaim spares the
	// app (v1 memory.soft_limit_in_bytes, v2 memory.low; -1: all).
	MemoryReservation int64 `json:"memoryReservation,omitempty"`
}

// HugepageLimit caps the app's huge pages of one size.
type HugepageLimit struct {
	// PageSize as in the kernel's hugetlb files: "2MB", "1GB".
	PageSize string `json:"pageSize"`
	Limit    uint64 `json:"limit"` // bytes
}

// AppSpec is everything the agent needs to create and start one container.
// Users, capabilities and the command line are already resolved by the
// daemon; the agent applies them and does not interpret images.
type AppSpec struct {
	ID       string   `json:"id"`
	Name     string   `json:"name"`
	Rootfs   string   `json:"rootfs"`
	Args     []string `json:"args"`
	Env      []string `json:"env,omitempty"`
	Cwd      string   `json:"cwd,omitempty"`
	Hostname string   `json:"hostname,omitempty"`
	// PrivateUTS runs the app in a UTS namespace of its own (its pod's
	// hostname is not the host's: a pod outside the host's network), also
	// when Hostname is empty; a Hostname implies it.
	PrivateUTS bool `json:"privateUts,omitempty"`

	UID            uint32   `json:"uid"`
	GID            uint32   `json:"gid"`
	AdditionalGIDs []uint32 `json:"additionalGids,omitempty"`

	// Capabilities is the full bounding/effective/permitted set, by name
	// ("CAP_CHOWN"). Ignored when Privileged (all capabilities).
	Capabilities   []string `json:"capabilities,omitempty"`
	Privileged     bool     `json:"privileged,omitempty"`
	NoNewPrivs     bool     `json:"noNewPrivs,omitempty"`
	ReadonlyRootfs bool     `json:"readonlyRootfs,omitempty"`
	// LocalUpper: the agent gives the app a writable layer of its own,
	// on its side's storage (a VM guest's memory), over Rootfs, which the
	// app then sees read-only beneath it: an overlay mounted at create
	// and released at remove; Stats report what it holds.
	LocalUpper bool `json:"localUpper,omitempty"`

	Mounts    []Mount   `json:"mounts,omitempty"`
	Resources Resources `json:"resources"`
	// HugepageLimits cap the app's huge pages of each size listed (v1
	// hugetlb.<size>.limit_in_bytes, v2 hugetlb.<size>.max); set when the
	// app is created, they cannot change (Resources stays comparable).
	HugepageLimits []HugepageLimit `json:"hugepageLimits,omitempty"`
	// Rlimits are the resource limits the app's processes start with
	// (the daemon's children's, as containerd passes its own to runc);
	// nil: the agent's children's.
	Rlimits []rlimit.Limit `json:"rlimits,omitempty"`

	// Devices are the device nodes made in the app's root (mknod, with
	// the mode and owner given), as the host's devices are numbered; a
	// node already there as the same device is kept.
	Devices []specs.LinuxDevice `json:"devices,omitempty"`
	// PodDevices: the app (a privileged one) also gets the device nodes
	// of the agent's own /dev: the pod's (nspawn) or the guest's (kvm),
	// where the host's are not the app's to have.
	PodDevices bool `json:"podDevices,omitempty"`
	// DeviceCgroup fences the devices the app's processes may create and
	// open: a first rule over every device that allows or denies all,
	// then what is allowed besides (package devices makes them). Nil:
	// not fenced by the agent (a VM's guest, whose devices are its own).
	DeviceCgroup []specs.LinuxDeviceCgroup `json:"deviceCgroup,omitempty"`

	// Seccomp is the system call filter of the app and of every command
	// exec'd in it, as an OCI profile; nil means none. The agent compiles
	// it (package seccomp) and installs it right before execve.
	Seccomp *specs.LinuxSeccomp `json:"seccomp,omitempty"`
	// SeccompProfile says where Seccomp comes from ("runtime/default",
	// "localhost/PATH"), for status and logs.
	SeccompProfile string `json:"seccompProfile,omitempty"`
	// SELinuxProcessLabel is the context the app's commands are executed
	// in, SELinuxMountLabel the context of the file systems the agent
	// mounts for it. Both are applied only where SELinux is enabled.
	SELinuxProcessLabel string `json:"selinuxProcessLabel,omitempty"`
	SELinuxMountLabel   string `json:"selinuxMountLabel,omitempty"`
	// AppArmorProfile is the AppArmor profile the app's commands are
	// executed under; empty means the agent's own.
	AppArmorProfile string `json:"apparmorProfile,omitempty"`

	// PIDNamespace: "" or "pod" runs the app in the pod's PID namespace
	// (the agent's); "container" gives it one of its own, where it is
	// PID 1 and exec'd commands join it; "target" runs it in the PID
	// namespace of the app PIDTarget (which must be running), as
	// kubectl debug --target asks.
	PIDNamespace string `json:"pidNamespace,omitempty"`
	PIDTarget    string `json:"pidTarget,omitempty"`

	// MaskedPaths are hidden from the app (an empty read-only tmpfs on a
	// directory, /dev/null on a file), ReadonlyPaths made read-only;
	// nil means the agent's defaults (DefaultMaskedPaths,
	// DefaultReadonlyPaths). A path the root does not have is skipped.
	// Privileged apps get neither.
	MaskedPaths   []string `json:"maskedPaths,omitempty"`
	ReadonlyPaths []string `json:"readonlyPaths,omitempty"`
	// Unmasked: neither, nor the defaults (the kubelet's procMount
	// Unmasked).
	Unmasked bool `json:"unmasked,omitempty"`

	// LogPath is where the app's stdout/stderr go in CRI log format;
	// empty means discard.
	LogPath string `json:"logPath,omitempty"`
	// TTY runs the app on a terminal the agent holds; its output is
	// logged as stdout.
	TTY bool `json:"tty,omitempty"`
	// Stdin keeps the app's stdin open (a pipe, or the terminal with
	// TTY) for attach sessions; without it stdin is /dev/null.
	// StdinOnce closes it when the first attach session that wrote to it
	// ends (a terminal gets its end-of-file character).
	Stdin     bool `json:"stdin,omitempty"`
	StdinOnce bool `json:"stdinOnce,omitempty"`

	// RootfsDisk, with LocalUpper, is the disk of the VM's guest that
	// holds the app's image files (a read-only file system): the agent
	// mounts it (once for every app that names it) as the lower layer of
	// the app's overlay, mounted in the guest's own storage, instead of
	// Rootfs. Nil: Rootfs is the lower layer.
	RootfsDisk *Disk `json:"rootfsDisk,omitempty"`
	// HostLog: the daemon writes the app's CRI log on the host, at
	// LogPath, from the app's OpLogs session; the agent formats the
	// lines as it would for the file and keeps them for that session
	// (the app's output waits while they are not taken), and never opens
	// LogPath. Needs a LogPath.
	HostLog bool `json:"hostLog,omitempty"`
}

// Disk is a disk plugged into a VM's guest: a SCSI disk on its
// virtio-scsi controller (channel 0, LUN 0) at Target, reporting serial
// number Serial, holding a file system of type FSType ("erofs").
type Disk struct {
	Target int    `json:"target"`
	Serial string `json:"serial,omitempty"`
	FSType string `json:"fstype"`
}

// OwnUTS tells whether the app runs in a UTS namespace of its own.
func (s *AppSpec) OwnUTS() bool { return s.PrivateUTS || s.Hostname != "" }

// PID namespace modes of an app.
const (
	PIDNamespacePod       = "pod"
	PIDNamespaceContainer = "container"
	PIDNamespaceTarget    = "target"
)

// App states.
const (
	StateCreated = "created"
	StateRunning = "running"
	StateExited  = "exited"
)

// Exit reasons, as the kubelet expects them.
const (
	ReasonCompleted = "Completed"
	ReasonError     = "Error"
	ReasonOOMKilled = "OOMKilled"
)

// AppStatus is the agent's truth about one app.
type AppStatus struct {
	ID         string    `json:"id"`
	State      string    `json:"state"`
	PID        int       `json:"pid,omitempty"`
	ExitCode   int32     `json:"exitCode"`
	Reason     string    `json:"reason,omitempty"`
	Message    string    `json:"message,omitempty"`
	CreatedAt  time.Time `json:"createdAt"`
	StartedAt  time.Time `json:"startedAt,omitzero"`
	FinishedAt time.Time `json:"finishedAt,omitzero"`
}

// ExecOutputLimit caps an exec's captured stdout and stderr together, so
// that the whole ExecSync reply stays under the kubelet's 16 MiB gRPC
// receive limit: the agent keeps no more, the daemon takes no more.
const ExecOutputLimit = 12 << 20

// ExecResult is the outcome of a synchronous exec.
type ExecResult struct {
	Stdout   []byte `json:"stdout,omitempty"`
	Stderr   []byte `json:"stderr,omitempty"`
	ExitCode int32  `json:"exitCode"`
	TimedOut bool   `json:"timedOut,omitempty"`
}

// Stats are resource usage figures read from the app's (or pod's) cgroup.
type Stats struct {
	Timestamp            time.Time `json:"timestamp"`
	CPUUsageNanos        uint64    `json:"cpuUsageNanos"`
	MemoryUsageBytes     uint64    `json:"memoryUsageBytes"`
	MemoryWorkingSet     uint64    `json:"memoryWorkingSet"`
	MemoryRSSBytes       uint64    `json:"memoryRssBytes"`
	MemoryPageFaults     uint64    `json:"memoryPageFaults"`
	MemoryMajorPageFault uint64    `json:"memoryMajorPageFaults"`
	Pids                 uint64    `json:"pids"`
	// LocalLayer: the app has a local writable layer (AppSpec.LocalUpper)
	// and WritableBytes and WritableInodes are what it holds.
	LocalLayer     bool   `json:"localLayer,omitempty"`
	WritableBytes  uint64 `json:"writableBytes,omitempty"`
	WritableInodes uint64 `json:"writableInodes,omitempty"`
}
