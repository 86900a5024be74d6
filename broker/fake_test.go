package broker

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/image"
	"github.com/stagelet/stagelet/network"
	"github.com/stagelet/stagelet/stage1"
)

// fakeBackend keeps pods in memory; "alive" pods survive a broker restart
// as long as the same fakeBackend value is reused.
type fakeBackend struct {
	name      string
	mu        sync.Mutex
	pods      map[string]*fakePod
	destroyed map[string]int
	specs     map[string]*stage1.PodSpec
	failStart bool
	caps      stage1.Capabilities
	// hang: RecoverPod of these pods waits until its context ends.
	hang map[string]bool
	// recovering counts RecoverPod calls under way; maxRecovering is the
	// most at once.
	recovering, maxRecovering int
}

func newFakeBackend() *fakeBackend {
	return &fakeBackend{
		name:      "fake",
		pods:      map[string]*fakePod{},
		destroyed: map[string]int{},
		specs:     map[string]*stage1.PodSpec{},
		caps:      stage1.Capabilities{HostNetwork: true, HostPID: true, HostIPC: true, Privileged: "host"},
	}
}

func (f *fakeBackend) Name() string                      { return "fake" }
func (f *fakeBackend) Capabilities() stage1.Capabilities { return f.caps }

type fakeState struct {
	Version int    `json:"version"`
	ID      string `json:"id"`
}

func (f *fakeBackend) StartPod(ctx context.Context, spec *stage1.PodSpec, persist stage1.Persist) (stage1.Pod, error) {
	st := stage1.MarshalState(fakeState{Version: 1, ID: spec.ID})
	if err := persist(st); err != nil {
		return nil, err
	}
	if f.failStart {
		return nil, fmt.Errorf("fake start failure")
	}
	p := &fakePod{id: spec.ID, apps: map[string]*api.AppStatus{}, specs: map[string]*api.AppSpec{}, alive: true, gone: make(chan struct{})}
	f.mu.Lock()
	f.pods[spec.ID] = p
	f.specs[spec.ID] = spec
	f.mu.Unlock()
	return f.wrap(p), nil
}

func (f *fakeBackend) RecoverPod(ctx context.Context, spec *stage1.PodSpec, state []byte) (stage1.Pod, error) {
	var st fakeState
	if err := json.Unmarshal(state, &st); err != nil {
		return nil, err
	}
	f.mu.Lock()
	f.recovering++
	f.maxRecovering = max(f.maxRecovering, f.recovering)
	hang := f.hang[st.ID]
	f.mu.Unlock()
	defer func() {
		f.mu.Lock()
		f.recovering--
		f.mu.Unlock()
	}()
	if hang {
		<-ctx.Done()
		return nil, ctx.Err()
	}
	// Long enough for the calls of a parallel recovery to overlap.
	select {
	case <-time.After(20 * time.Millisecond):
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	p, ok := f.pods[st.ID]
	if !ok || !p.isAlive() {
		return nil, fmt.Errorf("fake: %w", stage1.ErrPodGone)
	}
	return f.wrap(p), nil
}

func (f *fakeBackend) DestroyPod(ctx context.Context, spec *stage1.PodSpec, state []byte) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.pods, spec.ID)
	f.destroyed[spec.ID]++
	return nil
}

// wrap makes the "vm" backend's pods sized ones (stage1.PodResizer), as
// a VM's are.
func (f *fakeBackend) wrap(p *fakePod) stage1.Pod {
	if f.name == "vm" {
		return &fakeVMPod{fakePod: p, memoryLimit: 256 << 20}
	}
	return p
}

// fakeVMPod is a pod of a fixed size.
type fakeVMPod struct {
	*fakePod
	memoryLimit int64
}

func (p *fakeVMPod) UpdatePodResources(ctx context.Context, r stage1.PodResources) error {
	if r.MemoryLimit > p.memoryLimit {
		return errdefs.FailedPrecondition("fake VM: %d bytes do not fit in %d", r.MemoryLimit, p.memoryLimit)
	}
	return nil
}

type fakePod struct {
	mu    sync.Mutex
	id    string
	alive bool
	dead  bool // the agent died (die): calls fail with ErrUnavailable
	execs int  // ExecSync calls, to count round trips
	lists int  // ListContainers calls
	// calls counts every call to the agent but Watch.
	calls int
	// subs are the Watch subscribers; gone is closed when the agent dies
	// or stops, which ends them. noEvents makes Watch answer as an
	// agent from before events did.
	updates  map[string]api.Resources // UpdateContainerResources by app
	subs     map[chan *api.Event]struct{}
	gone     chan struct{}
	noEvents bool
	apps     map[string]*api.AppStatus
	specs    map[string]*api.AppSpec
	// sysctls are those SetSysctls was given.
	sysctls map[string]string
}

func (p *fakePod) isAlive() bool { p.mu.Lock(); defer p.mu.Unlock(); return p.alive }

// die makes the agent die: its subscriptions end and calls fail.
func (p *fakePod) die() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.dead = true
	p.endLocked()
}

func (p *fakePod) endLocked() {
	select {
	case <-p.gone:
	default:
		close(p.gone)
	}
}

// publishLocked sends an event to every subscriber.
func (p *fakePod) publishLocked(typ string, a *api.AppStatus) {
	cp := *a
	for ch := range p.subs {
		ch <- &api.Event{Type: typ, App: &cp, Time: time.Now()}
	}
}

func (p *fakePod) Watch(ctx context.Context, snapshot func([]*api.AppStatus), event func(*api.Event)) error {
	p.mu.Lock()
	if p.noEvents {
		p.mu.Unlock()
		return errdefs.InvalidArgument(`unknown operation "events"`)
	}
	if p.dead {
		p.mu.Unlock()
		return fmt.Errorf("fake agent: %w", errdefs.ErrUnavailable)
	}
	ch := make(chan *api.Event, 1000)
	if p.subs == nil {
		p.subs = map[chan *api.Event]struct{}{}
	}
	p.subs[ch] = struct{}{}
	var snap []*api.AppStatus
	for _, a := range p.apps {
		cp := *a
		snap = append(snap, &cp)
	}
	gone := p.gone
	p.mu.Unlock()
	defer func() {
		p.mu.Lock()
		delete(p.subs, ch)
		p.mu.Unlock()
	}()
	snapshot(snap)
	for {
		select {
		case ev := <-ch:
			event(ev)
		case <-gone:
			return fmt.Errorf("fake agent: events: %w", errdefs.ErrUnavailable)
		case <-ctx.Done():
			return nil
		}
	}
}

// dropSubscribers ends every subscription while the agent lives on, as
// an agent does with a subscriber that falls behind.
func (p *fakePod) dropSubscribers() {
	p.mu.Lock()
	defer p.mu.Unlock()
	close(p.gone)
	p.gone = make(chan struct{})
}

// callCount is how many calls but Watch the agent answered.
func (p *fakePod) callCount() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.calls
}

// subscribers is how many Watch calls are subscribed now.
func (p *fakePod) subscribers() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.subs)
}

func (p *fakePod) State() []byte { return stage1.MarshalState(fakeState{Version: 1, ID: p.id}) }
func (p *fakePod) Info(ctx context.Context) (*api.Info, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.calls++
	if p.dead {
		return nil, fmt.Errorf("fake agent: %w", errdefs.ErrUnavailable)
	}
	return &api.Info{Version: api.Version, PID: 1, Kernel: "fake"}, nil
}
func (p *fakePod) Details() map[string]string { return map[string]string{"fake": "yes"} }

func (p *fakePod) CreateContainer(ctx context.Context, spec *stage1.ContainerSpec) (*api.AppStatus, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if _, ok := p.apps[spec.ID]; ok {
		return nil, errdefs.AlreadyExists("app %s exists", spec.ID)
	}
	st := &api.AppStatus{ID: spec.ID, State: api.StateCreated, CreatedAt: time.Now()}
	p.apps[spec.ID] = st
	s := spec.AppSpec
	p.specs[spec.ID] = &s
	p.calls++
	p.publishLocked(api.EventCreated, st)
	cp := *st
	return &cp, nil
}

func (p *fakePod) app(id string) (*api.AppStatus, error) {
	a, ok := p.apps[id]
	if !ok {
		return nil, errdefs.NotFound("app %s", id)
	}
	return a, nil
}

func (p *fakePod) StartContainer(ctx context.Context, id string) (*api.AppStatus, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	a, err := p.app(id)
	if err != nil {
		return nil, err
	}
	a.State, a.StartedAt, a.PID = api.StateRunning, time.Now(), 4242
	p.calls++
	p.publishLocked(api.EventStarted, a)
	cp := *a
	return &cp, nil
}

// exit makes a running app exit with code.
func (p *fakePod) exit(id string, code int32) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.exitLocked(id, code)
	p.publishLocked(api.EventExited, p.apps[id])
}

// exitQuietly makes a running app exit with code, without an event.
func (p *fakePod) exitQuietly(id string, code int32) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.exitLocked(id, code)
}

func (p *fakePod) exitLocked(id string, code int32) {
	a := p.apps[id]
	a.State, a.ExitCode, a.FinishedAt = api.StateExited, code, time.Now()
	a.Reason = api.ReasonCompleted
	if code != 0 {
		a.Reason = api.ReasonError
	}
}

func (p *fakePod) StopContainer(ctx context.Context, id string, timeout time.Duration) (*api.AppStatus, error) {
	p.mu.Lock()
	a, err := p.app(id)
	p.mu.Unlock()
	if err != nil {
		return nil, err
	}
	if a.State == api.StateRunning {
		p.exit(id, 137)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	cp := *a
	return &cp, nil
}

func (p *fakePod) RemoveContainer(ctx context.Context, id string) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.calls++
	if a, ok := p.apps[id]; ok {
		delete(p.apps, id)
		p.publishLocked(api.EventRemoved, a)
	}
	return nil
}

func (p *fakePod) ContainerStatus(ctx context.Context, id string) (*api.AppStatus, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.calls++
	a, err := p.app(id)
	if err != nil {
		return nil, err
	}
	cp := *a
	return &cp, nil
}

func (p *fakePod) ListContainers(ctx context.Context) ([]*api.AppStatus, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.lists++
	p.calls++
	if p.dead {
		return nil, fmt.Errorf("fake agent: %w", errdefs.ErrUnavailable)
	}
	var out []*api.AppStatus
	for _, a := range p.apps {
		cp := *a
		out = append(out, &cp)
	}
	return out, nil
}

func (p *fakePod) ExecSync(ctx context.Context, id string, cmd []string, timeout time.Duration) (*api.ExecResult, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.execs++
	if a, err := p.app(id); err != nil || a.State != api.StateRunning {
		return nil, errdefs.FailedPrecondition("app %s is not running", id)
	}
	return &api.ExecResult{Stdout: []byte(fmt.Sprint(cmd))}, nil
}

// ExecStream writes the command to stdout, then echoes stdin; the exit
// code is the number of arguments.
func (p *fakePod) ExecStream(ctx context.Context, id string, cmd []string, sio stage1.StreamIO) (int32, error) {
	p.mu.Lock()
	p.execs++
	a, err := p.app(id)
	p.mu.Unlock()
	if err != nil || a.State != api.StateRunning {
		return 0, errdefs.FailedPrecondition("app %s is not running", id)
	}
	fmt.Fprint(sio.Stdout, cmd)
	if sio.Stdin != nil {
		io.Copy(sio.Stdout, sio.Stdin)
	}
	return int32(len(cmd)), nil
}

// Attach echoes stdin to stdout until stdin ends.
func (p *fakePod) Attach(ctx context.Context, id string, sio stage1.StreamIO) error {
	p.mu.Lock()
	a, err := p.app(id)
	p.mu.Unlock()
	if err != nil || a.State != api.StateRunning {
		return errdefs.FailedPrecondition("app %s is not running", id)
	}
	_, err = io.Copy(sio.Stdout, sio.Stdin)
	return err
}

// PortForward answers "port N: " and echoes the stream.
func (p *fakePod) PortForward(ctx context.Context, port int32, stream io.ReadWriter) error {
	fmt.Fprintf(stream, "port %d: ", port)
	_, err := io.Copy(stream, stream)
	return err
}

func (p *fakePod) ReopenLog(ctx context.Context, id string) error { return nil }

// UpdateContainerResources records the last update of each app.
func (p *fakePod) UpdateContainerResources(ctx context.Context, id string, r api.Resources) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.calls++
	a, err := p.app(id)
	if err != nil {
		return err
	}
	if a.State == api.StateExited {
		return errdefs.FailedPrecondition("app %s has exited", id)
	}
	if p.updates == nil {
		p.updates = map[string]api.Resources{}
	}
	p.updates[id] = r
	return nil
}
func (p *fakePod) SetSysctls(ctx context.Context, sysctls map[string]string) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.sysctls = maps.Clone(sysctls)
	return nil
}
func (p *fakePod) Stats(ctx context.Context, id string) (*api.Stats, error) {
	return &api.Stats{Timestamp: time.Now(), CPUUsageNanos: 1}, nil
}
func (p *fakePod) Stop(ctx context.Context, timeout time.Duration) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, a := range p.apps {
		if a.State == api.StateRunning {
			a.State, a.ExitCode, a.Reason, a.FinishedAt = api.StateExited, 137, api.ReasonError, time.Now()
			p.publishLocked(api.EventExited, a)
		}
	}
	p.alive = false
	p.endLocked()
	return nil
}

// fakeImages is an image store with one image whose rootfs is a plain
// directory holding /etc/passwd and /etc/group.
type fakeImages struct {
	mu      sync.Mutex
	mounted map[string]bool
}

var fakeImage = &image.Image{
	ID:       "sha256:" + fmt.Sprintf("%064d", 1),
	RepoTags: []string{"example.test/busybox:latest"},
	Config:   image.ImageConfig{Entrypoint: []string{"/bin/sh"}, Cmd: []string{"-c", "true"}, Env: []string{"PATH=/bin", "A=1"}, User: "app"},
}

func (f *fakeImages) Pull(ctx context.Context, ref string, auth *image.Auth) (*image.Image, error) {
	return f.Get(ref)
}
func (f *fakeImages) Get(ref string) (*image.Image, error) {
	if ref == fakeImage.ID || ref == fakeImage.RepoTags[0] {
		return fakeImage, nil
	}
	return nil, errdefs.NotFound("image %q", ref)
}
func (f *fakeImages) List() []*image.Image           { return []*image.Image{fakeImage} }
func (f *fakeImages) Remove(ref string) error        { return nil }
func (f *fakeImages) Usage() (uint64, uint64, error) { return 1, 1, nil }
func (f *fakeImages) Root() string                   { return "/fake" }
func (f *fakeImages) MountRootfs(id, dir string) (string, error) {
	rootfs := filepath.Join(dir, "rootfs")
	if err := os.MkdirAll(filepath.Join(rootfs, "etc"), 0o755); err != nil {
		return "", err
	}
	os.WriteFile(filepath.Join(rootfs, "etc/passwd"), []byte("root:x:0:0::/root:/bin/sh\napp:x:1000:1000::/home/app:/bin/sh\n"), 0o644)
	os.WriteFile(filepath.Join(rootfs, "etc/group"), []byte("root:x:0:\napp:x:1000:\nextra:x:2000:app\n"), 0o644)
	f.mu.Lock()
	if f.mounted == nil {
		f.mounted = map[string]bool{}
	}
	f.mounted[dir] = true
	f.mu.Unlock()
	return rootfs, nil
}
func (f *fakeImages) UnmountRootfs(dir string) error {
	f.mu.Lock()
	delete(f.mounted, dir)
	f.mu.Unlock()
	return os.RemoveAll(dir)
}

// fakeNetwork hands out one IP per pod and tracks attachments; a netns is
// a plain file.
type fakeNetwork struct {
	mu       sync.Mutex
	dir      string
	netns    map[string]string
	attached map[string]*network.PodNetwork
}

func newFakeNetwork(dir string) *fakeNetwork {
	os.MkdirAll(dir, 0o700)
	return &fakeNetwork{dir: dir, netns: map[string]string{}, attached: map[string]*network.PodNetwork{}}
}

func (n *fakeNetwork) Status() (bool, string)     { return true, "" }
func (n *fakeNetwork) NetNSPath(id string) string { return filepath.Join(n.dir, id) }
func (n *fakeNetwork) NewNetNS(id string) (string, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	p := n.NetNSPath(id)
	n.netns[id] = p
	return p, os.WriteFile(p, nil, 0o600)
}
func (n *fakeNetwork) RemoveNetNS(p string) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	delete(n.netns, filepath.Base(p))
	return removeIfExists(p)
}
func (n *fakeNetwork) NetNSPods() ([]string, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	var ids []string
	for id := range n.netns {
		ids = append(ids, id)
	}
	return ids, nil
}
func (n *fakeNetwork) Setup(ctx context.Context, pn network.PodNetwork) (*network.Result, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.attached[pn.PodID] = &pn
	return &network.Result{IPs: []string{"10.213.0.2"}, Interface: "eth0"}, nil
}
func (n *fakeNetwork) Teardown(ctx context.Context, pn network.PodNetwork) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	delete(n.attached, pn.PodID)
	return nil
}
