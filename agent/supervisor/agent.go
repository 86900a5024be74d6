package supervisor

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"sort"
	"sync"
	"syscall"
	"time"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/agent/wire"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/logctx"
	"github.com/stagelet/stagelet/tracing"
	"github.com/stagelet/stagelet/tracing/collect"
	"go.opentelemetry.io/otel/attribute"
)

// Config configures an Agent.
type Config struct {
	// StateDir holds one record per app, <StateDir>/<id>.json, rewritten
	// atomically on every state change. Created if missing. Required.
	StateDir string
	// Logger receives the agent's logs; nil means slog.Default().
	Logger *slog.Logger
	// Exe is the stagelet binary re-executed to start apps and execs
	// (`Exe agent init`) by the Linux System; empty means /proc/self/exe.
	Exe string
	// System runs the apps; nil means Linux(Exe, Logger), with
	// MemoryCgroup.
	System System
	// MemoryCgroup, for the Linux System on a cgroup v1 host, is the
	// memory cgroup directory the apps' memory cgroups go beneath instead
	// of the agent's own: the pod's, where the agent itself is charged to
	// a memory cgroup outside the pod's limit (the nspawn stage1 binds
	// it into the pod). Empty: the agent's own.
	MemoryCgroup string
	// ExecInit, for the Linux System, starts every exec'd command through
	// `agent exec-init`, never straight from the agent
	// (execdirect_linux.go).
	ExecInit bool
	// Setup answers OpSetup (at most once); nil: the agent refuses it.
	Setup func(*api.Request) error
	// MountShare answers OpMountShare; nil: the agent refuses it.
	MountShare func() error
	// Network answers OpNetwork; nil: the agent refuses it.
	Network func(*api.Request) error
}

// Agent supervises a pod's apps. Over the Linux System it reaps every
// child of the process, so a process holds at most one such Agent and
// starts no children of its own outside it. Its methods are safe for
// concurrent use.
type Agent struct {
	log     *slog.Logger
	dir     string
	sys     System
	started time.Time
	// setup answers OpSetup; nil once it ran (or when there is none).
	setupMu sync.Mutex
	setup   func(*api.Request) error
	// mountShare answers OpMountShare, network OpNetwork; nil: refused.
	mountShare func() error
	network    func(*api.Request) error
	// spans keeps the spans of traced requests for their answers.
	spans *collect.Collector
	// cg is the agent's own cgroup, the parent of every app's; nil when
	// cgroups are not available (limits are then not applied).
	cg cgroup

	mu      sync.Mutex
	apps    map[string]*app
	closing bool

	// events go to OpEvents subscribers.
	events hub

	// disks are the disks mounted for apps' layers (disk.go).
	disks diskMounts

	done     chan struct{}
	doneOnce sync.Once
}

// New prepares an agent: it creates the state directory, loads the records
// an earlier agent left there (apps that had not exited are recorded as
// exited with reason Error) and sets up its System (the Linux one starts
// reaping children and finds its own cgroup). Errors: the state directory
// cannot be made.
func New(cfg Config) (*Agent, error) {
	if cfg.StateDir == "" {
		return nil, errdefs.InvalidArgument("agent: a state directory is required")
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	if err := os.MkdirAll(cfg.StateDir, 0o700); err != nil {
		return nil, fmt.Errorf("agent: state dir: %w", err)
	}
	// A request's lines carry its ID (requestContext).
	log = slog.New(logctx.NewHandler(log.Handler()))
	sys := cfg.System
	if sys == nil {
		sys = newLinux(cfg.Exe, log, cfg.MemoryCgroup, cfg.ExecInit)
	}
	a := &Agent{
		spans:   collect.Install(),
		log:     log,
		dir:     cfg.StateDir,
		sys:     sys,
		cg:      sys.podCgroup(),
		setup:   cfg.Setup,
		started: time.Now(),
		apps:    map[string]*app{},
		done:    make(chan struct{}),
	}
	a.mountShare, a.network = cfg.MountShare, cfg.Network
	sts, bad := readStates(a.dir)
	for _, err := range bad {
		log.Warn("skipping app record", "err", err)
	}
	for _, st := range sts {
		if prev := st.State; prev != api.StateExited {
			st.Message = "the agent restarted while the app was " + prev
			st.State = api.StateExited
			st.PID = 0
			st.ExitCode = 128
			st.Reason = api.ReasonError
			if st.FinishedAt.IsZero() {
				st.FinishedAt = time.Now()
			}
		}
		a.apps[st.ID] = &app{id: st.ID, st: *st, cg: sys.appCgroup(st.ID)}
	}
	return a, nil
}

// Exited returns a channel closed once app id has exited and its record
// is final; nil for an unknown app or one never started.
func (a *Agent) Exited(id string) <-chan struct{} {
	ap, err := a.get(id)
	if err != nil {
		return nil
	}
	ap.mu.Lock()
	defer ap.mu.Unlock()
	return ap.exited
}

// Done is closed once a successful OpShutdown has been answered (or Close
// was called).
func (a *Agent) Done() <-chan struct{} { return a.done }

// Close marks the agent finished: Serve returns. It does not stop apps
// (see StopAll). Idempotent.
func (a *Agent) Close() { a.doneOnce.Do(func() { close(a.done) }) }

// Serve answers requests on l, one request and one response per
// connection (then frames, for a session), until Done; it then closes l
// and returns nil. It returns an error when l fails.
func (a *Agent) Serve(l net.Listener) error {
	go func() {
		<-a.done
		l.Close()
	}()
	for {
		c, err := l.Accept()
		if err != nil {
			select {
			case <-a.done:
				return nil
			default:
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			return err
		}
		go a.ServeConn(c)
	}
}

// ServeConn answers one connection: a request and its response, then
// the events or session frames the request opened; it closes c.
func (a *Agent) ServeConn(c net.Conn) {
	defer c.Close()
	var req api.Request
	var resp *api.Response
	dec := json.NewDecoder(c)
	if err := dec.Decode(&req); err != nil {
		resp = wire.ErrorResponse(errdefs.InvalidArgument("bad request: %w", err))
	} else if isSession(req.Op) {
		a.serveSession(c, io.MultiReader(dec.Buffered(), c), &req)
		return
	} else if req.Op == api.OpEvents {
		a.serveEvents(c, io.MultiReader(dec.Buffered(), c))
		return
	} else {
		resp = a.Handle(&req)
	}
	if err := json.NewEncoder(c).Encode(resp); err != nil {
		a.log.Debug("reply", "op", req.Op, "err", err)
	}
	if req.Op == api.OpShutdown && resp.Code == api.CodeOK {
		c.Close()
		a.Close()
	}
}

// Handle executes one request and returns its response; an error is
// carried in Response.Code/Error. For OpShutdown it stops every app and
// answers; the transport then delivers the answer and calls Close.
func (a *Agent) Handle(req *api.Request) *api.Response {
	start := time.Now()
	ctx, span := tracing.Start(requestContext(req), "handle."+req.Op)
	if req.ID != "" {
		span.SetAttributes(attribute.String("stagelet.app", req.ID))
	}
	resp, err := a.handle(ctx, req)
	tracing.End(span, err)
	defer func() {
		if resp != nil {
			resp.Spans = a.spans.Take(ctx)
		}
	}()
	if err != nil {
		resp = wire.ErrorResponse(err)
		lvl := slog.LevelWarn
		if resp.Code != api.CodeInternal {
			lvl = slog.LevelDebug
		}
		a.log.Log(ctx, lvl, "request failed", "op", req.Op, "app", req.ID, "code", resp.Code, "err", err)
	} else {
		a.log.DebugContext(ctx, "request", "op", req.Op, "app", req.ID, "took", time.Since(start))
	}
	return resp
}

func (a *Agent) handle(ctx context.Context, req *api.Request) (*api.Response, error) {
	switch req.Op {
	case api.OpInfo:
		return &api.Response{Info: a.info()}, nil
	case api.OpCreate:
		if req.App == nil {
			return nil, errdefs.InvalidArgument("create: no app spec")
		}
		st, err := a.create(ctx, req.App)
		return &api.Response{App: st}, err
	case api.OpStart:
		st, err := a.start(ctx, req.ID)
		return &api.Response{App: st}, err
	case api.OpStop:
		st, err := a.stop(ctx, req.ID, req.Timeout)
		return &api.Response{App: st}, err
	case api.OpSignal:
		return &api.Response{}, a.signal(req.ID, req.Signal)
	case api.OpRemove:
		return &api.Response{}, a.remove(ctx, req.ID)
	case api.OpStatus:
		st, err := a.status(req.ID)
		return &api.Response{App: st}, err
	case api.OpList:
		return &api.Response{Apps: a.list()}, nil
	case api.OpExec:
		res, err := a.exec(ctx, req.ID, req.Cmd, req.Timeout)
		return &api.Response{Exec: res}, err
	case api.OpReopenLog:
		return &api.Response{}, a.reopenLog(req.ID)
	case api.OpStats:
		st, err := a.stats(req.ID)
		return &api.Response{Stats: st}, err
	case api.OpShutdown:
		a.StopAll(req.Timeout)
		return &api.Response{}, nil
	case api.OpSysctl:
		return &api.Response{}, a.sys.setSysctls(req.Sysctls, a.dir)
	case api.OpUpdate:
		st, err := a.update(ctx, req.ID, req.Resources)
		return &api.Response{App: st}, err
	case api.OpSetup:
		return &api.Response{}, a.runSetup(req)
	case api.OpRestore:
		r, err := a.prepareRestore(ctx, req.ID)
		return &api.Response{Restore: r}, err
	case api.OpRestoreRun:
		res, err := a.runRestorer(ctx, req.ID, req.Cmd, req.Timeout)
		return &api.Response{Exec: res}, err
	case api.OpAdopt:
		st, err := a.adopt(ctx, req.ID, req.PID, req.Message)
		return &api.Response{App: st}, err
	case api.OpMountShare:
		return &api.Response{}, a.runMountShare()
	case api.OpNetwork:
		return &api.Response{}, a.runNetwork(req)
	case api.OpRename:
		st, err := a.rename(ctx, req.ID, req.NewID)
		return &api.Response{App: st}, err
	case api.OpPutFiles:
		return &api.Response{}, a.putFiles(req.Files)
	case api.OpTermination:
		msg, err := a.terminationMessage(req.ID)
		return &api.Response{Termination: msg}, err
	}
	return nil, errdefs.InvalidArgument("unknown operation %q", req.Op)
}

// requestContext is the context of req's handling: its log lines carry
// the daemon's request ID, when the daemon sent one, and its spans go
// beneath the daemon's, when the daemon traces it.
func requestContext(req *api.Request) context.Context {
	ctx := tracing.Remote(context.Background(), req.TraceParent)
	if req.RequestID != "" {
		ctx = logctx.With(ctx, "req", req.RequestID)
	}
	return ctx
}

// runSetup runs Config.Setup once: a second call, or one to an agent
// without it, is FailedPrecondition.
func (a *Agent) runSetup(req *api.Request) error {
	a.setupMu.Lock()
	defer a.setupMu.Unlock()
	if a.setup == nil {
		return errdefs.FailedPrecondition("setup: this agent awaits no setup (not a guest restored from a template, or set up already)")
	}
	f := a.setup
	a.setup = nil
	return f(req)
}

func (a *Agent) info() *api.Info {
	return &api.Info{Version: api.Version, PID: os.Getpid(), Kernel: a.sys.kernel(), StartedAt: a.started, Features: []string{api.FeatureGuestVolumes}}
}

func (a *Agent) get(id string) (*app, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	ap, ok := a.apps[id]
	if !ok {
		return nil, errdefs.NotFound("app %q not found", id)
	}
	return ap, nil
}

func (a *Agent) status(id string) (*api.AppStatus, error) {
	ap, err := a.get(id)
	if err != nil {
		return nil, err
	}
	return ap.status(), nil
}

func (a *Agent) list() []*api.AppStatus {
	a.mu.Lock()
	apps := make([]*app, 0, len(a.apps))
	for _, ap := range a.apps {
		apps = append(apps, ap)
	}
	a.mu.Unlock()
	sts := make([]*api.AppStatus, len(apps))
	for i, ap := range apps {
		sts[i] = ap.status()
	}
	sort.Slice(sts, func(i, j int) bool { return sts[i].ID < sts[j].ID })
	return sts
}

// stats are the usage of app id (of the pod, for ""): its cgroup's
// figures, and what its local writable layer holds. An app without
// cgroups but with such a layer gets the layer's figures alone.
func (a *Agent) stats(id string) (*api.Stats, error) {
	cg := a.cg
	var layer *api.Stats
	if id != "" {
		ap, err := a.get(id)
		if err != nil {
			return nil, err
		}
		cg = ap.cg
		if ap.spec.LocalUpper {
			layer = &api.Stats{Timestamp: time.Now()}
			layer.WritableBytes, layer.WritableInodes, layer.LocalLayer = a.layerUsage(id)
		}
	}
	if cg == nil {
		if layer != nil {
			return layer, nil
		}
		return nil, errdefs.FailedPrecondition("stats: cgroups are not available to the agent")
	}
	s, err := cg.Stats()
	if err != nil {
		return nil, fmt.Errorf("stats %q: %w", id, err)
	}
	if layer == nil {
		layer = &api.Stats{}
	}
	return &api.Stats{
		LocalLayer:           layer.LocalLayer,
		WritableBytes:        layer.WritableBytes,
		WritableInodes:       layer.WritableInodes,
		Timestamp:            time.Now(),
		CPUUsageNanos:        s.CPUUsageNanos,
		MemoryUsageBytes:     s.MemoryUsage,
		MemoryWorkingSet:     s.MemoryWorkingSet,
		MemoryRSSBytes:       s.MemoryRSS,
		MemoryPageFaults:     s.PageFaults,
		MemoryMajorPageFault: s.MajorPageFaults,
		Pids:                 s.Pids,
	}, nil
}

// StopAll stops every running app (SIGTERM, up to timeout, SIGKILL; all at
// once), removes the app cgroups, and refuses new apps from then on. It
// returns once every app has exited.
func (a *Agent) StopAll(timeout time.Duration) {
	a.mu.Lock()
	a.closing = true
	apps := make([]*app, 0, len(a.apps))
	for _, ap := range a.apps {
		apps = append(apps, ap)
	}
	a.mu.Unlock()
	// The apps' exits wait for the daemon to take their last lines, for
	// a while: it may be gone.
	unwait := time.AfterFunc(timeout+shutdownLogGrace, func() {
		for _, ap := range apps {
			if ap.hlog != nil {
				ap.hlog.unwait()
			}
		}
	})
	defer unwait.Stop()
	var wg sync.WaitGroup
	for _, ap := range apps {
		wg.Add(1)
		go func() {
			defer wg.Done()
			a.stopApp(context.Background(), ap, timeout)
			if ap.cg != nil {
				if err := ap.cg.Delete(); err != nil {
					a.log.Warn("delete app cgroup", "app", ap.id, "err", err)
				}
			}
		}()
	}
	wg.Wait()
}

// signalProc sends sig, ignoring a process that is already gone.
func signalProc(p process, sig syscall.Signal) error {
	err := p.Signal(sig)
	if err == nil || errors.Is(err, os.ErrProcessDone) {
		return nil
	}
	return err
}
