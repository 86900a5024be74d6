package host

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	sddbus "github.com/coreos/go-systemd/v22/dbus"
	"github.com/godbus/dbus/v5"
	"go.opentelemetry.io/otel/attribute"

	"github.com/stagelet/stagelet/cgroups"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/tracing"
)

// UnitLauncher is a Launcher that runs each process as a unit of a service
// manager (systemd), which supervises it and chooses its cgroup:
// LaunchSpec.Cgroup is then only read as "give the process a cgroup of its
// own" (it need not exist, and is not created), and the cgroup the process
// got is returned in Process.Cgroup. Backends type-assert for it.
type UnitLauncher interface {
	Launcher
	// Release stops the unit launched under name (LaunchSpec.Name),
	// SIGKILLing every process left in it, and makes the manager forget
	// it. Idempotent: a unit that is gone is not an error. Errors are the
	// manager's (Unavailable when it cannot be reached).
	Release(ctx context.Context, name string) error
	// Units lists the names (LaunchSpec.Name) of the units the manager
	// has loaded whose name begins with prefix.
	Units(ctx context.Context, prefix string) ([]string, error)
	// LimitSlice caps the memory of everything in slice together (bytes;
	// 0 lifts the cap): a slice the units of LaunchSpec.Slice go in.
	LimitSlice(ctx context.Context, slice string, memoryMax int64) error
}

// ReleaseLaunched releases what l keeps of the process launched under name
// (see UnitLauncher.Release); a nothing for a launcher that keeps nothing.
func ReleaseLaunched(ctx context.Context, l Launcher, name string) error {
	if u, ok := l.(UnitLauncher); ok {
		return u.Release(ctx, name)
	}
	return nil
}

// SystemdLauncher starts each process as a transient systemd service,
// "<LaunchSpec.Name>.service", through systemd's D-Bus API, so that systemd
// supervises it and it outlives the daemon. The unit: ExecStart is
// Path+Args (Type=exec: the start fails if the binary cannot be executed),
// WorkingDirectory Dir, Environment Env (nil: the daemon's), stdin on
// /dev/null, stdout and stderr appended to LogPath (systemd 240 or later),
// KillMode=mixed (SIGTERM to the main process on stop, SIGKILL to the rest
// after the stop timeout), Delegate=yes (the pod makes its own
// sub-cgroups), in Slice, and CollectMode=inactive-or-failed (systemd
// forgets the unit once it ends, however it ends).
//
// The process runs in the unit's cgroup. When LaunchSpec.Cgroup is set,
// Process.Cgroup names the unit's cgroup in the hierarchies this project
// manages where systemd placed the process; on a v1 host systemd does not
// manage the freezer hierarchy, so that one is left out. ExtraFiles cannot
// be passed to a service and are refused.
//
// Paths in a LaunchSpec are the manager's: the host's for a host systemd.
// A SystemdLauncher is safe for concurrent use; it keeps one connection,
// opened on first use and again after it broke.
type SystemdLauncher struct {
	Log *slog.Logger // nil: slog.Default()
	// Slice holds the units; empty means cgroups.DefaultSlice. systemd
	// creates it on first use.
	Slice string
	// Dial opens one authenticated connection to systemd (Hello done,
	// where a bus needs it); each call must return a new connection. nil
	// dials the system bus. See DialBus.
	Dial func() (*dbus.Conn, error)
	// HostPID maps a PID as the manager reports it to the daemon's PID
	// namespace; nil means they share it (systemd is the host's PID 1). A
	// manager in a container (tests) needs one.
	HostPID func(pid int) (int, error)
	// Owner names the daemon whose pods these units are (its state
	// directory) in their descriptions, so that Units lists its own only
	// where several daemons share one systemd. Set before the first
	// Launch.
	Owner string

	mu   sync.Mutex
	conn *sddbus.Conn
}

var _ UnitLauncher = (*SystemdLauncher)(nil)

// DialBus returns a Dial function for the bus at address (a D-Bus address
// such as "unix:path=/run/dbus/system_bus_socket"): it connects,
// authenticates as the caller's uid (EXTERNAL) and says Hello.
func DialBus(address string) func() (*dbus.Conn, error) {
	return func() (*dbus.Conn, error) {
		c, err := dbus.Dial(address)
		if err != nil {
			return nil, err
		}
		if err := c.Auth([]dbus.Auth{dbus.AuthExternal(strconv.Itoa(os.Getuid()))}); err != nil {
			c.Close()
			return nil, err
		}
		if err := c.Hello(); err != nil {
			c.Close()
			return nil, err
		}
		return c, nil
	}
}

func (l *SystemdLauncher) log() *slog.Logger {
	if l.Log == nil {
		return slog.Default()
	}
	return l.Log
}

func (l *SystemdLauncher) slice() string {
	if l.Slice == "" {
		return cgroups.DefaultSlice
	}
	return l.Slice
}

// connect returns the open connection, opening one when there is none or
// it broke.
func (l *SystemdLauncher) connect(ctx context.Context) (*sddbus.Conn, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.conn != nil && l.conn.Connected() {
		return l.conn, nil
	}
	if l.conn != nil {
		l.conn.Close()
		l.conn = nil
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	var (
		c   *sddbus.Conn
		err error
	)
	if l.Dial != nil {
		c, err = sddbus.NewConnection(l.Dial)
	} else {
		// Not tied to ctx: the connection outlives this call.
		c, err = sddbus.NewSystemConnectionContext(context.Background())
	}
	if err != nil {
		return nil, errdefs.New(errdefs.ErrUnavailable, "systemd: connect: %w", err)
	}
	l.conn = c
	return c, nil
}

// Close closes the launcher's connection; the next call opens another.
func (l *SystemdLauncher) Close() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.conn != nil {
		l.conn.Close()
		l.conn = nil
	}
}

// Ping connects and reads systemd's version: whether the manager answers.
func (l *SystemdLauncher) Ping(ctx context.Context) error {
	c, err := l.connect(ctx)
	if err != nil {
		return err
	}
	if _, err := c.GetManagerProperty("Version"); err != nil {
		return errdefs.New(errdefs.ErrUnavailable, "systemd: %w", err)
	}
	return nil
}

// UnitName is the unit a launch under name runs as.
func UnitName(name string) string { return name + ".service" }

// properties are the transient unit's settings for spec.
func (l *SystemdLauncher) properties(spec LaunchSpec) []sddbus.Property {
	dir := spec.Dir
	if dir == "" {
		dir = "/"
	}
	env := spec.Env
	if env == nil {
		env = os.Environ()
	}
	slice := spec.Slice
	if slice == "" {
		slice = l.slice()
	}
	props := []sddbus.Property{
		sddbus.PropDescription(l.description(spec.Name)),
		sddbus.PropType("exec"),
		sddbus.PropExecStart(append([]string{spec.Path}, spec.Args...), false),
		sddbus.PropSlice(slice),
		{Name: "WorkingDirectory", Value: dbus.MakeVariant(dir)},
		{Name: "Environment", Value: dbus.MakeVariant(env)},
		{Name: "StandardInput", Value: dbus.MakeVariant("null")},
		{Name: "StandardOutputFileToAppend", Value: dbus.MakeVariant(spec.LogPath)},
		{Name: "StandardErrorFileToAppend", Value: dbus.MakeVariant(spec.LogPath)},
		{Name: "KillMode", Value: dbus.MakeVariant("mixed")},
		{Name: "Delegate", Value: dbus.MakeVariant(true)},
		{Name: "CollectMode", Value: dbus.MakeVariant("inactive-or-failed")},
	}
	if spec.NetNS != "" {
		props = append(props, sddbus.Property{Name: "NetworkNamespacePath", Value: dbus.MakeVariant(spec.NetNS)})
	}
	if spec.MemoryMax > 0 {
		props = append(props, sddbus.Property{Name: "MemoryMax", Value: dbus.MakeVariant(uint64(spec.MemoryMax))})
	}
	if spec.CPUShares > 0 {
		props = append(props, sddbus.Property{Name: "CPUWeight", Value: dbus.MakeVariant(uint64(cgroups.SharesToWeight(spec.CPUShares)))})
	}
	// Both "(bs)": whether a failure to apply it is ignored (never), and
	// the value.
	type label struct {
		IgnoreFailure bool
		Value         string
	}
	if spec.SELinuxLabel != "" {
		props = append(props, sddbus.Property{Name: "SELinuxContext", Value: dbus.MakeVariant(label{Value: spec.SELinuxLabel})})
	}
	if spec.AppArmorProfile != "" {
		props = append(props, sddbus.Property{Name: "AppArmorProfile", Value: dbus.MakeVariant(label{Value: spec.AppArmorProfile})})
	}
	return props
}

// LimitSlice caps the memory of every unit in slice together (bytes; 0
// lifts a cap set before), as its MemoryMax= for as long as systemd runs
// (a runtime property: no file is written). systemd loads the slice when
// it is not yet, and makes its cgroup when a unit first runs in it.
func (l *SystemdLauncher) LimitSlice(ctx context.Context, slice string, memoryMax int64) error {
	if !cgroups.ValidSlice(slice) {
		return errdefs.InvalidArgument("limit slice %q: not a systemd slice name", slice)
	}
	c, err := l.connect(ctx)
	if err != nil {
		return fmt.Errorf("limit slice %s: %w", slice, err)
	}
	v := uint64(math.MaxUint64) // infinity
	if memoryMax > 0 {
		v = uint64(memoryMax)
	}
	if err := c.SetUnitPropertiesContext(ctx, slice, true, sddbus.Property{Name: "MemoryMax", Value: dbus.MakeVariant(v)}); err != nil {
		return fmt.Errorf("limit slice %s: %w", slice, classify(err))
	}
	return nil
}

// Launch implements Launcher: it starts the transient unit and waits for
// its start job. Errors: InvalidArgument (a spec it cannot run: no path,
// no log, a name that is not a unit name, ExtraFiles), AlreadyExists (the
// unit exists), Unavailable (systemd cannot be reached), and the start
// job's failure (the unit is then released). When ctx ends while the job
// runs, the unit is released.
func (l *SystemdLauncher) Launch(ctx context.Context, spec LaunchSpec) (_ *Process, err error) {
	ctx, span := tracing.Start(ctx, "host.launch", attribute.String("stagelet.launch", spec.Name), attribute.String("stagelet.launcher", "systemd"))
	defer func() { tracing.End(span, err) }()
	if spec.Path == "" || spec.LogPath == "" {
		return nil, errdefs.InvalidArgument("launch %s: path and log path are required", spec.Name)
	}
	if !cgroups.ValidUnitName(spec.Name) {
		return nil, errdefs.InvalidArgument("launch %q: not a valid systemd unit name", spec.Name)
	}
	if len(spec.ExtraFiles) > 0 {
		return nil, errdefs.InvalidArgument("launch %s: a systemd unit cannot be given extra files", spec.Name)
	}
	if spec.Slice != "" && !cgroups.ValidSlice(spec.Slice) {
		return nil, errdefs.InvalidArgument("launch %s: %q is not a systemd slice name", spec.Name, spec.Slice)
	}
	if err := os.MkdirAll(filepath.Dir(spec.LogPath), 0o755); err != nil {
		return nil, fmt.Errorf("launch %s: %w", spec.Name, err)
	}
	c, err := l.connect(ctx)
	if err != nil {
		return nil, fmt.Errorf("launch %s: %w", spec.Name, err)
	}
	unit := UnitName(spec.Name)
	log := l.log().With("unit", unit)

	// Buffered: go-systemd's dispatcher must never block on it.
	done := make(chan string, 1)
	if _, err := c.StartTransientUnitContext(ctx, unit, "fail", l.properties(spec), done); err != nil {
		if busErrorName(err) == "org.freedesktop.systemd1.UnitExists" {
			return nil, errdefs.AlreadyExists("launch %s: unit %s already exists", spec.Name, unit)
		}
		return nil, fmt.Errorf("launch %s: start unit %s: %w", spec.Name, unit, classify(err))
	}
	select {
	case res := <-done:
		if res != "done" {
			why := l.unitFailure(unit)
			l.releaseAfterFailure(unit)
			return nil, fmt.Errorf("launch %s: start job of %s: %s%s", spec.Name, unit, res, why)
		}
	case <-ctx.Done():
		l.releaseAfterFailure(unit)
		return nil, fmt.Errorf("launch %s: %w", spec.Name, ctx.Err())
	}

	p, err := l.process(ctx, c, unit, spec.Cgroup != nil)
	if err != nil {
		l.releaseAfterFailure(unit)
		return nil, fmt.Errorf("launch %s: %w (log %s)", spec.Name, err, spec.LogPath)
	}
	log.DebugContext(ctx, "pod process started as a unit", "name", spec.Name, "pid", p.PID, "path", spec.Path, "cgroup", cgroupString(p.Cgroup))
	return p, nil
}

// process reads the started unit's main process and, when wantCgroup, the
// cgroup systemd gave it.
func (l *SystemdLauncher) process(ctx context.Context, c *sddbus.Conn, unit string, wantCgroup bool) (*Process, error) {
	prop, err := c.GetServicePropertyContext(ctx, unit, "MainPID")
	if err != nil {
		return nil, fmt.Errorf("unit %s: MainPID: %w", unit, classify(err))
	}
	mainPID, ok := prop.Value.Value().(uint32)
	if !ok {
		return nil, fmt.Errorf("unit %s: MainPID is %s", unit, prop.Value.Signature())
	}
	if mainPID == 0 {
		return nil, fmt.Errorf("unit %s: its process exited at once: %w", unit, ErrProcessGone)
	}
	pid := int(mainPID)
	if l.HostPID != nil {
		if pid, err = l.HostPID(pid); err != nil {
			return nil, fmt.Errorf("unit %s: main pid %d: %w", unit, mainPID, err)
		}
	}
	st, err := ProcessStartTime(pid)
	if err != nil {
		return nil, fmt.Errorf("unit %s: %w", unit, err)
	}
	p := &Process{PID: pid, StartTime: st, Unit: unit}
	if wantCgroup {
		cg, err := unitCgroup(pid, unit)
		if err != nil {
			return nil, fmt.Errorf("unit %s: %w", unit, err)
		}
		if cg == nil {
			l.log().WarnContext(ctx, "systemd placed the unit in none of the managed cgroup hierarchies; the pod has no cgroup of its own", "unit", unit, "pid", pid)
		}
		p.Cgroup = cg
	}
	return p, nil
}

// unitCgroup returns the cgroup of pid in the managed hierarchies where it
// is the unit's own cgroup (its path ends in "/<unit>"); nil when it is in
// none. Hierarchies systemd does not manage (the v1 freezer) hold the
// process at their root, which must never be taken for the pod's.
func unitCgroup(pid int, unit string) (*cgroups.Cgroup, error) {
	cg, err := cgroups.OfProcess(pid)
	if err != nil {
		return nil, err
	}
	out := &cgroups.Cgroup{Paths: map[string]string{}}
	for k, d := range cg.Paths {
		if strings.HasSuffix(d, "/"+unit) {
			out.Paths[k] = d
		}
	}
	if len(out.Paths) == 0 {
		return nil, nil
	}
	return out, nil
}

// unitFailure describes why a unit failed, from its properties; empty when
// they cannot be read (a unit already collected).
func (l *SystemdLauncher) unitFailure(unit string) string {
	c, err := l.connect(context.Background())
	if err != nil {
		return ""
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if u, err := c.GetUnitPropertiesContext(ctx, unit); err != nil || u["LoadState"] != "loaded" {
		// Collected at once (CollectMode): only systemd's journal knows.
		return " (the unit is gone; see systemd's journal)"
	}
	props, err := c.GetUnitTypePropertiesContext(ctx, unit, "Service")
	if err != nil {
		return ""
	}
	return fmt.Sprintf(" (result %v, exit status %v)", props["Result"], props["ExecMainStatus"])
}

// releaseAfterFailure releases a unit whose launch failed, bounded, and
// logs what went wrong.
func (l *SystemdLauncher) releaseAfterFailure(unit string) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := l.Release(ctx, strings.TrimSuffix(unit, ".service")); err != nil {
		l.log().WarnContext(ctx, "releasing the unit of a failed launch", "unit", unit, "err", err)
	}
}

// Release implements UnitLauncher: SIGKILL to every process of the unit,
// a stop job waited for, and a reset of its failed state. Each step treats
// a unit systemd no longer knows as done.
func (l *SystemdLauncher) Release(ctx context.Context, name string) error {
	if !cgroups.ValidUnitName(name) {
		return errdefs.InvalidArgument("release %q: not a valid systemd unit name", name)
	}
	c, err := l.connect(ctx)
	if err != nil {
		return fmt.Errorf("release %s: %w", name, err)
	}
	unit := UnitName(name)
	if err := c.KillUnitWithTarget(ctx, unit, sddbus.All, int32(syscall.SIGKILL)); err != nil && !gone(err) {
		return fmt.Errorf("release %s: kill: %w", unit, classify(err))
	}
	done := make(chan string, 1)
	if _, err := c.StopUnitContext(ctx, unit, "replace", done); err != nil {
		if !gone(err) {
			return fmt.Errorf("release %s: stop: %w", unit, classify(err))
		}
	} else {
		select {
		case res := <-done:
			if res != "done" && res != "skipped" {
				return fmt.Errorf("release %s: stop job: %s", unit, res)
			}
		case <-ctx.Done():
			return fmt.Errorf("release %s: %w", unit, ctx.Err())
		}
	}
	if err := c.ResetFailedUnitContext(ctx, unit); err != nil && !gone(err) {
		return fmt.Errorf("release %s: reset: %w", unit, classify(err))
	}
	return nil
}

// description is the Description of the unit launched under name.
func (l *SystemdLauncher) description(name string) string {
	d := "stagelet pod process " + name
	if l.Owner != "" {
		d += " of " + l.Owner
	}
	return d
}

// Units implements UnitLauncher: the units this launcher's owner
// launched (their description says so).
func (l *SystemdLauncher) Units(ctx context.Context, prefix string) ([]string, error) {
	c, err := l.connect(ctx)
	if err != nil {
		return nil, fmt.Errorf("list units: %w", err)
	}
	us, err := c.ListUnitsByPatternsContext(ctx, nil, []string{prefix + "*.service"})
	if err != nil {
		return nil, fmt.Errorf("list units: %w", classify(err))
	}
	var out []string
	for _, u := range us {
		if name, ok := strings.CutSuffix(u.Name, ".service"); ok && strings.HasPrefix(name, prefix) && u.Description == l.description(name) {
			out = append(out, name)
		}
	}
	return out, nil
}

// busErrorName is the D-Bus error name of err, or "".
func busErrorName(err error) string {
	var v dbus.Error
	if errors.As(err, &v) {
		return v.Name
	}
	var p *dbus.Error
	if errors.As(err, &p) && p != nil {
		return p.Name
	}
	return ""
}

// gone reports whether err says the unit (or any process in it) is not
// there: the outcome Release wants.
func gone(err error) bool {
	switch busErrorName(err) {
	case "org.freedesktop.systemd1.NoSuchUnit",
		"org.freedesktop.systemd1.LoadFailed",
		"org.freedesktop.DBus.Error.NoSuchProcess",
		"org.freedesktop.systemd1.NoSuchProcess":
		return true
	}
	// systemd's "Unit x.service not loaded." (every version since 209)
	// carries NoSuchUnit: the name decides, never the text.
	return false
}

// classify gives a bus error its class: a connection that broke is
// Unavailable, so the caller may retry.
func classify(err error) error {
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	if busErrorName(err) == "" {
		return errdefs.New(errdefs.ErrUnavailable, "%w", err)
	}
	return err
}

// systemdAnswers reports whether systemd answers on the system bus within
// a short bound.
func systemdAnswers(l *SystemdLauncher) error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	errc := make(chan error, 1)
	go func() { errc <- l.Ping(ctx) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
		return fmt.Errorf("systemd: no answer on the system bus: %w", errdefs.ErrUnavailable)
	}
}
