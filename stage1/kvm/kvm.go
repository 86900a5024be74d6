// Package kvm is the stage1 that runs each pod in its own lightweight
// virtual machine: qemu-system-x86_64 boots a guest kernel whose initramfs
// runs the stagelet agent as PID 1 (`stagelet agent guest`), so the pod's
// apps run under their own kernel.
//
// The guest assets (an uncompressed PVH kernel, an initramfs holding the
// stagelet binary and, with a Debian kernel package, the modules the guest
// loads) are built by guest/build.sh into Config.AssetsDir: by default a
// minimal kernel built from Debian's source (guest/kernel.config).
//
// One VM per pod, started detached by the stage1 launcher so that it
// outlives the daemon, in the pod cgroup or, when the pod's cgroup cannot
// hold the VM and qemu (a pod with memory limits and no RuntimeClass
// overhead), in a cgroup of its own in stagelet's overhead cgroup, capped
// at the VM's size (placement.go):
//
//   - control: a virtio-serial port whose host side is a unix socket qemu
//     serves (<RunDir>/vm/ctl.sock). It is one byte stream: the agent
//     protocol is multiplexed over it with yamux, one stream per call,
//     behind a handshake that lets a restarted daemon start a new session
//     with a running guest (transport.SerialDialer, transport.SerialListener).
//   - files: the pod's shared directory <RunDir>/mounts is a shared mount,
//     exported by qemu itself over virtio-9p and mounted in the guest at
//     /mnt/stagelet. CreateContainer binds a container's rootfs, log
//     directory and mount sources beneath it on the host; qemu sees them
//     at once and so does the running guest, where the agent writes the
//     CRI log files straight to the kubelet's paths.
//   - container writes: over 9p each file operation is a round trip to
//     qemu (7x-60x the guest's tmpfs for small files, stagelet-bench
//     -fileio), so a container's rootfs seen over 9p is only the lower
//     layer of an overlay the agent mounts in the guest, whose upper is a
//     tmpfs of the container's own (AppSpec.LocalUpper): its writes stay
//     in guest memory, go at RemoveContainer and are counted by the
//     agent's Stats. The host's writable layer stays as the image left
//     it. emptyDir volumes live in the guest, the kubelet's configMap,
//     secret, projected and downwardAPI volumes and the pod's small
//     files are copies kept current, the termination message is copied
//     back at exit (classify.go, volumes.go); other volumes and the logs
//     are binds seen over 9p as before: the host sees their writes.
//   - images: that lower layer is not read over 9p but from the image's
//     read-only erofs disk, hot-plugged into the VM's virtio-scsi
//     controller once per image and shared by its containers (disks.go).
//     The host's rootfs is still bound into the share (a pod with a user
//     namespace of its own reads its image there).
//   - start: with Config.TemplateDir set, a pod's VM is restored from a
//     template, a VM booted once and saved, whose memory every pod's VM
//     maps privately (template.go); else it boots the guest kernel.
//   - network: in the pod's network namespace a tap device is wired to the
//     CNI interface eth0 with tc ingress redirects both ways (tc-mirred);
//     qemu gets the tap as a file descriptor, and the guest's interface
//     gets eth0's MAC, addresses, routes and MTU on the kernel command
//     line. A VM cannot share the host's network, PID or IPC namespaces.
//   - acceleration: KVM when a probe boot of the guest under KVM reaches
//     the agent, else TCG; probed once per Backend (daemon run).
//
// Every host resource a pod takes (cgroup, shared mount, tap and tc
// filters, the qemu process) is recorded through Persist before it is
// taken; DestroyPod releases them after any crash. Pods started by
// earlier versions also have a virtiofsd (and under systemd its cgroup),
// released with them.
package kvm

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/attribute"

	"github.com/stagelet/stagelet/agent/client"
	"github.com/stagelet/stagelet/agent/guest"
	"github.com/stagelet/stagelet/agent/transport"
	"github.com/stagelet/stagelet/cgroups"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/stage1"
	"github.com/stagelet/stagelet/stage1/host"
	"github.com/stagelet/stagelet/tracing"
)

// Name is the stage1's registered name.
const Name = "kvm"

// stateVersion is the version of the persisted state. Every version ever
// written stays readable: raising it means passing parseState's
// stage1.ParseState a stage1.Migration from the version before.
// Version 2 keeps the resources in a ledger; version 1 had a field each.
const stateVersion = 2

// The roles of a pod's resources in its ledger, in the order StartPod
// takes them. Pods of earlier versions also have a virtiofsd, its unit
// and (under systemd) its cgroup.
const (
	rolePodCgroup = "pod cgroup"
	// roleVMMCgroup is qemu's cgroup in the overhead cgroup, which a pod
	// has instead of a pod cgroup when its qemu runs there (Placement).
	roleVMMCgroup       = "VMM cgroup"
	roleVirtiofsdCgroup = "virtiofsd cgroup"
	roleDir             = "VM directory"
	roleMounts          = "shared mounts"
	roleTap             = "tap"
	roleUnit            = "qemu unit"
	roleVirtiofsdUnit   = "virtiofsd unit"
	roleQemu            = "qemu"
	roleVirtiofsd       = "virtiofsd"
)

// kindTap is a tap device (Name) and the tc filters mirroring the pod's
// eth0 to it, in the network namespace NetNS.
const kindTap host.Kind = "tap"

// migrations bring an older state up to stateVersion.
var migrations = map[int]stage1.Migration{
	1: func(m map[string]any) error {
		// The tap was two fields; the rest one each.
		tap, _ := m["tap"].(string)
		netns, _ := m["netns"].(string)
		delete(m, "tap")
		delete(m, "netns")
		err := host.ToLedger(
			host.LegacyField{Field: "cgroup", Kind: host.KindCgroup, Role: rolePodCgroup},
			host.LegacyField{Field: "fsCgroup", Kind: host.KindCgroup, Role: roleVirtiofsdCgroup},
			host.LegacyField{Field: "dir", Kind: host.KindDir, Role: roleDir},
			host.LegacyField{Field: "mounts", Kind: host.KindDir, Role: roleMounts},
		)(m)
		if err != nil {
			return err
		}
		if tap != "" && netns != "" {
			m["resources"] = append(m["resources"].([]any), map[string]any{"kind": string(kindTap), "role": roleTap, "name": tap, "netns": netns})
		}
		return host.ToLedger(
			host.LegacyField{Field: "virtiofsd", Kind: host.KindProcess, Role: roleVirtiofsd},
			host.LegacyField{Field: "qemu", Kind: host.KindProcess, Role: roleQemu},
		)(m)
	},
}

// Defaults of Config.
const (
	// DefaultAssetsDir is where `make guest` puts the guest assets.
	DefaultAssetsDir = "/usr/local/lib/stagelet/guest"
	// DefaultMemoryMiB is a VM's memory when the policy gives none
	// ("memory" option). The host pays what the guest touches of it plus
	// qemu's own memory (BenchmarkFootprint); a VM restored from a
	// template shares what it only reads with the other VMs of that
	// template.
	DefaultMemoryMiB = 256
	// DefaultVCPUs is a VM's vCPU count when the policy gives none
	// ("vcpus" option).
	DefaultVCPUs = 1
	// DefaultTBSizeMiB bounds TCG's translation cache per VM (qemu's
	// default lets it grow to 1 GiB of the host's memory).
	DefaultTBSizeMiB = 32
)

// Timeouts; variables so tests may shorten them.
var (
	// AgentReadyTimeout is Config.BootTimeout's default: how long StartPod
	// waits for the guest's agent to answer (a TCG boot takes about 2 s on
	// an idle core).
	AgentReadyTimeout = 60 * time.Second
	// ExitGrace is how long Stop waits for qemu to exit after the agent
	// powered the guest off, beyond the apps' stop timeout, and how long
	// teardown waits for killed processes to go.
	ExitGrace = 10 * time.Second
	// recoverTimeout bounds the first call to a recovered pod's agent
	// (a new serial session included).
	recoverTimeout = 15 * time.Second
)

// Config configures the kvm stage1.
type Config struct {
	// AssetsDir holds the guest kernel (vmlinux, else vmlinuz) and
	// initrd.cpio built by guest/build.sh. Default DefaultAssetsDir.
	AssetsDir string
	// QemuPath is qemu-system-x86_64; default: found in PATH.
	QemuPath string
	// TemplateDir holds the VM templates pods' VMs are restored from
	// (template.go); empty: every VM boots its kernel.
	TemplateDir string
	// TBSizeMiB bounds TCG's translation cache per VM (qemu's tb-size);
	// 0 means DefaultTBSizeMiB. Unused under KVM.
	TBSizeMiB int
	// Accelerator is "kvm", "tcg", or "" to probe (a real boot under KVM,
	// falling back to TCG).
	Accelerator string
	// Machine is the qemu machine type: "microvm" (default) or "q35".
	Machine string
	// MemoryMiB and VCPUs are the defaults of pods whose policy options
	// give none; zero means DefaultMemoryMiB and DefaultVCPUs.
	MemoryMiB int
	VCPUs     int
	// ProbeTimeout bounds the KVM probe boot; default 10s.
	ProbeTimeout time.Duration
	// BootTimeout bounds how long StartPod waits for a template's state
	// to load and for the guest's agent; 0 means AgentReadyTimeout.
	BootTimeout time.Duration
	// Launcher starts qemu; nil means the plain launcher (the cgroupfs
	// driver). Under a host.UnitLauncher (the systemd driver) qemu runs
	// as a transient unit in the pod's slice (or the overhead slice), in
	// the pod's network namespace, opening the tap by name.
	Launcher host.Launcher
	// Placement is where pods' qemu runs and is charged; "" means
	// PlacementAuto.
	Placement Placement
	// OverheadCgroup is where qemu runs when it is not in the pod's
	// cgroup (Placement): under the plain launcher a cgroup path,
	// absolute or relative to the daemon's own cgroup (default
	// DefaultOverheadCgroup), under a UnitLauncher a slice (default
	// DefaultOverheadSlice). Each VM there has a cgroup of its own,
	// "stagelet-pod-<id>" (a unit of that name in the slice), capped at
	// the VM's memory and qemu's own.
	OverheadCgroup string
	// OverheadMemoryMax caps the overhead cgroup itself, every VM in it
	// together (bytes); 0: no cap but each VM's own.
	OverheadMemoryMax int64
	// ImageDisks gives containers' images as disks (disks.go); nil: their
	// files reach the guest over 9p.
	ImageDisks ImageDiskFunc
}

// Backend is the kvm stage1. Everything about a pod is in the state it
// persists; the Backend itself holds the accelerator chosen for this
// daemon run and one serial session per running VM, shared by every Pod
// value of that VM. Safe for concurrent use.
type Backend struct {
	host.Base
	cfg Config

	accelOnce sync.Once
	accel     string
	// accelReason says why accel was chosen: the configuration, or the
	// probe's failure under KVM.
	accelReason string
	// chosen is accel once accelOnce is done, for VMStats.
	chosen atomic.Pointer[string]
	// Template hits, misses, builds and failed builds (VMStats).
	hits, misses, built, buildFailures atomic.Uint64
	// confinedOnce logs once that confined VMs are not restored from
	// templates.
	confinedOnce sync.Once

	mu      sync.Mutex
	dialers map[string]*transport.SerialDialer // by control socket path
	builds  map[string]*templateBuild          // templates being built, by key
	// templateUses are the templates starts hold, by directory
	// (Backend.template, releaseTemplate).
	templateUses map[string]*templateUse
	// templateGC is the assets fingerprint stale templates were last
	// removed for.
	templateGC string
	// overhead is the overhead cgroup under the plain launcher, once made
	// and capped; sliceLimited says the overhead slice was capped under a
	// UnitLauncher.
	overhead     *cgroups.Cgroup
	sliceLimited bool
}

var _ stage1.Backend = (*Backend)(nil)

var _ stage1.Collector = (*Backend)(nil)

// New returns the kvm backend; the caller registers it. Whether qemu and
// the guest assets are present is checked by StartPod
// (FailedPrecondition), not here.
func New(log *slog.Logger, cfg Config) *Backend {
	if cfg.AssetsDir == "" {
		cfg.AssetsDir = DefaultAssetsDir
	}
	if cfg.Machine == "" {
		cfg.Machine = "microvm"
	}
	if cfg.MemoryMiB <= 0 {
		cfg.MemoryMiB = DefaultMemoryMiB
	}
	if cfg.VCPUs <= 0 {
		cfg.VCPUs = DefaultVCPUs
	}
	if cfg.TBSizeMiB <= 0 {
		cfg.TBSizeMiB = DefaultTBSizeMiB
	}
	if cfg.ProbeTimeout <= 0 {
		cfg.ProbeTimeout = 10 * time.Second
	}
	if cfg.Placement == "" {
		cfg.Placement = PlacementAuto
	}
	base := host.NewBase(log, cfg.Launcher)
	if cfg.OverheadCgroup == "" {
		cfg.OverheadCgroup = DefaultOverheadCgroup
		if base.UnitLaunch() {
			cfg.OverheadCgroup = DefaultOverheadSlice
		}
	}
	return &Backend{
		Base:    base,
		cfg:     cfg,
		dialers: map[string]*transport.SerialDialer{},
		builds:  map[string]*templateBuild{},

		templateUses: map[string]*templateUse{},
	}
}

// Collect implements stage1.Collector: under the systemd driver, the
// units of pods no record names (host.CollectUnits), in the pods' slices
// and the overhead slice alike; under the plain launcher, their cgroups
// in the overhead cgroup (cgroups.CollectPodCgroups), with the qemu in
// each. Their pod cgroups are the broker's to collect.
func (b *Backend) Collect(ctx context.Context, keep func(podID string) bool) ([]string, error) {
	if b.UnitLaunch() {
		return host.CollectUnits(ctx, b.Launcher, keep)
	}
	found, err := cgroups.CollectPodCgroups(b.cfg.OverheadCgroup, keep)
	if err != nil {
		return nil, fmt.Errorf("kvm: %w", err)
	}
	var ids []string
	var errs []error
	for _, o := range found {
		if o.Err != nil {
			errs = append(errs, fmt.Errorf("kvm: the VMM cgroup of pod %s (%d processes) is left: %w", o.PodID, o.Procs, o.Err))
			continue
		}
		ids = append(ids, o.PodID)
	}
	return ids, errors.Join(errs...)
}

// Name implements stage1.Backend.
func (b *Backend) Name() string { return Name }

// Capabilities implements stage1.Backend: kernel isolation, a pod network
// only (a VM cannot join the host's network, PID or IPC namespaces), and a
// privileged container is privileged inside its guest only: no host device
// is ever passed to a VM.
func (b *Backend) Capabilities() stage1.Capabilities {
	return stage1.Capabilities{
		Isolation:      stage1.IsolationKernel,
		KernelIsolated: true,
		HostNetwork:    false,
		PodNetwork:     true,
		HostPID:        false,
		HostIPC:        false,
		Privileged:     "guest",
		// The VM's interface takes the MAC, addresses and routes of the
		// pod's eth0 (net.go).
		NetworkBeforeStart: true,
		// Containers write into a layer in the guest's memory (vfio.go).
		LocalLayers: true,
		// The pod's agent runs in the pod's user namespace inside the
		// guest (agent/guestinit/nest.go); its files reach it idmapped.
		UserNamespaces: true,
		// The daemon writes the containers' logs on the host from the
		// agent's sessions: no log directory crosses into the guest.
		HostLogs: true,
		// The VM's size (qemu.go).
		Options: slices.Clone(podOptions),
		// The VM is saved whole (save.go).
		WholePodCheckpoint: true,
	}
}

// state is what kvm persists for a pod.
type state struct {
	Version int `json:"version"`
	// VM is what the VM was started with, for Details.
	VM vmInfo `json:"vm"`
	// UserNS is the pod's user namespace mapping; nil: the guest's.
	UserNS *stage1.IDMapping `json:"userNS,omitempty"`
	host.Ledger
	// ShareOnDemand: the guest mounts the 9p share only when a container
	// needs it (shareuse.go); false: at boot.
	ShareOnDemand bool `json:"shareOnDemand,omitempty"`
}

// The VM directory holds the sockets and logs of the VM (<RunDir>/vm);
// the shared mounts directory is exported to the guest, and every mount
// beneath it is the backend's. qemu's cgroup is the pod cgroup, or its
// cgroup in the overhead cgroup (Placement); under a UnitLauncher it is
// qemu's unit's.
func (s *state) dir() string         { return s.Path(roleDir) }
func (s *state) mounts() string      { return s.Path(roleMounts) }
func (s *state) qemu() *host.Process { return s.Process(roleQemu) }

func (s *state) cgroup() *cgroups.Cgroup {
	if cg := s.Cgroup(roleVMMCgroup); cg != nil {
		return cg
	}
	return s.Cgroup(rolePodCgroup)
}

// cgroupRole is the role of qemu's cgroup in the ledger.
func cgroupRole(overhead bool) string {
	if overhead {
		return roleVMMCgroup
	}
	return rolePodCgroup
}

// tap is the tap device's name and network namespace; empty without a
// pod network.
func (s *state) tap() (name, netns string) {
	r, _ := s.Get(roleTap)
	return r.Name, r.NetNS
}

// vmInfo describes a started VM.
type vmInfo struct {
	Accelerator string `json:"accelerator,omitempty"`
	Machine     string `json:"machine,omitempty"`
	MemoryMiB   int    `json:"memoryMiB,omitempty"`
	VCPUs       int    `json:"vcpus,omitempty"`
	Kernel      string `json:"kernel,omitempty"`
	MAC         string `json:"mac,omitempty"`
	// TBSizeMiB is TCG's translation cache bound (0 under KVM).
	TBSizeMiB int `json:"tbSizeMiB,omitempty"`
	// Template is the directory of the template the VM was restored from;
	// empty for a VM that booted its kernel.
	Template string `json:"template,omitempty"`
	// Overhead: qemu runs in the overhead cgroup, capped at CapMiB,
	// instead of the pod's cgroup (Placement).
	Overhead bool `json:"overhead,omitempty"`
	CapMiB   int  `json:"capMiB,omitempty"`
}

func (s *state) marshal() []byte { return stage1.MarshalState(s) }

// qemu's sockets, in state.Dir: the agent's control channel and QMP.
const (
	ctlSocketName = "ctl.sock"
	qmpSocketName = "qmp.sock"
)

// qemu's console and its output (stdout and stderr), in state.Dir.
const (
	consoleName = "console.log"
	qemuLogName = "qemu.log"
)

func (s *state) ctlSocket() string { return filepath.Join(s.dir(), ctlSocketName) }
func (s *state) qmpSocket() string { return filepath.Join(s.dir(), qmpSocketName) }

// sockDir is qemu's working directory: two levels above the VM directory
// (the run directory's pods directory). It is given its sockets as paths
// relative to it (sockName: "<pod>/vm/ctl.sock"), which fit a unix socket
// address (107 bytes) however long the run directory is.
// maxSocketName is the room for a path in a unix socket address.
const maxSocketName = 107

func (s *state) sockDir() string { return filepath.Dir(filepath.Dir(s.dir())) }

func (s *state) sockName(name string) string {
	return filepath.Join(filepath.Base(filepath.Dir(s.dir())), filepath.Base(s.dir()), name)
}

func parseState(b []byte) (*state, error) {
	var s state
	if err := stage1.ParseState(Name, b, stateVersion, &s, migrations); err != nil {
		return nil, err
	}
	return &s, nil
}

// layout is a pod's state with what follows from spec: its directories,
// after its pod cgroup when podCgroup (qemu's under the plain launcher,
// unless it runs in the overhead cgroup), recorded in the order StartPod
// takes them.
func layout(spec *stage1.PodSpec, podCgroup bool) *state {
	st := &state{Version: stateVersion}
	if cg, err := cgroups.PodCgroup(spec.CgroupParent, spec.ID); err == nil && podCgroup {
		st.Record(host.Resource{Kind: host.KindCgroup, Role: rolePodCgroup, Cgroup: cg})
	}
	st.Record(host.Resource{Kind: host.KindDir, Role: roleDir, Path: filepath.Join(spec.RunDir, "vm")})
	st.Record(host.Resource{Kind: host.KindDir, Role: roleMounts, Path: filepath.Join(spec.RunDir, "mounts")})
	return st
}

// validate refuses what this backend cannot do.
func validate(spec *stage1.PodSpec) error {
	if spec.ID == "" || spec.RunDir == "" {
		return errdefs.InvalidArgument("kvm: pod id and run dir are required")
	}
	if spec.HostNetwork || spec.HostPID || spec.HostIPC {
		return errdefs.InvalidArgument("kvm: a VM cannot share the host's network, PID or IPC namespace")
	}
	if !filepath.IsAbs(spec.RunDir) {
		return errdefs.InvalidArgument("kvm: run dir %q is not absolute", spec.RunDir)
	}
	if n := len(layout(spec, false).sockName(ctlSocketName)); n > maxSocketName {
		return errdefs.InvalidArgument("kvm: pod id %q too long for a socket name (%d > %d)", spec.ID, n, maxSocketName)
	}
	if strings.ContainsAny(spec.RunDir, ",=") {
		return errdefs.InvalidArgument("kvm: run dir %q: ',' and '=' separate qemu's options", spec.RunDir)
	}
	if u := spec.UserNS; u != nil {
		if err := u.Check("kvm"); err != nil {
			return err
		}
	}
	return nil
}

// StartPod implements stage1.Backend. In order, each recorded before it is
// taken: the pod cgroup, the shared mounts directory, the tap and its tc
// filters in the pod's network namespace, qemu (launched detached in the
// pod cgroup). With templates, qemu is restored from the VM's template
// (built first when there is none; when it cannot be, the VM boots its
// kernel) and the agent then gets the pod's identity. It returns once the
// guest's agent answers Info (at most Config.BootTimeout, or ctx). Errors:
// InvalidArgument (a spec a VM cannot run, bad options),
// FailedPrecondition (qemu or the guest assets missing), Unavailable or
// DeadlineExceeded (the guest did not come up; the console log is named).
// On failure it releases what it took.
func (b *Backend) StartPod(ctx context.Context, spec *stage1.PodSpec, persist stage1.Persist) (_ stage1.Pod, retErr error) {
	log := b.Log.With("pod", spec.ID)
	if err := validate(spec); err != nil {
		return nil, err
	}
	res, err := b.resolveTools()
	if err != nil {
		return nil, err
	}
	plan, err := b.podPlan(ctx, log, spec, res)
	if err != nil {
		return nil, err
	}
	unitLaunch := b.UnitLaunch()
	cg, err := b.vmmCgroup(spec, plan.overhead && !unitLaunch)
	if err != nil {
		return nil, err
	}

	st := podState(spec, plan, cg, unitLaunch)
	save := func() error { return persist(st.marshal()) }
	undo, err := host.Starting(ctx, log, Name, save, func(ctx context.Context) error { return b.release(ctx, st) })
	if err != nil {
		return nil, err
	}
	defer undo(&retErr)
	if err := prepareHost(st, cg, unitLaunch); err != nil {
		return nil, err
	}

	gcfg := guestConfig(spec)
	tap, tapMode, err := attachTap(spec, st, save, unitLaunch, gcfg)
	if err != nil {
		return nil, err
	}
	defer tap.Close() // qemu holds its own copy, or opens it by name

	conf, err := confine(ctx, spec, st, res, save)
	if err != nil {
		return nil, err
	}
	tctx, span := tracing.Start(ctx, "kvm.template")
	tpl, err := b.podTemplate(tctx, log, res, plan.vm, conf.confined())
	span.SetAttributes(attribute.Bool("stagelet.kvm.template", tpl != nil))
	tracing.End(span, err)
	if err != nil {
		return nil, err
	}
	// Held until the VM was restored from it, or failed to be.
	defer b.releaseTemplate(tpl)
	vs := podVMSpec(spec, st, gcfg, tpl, tapMode)
	if err := st.Take(host.Resource{Kind: host.KindUnit, Role: roleUnit, Name: launchName(spec.ID)}, save); err != nil {
		return nil, fmt.Errorf("kvm: persist: %w", err)
	}
	launch := qemuLaunch(spec, st, res, vs, cg, tap, unitLaunch)
	conf.apply(&launch)
	if plan.overhead {
		if err := b.placeInOverhead(ctx, &launch, spec, plan); err != nil {
			return nil, err
		}
	}
	launched := time.Now()
	lctx, span := tracing.Start(ctx, "kvm.launch_qemu")
	qemu, err := b.launchQEMU(lctx, st, launch, unitLaunch, save)
	tracing.End(span, err)
	if err != nil {
		return nil, err
	}
	pod := b.newPod(spec, st)
	restored, ready, err := b.bringUp(ctx, pod, qemu, tpl, gcfg, vs.console, launch.LogPath)
	if err != nil {
		return nil, err
	}
	logStarted(ctx, log, pod, qemu, plan.vm, tpl != nil, launched, restored, ready)
	return pod, nil
}

// bootTimeout bounds the wait for a pod's guest agent.
func (b *Backend) bootTimeout() time.Duration {
	if b.cfg.BootTimeout > 0 {
		return b.cfg.BootTimeout
	}
	return AgentReadyTimeout
}

// podState is a new pod's state, before anything is taken: its layout,
// qemu's cgroup under the plain launcher (under a UnitLauncher qemu's
// cgroup is the unit's, recorded once qemu runs), the planned VM and the
// pod's user namespace.
func podState(spec *stage1.PodSpec, plan vmPlan, cg *cgroups.Cgroup, unitLaunch bool) *state {
	st := layout(spec, false)
	if !unitLaunch {
		st.Record(host.Resource{Kind: host.KindCgroup, Role: cgroupRole(plan.overhead), Cgroup: cg})
	}
	st.VM = plan.vm
	st.UserNS = spec.UserNS
	st.ShareOnDemand = shareOnDemand(spec)
	return st
}

// guestConfig is the guest's configuration from spec, before the pod
// network (attachTap) adds its addresses: the agent's port, the hostname,
// the shared directory, the user namespace's IDs and the network sysctls.
func guestConfig(spec *stage1.PodSpec) *guest.Config {
	gcfg := &guest.Config{
		Port:     guest.DefaultPort,
		Hostname: spec.Hostname,
		FSTag:    fsTag,
		FSType:   guest.FSVirtio9P,
	}
	if u := spec.UserNS; u != nil {
		gcfg.UserNSHost, gcfg.UserNSSize = u.HostID, u.Size
	}
	gcfg.Sysctls = spec.NetSysctls
	gcfg.ShareOnDemand = shareOnDemand(spec)
	return gcfg
}

// podTemplate is the template the pod's VM (vm) is restored from, built
// first when there is none; nil without a template directory, or when
// the pod's qemu runs confined (confined): qemu (7.2) opens a template's
// memory for writing even to map it copy-on-write, and a confined qemu
// allowed that could change the memory every later VM starts from.
// A template that cannot be had is logged and the VM boots its kernel:
// the error is returned only when ctx ended.
func (b *Backend) podTemplate(ctx context.Context, log *slog.Logger, res *tools, vm vmInfo, confined bool) (*template, error) {
	if b.cfg.TemplateDir == "" {
		return nil, nil
	}
	if confined {
		b.confinedOnce.Do(func() {
			log.InfoContext(ctx, "kvm: VMs boot their kernel instead of being restored from a template: qemu runs confined (SELinux or AppArmor), and qemu opens a template's memory for writing")
		})
		return nil, nil
	}
	tpl, err := b.template(ctx, res, vm)
	if err != nil {
		if ctx.Err() != nil {
			return nil, err
		}
		log.WarnContext(ctx, "kvm: no VM template: booting the guest kernel", "err", err)
	}
	return tpl, nil
}

// logStarted logs a pod whose VM is up: the VM, where qemu runs and how
// long each stage took, from qemu's launch to its restore (or boot),
// the agent's answer, and the setup since.
func logStarted(ctx context.Context, log *slog.Logger, pod *Pod, qemu *host.Process, vm vmInfo, template bool, launched, restored, ready time.Time) {
	ms := func(d time.Duration) string { return d.Round(time.Millisecond).String() }
	log.InfoContext(ctx, "kvm pod started", "qemuPID", qemu.PID, "accelerator", vm.Accelerator,
		"machine", vm.Machine, "memoryMiB", vm.MemoryMiB, "vcpus", vm.VCPUs, "template", template,
		"qemuCgroup", qemu.Cgroup.String(), "overheadCapMiB", vm.CapMiB,
		"network", pod.Details()["network"], "launch+restore", ms(restored.Sub(launched)),
		"agent", ms(ready.Sub(restored)), "setup", ms(time.Since(ready)))
}

// prepareHost makes what a pod needs on the host before qemu runs: its
// cgroup (under the plain launcher), its directory and the shared
// directory.
func prepareHost(st *state, cg *cgroups.Cgroup, unitLaunch bool) error {
	if !unitLaunch {
		if err := cg.Create(); err != nil {
			return fmt.Errorf("kvm: %w", err)
		}
	}
	if err := os.MkdirAll(st.dir(), 0o700); err != nil {
		return fmt.Errorf("kvm: %w", err)
	}
	if err := st.shared().Prepare(); err != nil {
		return fmt.Errorf("kvm: %w", err)
	}
	return nil
}

// podVMSpec is the qemu command line's view of a pod's VM: restored from
// tpl when there is one (st.VM names it), else booting the guest kernel
// with guest as its command line.
func podVMSpec(spec *stage1.PodSpec, st *state, gcfg *guest.Config, tpl *template, tapMode string) vmSpec {
	vs := vmSpec{
		name:    "stagelet-" + spec.ID,
		vm:      st.VM,
		port:    gcfg.Port,
		console: filepath.Join(st.dir(), consoleName),
		ctl:     st.sockName(ctlSocketName),
		qmp:     st.sockName(qmpSocketName),
		share:   st.mounts(),
		tap:     tapMode,
		tapName: tapName,
		mac:     st.VM.MAC,
	}
	if tpl != nil {
		vs.mem, vs.memDir, vs.incoming = memRestored, tpl.dir, true
		st.VM.Template = tpl.dir
	} else {
		vs.cmdline = gcfg.Cmdline()
	}
	return vs
}

// qemuLaunch is how qemu is started for a pod: in its cgroup (or unit, in
// the pod's network namespace), with the tap as file descriptor 3 when
// qemu is to get it so (vs.tap "fd").
func qemuLaunch(spec *stage1.PodSpec, st *state, res *tools, vs vmSpec, cg *cgroups.Cgroup, tap *os.File, unitLaunch bool) host.LaunchSpec {
	launch := host.LaunchSpec{
		Name:    launchName(spec.ID),
		Path:    res.qemu,
		Args:    qemuArgs(res, vs),
		Env:     []string{"PATH=/usr/sbin:/usr/bin:/sbin:/bin"},
		Dir:     st.sockDir(),
		LogPath: filepath.Join(st.dir(), qemuLogName),
		Cgroup:  cg,
		Slice:   cgroups.SliceOf(spec.CgroupParent),
	}
	if vs.tap == "fd" {
		launch.ExtraFiles = []*os.File{tap}
	}
	if unitLaunch {
		launch.NetNS = spec.NetNSPath
	}
	return launch
}

// podPlan is the plan a pod starts with (planVM) on this node's
// accelerator, which the first pod probes.
func (b *Backend) podPlan(ctx context.Context, log *slog.Logger, spec *stage1.PodSpec, res *tools) (vmPlan, error) {
	budget, err := podBudget(spec)
	if err != nil {
		return vmPlan{}, err
	}
	accel := b.accelerator(ctx, res)
	plan, err := b.planVM(spec, accel, budget)
	if err != nil {
		return plan, err
	}
	plan.vm.Kernel = res.kernelVersion
	if plan.overhead {
		plan.vm.Overhead, plan.vm.CapMiB = true, plan.capMiB()
	}
	if sized, err := b.vmConfig(spec.Options, spec.Resources); err == nil && plan.vm.MemoryMiB != sized.MemoryMiB {
		log.InfoContext(ctx, "kvm: VM memory lowered to fit the pod's cgroup", "memoryMiB", plan.vm.MemoryMiB, "wanted", sized.MemoryMiB, "cgroupLimitMiB", budget>>20)
	}
	log.DebugContext(ctx, "kvm: pod's VM planned", "plan", plan.describe(b))
	return plan, nil
}

// placeInOverhead puts a launch in the overhead cgroup: capped at the
// plan's VM memory and qemu's own, its CPU weighed by the pod's CPU
// requests. Under a UnitLauncher it runs in the overhead slice (capped
// first, once); under the plain launcher its cgroup is already there.
func (b *Backend) placeInOverhead(ctx context.Context, launch *host.LaunchSpec, spec *stage1.PodSpec, plan vmPlan) error {
	launch.MemoryMax = int64(plan.capMiB()) << 20
	launch.CPUShares = spec.Resources.CPUShares
	if ul, ok := b.Launcher.(host.UnitLauncher); ok {
		if err := b.limitOverheadSlice(ctx, ul); err != nil {
			return err
		}
		launch.Slice = b.cfg.OverheadCgroup
	}
	return nil
}

// attachTap wires a tap device to the pod's network namespace (recorded
// first) and gives the guest the pod's addresses. It returns the tap and
// how qemu gets it: "fd" (passed to it), "name" (a unit opens it by name
// in the pod's namespace), or "" and a nil tap when the pod has no network
// namespace of its own.
func attachTap(spec *stage1.PodSpec, st *state, save func() error, unitLaunch bool, gcfg *guest.Config) (*os.File, string, error) {
	if spec.NetNSPath == "" {
		return nil, "", nil
	}
	if err := st.Take(host.Resource{Kind: kindTap, Role: roleTap, Name: tapName, NetNS: spec.NetNSPath}, save); err != nil {
		return nil, "", fmt.Errorf("kvm: persist: %w", err)
	}
	nc, tap, err := setupTap(spec.NetNSPath, tapName, unitLaunch)
	if err != nil {
		return nil, "", fmt.Errorf("kvm: pod network: %w", err)
	}
	gcfg.MAC, gcfg.IPs, gcfg.Routes, gcfg.MTU = nc.MAC, nc.IPs, nc.Routes, nc.MTU
	st.VM.MAC = nc.MAC.String()
	if unitLaunch {
		return tap, "name", nil
	}
	return tap, "fd", nil
}

// launchQEMU starts qemu and records it (and under a UnitLauncher its
// unit's cgroup, the pod's) in st, persisted.
func (b *Backend) launchQEMU(ctx context.Context, st *state, launch host.LaunchSpec, unitLaunch bool, save func() error) (*host.Process, error) {
	qemu, err := b.Launcher.Launch(ctx, launch)
	if err != nil {
		return nil, fmt.Errorf("kvm: qemu: %w", err)
	}
	st.Record(host.Resource{Kind: host.KindProcess, Role: roleQemu, Process: qemu})
	if unitLaunch {
		st.Record(host.Resource{Kind: host.KindCgroup, Role: cgroupRole(st.VM.Overhead), Cgroup: qemu.Cgroup})
	}
	if err := save(); err != nil {
		return nil, fmt.Errorf("kvm: persist: %w", err)
	}
	return qemu, nil
}

// bringUp makes a launched VM a running pod: it restores the template's
// state into it (when restored from one), waits for its agent, and sets
// up a restored guest as the pod's (its network, hostname, clock, entropy).
// It returns when the VM was restored and when its agent answered.
func (b *Backend) bringUp(ctx context.Context, pod *Pod, qemu *host.Process, tpl *template, gcfg *guest.Config, console, qemuLog string) (restored, ready time.Time, err error) {
	if tpl != nil {
		rctx, span := tracing.Start(ctx, "kvm.restore")
		err := restore(rctx, pod.st.qmpSocket(), qemu, tpl, b.bootTimeout())
		tracing.End(span, err)
		if err != nil {
			if ctx.Err() == nil {
				// A template this qemu cannot load would fail every pod:
				// the next one builds it afresh.
				b.discardTemplate(tpl, err)
			}
			return restored, ready, fmt.Errorf("kvm: restoring the VM (qemu log %s): %w", qemuLog, err)
		}
	}
	restored = time.Now()
	// Each probe dials: a serial session whose handshake the guest
	// answers once its agent serves the port.
	if err := host.WaitAgentReady(ctx, pod, qemu, b.bootTimeout(), "qemu"); err != nil {
		return restored, ready, fmt.Errorf("kvm: guest agent (console %s, qemu log %s): %w", console, qemuLog, err)
	}
	ready = time.Now()
	if tpl != nil {
		sctx, span := tracing.Start(ctx, "kvm.guest_setup")
		err := client.NewClient(pod.Agent().Dial).Setup(sctx, gcfg.Cmdline(), time.Now(), seed())
		tracing.End(span, err)
		if err != nil {
			return restored, ready, fmt.Errorf("kvm: setting up the restored guest (console %s): %w", console, err)
		}
	}
	return restored, ready, nil
}

// RecoverPod implements stage1.Backend: the pod is back when its qemu
// process (PID and start time) still runs and the guest's agent answers
// Info over a new serial session; otherwise the error wraps
// stage1.ErrPodGone.
func (b *Backend) RecoverPod(ctx context.Context, spec *stage1.PodSpec, stateBytes []byte) (stage1.Pod, error) {
	return host.Recover(ctx, Name, spec, stateBytes, parseState, "qemu", recoverTimeout,
		func(st *state) (stage1.Pod, *host.Process) {
			p := b.newPod(spec, st)
			p.vols.load()
			return p, st.qemu()
		})
}

// DestroyPod implements stage1.Backend: it kills qemu (and an earlier
// version's virtiofsd) when the recorded PIDs still name them, and
// whatever else is in the pod cgroup, removes the cgroup, the tc filters and the tap in the pod's
// network namespace (when it still exists), unmounts everything beneath
// the shared directory and removes it and the VM directory. Idempotent.
// What the state lacks (a crash before the first persist) is derived from
// spec.
func (b *Backend) DestroyPod(ctx context.Context, spec *stage1.PodSpec, stateBytes []byte) error {
	return host.Destroy(ctx, b.Log, Name, spec, stateBytes, parseState, func(st *state) {
		if spec.ID == "" || spec.RunDir == "" {
			return
		}
		_, overhead := st.Get(roleVMMCgroup)
		for _, r := range layout(spec, !b.UnitLaunch() && !overhead).Resources {
			st.Default(r)
		}
		st.Default(host.Resource{Kind: host.KindUnit, Role: roleUnit, Name: launchName(spec.ID)})
		if _, ok := st.Get(roleVirtiofsd); ok {
			st.Default(host.Resource{Kind: host.KindUnit, Role: roleVirtiofsdUnit, Name: fsLaunchName(spec.ID)})
		}
	}, b.release)
}

// launchName and fsLaunchName name a pod's qemu and (pods of earlier
// versions) virtiofsd to the launcher (and their systemd units).
func launchName(id string) string   { return host.LaunchName(id) }
func fsLaunchName(id string) string { return host.LaunchName(id) + "-virtiofsd" }

// release ends the VM's serial session and releases everything st's
// ledger names (host.Ledger.Release), the tap with its tc filters in the
// pod's network namespace.
func (b *Backend) release(ctx context.Context, st *state) error {
	if st.dir() != "" {
		b.dropDialer(st.ctlSocket())
	}
	rel := host.Releaser{Launcher: b.Launcher, Grace: ExitGrace, Custom: map[host.Kind]func(context.Context, host.Resource) error{
		kindTap:      func(_ context.Context, r host.Resource) error { return teardownTap(r.NetNS, r.Name) },
		kindAppArmor: removeProfile,
	}}
	if err := st.Release(ctx, rel); err != nil {
		return fmt.Errorf("kvm: %w", err)
	}
	return nil
}

// dialer returns the serial session of the VM whose control socket is
// path, shared by every Pod value of it in this daemon.
func (b *Backend) dialer(path string) *transport.SerialDialer {
	b.mu.Lock()
	defer b.mu.Unlock()
	d, ok := b.dialers[path]
	if !ok {
		d = transport.NewSerialDialer(path, b.Log)
		b.dialers[path] = d
	}
	return d
}

// dropDialer ends and forgets the serial session of a VM.
func (b *Backend) dropDialer(path string) {
	b.mu.Lock()
	d := b.dialers[path]
	delete(b.dialers, path)
	b.mu.Unlock()
	if d != nil {
		d.Close()
	}
}

// CloseSessions ends every serial session this Backend holds, as the
// daemon's exit would; the VMs keep running and a later RecoverPod (by
// this Backend or a new one) starts new sessions.
func (b *Backend) CloseSessions() {
	b.mu.Lock()
	ds := b.dialers
	b.dialers = map[string]*transport.SerialDialer{}
	b.mu.Unlock()
	for _, d := range ds {
		d.Close()
	}
}

// tools are the resolved executables and assets.
type tools struct {
	qemu           string
	kernel, initrd string
	kernelVersion  string
}

// resolveTools finds qemu and the guest assets:
// FailedPrecondition when one is missing.
func (b *Backend) resolveTools() (*tools, error) {
	t := &tools{}
	var err error
	if t.qemu = b.cfg.QemuPath; t.qemu == "" {
		if t.qemu, err = exec.LookPath("qemu-system-x86_64"); err != nil {
			return nil, errdefs.FailedPrecondition("kvm: qemu-system-x86_64 is not installed (Debian: qemu-system-x86): %w", err)
		}
	}
	for _, k := range []string{"vmlinux", "vmlinuz"} {
		p := filepath.Join(b.cfg.AssetsDir, k)
		if _, err := os.Stat(p); err == nil {
			t.kernel = p
			break
		}
	}
	t.initrd = filepath.Join(b.cfg.AssetsDir, "initrd.cpio")
	if _, err := os.Stat(t.initrd); err != nil || t.kernel == "" {
		return nil, errdefs.FailedPrecondition("kvm: guest assets missing in %s (build them with `make guest`)", b.cfg.AssetsDir)
	}
	t.kernelVersion = manifestKernel(b.cfg.AssetsDir)
	return t, nil
}

// manifestKernel reads the guest kernel's version from the assets'
// manifest; "" when unknown.
func manifestKernel(dir string) string {
	b, err := os.ReadFile(filepath.Join(dir, "manifest"))
	if err != nil {
		return ""
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "kernel "); ok {
			return strings.TrimSpace(v)
		}
	}
	return ""
}

// HasAssets reports whether dir holds a guest kernel and initramfs as
// guest/build.sh makes them.
func HasAssets(dir string) bool {
	if _, err := os.Stat(filepath.Join(dir, "initrd.cpio")); err != nil {
		return false
	}
	for _, k := range []string{"vmlinux", "vmlinuz"} {
		if _, err := os.Stat(filepath.Join(dir, k)); err == nil {
			return true
		}
	}
	return false
}

var _ stage1.NodeInformer = (*Backend)(nil)

var _ stage1.VMReporter = (*Backend)(nil)

// VMStats implements stage1.VMReporter: template use since the daemon
// started and the accelerator, once chosen. It probes nothing.
func (b *Backend) VMStats() stage1.VMStats {
	s := stage1.VMStats{
		TemplateHits:          b.hits.Load(),
		TemplateMisses:        b.misses.Load(),
		TemplateBuilds:        b.built.Load(),
		TemplateBuildFailures: b.buildFailures.Load(),
	}
	if a := b.chosen.Load(); a != nil {
		s.Accelerator = *a
	}
	return s
}

// NodeInfo implements stage1.NodeInformer: the accelerator pods get (the
// first call runs the probe), the guest kernel, where VM templates are
// kept (or that there are none), and where qemu runs: the placement, the
// overhead cgroup (or slice) and its cap ("none" or a size).
func (b *Backend) NodeInfo(ctx context.Context) map[string]string {
	info := map[string]string{"assetsDir": b.cfg.AssetsDir, "templates": "off (VMs boot their kernel)",
		"placement": string(b.cfg.Placement), "overheadCgroup": b.cfg.OverheadCgroup, "overheadMemoryMax": "none"}
	if m := b.cfg.OverheadMemoryMax; m > 0 {
		info["overheadMemoryMax"] = strconv.FormatInt(m>>20, 10) + " MiB"
	}
	if !b.UnitLaunch() && !filepath.IsAbs(b.cfg.OverheadCgroup) {
		info["overheadCgroup"] += " (beneath the daemon's cgroup)"
	}
	if b.cfg.TemplateDir != "" {
		info["templates"] = b.cfg.TemplateDir
	}
	accel, err := b.Accelerator(ctx)
	if err != nil {
		info["error"] = err.Error()
		return info
	}
	info["accelerator"] = accel
	info["acceleratorReason"] = b.accelReason
	if t, err := b.resolveTools(); err == nil {
		info["qemu"] = t.qemu
	}
	if v := manifestKernel(b.cfg.AssetsDir); v != "" {
		info["guestKernel"] = v
	}
	return info
}
