package podconn_test

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/stage1"
	"github.com/stagelet/stagelet/stage1/fake"
	"github.com/stagelet/stagelet/stage1/podconn"
)

// The connection is tested against fake pods: the real agent, in-process
// over the fake stage1's toy shell.

// testContext bounds what a test waits for: no step of these tests takes
// more than a fraction of it, so a hang fails the test instead of
// holding it until go test's timeout.
func testContext(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// startPod starts a fake pod; it is stopped when the test ends.
func startPod(t *testing.T) (*fake.Backend, stage1.Pod) {
	t.Helper()
	b := fake.New("fake")
	spec := &stage1.PodSpec{ID: "pod", RunDir: t.TempDir()}
	pod, err := b.StartPod(testContext(t), spec, func([]byte) error { return nil })
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = pod.Stop(context.Background(), 0, func(context.Context, time.Duration) error { return nil })
	})
	return b, pod
}

// app is the spec of a container running args, with a rootfs of its own.
func app(t *testing.T, id string, args ...string) *stage1.ContainerSpec {
	return &stage1.ContainerSpec{AppSpec: api.AppSpec{ID: id, Rootfs: t.TempDir(), Args: args}}
}

// paths is a stage1.ContainerPaths that shares a container's rootfs at
// a directory of its own (the rootfs the caller names need not exist:
// the agent sees only the shared one) and records what it is told.
type paths struct {
	inPod string

	mu    sync.Mutex
	calls []string
}

var _ stage1.ContainerPaths = (*paths)(nil)

func (p *paths) record(call string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.calls = append(p.calls, call)
}

func (p *paths) told() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.calls)
}

func (p *paths) Share(ctx context.Context, spec *stage1.ContainerSpec, known func(context.Context, string) (bool, error)) (*stage1.ContainerSpec, error) {
	k, err := known(ctx, spec.ID)
	if err != nil {
		return nil, err
	}
	if k {
		p.record("share known " + spec.ID)
	} else {
		p.record("share " + spec.ID)
	}
	cp := *spec
	cp.Rootfs = p.inPod
	return &cp, nil
}

func (p *paths) Started(id string) error { p.record("started " + id); return nil }
func (p *paths) Unshare(id string) error { p.record("unshare " + id); return nil }

// TestConnContainerPaths: a container's host paths are shared before the
// agent hears of it, at the paths the agent sees; what was shared is
// undone when the create fails and when the container goes, and
// removing a container is idempotent.
func TestConnContainerPaths(t *testing.T) {
	ctx := testContext(t)
	_, pod := startPod(t)
	p := &paths{inPod: t.TempDir()}
	ep := pod.Agent()
	ep.Paths = p
	conn := podconn.New(ep, nil)

	spec := &stage1.ContainerSpec{AppSpec: api.AppSpec{ID: "a", Rootfs: "/host/not/in/the/pod", Args: []string{"sleep", "60"}}}
	if st, err := conn.CreateContainer(ctx, spec); err != nil || st.State != api.StateCreated {
		t.Fatalf("create: %+v, %v", st, err)
	}
	if spec.Rootfs != "/host/not/in/the/pod" {
		t.Errorf("the caller's spec was changed: rootfs %s", spec.Rootfs)
	}
	if _, err := conn.CreateContainer(ctx, spec); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Errorf("second create: %v, want AlreadyExists", err)
	}
	if _, err := conn.CreateContainer(ctx, &stage1.ContainerSpec{}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("create without an id: %v, want InvalidArgument", err)
	}
	if st, err := conn.StartContainer(ctx, "a"); err != nil || st.State != api.StateRunning {
		t.Fatalf("start: %+v, %v", st, err)
	}
	if _, err := conn.StartContainer(ctx, "nope"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("start of an unknown container: %v, want NotFound", err)
	}
	if st, err := conn.StopContainer(ctx, "a", time.Second); err != nil || st.State != api.StateExited {
		t.Errorf("stop: %+v, %v", st, err)
	}
	for range 2 {
		if err := conn.RemoveContainer(ctx, "a"); err != nil {
			t.Errorf("remove: %v", err)
		}
	}
	if _, err := conn.ContainerStatus(ctx, "a"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("status after remove: %v, want NotFound", err)
	}
	want := []string{"share a", "share known a", "unshare a", "started a", "unshare a", "unshare a"}
	if got := p.told(); !slices.Equal(got, want) {
		t.Errorf("the paths were told %q, want %q", got, want)
	}
}

// TestConnWithoutPaths: without ContainerPaths (the agent sees the
// host's files) the spec goes to the agent as it is.
func TestConnWithoutPaths(t *testing.T) {
	ctx := testContext(t)
	_, pod := startPod(t)
	conn := podconn.Connect(pod, nil)
	if _, err := conn.CreateContainer(ctx, app(t, "a", "true")); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.StartContainer(ctx, "a"); err != nil {
		t.Fatal(err)
	}
	if apps, err := conn.ListContainers(ctx); err != nil || len(apps) != 1 || apps[0].ID != "a" {
		t.Errorf("list: %+v, %v", apps, err)
	}
	if err := conn.RemoveContainer(ctx, "a"); err != nil {
		t.Errorf("remove: %v", err)
	}
}

// vmPod is a pod that counts on the host (stage1.HostStatser).
type vmPod struct {
	stage1.Pod
	host *api.Stats
	err  error
}

var _ stage1.HostStatser = (*vmPod)(nil)

func (p *vmPod) HostStats() (*api.Stats, error) { return p.host, p.err }

// TestPodStats: a pod's figures are its agent's, or for a pod that
// counts on the host (a VM) the host's with the agent's process count;
// when the host's cannot be read, the agent's. Stop goes through the
// pod's connection.
func TestPodStats(t *testing.T) {
	ctx := testContext(t)
	b, pod := startPod(t)
	conn := podconn.Connect(pod, nil)
	if _, err := conn.CreateContainer(ctx, app(t, "a", "sleep", "60")); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.StartContainer(ctx, "a"); err != nil {
		t.Fatal(err)
	}

	s, err := podconn.Open(pod, nil).Stats(ctx, "")
	if err != nil || s.Pids != 1 {
		t.Errorf("a pod's stats: %+v, %v (want the agent's 1 process)", s, err)
	}
	vm := &vmPod{Pod: pod, host: &api.Stats{MemoryUsageBytes: 64 << 20}}
	s, err = podconn.Open(vm, nil).Stats(ctx, "")
	if err != nil || s.MemoryUsageBytes != 64<<20 || s.Pids != 1 {
		t.Errorf("a VM pod's stats: %+v, %v (want the host's memory and the agent's process count)", s, err)
	}
	vm = &vmPod{Pod: pod, err: errors.New("no qemu")}
	s, err = podconn.Open(vm, nil).Stats(ctx, "")
	if err != nil || s.MemoryUsageBytes != 0 || s.Pids != 1 {
		t.Errorf("a VM pod's stats when the host's cannot be read: %+v, %v (want the agent's)", s, err)
	}
	if s, err := podconn.Open(vm, nil).Stats(ctx, "a"); err != nil || s.Pids != 1 {
		t.Errorf("a container's stats: %+v, %v", s, err)
	}

	p := podconn.Open(pod, nil)
	if err := p.Stop(ctx, time.Second); err != nil {
		t.Errorf("stop: %v", err)
	}
	if b.Pod("pod").Alive() {
		t.Error("the pod runs after its stop")
	}
}
