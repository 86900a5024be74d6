// Package fake is a stage1 for tests that need no root: pods are kept in
// memory, and each pod's agent is the real one (agent/supervisor), run
// in-process over in-memory streams with a toy System beneath it
// (supervisor.Toy): no process, namespace or cgroup is made. Whoever talks
// to a fake pod goes through the same code as with a real one:
// AgentEndpoint, packages stage1/podconn and agent/client, the agent's
// request handling.
//
// An app's or exec's command is read by a toy shell (shell.go): a started
// app runs until its command ends, the test makes it exit (Pod.Exit), it
// is stopped, or its pod stops. A port-forward answers "port N: " and
// echoes. A pod's agent can be made to lie (Pod.Lie), as a hostile guest
// makes it.
package fake

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/opencontainers/runtime-spec/specs-go"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/agent/supervisor"
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
	// SaveApp, when set, makes pods stage1.AppCheckpointers whose
	// CheckpointApp it is (it writes stand-in images into dir).
	SaveApp func(id string, pid int, dir string) error
	// RestoreApp, when set with SaveApp, makes pods also
	// stage1.AppRestorers whose RestoreApp it is.
	RestoreApp func(r *stage1.AppRestore) (int, error)
	// MovesLive, with PodMemory, makes pods that move live to another
	// pod of the same size (stage1.PodSender, stage1.PodReceiver:
	// move.go). Capabilities.WholePodCheckpoint routes checkpoints there.
	MovesLive bool

	name string
	mu   sync.Mutex
	pods map[string]*Pod
	// destroyed counts DestroyPod calls by pod; specs are the last spec
	// of each pod.
	destroyed map[string]int
	specs     map[string]*stage1.PodSpec
	failStart bool
	frozen    map[string]bool
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
	p, err := newPod(spec, b.name)
	if err != nil {
		return nil, err
	}
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

// DestroyPod implements stage1.Backend: the pod's agent is ended, its
// records removed, the pod forgotten. Idempotent.
func (b *Backend) DestroyPod(ctx context.Context, spec *stage1.PodSpec, st []byte) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if p := b.pods[spec.ID]; p != nil {
		p.Die()
		if err := os.RemoveAll(p.guest().stateDir); err != nil {
			return err
		}
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
		if err := os.RemoveAll(p.guest().stateDir); err != nil {
			return out, err
		}
		delete(b.pods, id)
		b.destroyed[id]++
		out = append(out, id)
	}
	slices.Sort(out)
	return out, nil
}

func (b *Backend) wrap(p *Pod) stage1.Pod {
	if b.SaveApp != nil {
		sp := &savingPod{Pod: p, save: b.SaveApp, b: b}
		if b.RestoreApp != nil {
			return &restoringPod{savingPod: sp, restore: b.RestoreApp}
		}
		return sp
	}
	if b.PodMemory > 0 {
		sp := &sizedPod{Pod: p, memory: b.PodMemory}
		if b.MovesLive {
			return &movingPod{sizedPod: sp}
		}
		return sp
	}
	return p
}

// savingPod is a fake pod that saves its apps (Backend.SaveApp).
type savingPod struct {
	*Pod
	save func(id string, pid int, dir string) error
	b    *Backend
}

// FreezeApps implements stage1.AppCheckpointer: Frozen tells which apps
// are paused.
func (p *savingPod) FreezeApps(_ context.Context, ids []string) (func() error, error) {
	p.b.mu.Lock()
	defer p.b.mu.Unlock()
	if p.b.frozen == nil {
		p.b.frozen = map[string]bool{}
	}
	for _, id := range ids {
		p.b.frozen[id] = true
	}
	return func() error {
		p.b.mu.Lock()
		defer p.b.mu.Unlock()
		for _, id := range ids {
			delete(p.b.frozen, id)
		}
		return nil
	}, nil
}

// Frozen tells whether app id is paused (FreezeApps).
func (b *Backend) Frozen(id string) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.frozen[id]
}

var _ stage1.AppCheckpointer = (*savingPod)(nil)

// CheckpointApp implements stage1.AppCheckpointer.
func (p *savingPod) CheckpointApp(_ context.Context, s *stage1.AppSave) (*stage1.AppImage, error) {
	if err := p.save(s.ID, s.PID, s.Dir); err != nil {
		return nil, err
	}
	return &stage1.AppImage{Stdio: map[int]string{1: "pipe:[1]", 2: "pipe:[2]"}}, nil
}

// restoringPod is a fake pod that also restores its apps
// (Backend.RestoreApp).
type restoringPod struct {
	*savingPod
	restore func(r *stage1.AppRestore) (int, error)
}

var _ stage1.AppRestorer = (*restoringPod)(nil)

// RestoreApp implements stage1.AppRestorer.
func (p *restoringPod) RestoreApp(_ context.Context, r *stage1.AppRestore) (int, error) {
	return p.restore(r)
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
	if !p.Alive() {
		return nil
	}
	return p.guest().toy.Running()
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

// Pod is a fake pod: the real agent over a toy System, and the streams
// to it.
type Pod struct {
	id      string
	backend string // its Backend's name

	mu sync.Mutex
	g  *guest // what runs in the pod; empty once it moved away (move.go)
	// paused: the guest is on its way to another pod (move.go), which
	// holds it once dead is set too.
	paused bool
	alive  bool // the pod's isolation runs
	dead   bool // its agent is gone: dialling fails
	// calls counts requests by operation (events subscriptions aside).
	calls    map[string]int
	noEvents bool
	// quiet: the exit of these apps is not published (ExitQuietly).
	quiet map[string]bool
	// updates are the last resources each app was sent.
	updates map[string]api.Resources
	// subs are the open events subscriptions: their streams.
	subs map[*subscription]struct{}
	// liar rewrites what the agent answers (Lie).
	liar Liar
}

// Liar rewrites what a pod's agent answers, as a hostile agent (a VM's
// kernel, a compromised pod) may: the daemon's side must not believe it.
// Unset functions leave that part as the agent said it.
type Liar struct {
	// Answer changes the agent's response to req before it is sent: a
	// plain request's, and an events subscription's snapshot.
	Answer func(req *api.Request, resp *api.Response)
	// Event returns what is sent in place of one event of a
	// subscription: nothing, the event, or many.
	Event func(ev *api.Event) []*api.Event
	// SessionEnd changes how an exec or attach session ends.
	SessionEnd func(end *api.SessionEnd)
}

// Lie makes the pod's agent answer as l says from now on; the zero Liar
// makes it truthful again.
func (p *Pod) Lie(l Liar) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.liar = l
}

func (p *Pod) lies() Liar {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.liar
}

// guest is what runs in a fake pod, as a VM's kernel and memory run in a
// kvm pod: the agent, the toy System beneath it, and the directory of
// the agent's records.
type guest struct {
	agent    *supervisor.Agent
	toy      *supervisor.Toy
	stateDir string
}

// guest is what runs in the pod: the zero guest once it moved away.
func (p *Pod) guest() guest {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.g == nil {
		return guest{}
	}
	return *p.g
}

// subscription is an events stream: the client's end and the agent's.
type subscription struct{ client, agent net.Conn }

func (s *subscription) close() {
	s.client.Close()
	s.agent.Close()
}

var _ stage1.Pod = (*Pod)(nil)

// newPod starts a pod's agent, its records in the pod's run directory.
func newPod(spec *stage1.PodSpec, backend string) (*Pod, error) {
	if spec.RunDir == "" {
		return nil, errdefs.InvalidArgument("fake: pod %s: no run directory", spec.ID)
	}
	g := &guest{stateDir: filepath.Join(spec.RunDir, "fake-agent")}
	g.toy = &supervisor.Toy{Run: shell, Serve: func(port int32, conn net.Conn) {
		defer conn.Close()
		fmt.Fprintf(conn, "port %d: ", port)
		_, _ = io.Copy(conn, conn)
	}}
	a, err := supervisor.New(supervisor.Config{StateDir: g.stateDir, Logger: slog.New(slog.DiscardHandler), System: g.toy})
	if err != nil {
		return nil, err
	}
	g.agent = a
	return &Pod{id: spec.ID, backend: backend, g: g, alive: true,
		calls: map[string]int{}, quiet: map[string]bool{}, updates: map[string]api.Resources{}, subs: map[*subscription]struct{}{}}, nil
}

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
// ErrPodGone. Its apps' processes end with it.
func (p *Pod) Die() {
	p.mu.Lock()
	if p.dead {
		p.mu.Unlock()
		return
	}
	p.dead, p.alive = true, false
	subs, g := p.subs, p.g
	p.subs = map[*subscription]struct{}{}
	p.mu.Unlock()
	for s := range subs {
		s.close()
	}
	if g != nil {
		g.stop()
	}
}

// stop ends the guest's agent and its apps.
func (g *guest) stop() {
	g.agent.Close()
	g.agent.StopAll(0)
}

// Exit makes app id exit with code, and returns once the agent recorded
// the exit (and published it).
func (p *Pod) Exit(id string, code int32) {
	g := p.guest()
	if g.agent == nil {
		return
	}
	if done := g.agent.Exited(id); done != nil && g.toy.Exit(id, code) {
		<-done
	}
}

// ExitQuietly makes app id exit with code without its exit reaching the
// subscribers, as when the event is still on its way.
func (p *Pod) ExitQuietly(id string, code int32) {
	p.mu.Lock()
	p.quiet[id] = true
	p.mu.Unlock()
	p.Exit(id, code)
}

// DropSubscribers ends every events subscription while the agent lives
// on, as an agent does with a subscriber that falls behind.
func (p *Pod) DropSubscribers() {
	p.mu.Lock()
	subs := p.subs
	p.subs = map[*subscription]struct{}{}
	p.mu.Unlock()
	for s := range subs {
		s.close()
	}
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

// Updated is the last resources update app id was sent (and the agent
// took).
// DeviceRules returns the device rules the agent gave app id's cgroup.
func (p *Pod) DeviceRules(id string) []specs.LinuxDeviceCgroup { return p.guest().toy.Devices(id) }

func (p *Pod) Updated(id string) api.Resources {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.updates[id]
}

// Sysctls are the sysctls the agent set.
func (p *Pod) Sysctls() map[string]string { return p.guest().toy.Sysctls() }

// dial opens a stream to the agent: one end of a pipe, the agent serving
// the other.
func (p *Pod) dial(ctx context.Context) (net.Conn, error) {
	p.mu.Lock()
	dead, paused := p.dead, p.paused
	p.mu.Unlock()
	if dead {
		return nil, fmt.Errorf("fake: pod %s: the agent is gone", p.id)
	}
	if paused {
		return nil, fmt.Errorf("fake: pod %s: paused for a live move", p.id)
	}
	client, server := net.Pipe()
	go p.serve(server)
	return client, nil
}

// serve passes one stream's request to the agent, counting it: a plain
// request is answered by the agent's Handle; a session or an events
// subscription goes on a stream of its own to the agent's ServeConn.
func (p *Pod) serve(c net.Conn) {
	defer c.Close()
	dec := json.NewDecoder(c)
	var req api.Request
	if err := dec.Decode(&req); err != nil {
		return
	}
	in := io.MultiReader(dec.Buffered(), c)
	p.mu.Lock()
	noEvents := p.noEvents
	if req.Op != api.OpEvents {
		p.calls[req.Op]++
	}
	p.mu.Unlock()
	switch req.Op {
	case api.OpEvents:
		if noEvents {
			_ = json.NewEncoder(c).Encode(wire.ErrorResponse(errdefs.InvalidArgument("unknown operation %q", api.OpEvents)))
			return
		}
		p.subscribe(c, in, &req)
		return
	case api.OpExecStream, api.OpAttach, api.OpPortForward, api.OpLogs:
		p.session(c, in, &req)
		return
	}
	a := p.guest().agent
	if a == nil {
		return // moved away since the dial: the stream ends unanswered
	}
	resp := a.Handle(&req)
	if lie := p.lies().Answer; lie != nil {
		lie(&req, resp)
	}
	if req.Op == api.OpUpdate && resp.Code == api.CodeOK && req.Resources != nil {
		p.mu.Lock()
		p.updates[req.ID] = *req.Resources
		p.mu.Unlock()
	}
	_ = json.NewEncoder(c).Encode(resp)
	if req.Op == api.OpShutdown && resp.Code == api.CodeOK {
		p.Die()
	}
}

// toAgent opens a stream to the agent's ServeConn and sends req on it,
// without the newline after it: the client's, still to be read from its
// stream, follows.
func (p *Pod) toAgent(req *api.Request) (net.Conn, error) {
	b, err := json.Marshal(req)
	if err != nil {
		return nil, err
	}
	a := p.guest().agent
	if a == nil {
		return nil, fmt.Errorf("fake: pod %s: the agent is gone", p.id)
	}
	mine, theirs := net.Pipe()
	go a.ServeConn(theirs)
	if _, err := mine.Write(b); err != nil {
		mine.Close()
		return nil, err
	}
	return mine, nil
}

// session joins the client's stream to a session stream of the agent's.
func (p *Pod) session(c net.Conn, in io.Reader, req *api.Request) {
	a, err := p.toAgent(req)
	if err != nil {
		return
	}
	defer a.Close()
	go func() {
		_, _ = io.Copy(a, in)
		a.Close() // the client went: the agent's session ends
	}()
	lie := p.lies().SessionEnd
	if lie == nil {
		_, _ = io.Copy(c, a)
		return
	}
	dec := json.NewDecoder(a)
	var resp api.Response
	if dec.Decode(&resp) != nil || json.NewEncoder(c).Encode(&resp) != nil {
		return
	}
	fr, fw := wire.NewReader(io.MultiReader(dec.Buffered(), a)), wire.NewWriter(c)
	for {
		typ, b, err := fr.Next()
		if err != nil {
			return
		}
		if typ == api.FrameEnd {
			var end api.SessionEnd
			if json.Unmarshal(b, &end) == nil {
				lie(&end)
				b, _ = json.Marshal(&end)
			}
		}
		if fw.Send(typ, b) != nil {
			return
		}
	}
}

// subscribe passes the agent's events on to the client, but the exits
// of quiet apps, until either side goes or the subscription is dropped.
func (p *Pod) subscribe(c net.Conn, in io.Reader, req *api.Request) {
	a, err := p.toAgent(req)
	if err != nil {
		return
	}
	sub := &subscription{client: c, agent: a}
	p.mu.Lock()
	if p.dead {
		p.mu.Unlock()
		a.Close()
		return
	}
	p.subs[sub] = struct{}{}
	p.mu.Unlock()
	defer func() {
		p.mu.Lock()
		delete(p.subs, sub)
		p.mu.Unlock()
		sub.close()
	}()
	go func() {
		_, _ = io.Copy(io.Discard, in)
		sub.close()
	}()
	dec, enc := json.NewDecoder(a), json.NewEncoder(c)
	var resp api.Response
	if dec.Decode(&resp) != nil {
		return
	}
	if lie := p.lies().Answer; lie != nil {
		lie(req, &resp)
	}
	if enc.Encode(&resp) != nil {
		return
	}
	for {
		var ev api.Event
		if dec.Decode(&ev) != nil {
			return
		}
		p.mu.Lock()
		quiet := ev.Type == api.EventExited && ev.App != nil && p.quiet[ev.App.ID]
		p.mu.Unlock()
		if quiet {
			continue
		}
		evs := []*api.Event{&ev}
		if lie := p.lies().Event; lie != nil {
			evs = lie(&ev)
		}
		for _, e := range evs {
			if enc.Encode(e) != nil {
				return
			}
		}
	}
}
