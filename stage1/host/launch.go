package host

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"

	"go.opentelemetry.io/otel/attribute"

	"github.com/stagelet/stagelet/cgroups"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/lsm"
	"github.com/stagelet/stagelet/internal/osthread"
	"github.com/stagelet/stagelet/tracing"
)

// LaunchSpec describes a pod's host-side process: the fly agent, an nspawn
// or a qemu process. It must outlive the daemon that launches it.
type LaunchSpec struct {
	// Name identifies the process in logs and names its systemd unit
	// ("<Name>.service") under a UnitLauncher, e.g. "stagelet-pod-<id>".
	Name string
	// Path is the executable; Args are its arguments after argv[0].
	Path string
	Args []string
	// Env is the environment; nil means the daemon's.
	Env []string
	// Dir is the working directory; empty means "/".
	Dir string
	// LogPath receives stdout and stderr (appended, created if missing).
	LogPath string
	// Cgroup, already created, is where the process runs from its first
	// instruction; nil leaves it in the daemon's cgroup. A UnitLauncher
	// runs the process in its unit's cgroup instead (Cgroup need not
	// exist); either way Process.Cgroup names where it runs.
	Cgroup *cgroups.Cgroup
	// ExtraFiles are passed as fd 3, 4, ... (not by a UnitLauncher).
	ExtraFiles []*os.File
	// Slice is the systemd slice a UnitLauncher puts the unit in (the
	// kubelet's pod slice, "kubepods-burstable-pod<uid>.slice"); empty
	// means the launcher's own. The plain launcher ignores it: its
	// placement is Cgroup.
	Slice string
	// NetNS is a network namespace (a path) the process runs in; empty
	// means the launcher's. Only a UnitLauncher offers it (systemd's
	// NetworkNamespacePath); the plain launcher refuses it.
	NetNS string
	// MemoryMax caps the memory of the process's cgroup (bytes; 0: no
	// cap of its own) and CPUShares weighs its CPU against its siblings'
	// (cgroup v1 shares; 0: the default). The plain launcher sets them on
	// Cgroup before the process starts, a UnitLauncher gives its unit
	// MemoryMax= and CPUWeight=.
	MemoryMax int64
	CPUShares int64
	// SELinuxLabel is the SELinux context the process runs in, and
	// AppArmorProfile the AppArmor profile it runs under (loaded
	// already); empty leaves the launcher's. Either is set at its exec,
	// by the plain launcher on the thread that starts it, by a
	// UnitLauncher as its unit's SELinuxContext= and AppArmorProfile=.
	SELinuxLabel    string
	AppArmorProfile string
}

// Launcher starts detached pod processes. Implementations: the plain
// launcher (own session, own cgroup: the cgroupfs driver) and the systemd
// launcher (a transient unit: the systemd driver; see UnitLauncher).
type Launcher interface {
	// Launch starts the process and returns once it runs. The process is
	// not tied to ctx, nor to the daemon's life.
	Launch(ctx context.Context, spec LaunchSpec) (*Process, error)
}

// PlainLauncher starts processes as children of the daemon in their own
// session, with stdin on /dev/null and stdout/stderr on a log file, inside
// the given cgroup from the start (see cgroups.Cgroup.Start). The daemon's
// death does not signal them (no parent-death signal, no shared session or
// process group). While the daemon runs it reaps them.
type PlainLauncher struct {
	Log *slog.Logger // nil: slog.Default()
}

var _ Launcher = (*PlainLauncher)(nil)

// NewLauncher returns the launcher for a node's cgroup driver: with
// systemd, a SystemdLauncher whose units go into slice
// (cgroups.DefaultSlice when empty), which needs systemd as PID 1
// answering on the system bus (an error says what is missing); otherwise
// the plain launcher.
func NewLauncher(log *slog.Logger, systemd bool, slice string) (Launcher, error) {
	if log == nil {
		log = slog.Default()
	}
	if !systemd {
		return &PlainLauncher{Log: log}, nil
	}
	if !SystemdBooted() {
		return nil, errdefs.FailedPrecondition("the systemd cgroup driver needs systemd as PID 1 (/run/systemd/system does not exist); use cgroup_driver: cgroupfs")
	}
	sl := &SystemdLauncher{Log: log, Slice: slice}
	if err := systemdAnswers(sl); err != nil {
		return nil, fmt.Errorf("the systemd cgroup driver needs systemd on the system bus: %w", err)
	}
	log.Info("pods are started as systemd transient units", "slice", sl.slice())
	return sl, nil
}

// SystemdBooted reports whether systemd is the host's init
// (sd_booted(3): /run/systemd/system exists).
func SystemdBooted() bool {
	fi, err := os.Lstat("/run/systemd/system")
	return err == nil && fi.IsDir()
}

// Launch implements Launcher.
func (l *PlainLauncher) Launch(ctx context.Context, spec LaunchSpec) (_ *Process, err error) {
	ctx, span := tracing.Start(ctx, "host.launch", attribute.String("stagelet.launch", spec.Name), attribute.String("stagelet.launcher", "plain"))
	defer func() { tracing.End(span, err) }()
	log := l.Log
	if log == nil {
		log = slog.Default()
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if spec.Path == "" || spec.LogPath == "" {
		return nil, fmt.Errorf("launch %s: path and log path are required", spec.Name)
	}
	if spec.NetNS != "" {
		return nil, errdefs.InvalidArgument("launch %s: the plain launcher cannot start a process in a network namespace", spec.Name)
	}
	if err := os.MkdirAll(filepath.Dir(spec.LogPath), 0o755); err != nil {
		return nil, fmt.Errorf("launch %s: %w", spec.Name, err)
	}
	logf, err := os.OpenFile(spec.LogPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o640)
	if err != nil {
		return nil, fmt.Errorf("launch %s: log: %w", spec.Name, err)
	}
	defer logf.Close()
	devnull, err := os.Open(os.DevNull)
	if err != nil {
		return nil, fmt.Errorf("launch %s: %w", spec.Name, err)
	}
	defer devnull.Close()

	cmd := exec.Command(spec.Path, spec.Args...)
	cmd.Env = spec.Env
	cmd.Dir = spec.Dir
	if cmd.Dir == "" {
		cmd.Dir = "/"
	}
	cmd.Stdin = devnull
	cmd.Stdout = logf
	cmd.Stderr = logf
	cmd.ExtraFiles = spec.ExtraFiles
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if spec.MemoryMax != 0 || spec.CPUShares != 0 {
		if spec.Cgroup == nil {
			return nil, errdefs.InvalidArgument("launch %s: limits without a cgroup to set them on", spec.Name)
		}
		if err := spec.Cgroup.Set(cgroups.Resources{MemoryLimit: spec.MemoryMax, CPUShares: spec.CPUShares}); err != nil {
			return nil, fmt.Errorf("launch %s: %w", spec.Name, err)
		}
	}
	if err := startConfined(cmd, spec); err != nil {
		return nil, fmt.Errorf("launch %s: %w", spec.Name, err)
	}
	pid := cmd.Process.Pid
	// Not yet reaped, so /proc/pid exists even if it already exited.
	st, err := ProcessStartTime(pid)
	if err != nil {
		cmd.Process.Kill()
		cmd.Wait()
		return nil, fmt.Errorf("launch %s: %w", spec.Name, err)
	}
	p := &Process{PID: pid, StartTime: st, Cgroup: spec.Cgroup, exited: make(chan struct{})}
	go func() {
		err := cmd.Wait()
		log.DebugContext(ctx, "pod process exited", "name", spec.Name, "pid", pid, "status", exitString(err))
		close(p.exited)
	}()
	log.DebugContext(ctx, "pod process started", "name", spec.Name, "pid", pid, "path", spec.Path, "cgroup", cgroupString(spec.Cgroup))
	return p, nil
}

// startConfined starts cmd in spec.Cgroup (when set), with spec's
// SELinux label and AppArmor profile from its exec on: both are
// attributes of the thread that forks it, which the child inherits, so
// they are set on a thread that ends once cmd has started.
func startConfined(cmd *exec.Cmd, spec LaunchSpec) error {
	start := func() error {
		if spec.Cgroup != nil {
			return spec.Cgroup.Start(cmd)
		}
		return cmd.Start()
	}
	if spec.SELinuxLabel == "" && spec.AppArmorProfile == "" {
		return start()
	}
	return osthread.Run(func() error {
		if err := lsm.SetSELinuxExec(spec.SELinuxLabel); err != nil {
			return err
		}
		if err := lsm.SetAppArmorExec(spec.AppArmorProfile); err != nil {
			return err
		}
		return start()
	})
}

func exitString(err error) string {
	if err == nil {
		return "exit status 0"
	}
	return err.Error()
}

func cgroupString(c *cgroups.Cgroup) string {
	if c == nil {
		return ""
	}
	return c.String()
}

// LaunchName is the launcher's name of a pod's main host process (its
// transient unit's under a UnitLauncher): "stagelet-pod-<id>", the name
// of its cgroup under the plain launcher as well.
func LaunchName(podID string) string { return cgroups.PodCgroupName(podID) }

// BackendDefaults fills in a backend constructor's nil arguments: the
// default logger, and the plain launcher (the cgroupfs driver).
func BackendDefaults(log *slog.Logger, l Launcher) (*slog.Logger, Launcher) {
	if log == nil {
		log = slog.Default()
	}
	if l == nil {
		l = &PlainLauncher{Log: log}
	}
	return log, l
}

// Base is what every host-side backend holds: its logger and the
// launcher of its pods' host processes. Backends embed it.
type Base struct {
	Log      *slog.Logger
	Launcher Launcher
}

// NewBase is a Base of log and l, their nil defaults filled in
// (BackendDefaults).
func NewBase(log *slog.Logger, l Launcher) Base {
	log, l = BackendDefaults(log, l)
	return Base{Log: log, Launcher: l}
}

// UnitLaunch tells whether the pods' processes run as systemd units
// (a UnitLauncher): their cgroups are then the units'.
func (b Base) UnitLaunch() bool {
	_, ok := b.Launcher.(UnitLauncher)
	return ok
}
