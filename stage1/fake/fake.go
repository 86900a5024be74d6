// Package fake is a stage1 for tests that need no root: pods are kept in
// memory, and each pod's agent is an in-process server speaking the
// agent's own protocol (package agent/api's requests, responses, events
// and session frames, package agent/wire's framing) over in-memory
// streams. Whoever talks to a fake pod goes through the same code as with
// a real one: AgentEndpoint, then package agent/client.
//
// Apps do not run: a started app is "running" until the test makes it
// exit (Pod.Exit), it is stopped, or its pod stops. Exec sessions write
// their command and echo their stdin; attach echoes; port-forward
// answers "port N: " and echoes.
package fake

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"os"
	"slices"
	"sync"
	"syscall"
	"time"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/agent/wire"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/stage1"
)

// Backend is a fake stage1. Pods survive a restart of whoever uses it
// (RecoverPod) as long as the same Backend value is reused. Set its
// exported fields before the first StartPod.
type Backend struct {
	// Caps are the capabilities it declares.
	Caps stage1.Capabilities
	// PodMemory, when set, makes pods of a fixed size, as a VM's are:
	// they implement stage1.PodResizer and refuse a larger memory limit.
	PodMemory int64
	// RecoverDelay is how long RecoverPod takes (long enough, say, for the
	// calls of a parallel recovery to overlap).
	RecoverDelay time.Duration

	name string
	mu   sync.Mutex
	pods map[string]*Pod
	// destroyed counts DestroyPod calls by pod; specs are the last spec
	// of each pod.
	destroyed map[string]int
	specs     map[string]*stage1.PodSpec
	failStart bool
	hang      map[string]bool
	// recovering counts RecoverPod calls under way; maxRecovering is the
	// most at once.
	recovering, maxRecovering int
}

// New returns a fake stage1 registered (by whoever registers it) as name,
// with the capabilities of a namespace-isolated one that also offers the
// host's namespaces.
func New(name string) *Backend {
	return &Backend{
		name:      name,
		Caps:      stage1.Capabilities{Isolation: stage1.IsolationNamespaces, HostNetwork: true, HostPID: true, HostIPC: true, PodNetwork: true, Privileged: "host"},
		pods:      map[string]*Pod{},
		destroyed: map[string]int{},
		specs:     map[string]*stage1.PodSpec{},
		hang:      map[string]bool{},
	}
}

var _ stage1.Backend = (*Backend)(nil)

// Name implements stage1.Backend.
func (b *Backend) Name() string { return b.name }

// Capabilities implements stage1.Backend.
func (b *Backend) Capabilities() stage1.Capabilities { return b.Caps }

type state struct {
	Version int    `json:"version"`
	ID      string `json:"id"`
}

// stateVersion is the only state version the fake writes.
const stateVersion = 1

// StartPod implements stage1.Backend: the state is persisted first, as a
// real backend does before it takes anything.
func (b *Backend) StartPod(ctx context.Context, spec *stage1.PodSpec, persist stage1.Persist) (stage1.Pod, error) {
	if err := persist(stage1.MarshalState(state{Version: stateVersion, ID: spec.ID})); err != nil {
		return nil, err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	cp := *spec
	b.specs[spec.ID] = &cp
	if b.failStart {
		return nil, fmt.Errorf("fake: start failure")
	}
	p := &Pod{id: spec.ID, backend: b.name, apps: map[string]*api.AppStatus{}, specs: map[string]*api.AppSpec{},
		alive: true, gone: make(chan struct{}), calls: map[string]int{}, kill: map[string]context.CancelFunc{}}
	b.pods[spec.ID] = p
	return b.wrap(p), nil
}

// RecoverPod implements stage1.Backend: ErrPodGone for a pod that is not
// alive (stopped, died, never started here).
func (b *Backend) RecoverPod(ctx context.Context, spec *stage1.PodSpec, st []byte) (stage1.Pod, error) {
	var s state
	if err := stage1.ParseState("fake", st, stateVersion, &s); err != nil {
		return nil, err
	}
	b.mu.Lock()
	b.recovering++
	b.maxRecovering = max(b.maxRecovering, b.recovering)
	hang := b.hang[s.ID]
	delay := b.RecoverDelay
	b.mu.Unlock()
	defer func() {
		b.mu.Lock()
		b.recovering--
		b.mu.Unlock()
	}()
	if hang {
		<-ctx.Done()
		return nil, ctx.Err()
	}
	if delay > 0 {
		t := time.NewTimer(delay)
		defer t.Stop()
		select {
		case <-t.C:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	p, ok := b.pods[s.ID]
	if !ok || !p.Alive() {
		return nil, fmt.Errorf("fake: pod %s: %w", s.ID, stage1.ErrPodGone)
	}
	return b.wrap(p), nil
}

// DestroyPod implements stage1.Backend: the pod is forgotten. Idempotent.
func (b *Backend) DestroyPod(ctx context.Context, spec *stage1.PodSpec, st []byte) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if p := b.pods[spec.ID]; p != nil {
		p.Die()
	}
	delete(b.pods, spec.ID)
	b.destroyed[spec.ID]++
	return nil
}

var _ stage1.Collector = (*Backend)(nil)

// Collect implements stage1.Collector: each pod it holds that no record
// names (keep) is destroyed, as DestroyPod does.
func (b *Backend) Collect(ctx context.Context, keep func(podID string) bool) ([]string, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	var out []string
	for id, p := range b.pods {
		if keep(id) {
			continue
		}
		p.Die()
		delete(b.pods, id)
		b.destroyed[id]++
		out = append(out, id)
	}
	slices.Sort(out)
	return out, nil
}

func (b *Backend) wrap(p *Pod) stage1.Pod {
	if b.PodMemory > 0 {
		return &sizedPod{Pod: p, memory: b.PodMemory}
	}
	return p
}

// FailStart makes StartPod fail (after persisting) while on.
func (b *Backend) FailStart(on bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.failStart = on
}

// Hang makes RecoverPod of pod id wait until its context ends.
func (b *Backend) Hang(id string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.hang[id] = true
}

// Pod returns the pod started as id, nil when there is none (never
// started, or destroyed).
func (b *Backend) Pod(id string) *Pod {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.pods[id]
}

// Pods is how many pods exist (started and not destroyed).
func (b *Backend) Pods() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.pods)
}

// Destroyed is how many times DestroyPod was called for pod id.
func (b *Backend) Destroyed(id string) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.destroyed[id]
}

// DestroyedPods is how many pods DestroyPod was called for.
func (b *Backend) DestroyedPods() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.destroyed)
}

// Spec is the spec pod id was last started with (nil: never).
func (b *Backend) Spec(id string) *stage1.PodSpec {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.specs[id]
}

// MaxRecovering is the most RecoverPod calls that were under way at once.
func (b *Backend) MaxRecovering() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.maxRecovering
}

// Kill ends the pod whose state is st at once, as a crash of its
// isolation would (Pod.Die); a pod that does not exist is no error.
func (b *Backend) Kill(st []byte) error {
	var s state
	if err := stage1.ParseState("fake", st, stateVersion, &s); err != nil {
		return err
	}
	if p := b.Pod(s.ID); p != nil {
		p.Die()
	}
	return nil
}

// Running lists the running apps of pod id while it is alive: what a
// real pod's processes would be.
func (b *Backend) Running(id string) []string {
	p := b.Pod(id)
	if p == nil {
		return nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.alive {
		return nil
	}
	var out []string
	for _, a := range p.apps {
		if a.State == api.StateRunning {
			out = append(out, a.ID)
		}
	}
	return out
}

var _ stage1.PodResizer = (*sizedPod)(nil)

// sizedPod is a pod of a fixed size (stage1.PodResizer).
type sizedPod struct {
	*Pod
	memory int64
}

// UpdatePodResources implements stage1.PodResizer.
func (p *sizedPod) UpdatePodResources(ctx context.Context, r stage1.PodResources) error {
	if r.MemoryLimit > p.memory {
		return errdefs.FailedPrecondition("fake: a %d-byte memory limit does not fit in the pod's %d bytes", r.MemoryLimit, p.memory)
	}
	return nil
}

// Pod is a fake pod and its agent.
type Pod struct {
	id      string
	backend string // its Backend's name

	mu    sync.Mutex
	alive bool // the pod's isolation runs
	dead  bool // its agent is gone: dialling fails
	// calls counts requests by operation (events subscriptions aside).
	calls map[string]int
	// subs are the events subscribers; gone is closed when the agent
	// dies or stops, which ends them.
	subs     map[chan *api.Event]struct{}
	gone     chan struct{}
	noEvents bool
	apps     map[string]*api.AppStatus
	specs    map[string]*api.AppSpec
	updates  map[string]api.Resources
	sysctls  map[string]string
	// kill ends a running app's toy shell.
	kill map[string]context.CancelFunc
}

var _ stage1.Pod = (*Pod)(nil)

// State implements stage1.Pod.
func (p *Pod) State() []byte {
	return stage1.MarshalState(state{Version: stateVersion, ID: p.id})
}

// Details implements stage1.Pod.
func (p *Pod) Details() map[string]string {
	return map[string]string{"stage1": p.backend, "fake": "yes"}
}

// Agent implements stage1.Pod: every stream is an in-memory pipe to the
// pod's agent; host paths are the agent's.
func (p *Pod) Agent() stage1.AgentEndpoint { return stage1.AgentEndpoint{Dial: p.dial} }

// Stop implements stage1.Pod: the agent is asked to shut down, then the
// pod ends. Idempotent.
func (p *Pod) Stop(ctx context.Context, timeout time.Duration, shutdown stage1.Shutdown) error {
	if err := shutdown(ctx, timeout); err != nil && !errors.Is(err, errdefs.ErrUnavailable) {
		return err
	}
	p.Die()
	return nil
}

// Alive tells whether the pod's isolation runs.
func (p *Pod) Alive() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.alive
}

// Die ends the pod at once, as a kill -9 of its agent would: event
// subscriptions end, calls fail with Unavailable, RecoverPod says
// ErrPodGone. Apps keep the state they had.
func (p *Pod) Die() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.dead, p.alive = true, false
	p.endLocked()
	for id, kill := range p.kill {
		kill()
		delete(p.kill, id)
	}
}

func (p *Pod) endLocked() {
	select {
	case <-p.gone:
	default:
		close(p.gone)
	}
}

// Exit makes app id exit with code, and publishes the exit.
func (p *Pod) Exit(id string, code int32) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.exitLocked(id, code) {
		p.publishLocked(api.EventExited, p.apps[id])
	}
}

// ExitQuietly makes app id exit with code without publishing it, as when
// the event is still on its way.
func (p *Pod) ExitQuietly(id string, code int32) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.exitLocked(id, code)
}

func (p *Pod) exitLocked(id string, code int32) bool {
	a := p.apps[id]
	if a == nil || a.State != api.StateRunning {
		return false
	}
	a.State, a.ExitCode, a.FinishedAt = api.StateExited, code, time.Now()
	if kill := p.kill[id]; kill != nil {
		kill()
		delete(p.kill, id)
	}
	a.Reason = api.ReasonCompleted
	if code != 0 {
		a.Reason = api.ReasonError
	}
	return true
}

// DropSubscribers ends every events subscription while the agent lives
// on, as an agent does with a subscriber that falls behind.
func (p *Pod) DropSubscribers() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.endLocked()
	p.gone = make(chan struct{})
}

// NoEvents makes the agent answer an events subscription as one from
// before events did (an unknown operation).
func (p *Pod) NoEvents() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.noEvents = true
}

// Calls is how many requests of operation op the agent was sent ("":
// every request but events subscriptions).
func (p *Pod) Calls(op string) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	if op != "" {
		return p.calls[op]
	}
	n := 0
	for _, c := range p.calls {
		n += c
	}
	return n
}

// Subscribers is how many events subscriptions are open now.
func (p *Pod) Subscribers() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.subs)
}

// Updated is the last resources update app id was given.
func (p *Pod) Updated(id string) api.Resources {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.updates[id]
}

// Sysctls are the sysctls the agent was given.
func (p *Pod) Sysctls() map[string]string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return maps.Clone(p.sysctls)
}

// publishLocked sends an event to every subscriber.
func (p *Pod) publishLocked(typ string, a *api.AppStatus) {
	cp := *a
	for ch := range p.subs {
		select {
		case ch <- &api.Event{Type: typ, App: &cp, Time: time.Now()}:
		default: // a subscriber that falls this far behind is dropped, as the agent does
			delete(p.subs, ch)
			close(ch)
		}
	}
}

// dial opens a stream to the agent: one end of a pipe, the agent serving
// the other.
func (p *Pod) dial(ctx context.Context) (net.Conn, error) {
	p.mu.Lock()
	dead := p.dead
	p.mu.Unlock()
	if dead {
		return nil, fmt.Errorf("fake: pod %s: the agent is gone", p.id)
	}
	client, server := net.Pipe()
	go p.serve(server)
	return client, nil
}

// serve answers one stream, as the agent does: a request, its response,
// then events or session frames.
func (p *Pod) serve(c net.Conn) {
	defer c.Close()
	dec := json.NewDecoder(c)
	var req api.Request
	if err := dec.Decode(&req); err != nil {
		return
	}
	in := io.MultiReader(dec.Buffered(), c)
	switch req.Op {
	case api.OpEvents:
		p.serveEvents(c, in)
		return
	case api.OpExecStream, api.OpAttach, api.OpPortForward:
		p.serveSession(c, in, &req)
		return
	case api.OpExec:
		resp, err := p.exec(&req)
		if err != nil {
			resp = wire.ErrorResponse(err)
		}
		_ = json.NewEncoder(c).Encode(resp)
		return
	}
	resp, err := p.handle(&req)
	if err != nil {
		resp = wire.ErrorResponse(err)
	}
	_ = json.NewEncoder(c).Encode(resp)
	if req.Op == api.OpShutdown && err == nil {
		p.Die()
	}
}

// handle answers a plain request.
func (p *Pod) handle(req *api.Request) (*api.Response, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.calls[req.Op]++
	switch req.Op {
	case api.OpInfo:
		return &api.Response{Info: &api.Info{Version: api.Version, PID: 1, Kernel: "fake"}}, nil
	case api.OpCreate:
		if req.App == nil || req.App.ID == "" {
			return nil, errdefs.InvalidArgument("create: no app")
		}
		if _, ok := p.apps[req.App.ID]; ok {
			return nil, errdefs.AlreadyExists("app %s exists", req.App.ID)
		}
		st := &api.AppStatus{ID: req.App.ID, State: api.StateCreated, CreatedAt: time.Now()}
		p.apps[req.App.ID] = st
		p.specs[req.App.ID] = req.App
		p.publishLocked(api.EventCreated, st)
		return p.appResponse(st), nil
	case api.OpStart:
		a, err := p.app(req.ID)
		if err != nil {
			return nil, err
		}
		if a.State != api.StateCreated {
			return nil, errdefs.FailedPrecondition("app %s is %s", req.ID, a.State)
		}
		a.State, a.StartedAt, a.PID = api.StateRunning, time.Now(), 4242
		p.publishLocked(api.EventStarted, a)
		resp := p.appResponse(a)
		ctx, kill := context.WithCancel(context.Background())
		p.kill[req.ID] = kill
		go p.runApp(ctx, req.ID, p.specs[req.ID])
		return resp, nil
	case api.OpStop:
		a, err := p.app(req.ID)
		if err != nil {
			return nil, err
		}
		if p.exitLocked(req.ID, 137) {
			p.publishLocked(api.EventExited, a)
		}
		return p.appResponse(a), nil
	case api.OpRemove:
		if a, ok := p.apps[req.ID]; ok {
			delete(p.apps, req.ID)
			delete(p.specs, req.ID)
			p.publishLocked(api.EventRemoved, a)
		}
		return &api.Response{}, nil
	case api.OpStatus:
		a, err := p.app(req.ID)
		if err != nil {
			return nil, err
		}
		return p.appResponse(a), nil
	case api.OpList:
		return &api.Response{Apps: p.listLocked()}, nil
	case api.OpReopenLog:
		_, err := p.app(req.ID)
		return &api.Response{}, err
	case api.OpStats:
		if req.ID != "" {
			if _, err := p.app(req.ID); err != nil {
				return nil, err
			}
		}
		return &api.Response{Stats: &api.Stats{Timestamp: time.Now(), CPUUsageNanos: 1}}, nil
	case api.OpSysctl:
		p.sysctls = maps.Clone(req.Sysctls)
		return &api.Response{}, nil
	case api.OpUpdate:
		a, err := p.app(req.ID)
		if err != nil {
			return nil, err
		}
		if a.State == api.StateExited {
			return nil, errdefs.FailedPrecondition("app %s has exited", req.ID)
		}
		if req.Resources == nil {
			return nil, errdefs.InvalidArgument("update: no resources")
		}
		if p.updates == nil {
			p.updates = map[string]api.Resources{}
		}
		p.updates[req.ID] = *req.Resources
		return p.appResponse(a), nil
	case api.OpShutdown:
		for id := range p.apps {
			if p.exitLocked(id, 137) {
				p.publishLocked(api.EventExited, p.apps[id])
			}
		}
		return &api.Response{}, nil
	}
	return nil, errdefs.InvalidArgument("unknown operation %q", req.Op)
}

func (p *Pod) app(id string) (*api.AppStatus, error) {
	a, ok := p.apps[id]
	if !ok {
		return nil, errdefs.NotFound("app %s", id)
	}
	return a, nil
}

func (p *Pod) runningLocked(id string) error {
	a, err := p.app(id)
	if err != nil {
		return err
	}
	if a.State != api.StateRunning {
		return errdefs.FailedPrecondition("app %s is not running", id)
	}
	return nil
}

func (p *Pod) appResponse(a *api.AppStatus) *api.Response {
	cp := *a
	return &api.Response{App: &cp}
}

func (p *Pod) listLocked() []*api.AppStatus {
	out := make([]*api.AppStatus, 0, len(p.apps))
	for _, a := range p.apps {
		cp := *a
		out = append(out, &cp)
	}
	return out
}

// serveEvents answers an events subscription: every app, then each
// change, until the client goes, the agent drops it or the agent ends.
func (p *Pod) serveEvents(c net.Conn, in io.Reader) {
	enc := json.NewEncoder(c)
	p.mu.Lock()
	if p.noEvents {
		p.mu.Unlock()
		_ = enc.Encode(wire.ErrorResponse(errdefs.InvalidArgument("unknown operation %q", api.OpEvents)))
		return
	}
	ch := make(chan *api.Event, 1000)
	if p.subs == nil {
		p.subs = map[chan *api.Event]struct{}{}
	}
	p.subs[ch] = struct{}{}
	snap := p.listLocked()
	gone := p.gone
	p.mu.Unlock()
	defer func() {
		p.mu.Lock()
		delete(p.subs, ch)
		p.mu.Unlock()
	}()
	if err := enc.Encode(&api.Response{Apps: snap}); err != nil {
		return
	}
	left := make(chan struct{})
	go func() {
		_, _ = io.Copy(io.Discard, in)
		close(left)
	}()
	for {
		select {
		case ev, ok := <-ch:
			if !ok {
				return
			}
			if err := enc.Encode(ev); err != nil {
				return
			}
		case <-gone:
			return
		case <-left:
			return
		}
	}
}

// serveSession answers an exec, attach or port-forward session.
func (p *Pod) serveSession(c net.Conn, in io.Reader, req *api.Request) {
	p.mu.Lock()
	p.calls[req.Op]++
	var err error
	if req.Op != api.OpPortForward {
		err = p.runningLocked(req.ID)
	}
	p.mu.Unlock()
	if err != nil {
		_ = json.NewEncoder(c).Encode(wire.ErrorResponse(err))
		return
	}
	switch req.Op {
	case api.OpExecStream:
		_ = wire.ServeStdioSession(c, in, func(stdin io.Reader, stdout, stderr io.Writer) int32 {
			if req.Stdio == nil || !req.Stdio.Stdin {
				stdin = nil
			}
			return shell(context.Background(), req.Cmd, stdin, stdout, stderr)
		})
	case api.OpAttach:
		// The toy app's own output goes to its log only: an attach
		// echoes what it is sent.
		_ = wire.ServeStdioSession(c, in, func(stdin io.Reader, stdout, stderr io.Writer) int32 {
			_, _ = io.Copy(stdout, stdin)
			return 0
		})
	case api.OpPortForward:
		_ = wire.ServePortSession(c, in, func(stream io.ReadWriter) {
			fmt.Fprintf(stream, "port %d: ", req.Port)
			_, _ = io.Copy(stream, stream)
		})
	}
}

// exec runs an OpExec request's command in a running app with the toy
// shell, up to the request's timeout.
func (p *Pod) exec(req *api.Request) (*api.Response, error) {
	p.mu.Lock()
	p.calls[req.Op]++
	err := p.runningLocked(req.ID)
	p.mu.Unlock()
	if err != nil {
		return nil, err
	}
	ctx := context.Background()
	if req.Timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, req.Timeout)
		defer cancel()
	}
	var stdout, stderr bytes.Buffer
	code := shell(ctx, req.Cmd, nil, &stdout, &stderr)
	res := &api.ExecResult{Stdout: stdout.Bytes(), Stderr: stderr.Bytes(), ExitCode: code}
	if ctx.Err() != nil {
		res.TimedOut = true
	}
	return &api.Response{Exec: res}, nil
}

// runApp runs a started app's command with the toy shell, its output to
// its CRI log, and records its exit unless something else ended it
// first (a stop, a test's Exit).
func (p *Pod) runApp(ctx context.Context, id string, spec *api.AppSpec) {
	var stdout, stderr io.Writer = io.Discard, io.Discard
	if spec.LogPath != "" {
		stdout, stderr = &criLog{path: spec.LogPath, stream: "stdout"}, &criLog{path: spec.LogPath, stream: "stderr"}
	}
	code := shell(ctx, spec.Args, nil, stdout, stderr)
	p.mu.Lock()
	defer p.mu.Unlock()
	if ctx.Err() != nil {
		return
	}
	if p.exitLocked(id, code) {
		p.publishLocked(api.EventExited, p.apps[id])
	}
}

// criLog writes one stream of an app's output to its CRI log, a line at a
// time ("<time> <stream> F <line>"); the file is opened for each line
// (without following a symlink), so a rotated log needs no reopening.
type criLog struct {
	path, stream string
	partial      []byte
}

func (l *criLog) Write(b []byte) (int, error) {
	n := len(b)
	for len(b) > 0 {
		i := bytes.IndexByte(b, '\n')
		if i < 0 {
			l.partial = append(l.partial, b...)
			break
		}
		line := append(l.partial, b[:i]...)
		l.partial, b = nil, b[i+1:]
		f, err := os.OpenFile(l.path, os.O_WRONLY|os.O_APPEND|os.O_CREATE|syscall.O_NOFOLLOW, 0o640)
		if err != nil {
			return 0, err
		}
		_, err = fmt.Fprintf(f, "%s %s F %s\n", time.Now().Format(time.RFC3339Nano), l.stream, line)
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return 0, err
		}
	}
	return n, nil
}
