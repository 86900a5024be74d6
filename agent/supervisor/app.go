package supervisor

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/cgroups"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/lsm"
	"github.com/stagelet/stagelet/internal/rlimit"
	"github.com/stagelet/stagelet/seccomp"
	"github.com/stagelet/stagelet/tracing"
)

// drainTimeout bounds how long output is still read after a process
// exited and its cgroup was emptied (a process outside the cgroup may hold
// the pipe).
const drainTimeout = 2 * time.Second

// app is one container. The fields below mu are guarded by it.
type app struct {
	id   string
	spec *api.AppSpec // nil for a record loaded from an earlier agent
	cg   cgroup       // nil without cgroups
	// hlog keeps the app's log lines for the daemon (spec.HostLog); nil
	// otherwise.
	hlog *logBuffer

	mu      sync.Mutex
	st      api.AppStatus
	removed bool
	proc    process
	log     *criLog
	io      *appIO // the app's stdio for attach sessions; set by launch
	oomBase uint64
	// started is closed when the start attempt ended, exited when the app
	// exited and its record is final; both nil before OpStart.
	started chan struct{}
	exited  chan struct{}
	// restore is the restore under way, between OpRestore and OpAdopt.
	restore *pendingRestore
	// stopOOMWatch ends the agent's OOM group of an app on cgroup v1
	// (applyLimits); nil without one.
	stopOOMWatch func()
	// groupOOM is set when that OOM group fired: the agent's kill may
	// take the app's processes before the kernel's OOM killer counts its
	// own kill, and the app was still killed for memory.
	groupOOM atomic.Bool
}

func (ap *app) status() *api.AppStatus {
	ap.mu.Lock()
	defer ap.mu.Unlock()
	st := ap.st
	return &st
}

// validateSpec checks what can be checked before anything is taken.
func validateSpec(s *api.AppSpec) error {
	if err := validID(s.ID); err != nil {
		return err
	}
	if err := validateDisk(s); err != nil {
		return err
	}
	if s.Rootfs == "" {
		return errdefs.InvalidArgument("app %s: no rootfs", s.ID)
	}
	// With a disk, the disk is the app's image and Rootfs is replaced.
	if s.RootfsDisk == nil {
		if st, err := os.Stat(s.Rootfs); err != nil {
			return errdefs.InvalidArgument("app %s: rootfs: %w", s.ID, err)
		} else if !st.IsDir() {
			return errdefs.InvalidArgument("app %s: rootfs %s is not a directory", s.ID, s.Rootfs)
		}
	}
	if len(s.Args) == 0 || s.Args[0] == "" {
		return errdefs.InvalidArgument("app %s: no command", s.ID)
	}
	if s.Cwd != "" && !filepath.IsAbs(s.Cwd) {
		return errdefs.InvalidArgument("app %s: cwd %q is not absolute", s.ID, s.Cwd)
	}
	if s.LogPath != "" && !filepath.IsAbs(s.LogPath) {
		return errdefs.InvalidArgument("app %s: log path %q is not absolute", s.ID, s.LogPath)
	}
	if s.HostLog && s.LogPath == "" {
		return errdefs.InvalidArgument("app %s: a log for the host without a log path", s.ID)
	}
	if _, err := parseCaps(s.Capabilities); err != nil {
		return errdefs.InvalidArgument("app %s: %w", s.ID, err)
	}
	if err := rlimit.Check(s.Rlimits); err != nil {
		return errdefs.InvalidArgument("app %s: %w", s.ID, err)
	}
	if s.Seccomp != nil {
		if _, err := seccomp.Compile(s.Seccomp); err != nil {
			return errdefs.InvalidArgument("app %s: seccomp profile %s: %w", s.ID, s.SeccompProfile, err)
		}
		if !seccomp.Supported() {
			return errdefs.FailedPrecondition("app %s: seccomp profile %s requested, but the kernel has no seccomp filters", s.ID, s.SeccompProfile)
		}
	}
	if s.AppArmorProfile != "" && !lsm.AppArmorKernelEnabled() {
		return errdefs.FailedPrecondition("app %s: AppArmor profile %s requested, but AppArmor is not enabled where the pod runs", s.ID, s.AppArmorProfile)
	}
	switch s.PIDNamespace {
	case "", api.PIDNamespacePod, api.PIDNamespaceContainer:
	case api.PIDNamespaceTarget:
		if s.PIDTarget == "" || s.PIDTarget == s.ID {
			return errdefs.InvalidArgument("app %s: PID namespace target %q", s.ID, s.PIDTarget)
		}
	default:
		return errdefs.InvalidArgument("app %s: unknown PID namespace mode %q", s.ID, s.PIDNamespace)
	}
	for _, p := range append(slices.Clone(s.MaskedPaths), s.ReadonlyPaths...) {
		if !filepath.IsAbs(p) {
			return errdefs.InvalidArgument("app %s: masked or read-only path %q is not absolute", s.ID, p)
		}
	}
	for _, m := range s.Mounts {
		if m.RecursiveReadonly && (!m.Readonly || (m.Propagation != "" && m.Propagation != "private")) {
			return errdefs.InvalidArgument("app %s: mount %s: recursive read-only needs readonly and private propagation", s.ID, m.Destination)
		}
		if !filepath.IsAbs(m.Source) || !filepath.IsAbs(m.Destination) {
			return errdefs.InvalidArgument("app %s: mount %q on %q: paths must be absolute", s.ID, m.Source, m.Destination)
		}
		switch m.Propagation {
		case "", "private", "rslave", "rshared":
		default:
			return errdefs.InvalidArgument("app %s: mount %s: unknown propagation %q", s.ID, m.Destination, m.Propagation)
		}
	}
	return nil
}

// validID accepts names usable as a file and cgroup name.
func validID(id string) error {
	if id == "" || len(id) > 128 || strings.HasPrefix(id, ".") {
		return errdefs.InvalidArgument("bad app id %q", id)
	}
	for _, r := range id {
		ok := r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_' || r == '.'
		if !ok {
			return errdefs.InvalidArgument("bad app id %q: only letters, digits, '-', '_' and '.'", id)
		}
	}
	return nil
}

// create records an app: InvalidArgument for a bad spec, AlreadyExists for
// a known id, FailedPrecondition while shutting down.
func (a *Agent) create(ctx context.Context, spec *api.AppSpec) (*api.AppStatus, error) {
	if err := a.resolveGuestMounts(spec); err != nil {
		return nil, err
	}
	if err := validateSpec(spec); err != nil {
		return nil, err
	}
	a.sys.useRlimits(spec.Rlimits)
	ap := &app{id: spec.ID, spec: spec, st: api.AppStatus{ID: spec.ID, State: api.StateCreated, CreatedAt: time.Now()}, cg: a.sys.appCgroup(spec.ID)}
	if spec.HostLog {
		ap.hlog = newLogBuffer(logBufferSize)
	}
	ap.mu.Lock()
	defer ap.mu.Unlock()
	a.mu.Lock()
	if a.closing {
		a.mu.Unlock()
		return nil, errdefs.FailedPrecondition("the agent is shutting down")
	}
	if _, dup := a.apps[spec.ID]; dup {
		a.mu.Unlock()
		return nil, errdefs.AlreadyExists("app %q already exists", spec.ID)
	}
	a.apps[spec.ID] = ap
	a.mu.Unlock()

	if spec.LocalUpper {
		_, span := tracing.Start(ctx, "app.layer")
		err := a.mountLayer(spec)
		tracing.End(span, err)
		if err != nil {
			a.mu.Lock()
			delete(a.apps, spec.ID)
			a.mu.Unlock()
			return nil, err
		}
	}
	cctx, span := tracing.Start(ctx, "app.cgroup")
	err := a.setupCgroup(cctx, ap)
	tracing.End(span, err)
	if err != nil {
		a.mu.Lock()
		delete(a.apps, spec.ID)
		a.mu.Unlock()
		if ap.cg != nil {
			_ = ap.cg.Delete()
		}
		if spec.LocalUpper {
			if lerr := a.unmountLayer(spec); lerr != nil {
				a.log.WarnContext(ctx, "release the writable layer of an app that failed to be created", "app", spec.ID, "err", lerr)
			}
		}
		return nil, err
	}
	if err := writeState(a.dir, &ap.st); err != nil {
		a.log.WarnContext(ctx, "write app record", "app", spec.ID, "err", err)
	}
	a.log.InfoContext(ctx, "app created", "app", spec.ID, "name", spec.Name)
	st := ap.st
	a.events.publish(api.EventCreated, &st)
	return &st, nil
}

// update changes the cgroup limits of an app that has not exited; zero
// fields stay as they are. NotFound, InvalidArgument (no resources, an
// OOM score, which only a process's start can set), FailedPrecondition
// (the app exited, the pod has no cgroups, or the kernel refused a value:
// e.g. a memory limit below what the app uses, on cgroup v1).
func (a *Agent) update(ctx context.Context, id string, r *api.Resources) (*api.AppStatus, error) {
	if r == nil {
		return nil, errdefs.InvalidArgument("update %s: no resources", id)
	}
	if r.OOMScoreAdj != 0 {
		return nil, errdefs.InvalidArgument("update %s: oom_score_adj is set when the process starts and cannot change", id)
	}
	ap, err := a.get(id)
	if err != nil {
		return nil, err
	}
	ap.mu.Lock()
	defer ap.mu.Unlock()
	if ap.st.State == api.StateExited {
		return nil, errdefs.FailedPrecondition("update %s: the app has exited", id)
	}
	if ap.cg == nil {
		return nil, errdefs.FailedPrecondition("update %s: cgroups are unavailable in this pod, so its limits cannot change", id)
	}
	if err := a.applyLimits(ap, *r); err != nil {
		return nil, errdefs.FailedPrecondition("update %s: %w", id, err)
	}
	a.log.InfoContext(ctx, "app limits changed", "app", id, "resources", *r)
	st := ap.st
	return &st, nil
}

// applyLimits sets the limits r of app ap's cgroup (the caller holds
// ap.mu). An OOM group on cgroup v1, which has none, is the agent's: on an
// OOM in the app's memory cgroup it kills every process of the app, as
// cgroup v2's memory.oom.group would.
func (a *Agent) applyLimits(ap *app, r api.Resources) error {
	limits := cgroupLimits(r)
	if c, ok := ap.cg.(oomWatcher); ok && limits.OOMGroup && !c.IsV2() {
		limits.OOMGroup = false
		if ap.stopOOMWatch == nil {
			events, stop, err := c.WatchOOM()
			if err != nil {
				return fmt.Errorf("OOM group: %w", err)
			}
			ap.stopOOMWatch = stop
			go func() {
				for range events {
					a.log.Info("OOM in an app with an OOM group: killing all of its processes", "app", ap.id)
					ap.groupOOM.Store(true)
					if err := ap.cg.Kill(); err != nil {
						a.log.Warn("kill the OOM group", "app", ap.id, "err", err)
					}
				}
			}()
		}
	}
	return ap.cg.Set(limits)
}

// oomWatcher is a cgroup whose OOM kills can be watched (a cgroup of the
// cgroups package).
type oomWatcher interface {
	IsV2() bool
	WatchOOM() (events <-chan struct{}, stop func(), err error)
}

// cgroupLimits are the cgroup limits of an app's resources (all but the
// OOM score, which is its process's).
func cgroupLimits(r api.Resources) cgroups.Resources {
	return cgroups.Resources{
		CPUShares:   r.CPUShares,
		CPUQuota:    r.CPUQuota,
		CPUPeriod:   r.CPUPeriod,
		MemoryLimit: r.MemoryLimit,
		PidsLimit:   r.PidsLimit,
		CpusetCpus:  r.CpusetCpus,
		CpusetMems:  r.CpusetMems,
		OOMGroup:    r.OOMGroup,

		MemorySwap:        r.MemorySwap,
		MemoryReservation: r.MemoryReservation,
	}
}

// hugepageLimits are the cgroup limits of an app's huge pages.
func hugepageLimits(hs []api.HugepageLimit) []cgroups.HugepageLimit {
	var out []cgroups.HugepageLimit
	for _, h := range hs {
		out = append(out, cgroups.HugepageLimit{PageSize: h.PageSize, Limit: h.Limit})
	}
	return out
}

func (a *Agent) setupCgroup(ctx context.Context, ap *app) error {
	r := ap.spec.Resources
	if ap.cg == nil {
		if !reflect.ValueOf(cgroupLimits(r)).IsZero() || len(ap.spec.HugepageLimits) > 0 {
			a.log.WarnContext(ctx, "cgroups unavailable: resource limits not applied", "app", ap.spec.ID)
		}
		if ap.spec.DeviceCgroup != nil {
			a.log.WarnContext(ctx, "cgroups unavailable: device access not fenced", "app", ap.spec.ID)
		}
		return nil
	}
	if err := ap.cg.Create(); err != nil {
		return fmt.Errorf("app %s: cgroup: %w", ap.spec.ID, err)
	}
	if err := a.applyLimits(ap, r); err != nil {
		return errdefs.InvalidArgument("app %s: resources: %w", ap.spec.ID, err)
	}
	if hs := hugepageLimits(ap.spec.HugepageLimits); hs != nil {
		if err := ap.cg.Set(cgroups.Resources{HugepageLimits: hs}); err != nil {
			return errdefs.InvalidArgument("app %s: hugepage limits: %w", ap.spec.ID, err)
		}
	}
	if ap.spec.DeviceCgroup != nil {
		if err := ap.cg.SetDevices(ap.spec.DeviceCgroup); err != nil {
			return fmt.Errorf("app %s: %w", ap.spec.ID, err)
		}
	}
	if n, err := ap.cg.OOMKills(); err == nil {
		ap.oomBase = n
	}
	return nil
}

// start starts a created app and returns once its command runs (or
// failed to). NotFound, FailedPrecondition (not in state created; the
// command cannot be run — the app is then exited with code 128).
func (a *Agent) start(ctx context.Context, id string) (*api.AppStatus, error) {
	ap, err := a.beginStart(id, nil)
	if err != nil {
		return nil, err
	}
	lctx, span := tracing.Start(ctx, "app.launch")
	err = a.launch(lctx, ap)
	tracing.End(span, err)
	if err != nil {
		return ap.status(), err
	}
	return ap.status(), nil
}

// beginStart marks created app id as starting (a start or a restore) and
// returns it; ready, unless nil, checks and readies the app first, under
// its lock. NotFound, FailedPrecondition (not created; shutting down;
// ready's refusal).
func (a *Agent) beginStart(id string, ready func(*app) error) (*app, error) {
	ap, err := a.get(id)
	if err != nil {
		return nil, err
	}
	a.mu.Lock()
	closing := a.closing
	a.mu.Unlock()
	ap.mu.Lock()
	defer ap.mu.Unlock()
	switch {
	case ap.removed:
		return nil, errdefs.NotFound("app %q not found", id)
	case closing:
		return nil, errdefs.FailedPrecondition("the agent is shutting down")
	case ap.spec == nil || ap.started != nil:
		st := ap.st.State
		if ap.st.State == api.StateCreated {
			st = "starting"
		}
		return nil, errdefs.FailedPrecondition("app %s is %s", id, st)
	}
	if ready != nil {
		if err := ready(ap); err != nil {
			return nil, err
		}
	}
	ap.started = make(chan struct{})
	ap.exited = make(chan struct{})
	return ap, nil
}

// launch starts the app's process, its output copied to its log and to
// attach sessions, and records it running. On failure the app is exited
// (code 128, reason Error, the failure as message) when it returns.
func (a *Agent) launch(ctx context.Context, ap *app) error {
	spec := ap.spec
	lg, err := openAppLog(ap)
	if err != nil {
		return a.failEarly(ctx, ap, errdefs.FailedPrecondition("%w", err))
	}
	s := &startSpec{app: spec, args: spec.Args, cio: childIO{stdin: spec.Stdin, tty: spec.TTY}, cg: ap.cg}
	if spec.PIDNamespace == api.PIDNamespaceTarget {
		if s.pid, err = a.targetPID(spec); err != nil {
			lg.close()
			return a.failEarly(ctx, ap, err)
		}
	}
	pr, err := a.sys.start(s)
	if err != nil {
		lg.close()
		return a.failEarly(ctx, ap, err)
	}
	a.running(ctx, ap, lg, pr)
	return nil
}

// running records the app's process pr running, its output copied to its
// log lg and to attach sessions, and monitors it.
func (a *Agent) running(ctx context.Context, ap *app, lg *criLog, pr *child) {
	spec := ap.spec
	aio := newAppIO(spec.StdinOnce)
	var copies sync.WaitGroup
	// Output goes to the CRI log and to every attach session.
	copyOut := func(stream string, typ byte, r io.Reader) {
		copies.Add(1)
		go func() {
			defer copies.Done()
			if err := lg.copyStream(stream, io.TeeReader(r, aio.output(typ))); err != nil {
				a.log.WarnContext(ctx, "app log", "app", spec.ID, "stream", stream, "err", err)
			}
		}()
	}
	switch {
	case spec.TTY:
		// A terminal's output is the app's stdout, as in containerd.
		copyOut(streamStdout, api.FrameStdout, pr.pty)
		if spec.Stdin {
			aio.setStdin(pr.pty, pr.pty)
		} else {
			aio.setStdin(nil, pr.pty)
		}
	default:
		copyOut(streamStdout, api.FrameStdout, pr.stdout)
		copyOut(streamStderr, api.FrameStderr, pr.stderr)
		if pr.stdin != nil {
			aio.setStdin(pr.stdin, nil)
		}
	}
	ap.mu.Lock()
	ap.proc = pr.proc
	ap.log = lg
	ap.io = aio
	ap.st.State = api.StateRunning
	ap.st.PID = pr.pid
	ap.st.StartedAt = time.Now()
	st := ap.st
	ap.mu.Unlock()
	go a.monitor(ap, pr, &copies)
	// Before started is closed: the monitor writes the exit record only
	// after it, so this one never overwrites that.
	if err := writeState(a.dir, &st); err != nil {
		a.log.WarnContext(ctx, "write app record", "app", spec.ID, "err", err)
	}
	a.log.InfoContext(ctx, "app started", "app", spec.ID, "pid", st.PID)
	a.events.publish(api.EventStarted, &st)
	close(ap.started)
}

// targetPID is the process of the app spec.PIDTarget, whose PID namespace
// spec's app joins: FailedPrecondition when it does not run.
func (a *Agent) targetPID(spec *api.AppSpec) (int, error) {
	target, err := a.get(spec.PIDTarget)
	if err != nil {
		return 0, errdefs.FailedPrecondition("app %s: target %s of its PID namespace: %w", spec.ID, spec.PIDTarget, err)
	}
	target.mu.Lock()
	running, pid := target.st.State == api.StateRunning, target.st.PID
	target.mu.Unlock()
	if !running {
		return 0, errdefs.FailedPrecondition("app %s: target %s of its PID namespace is not running", spec.ID, spec.PIDTarget)
	}
	return pid, nil
}

// failEarly records a start that failed before a process existed.
func (a *Agent) failEarly(ctx context.Context, ap *app, err error) error {
	ap.mu.Lock()
	st := ap.st
	ap.mu.Unlock()
	st.State = api.StateExited
	st.ExitCode = 128
	st.Reason = api.ReasonError
	st.Message = err.Error()
	st.FinishedAt = time.Now()
	if ap.hlog != nil {
		ap.hlog.end() // no output comes: the log session ends
	}
	if werr := writeState(a.dir, &st); werr != nil {
		a.log.WarnContext(ctx, "write app record", "app", st.ID, "err", werr)
	}
	ap.mu.Lock()
	ap.st = st
	ap.mu.Unlock()
	a.events.publish(api.EventExited, &st)
	close(ap.started)
	close(ap.exited)
	return err
}

// monitor waits for the app's process to exit, kills what is left in its
// cgroup, drains its output and records the exit.
func (a *Agent) monitor(ap *app, c *child, copies *sync.WaitGroup) {
	ws := <-c.wait
	finished := time.Now()
	<-ap.started
	if ap.cg != nil {
		if err := ap.cg.Kill(); err != nil {
			a.log.Warn("kill what is left of the app", "app", ap.id, "err", err)
		}
	}
	drain(copies, c.outputs()...)
	ap.mu.Lock()
	lg, aio := ap.log, ap.io
	ap.mu.Unlock()
	lg.close()
	if ap.hlog != nil {
		ap.hlog.delivered()
	}
	aio.end()
	if c.stdin != nil {
		c.stdin.Close()
	}
	oom := ap.groupOOM.Load()
	if !oom && ap.cg != nil {
		if n, err := ap.cg.OOMKills(); err == nil && n > ap.oomBase {
			oom = true
		}
	}

	// The record is written before the exit is visible through the API,
	// so whoever saw "exited" finds it on disk too.
	ap.mu.Lock()
	rec := ap.st
	ap.mu.Unlock()
	rec.State = api.StateExited
	// launch takes StartedAt once the handshake is done, which a quick
	// app may outlive: it never ends before it started.
	rec.FinishedAt = finished
	if finished.Before(rec.StartedAt) {
		rec.FinishedAt = rec.StartedAt
	}
	rec.ExitCode = exitCode(ws)
	switch {
	case oom:
		rec.Reason = api.ReasonOOMKilled
	case rec.ExitCode == 0:
		rec.Reason = api.ReasonCompleted
	default:
		rec.Reason = api.ReasonError
	}
	if err := writeState(a.dir, &rec); err != nil {
		a.log.Warn("write app record", "app", rec.ID, "err", err)
	}
	ap.mu.Lock()
	ap.st = rec
	ap.mu.Unlock()
	a.log.Info("app exited", "app", rec.ID, "code", rec.ExitCode, "reason", rec.Reason)
	a.events.publish(api.EventExited, &rec)
	close(ap.exited)
}

// outputs are the agent's ends of the child's output: its pipes or its
// terminal.
func (c *child) outputs() []io.Closer {
	var out []io.Closer
	for _, f := range []*os.File{c.stdout, c.stderr} {
		if f != nil {
			out = append(out, f)
		}
	}
	if c.pty != nil {
		out = append(out, c.pty)
	}
	return out
}

// drain waits for the output copiers to reach EOF, at most drainTimeout,
// then closes the read ends (which ends the copiers).
func drain[C io.Closer](copies *sync.WaitGroup, files ...C) {
	done := make(chan struct{})
	go func() {
		copies.Wait()
		close(done)
	}()
	t := time.NewTimer(drainTimeout)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
	}
	for _, f := range files {
		f.Close()
	}
	<-done
}

// stop stops a running app: SIGTERM, up to timeout, SIGKILL, and returns
// once it exited. Idempotent: an app that is not running is left as it is.
// NotFound.
func (a *Agent) stop(ctx context.Context, id string, timeout time.Duration) (*api.AppStatus, error) {
	ap, err := a.get(id)
	if err != nil {
		return nil, err
	}
	a.stopApp(ctx, ap, timeout)
	return ap.status(), nil
}

func (a *Agent) stopApp(ctx context.Context, ap *app, timeout time.Duration) {
	ap.mu.Lock()
	started, exited := ap.started, ap.exited
	ap.mu.Unlock()
	if started == nil {
		return // never started
	}
	a.abortRestore(ctx, ap, "stopped before its restore ended")
	<-started
	select {
	case <-exited:
		return
	default:
	}
	ap.mu.Lock()
	proc := ap.proc // set once started has closed
	ap.mu.Unlock()
	if err := signalProc(proc, syscall.SIGTERM); err != nil {
		a.log.WarnContext(ctx, "stop: SIGTERM", "app", ap.id, "err", err)
	}
	if timeout > 0 {
		t := time.NewTimer(timeout)
		defer t.Stop()
		select {
		case <-exited:
			return
		case <-t.C:
		}
	}
	if err := signalProc(proc, syscall.SIGKILL); err != nil {
		a.log.WarnContext(ctx, "stop: SIGKILL", "app", ap.id, "err", err)
	}
	<-exited // the monitor empties the cgroup once the main process is gone
}

// signal sends sig to a running app's main process: NotFound,
// InvalidArgument, FailedPrecondition (not running).
func (a *Agent) signal(id string, sig int) error {
	ap, err := a.get(id)
	if err != nil {
		return err
	}
	if sig <= 0 || sig > 64 {
		return errdefs.InvalidArgument("bad signal %d", sig)
	}
	ap.mu.Lock()
	running, proc := ap.st.State == api.StateRunning, ap.proc
	ap.mu.Unlock()
	if !running {
		return errdefs.FailedPrecondition("app %s is not running", id)
	}
	return signalProc(proc, syscall.Signal(sig))
}

// remove kills the app if it runs, deletes its cgroup, its local
// writable layer, record and entry.
// Idempotent: an unknown id is not an error.
func (a *Agent) remove(ctx context.Context, id string) error {
	a.mu.Lock()
	ap, ok := a.apps[id]
	a.mu.Unlock()
	if !ok {
		return nil
	}
	ap.mu.Lock()
	ap.removed = true
	ap.mu.Unlock()
	if ap.hlog != nil {
		// Nobody takes its lines any more: its output must not wait.
		ap.hlog.discard()
	}
	a.stopApp(ctx, ap, 0)
	ap.mu.Lock()
	stopWatch := ap.stopOOMWatch
	ap.mu.Unlock()
	if stopWatch != nil {
		stopWatch()
	}
	if ap.cg != nil {
		if err := ap.cg.Delete(); err != nil {
			return fmt.Errorf("remove %s: %w", id, err)
		}
	}
	if ap.spec.LocalUpper {
		if err := a.unmountLayer(ap.spec); err != nil {
			return fmt.Errorf("remove %s: %w", id, err)
		}
	}
	if err := os.Remove(stateFile(a.dir, id)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove %s: %w", id, err)
	}
	a.mu.Lock()
	if a.apps[id] == ap {
		delete(a.apps, id)
	}
	a.mu.Unlock()
	ap.mu.Lock()
	if ap.proc != nil {
		ap.proc.Release()
	}
	last := ap.st
	ap.mu.Unlock()
	a.events.publish(api.EventRemoved, &last)
	a.log.InfoContext(ctx, "app removed", "app", id)
	return nil
}

// reopenLog reopens a running app's log file: NotFound, FailedPrecondition
// (not running).
func (a *Agent) reopenLog(id string) error {
	ap, err := a.get(id)
	if err != nil {
		return err
	}
	if ap.hlog != nil {
		return errdefs.FailedPrecondition("app %s: its log file is the daemon's to reopen, on the host", id)
	}
	ap.mu.Lock()
	running, lg := ap.st.State == api.StateRunning, ap.log
	ap.mu.Unlock()
	if !running || lg == nil {
		return errdefs.FailedPrecondition("app %s is not running", id)
	}
	if err := lg.reopen(); err != nil {
		return fmt.Errorf("reopen log of %s: %w", id, err)
	}
	return nil
}
