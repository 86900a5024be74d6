package broker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/testutil"
	"github.com/stagelet/stagelet/policy"
	"github.com/stagelet/stagelet/stage1"
	"github.com/stagelet/stagelet/stage1/fake"
)

type env struct {
	net    *fakeNetwork
	be     *fake.Backend
	vm     *fake.Backend
	images *fakeImages
	state  string
	run    string
	// obs is the brokers' Observer; nil: none.
	obs Observer
	// criu is the brokers' Options.CRIU.
	criu func(context.Context) (string, error)
	// live is the brokers' Options.LiveAddress.
	live string
}

func newEnv(t *testing.T) *env {
	t.Helper()
	dir := t.TempDir()
	vm := fake.New("vm")
	vm.Caps = stage1.Capabilities{Isolation: stage1.IsolationKernel, KernelIsolated: true, PodNetwork: true, Privileged: "guest"}
	vm.PodMemory = 256 << 20
	be := fake.New("fake")
	be.Caps = stage1.Capabilities{HostNetwork: true, HostPID: true, HostIPC: true, Privileged: "host"}
	// Long enough for the calls of a parallel recovery to overlap.
	be.RecoverDelay, vm.RecoverDelay = 20*time.Millisecond, 20*time.Millisecond
	return &env{be: be, vm: vm, images: &fakeImages{}, state: filepath.Join(dir, "state"), run: filepath.Join(dir, "run")}
}

const testPolicy = `version: 1
default_stage1: fake
handlers:
  fake: {stage1: fake}
  fake-nohost: {stage1: fake, privileged_without_host_devices: true}
  vm: {stage1: vm}
rules:
  - name: no-privileged-in-locked
    match: {namespaces: [locked], privileged: true}
    refuse: "no privileged pods in locked"
  - name: privileged-to-vm
    match: {privileged: true}
    stage1: vm
annotations:
  allow: [vm]
`

// network returns the env's network, or nil (an untyped nil, so the broker
// sees no network) when the test gave none.
func (e *env) network() Network {
	if e.net == nil {
		return nil
	}
	return e.net
}

func (e *env) policy(t *testing.T) *policy.Policy {
	t.Helper()
	p, err := policy.Parse("test-policy.yaml", []byte(testPolicy))
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// broker starts a broker over the env's directories and recovers it, as
// the daemon does on every start.
func (e *env) broker(t *testing.T) *Broker {
	t.Helper()
	b, err := New(Options{
		StateDir: e.state, RunDir: e.run, CgroupParent: "test", Policy: e.policy(t),
		AgentBinary: "/nonexistent", Backends: stage1.Registry{"fake": e.be, "vm": e.vm}, Images: e.images, Network: e.network(),
		Observer: e.obs, CRIU: e.criu, LiveAddress: e.live,
	})
	if err != nil {
		t.Fatal(err)
	}
	if b.Ready() {
		t.Fatal("ready before recovery")
	}
	if _, err := b.Recover(context.Background()); err != nil {
		t.Fatal(err)
	}
	if !b.Ready() {
		t.Fatal("not ready after recovery")
	}
	t.Cleanup(b.Close)
	return b
}

func podCfg(name string) *PodConfig {
	return &PodConfig{
		Metadata:    PodMetadata{Name: name, Namespace: "default", UID: "uid-" + name},
		Labels:      map[string]string{"app": name, "tier": "web"},
		Annotations: map[string]string{"note": "kept exactly"},
		HostNetwork: true,
	}
}

func ctrCfg(name string) *ContainerConfig {
	return &ContainerConfig{Metadata: ContainerMetadata{Name: name}, Image: fakeImage.RepoTags[0], Labels: map[string]string{"c": name}}
}

func wantClass(t *testing.T, err, class error) {
	t.Helper()
	if !errors.Is(err, class) {
		t.Fatalf("err = %v, want class %v", err, class)
	}
}

func TestRunPodValidation(t *testing.T) {
	b := newEnv(t).broker(t)
	ctx := context.Background()
	for _, tc := range []struct {
		mutate func(*PodConfig)
		field  string
	}{
		{func(c *PodConfig) { c.Metadata.Name = "" }, "config.metadata.name"},
		{func(c *PodConfig) { c.Metadata.Namespace = "" }, "config.metadata.namespace"},
		{func(c *PodConfig) { c.Metadata.UID = "" }, "config.metadata.uid"},
		{func(c *PodConfig) { c.LogDirectory = "relative" }, "config.log_directory"},
		{func(c *PodConfig) { c.CgroupParent = "/kubepods/../x" }, "config.linux.cgroup_parent"},
		{func(c *PodConfig) { c.RuntimeHandler = "nosuch" }, "runtime handler \"nosuch\""},
	} {
		c := podCfg("v")
		tc.mutate(c)
		_, err := b.RunPod(ctx, c)
		wantClass(t, err, errdefs.ErrInvalidArgument)
		if !contains(err.Error(), tc.field) {
			t.Errorf("error %q does not name %s", err, tc.field)
		}
	}
}

func contains(s, sub string) bool { return strings.Contains(s, sub) }

func TestRunPodRetryAndNameReservation(t *testing.T) {
	e := newEnv(t)
	b := e.broker(t)
	ctx := context.Background()
	var wg sync.WaitGroup
	ids := make([]string, 4)
	for i := range ids {
		wg.Add(1)
		go func() {
			defer wg.Done()
			id, err := b.RunPod(ctx, podCfg("web"))
			if err != nil {
				t.Error(err)
			}
			ids[i] = id
		}()
	}
	wg.Wait()
	for _, id := range ids[1:] {
		if id != ids[0] {
			t.Fatalf("retries created different pods: %v", ids)
		}
	}
	if n := e.be.Pods(); n != 1 {
		t.Fatalf("backend started %d pods, want 1", n)
	}
	other := podCfg("web")
	other.Labels = map[string]string{"different": "config"}
	_, err := b.RunPod(ctx, other)
	wantClass(t, err, errdefs.ErrAlreadyExists)

	// After removal the name is free again.
	if err := b.RemovePod(ctx, ids[0]); err != nil {
		t.Fatal(err)
	}
	if _, err := b.RunPod(ctx, other); err != nil {
		t.Fatal(err)
	}
}

func TestPodLifecycleIdempotent(t *testing.T) {
	e := newEnv(t)
	b := e.broker(t)
	ctx := context.Background()
	id, err := b.RunPod(ctx, podCfg("p"))
	if err != nil {
		t.Fatal(err)
	}
	st, err := b.PodStatus(ctx, id, true)
	if err != nil {
		t.Fatal(err)
	}
	if !st.Ready || st.Record.Stage1 != "fake" || st.Info["stage1"] != "fake" || st.Info["stage1.fake"] != "yes" {
		t.Fatalf("status = %+v", st)
	}
	if st.Record.Config.Annotations["note"] != "kept exactly" || st.Record.Config.Labels["tier"] != "web" {
		t.Fatalf("labels/annotations not kept: %+v", st.Record.Config)
	}
	for range 2 {
		if err := b.StopPod(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	st, _ = b.PodStatus(ctx, id, false)
	if st.Ready {
		t.Fatal("ready after stop")
	}
	for range 2 {
		if err := b.RemovePod(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	_, err = b.PodStatus(ctx, id, false)
	wantClass(t, err, errdefs.ErrNotFound)
	if err := b.StopPod(ctx, "unknown-id"); err != nil {
		t.Fatal("stop of an unknown pod:", err)
	}
	if err := b.RemovePod(ctx, "unknown-id"); err != nil {
		t.Fatal("remove of an unknown pod:", err)
	}
	if e.be.Destroyed(id) != 1 {
		t.Fatalf("DestroyPod called %d times", e.be.Destroyed(id))
	}
	if _, err := os.Stat(filepath.Join(e.state, "pods", id+".json")); !os.IsNotExist(err) {
		t.Fatal("record left after remove")
	}
}

func TestFailedStartReleasesEverything(t *testing.T) {
	e := newEnv(t)
	e.be.FailStart(true)
	b := e.broker(t)
	_, err := b.RunPod(context.Background(), podCfg("bad"))
	if err == nil {
		t.Fatal("start should fail")
	}
	if len(b.ListPods(PodFilter{})) != 0 {
		t.Fatal("a failed pod is listed")
	}
	ents, _ := os.ReadDir(filepath.Join(e.state, "pods"))
	if len(ents) != 0 {
		t.Fatalf("records left: %v", ents)
	}
	if e.be.DestroyedPods() != 1 {
		t.Fatal("backend resources not released")
	}
	e.be.FailStart(false)
	if _, err := b.RunPod(context.Background(), podCfg("bad")); err != nil {
		t.Fatalf("the name stayed reserved: %v", err)
	}
}

func TestContainerLifecycle(t *testing.T) {
	e := newEnv(t)
	b := e.broker(t)
	ctx := context.Background()
	pid, _ := b.RunPod(ctx, podCfg("p"))
	cid, err := b.CreateContainer(ctx, pid, ctrCfg("c"))
	if err != nil {
		t.Fatal(err)
	}
	again, err := b.CreateContainer(ctx, pid, ctrCfg("c"))
	if err != nil || again != cid {
		t.Fatalf("same-config retry: %v %v", again, err)
	}
	other := ctrCfg("c")
	other.Args = []string{"different"}
	_, err = b.CreateContainer(ctx, pid, other)
	wantClass(t, err, errdefs.ErrAlreadyExists)

	rec, err := b.ContainerStatus(ctx, cid)
	if err != nil || rec.State != ContainerCreated {
		t.Fatalf("status: %+v %v", rec, err)
	}
	if rec.App.UID != 1000 || rec.App.GID != 1000 || !slices.Contains(rec.App.AdditionalGIDs, 2000) {
		t.Fatalf("user from the image not resolved: %+v", rec.App)
	}
	if _, err := b.ExecSync(ctx, cid, []string{"true"}, 0); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("exec in a created container: %v", err)
	}
	if err := b.StartContainer(ctx, cid); err != nil {
		t.Fatal(err)
	}
	wantClass(t, b.StartContainer(ctx, cid), errdefs.ErrFailedPrecondition)
	if got := b.ListContainers(ctx, ContainerFilter{State: ContainerRunning}); len(got) != 1 || got[0].ID != cid {
		t.Fatalf("running list: %v", got)
	}
	if got := b.ListContainers(ctx, ContainerFilter{LabelSelector: map[string]string{"c": "nope"}}); len(got) != 0 {
		t.Fatalf("label filter: %v", got)
	}
	// The app exits on its own: the agent tells the broker.
	e.be.Pod(pid).Exit(cid, 3)
	rec = waitContainer(t, b, cid, func(r *ContainerRecord) bool { return r.State == ContainerExited })
	if rec.ExitCode != 3 || rec.Reason != api.ReasonError || rec.FinishedAt.IsZero() {
		t.Fatalf("exit not seen: %+v", rec)
	}
	for range 2 {
		if err := b.StopContainer(ctx, cid, time.Second); err != nil {
			t.Fatal(err)
		}
		if err := b.RemoveContainer(ctx, cid); err != nil {
			t.Fatal(err)
		}
	}
	_, err = b.ContainerStatus(ctx, cid)
	wantClass(t, err, errdefs.ErrNotFound)
	// The container's file system goes off the reply path; the pod's
	// removal waits for it.
	if err := b.RemovePod(ctx, pid); err != nil {
		t.Fatal(err)
	}
	if n := e.images.mountedDirs(); n != 0 {
		t.Fatalf("rootfs left mounted after the pod's removal: %d", n)
	}
}

// RemoveContainer answers once the container's record and app are gone;
// its file system is unmounted and removed after the reply, and the
// pod's removal, and Close, wait for that.
func TestRemoveContainerReleasesFSInBackground(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	b := e.broker(t)
	pid, err := b.RunPod(ctx, podCfg("p"))
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"a", "b"} {
		cid, err := b.CreateContainer(ctx, pid, ctrCfg(name))
		if err != nil {
			t.Fatal(err)
		}
		rec, err := b.ContainerStatus(ctx, cid)
		if err != nil {
			t.Fatal(err)
		}
		e.images.mu.Lock()
		e.images.hold = make(chan struct{})
		hold := e.images.hold
		e.images.mu.Unlock()
		removed := make(chan error, 1)
		go func() { removed <- b.RemoveContainer(ctx, cid) }()
		select {
		case err := <-removed:
			if err != nil {
				t.Fatal(err)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("RemoveContainer waited for the container's file system to be released")
		}
		_, err = b.ContainerStatus(ctx, cid)
		wantClass(t, err, errdefs.ErrNotFound)
		if _, err := os.Stat(rec.Dir); err != nil {
			t.Fatalf("the file system went before its release was let go: %v", err)
		}
		if name == "a" {
			close(hold)
			if err := b.RemovePod(ctx, pid); err != nil {
				t.Fatal(err)
			}
			if _, err := os.Stat(rec.Dir); !errors.Is(err, os.ErrNotExist) {
				t.Fatalf("container file system left after the pod's removal: %v", err)
			}
			if pid, err = b.RunPod(ctx, podCfg("p2")); err != nil {
				t.Fatal(err)
			}
			continue
		}
		// Close waits for a release under way.
		closed := make(chan struct{})
		go func() { b.Close(); close(closed) }()
		close(hold)
		<-closed
		if _, err := os.Stat(rec.Dir); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("container file system left after Close: %v", err)
		}
	}
}

// The kubelet's removals of a pod's containers may race each other and
// the pod's own removal: each file system is released once, and the
// pod's removal returns after all of them.
func TestConcurrentRemovals(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	b := e.broker(t)
	pid, err := b.RunPod(ctx, podCfg("p"))
	if err != nil {
		t.Fatal(err)
	}
	var ids, dirs []string
	for _, name := range []string{"a", "b", "c"} {
		cid, err := b.CreateContainer(ctx, pid, ctrCfg(name))
		if err != nil {
			t.Fatal(err)
		}
		rec, err := b.ContainerStatus(ctx, cid)
		if err != nil {
			t.Fatal(err)
		}
		ids, dirs = append(ids, cid), append(dirs, rec.Dir)
	}
	errs := make(chan error, 2*len(ids)+1)
	for _, id := range append(slices.Clone(ids), ids...) {
		go func() { errs <- b.RemoveContainer(ctx, id) }()
	}
	go func() { errs <- b.RemovePod(ctx, pid) }()
	podGone := false
	for range cap(errs) {
		if err := <-errs; err != nil {
			t.Error(err)
		}
		if _, err := b.PodStatus(ctx, pid, false); errdefs.IsNotFound(err) && !podGone {
			podGone = true
			for _, d := range dirs {
				if _, err := os.Stat(d); !errors.Is(err, os.ErrNotExist) {
					t.Errorf("%s left when its pod's removal returned: %v", d, err)
				}
			}
		}
	}
	if n := e.images.mountedDirs(); n != 0 {
		t.Errorf("file systems left mounted: %d", n)
	}
}

func TestRecoveryAfterRestart(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	b := e.broker(t)
	live, _ := b.RunPod(ctx, podCfg("live"))
	dead, _ := b.RunPod(ctx, podCfg("dead"))
	c1, _ := b.CreateContainer(ctx, live, ctrCfg("a"))
	c2, _ := b.CreateContainer(ctx, live, ctrCfg("b"))
	c3, _ := b.CreateContainer(ctx, dead, ctrCfg("x"))
	for _, c := range []string{c1, c2, c3} {
		if err := b.StartContainer(ctx, c); err != nil {
			t.Fatal(err)
		}
	}
	// The daemon dies. While it is down c2 exits and the pod "dead" dies.
	b.Close()
	e.be.Pod(live).Exit(c2, 7)
	e.be.Pod(dead).Die()

	// A crash in the middle of a create leaves a "creating" record.
	half := &PodRecord{ID: "half", State: PodCreating, Config: *podCfg("half"), Stage1: "fake", RunDir: filepath.Join(e.run, "pods", "half")}
	os.MkdirAll(half.RunDir, 0o700)
	(&records{dir: e.state}).savePod(half)
	// And a record that cannot be read.
	os.WriteFile(filepath.Join(e.state, "pods", "garbage.json"), []byte("{not json"), 0o600)
	// And a pod the stage1 holds that no record names (its record lost).
	lost := strings.Repeat("ab", 32)
	if _, err := e.be.StartPod(ctx, &stage1.PodSpec{ID: lost, RunDir: filepath.Join(e.run, "lost")}, func([]byte) error { return nil }); err != nil {
		t.Fatal(err)
	}

	b2 := e.broker(t)
	if e.be.Pod(lost) != nil || e.be.Destroyed(lost) != 1 {
		t.Errorf("the stage1's pod no record names was not collected")
	}
	if st, err := b2.PodStatus(ctx, live, false); err != nil || !st.Ready {
		t.Fatalf("live pod after restart: %+v %v", st, err)
	}
	if st, err := b2.PodStatus(ctx, dead, false); err != nil || st.Ready {
		t.Fatalf("dead pod after restart: %+v %v", st, err)
	}
	r1, _ := b2.ContainerStatus(ctx, c1)
	r2, _ := b2.ContainerStatus(ctx, c2)
	r3, _ := b2.ContainerStatus(ctx, c3)
	if r1.State != ContainerRunning {
		t.Errorf("c1 = %s, want running", r1.State)
	}
	if r2.State != ContainerExited || r2.ExitCode != 7 {
		t.Errorf("c2 = %s/%d, want exited/7", r2.State, r2.ExitCode)
	}
	if r3.State != ContainerExited || r3.Reason != api.ReasonError {
		t.Errorf("c3 = %s/%s, want exited/Error", r3.State, r3.Reason)
	}
	if _, err := b2.PodStatus(ctx, "half", false); !errdefs.IsNotFound(err) {
		t.Errorf("half-created pod not discarded: %v", err)
	}
	if e.be.Destroyed("half") != 1 {
		t.Errorf("half-created pod's resources not released")
	}
	if _, err := os.Stat(half.RunDir); !os.IsNotExist(err) {
		t.Errorf("half-created pod's run dir left")
	}
	// Names stay reserved across the restart.
	other := podCfg("live")
	other.Labels = nil
	if _, err := b2.RunPod(ctx, other); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Errorf("name reservation lost: %v", err)
	}
	for _, id := range []string{live, dead} {
		if err := b2.RemovePod(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	if len(b2.ListContainers(ctx, ContainerFilter{})) != 0 {
		t.Fatal("containers left after pod removal")
	}
}

func TestImageInUseCannotBeRemoved(t *testing.T) {
	e := newEnv(t)
	b := e.broker(t)
	ctx := context.Background()
	pid, _ := b.RunPod(ctx, podCfg("p"))
	if _, err := b.CreateContainer(ctx, pid, ctrCfg("c")); err != nil {
		t.Fatal(err)
	}
	wantClass(t, b.RemoveImage(ctx, fakeImage.ID), errdefs.ErrFailedPrecondition)
	if err := b.RemoveImage(ctx, "absent.test/none:latest"); err != nil {
		t.Fatalf("removing an absent image: %v", err)
	}
}

// podNet is a pod config in its own network (the vm stage1 has no host
// network).
func podNet(name string) *PodConfig {
	c := podCfg(name)
	c.HostNetwork = false
	return c
}

func TestPolicyDecidesAndIsRecorded(t *testing.T) {
	e := newEnv(t)
	e.net = newFakeNetwork(filepath.Join(e.run, "netns"))
	b := e.broker(t)
	ctx := context.Background()
	plain, err := b.RunPod(ctx, podNet("plain"))
	if err != nil {
		t.Fatal(err)
	}
	raised := podNet("raised")
	raised.Annotations = map[string]string{"stagelet.io/stage1": "vm"}
	vmPod, err := b.RunPod(ctx, raised)
	if err != nil {
		t.Fatal(err)
	}
	st1, _ := b.PodStatus(ctx, plain, true)
	st2, _ := b.PodStatus(ctx, vmPod, true)
	if st1.Record.Stage1 != "fake" || st2.Record.Stage1 != "vm" {
		t.Fatalf("stage1s: %s, %s", st1.Record.Stage1, st2.Record.Stage1)
	}
	if !strings.Contains(st2.Info["reasons"], "stagelet.io/stage1") {
		t.Fatalf("reasons do not name the annotation: %q", st2.Info["reasons"])
	}
	if e.vm.Pods() != 1 || e.be.Pods() != 1 {
		t.Fatalf("pods per backend: fake %d, vm %d", e.be.Pods(), e.vm.Pods())
	}
	// A new policy applies to new pods only; the recorded decision stays.
	p, _ := policy.Parse("p2", []byte("version: 1\ndefault_stage1: vm\nhandlers: {fake: {stage1: fake}}\n"))
	b.SetPolicy(p)
	if st, _ := b.PodStatus(ctx, plain, false); st.Record.Stage1 != "fake" {
		t.Fatal("a running pod's stage1 changed with the policy")
	}
	later, _ := b.RunPod(ctx, podNet("later"))
	if st, _ := b.PodStatus(ctx, later, false); st.Record.Stage1 != "vm" {
		t.Fatalf("new pod got %s under the new policy", st.Record.Stage1)
	}
	// After a restart the recorded decision routes the pod, whatever the
	// policy says now.
	b2 := e.broker(t)
	if st, err := b2.PodStatus(ctx, plain, false); err != nil || !st.Ready || st.Record.Stage1 != "fake" {
		t.Fatalf("after restart: %+v %v", st, err)
	}
	if c := b.DecisionCounts(); c["fake"] != 1 || c["vm"] != 2 {
		t.Fatalf("counts = %v", c)
	}
}

func TestPolicyRefusals(t *testing.T) {
	b := newEnv(t).broker(t)
	ctx := context.Background()
	unknown := podCfg("u")
	unknown.RuntimeHandler = "nosuch"
	_, err := b.RunPod(ctx, unknown)
	wantClass(t, err, errdefs.ErrInvalidArgument)

	locked := podCfg("l")
	locked.Metadata.Namespace = "locked"
	locked.Privileged = true
	_, err = b.RunPod(ctx, locked)
	wantClass(t, err, errdefs.ErrPermissionDenied)
	if !strings.Contains(err.Error(), "no privileged pods in locked") {
		t.Fatalf("refusal does not carry the operator's message: %v", err)
	}
	if b.DecisionCounts()["refused"] != 2 {
		t.Fatalf("counts = %v", b.DecisionCounts())
	}
}

func TestPrivilegedContainerRechecksPolicy(t *testing.T) {
	e := newEnv(t)
	e.net = newFakeNetwork(filepath.Join(e.run, "netns"))
	b := e.broker(t)
	ctx := context.Background()
	pid, _ := b.RunPod(ctx, podNet("p"))
	c := ctrCfg("priv")
	c.Security.Privileged = true
	_, err := b.CreateContainer(ctx, pid, c)
	wantClass(t, err, errdefs.ErrPermissionDenied)
	if !strings.Contains(err.Error(), `stage1 "vm"`) {
		t.Fatalf("message: %v", err)
	}
	// Declared at sandbox level, the same container is fine.
	pc := podNet("q")
	pc.Privileged = true
	pid2, err := b.RunPod(ctx, pc)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.CreateContainer(ctx, pid2, c); err != nil {
		t.Fatal(err)
	}
}

func TestKubeletCgroupParentIsUsed(t *testing.T) {
	e := newEnv(t)
	b := e.broker(t)
	ctx := context.Background()
	c := podCfg("k")
	c.CgroupParent = "/kubepods/burstable/poduid-k"
	id, err := b.RunPod(ctx, c)
	if err != nil {
		t.Fatal(err)
	}
	plain, _ := b.RunPod(ctx, podCfg("plain"))
	if got := e.be.Spec(id).CgroupParent; got != c.CgroupParent {
		t.Errorf("cgroup parent = %q, want the kubelet's %q", got, c.CgroupParent)
	}
	if got := e.be.Spec(plain).CgroupParent; got != "test" {
		t.Errorf("cgroup parent = %q, want the node's", got)
	}
}

// TestCgroupParentMatchesTheDriver: a kubelet whose cgroup driver differs
// from the node's is told so at RunPodSandbox instead of its pod being
// placed somewhere it did not ask for.
func TestCgroupParentMatchesTheDriver(t *testing.T) {
	e := newEnv(t)
	b := e.broker(t)
	ctx := context.Background()
	c := podCfg("slice")
	c.CgroupParent = "kubepods-burstable-poduid.slice"
	_, err := b.RunPod(ctx, c)
	wantClass(t, err, errdefs.ErrInvalidArgument)
	if !contains(err.Error(), "cgroupfs") {
		t.Errorf("error %q does not name the node's driver", err)
	}

	b.opts.SystemdCgroup = true
	c = podCfg("path")
	c.CgroupParent = "/kubepods/burstable/poduid"
	_, err = b.RunPod(ctx, c)
	wantClass(t, err, errdefs.ErrInvalidArgument)
	if !contains(err.Error(), "systemd") {
		t.Errorf("error %q does not name the node's driver", err)
	}
	c = podCfg("slice2")
	c.CgroupParent = "kubepods-burstable-poduid2.slice"
	id, err := b.RunPod(ctx, c)
	if err != nil {
		t.Fatal(err)
	}
	if got := e.be.Spec(id).CgroupParent; got != c.CgroupParent {
		t.Errorf("cgroup parent = %q, want the kubelet's slice", got)
	}
}

func TestPodNetworkLifecycle(t *testing.T) {
	e := newEnv(t)
	net := newFakeNetwork(filepath.Join(e.run, "netns"))
	e.net = net
	b := e.broker(t)
	ctx := context.Background()
	c := podCfg("n")
	c.HostNetwork = false
	c.Hostname = "n-host"
	c.DNS = &DNSConfig{Servers: []string{"10.0.0.10"}, Searches: []string{"svc.local"}, Options: []string{"ndots:5"}}
	c.PortMappings = []PortMapping{{Protocol: "TCP", ContainerPort: 80, HostPort: 8080}, {Protocol: "TCP", ContainerPort: 81}}
	c.Sysctls = map[string]string{"net.core.somaxconn": "1024"}
	id, err := b.RunPod(ctx, c)
	if err == nil {
		// The fake netns is a plain file: applying the sysctl must fail and
		// release everything.
		t.Fatalf("sysctl on a fake netns: id %q err %v", id, err)
	}
	if len(net.attached) != 0 || len(net.netns) != 0 {
		t.Fatalf("a failed start left network resources: %v %v", net.attached, net.netns)
	}
	c.Sysctls = nil
	id, err = b.RunPod(ctx, c)
	if err != nil {
		t.Fatal(err)
	}
	st, _ := b.PodStatus(ctx, id, false)
	if st.Record.NetNS == "" || !slices.Equal(st.Record.IPs, []string{"10.213.0.2"}) {
		t.Fatalf("record: netns %q ips %v", st.Record.NetNS, st.Record.IPs)
	}
	if got := e.be.Spec(id).NetNSPath; got != st.Record.NetNS {
		t.Fatalf("backend got netns %q", got)
	}
	if pm := net.attached[id].PortMappings; len(pm) != 1 || pm[0].HostPort != 8080 {
		t.Fatalf("port mappings sent to CNI: %+v", pm)
	}
	resolv, _ := os.ReadFile(filepath.Join(st.Record.RunDir, "etc", "resolv.conf"))
	if !strings.Contains(string(resolv), "nameserver 10.0.0.10") || !strings.Contains(string(resolv), "ndots:5") {
		t.Fatalf("resolv.conf:\n%s", resolv)
	}
	cid, err := b.CreateContainer(ctx, id, ctrCfg("c"))
	if err != nil {
		t.Fatal(err)
	}
	rec, _ := b.ContainerStatus(ctx, cid)
	var dests []string
	for _, m := range rec.App.Mounts {
		dests = append(dests, m.Destination)
	}
	if !slices.Contains(dests, "/etc/resolv.conf") || !slices.Contains(dests, "/etc/hostname") || !slices.Contains(dests, "/etc/hosts") {
		t.Fatalf("pod files not mounted: %v", dests)
	}
	// Stop releases the attachment; remove the netns. Both idempotent.
	for range 2 {
		if err := b.StopPod(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	if _, ok := net.attached[id]; ok {
		t.Fatal("CNI attachment left after stop")
	}
	if _, ok := net.netns[id]; !ok {
		t.Fatal("netns removed at stop; it goes at remove")
	}
	if err := b.RemovePod(ctx, id); err != nil {
		t.Fatal(err)
	}
	if len(net.netns) != 0 {
		t.Fatal("netns left after remove")
	}
}

func TestOrphanNetNSCollectedOnRecovery(t *testing.T) {
	e := newEnv(t)
	net := newFakeNetwork(filepath.Join(e.run, "netns"))
	e.net = net
	net.NewNetNS(context.Background(), "orphan")
	net.attached["orphan"] = nil
	e.broker(t)
	if len(net.netns) != 0 || len(net.attached) != 0 {
		t.Fatalf("orphan not released: %v %v", net.netns, net.attached)
	}
}

func TestHostSysctlsRefused(t *testing.T) {
	b := newEnv(t).broker(t)
	c := podCfg("s")
	c.Sysctls = map[string]string{"kernel.panic": "1"}
	_, err := b.RunPod(context.Background(), c)
	wantClass(t, err, errdefs.ErrInvalidArgument)
	c.Sysctls = map[string]string{"net.core.somaxconn": "1"}
	_, err = b.RunPod(context.Background(), c)
	wantClass(t, err, errdefs.ErrInvalidArgument) // the pod is in the host network
}

func TestContainerPIDMode(t *testing.T) {
	b := newEnv(t).broker(t)
	ctx := context.Background()
	pc := podCfg("pid")
	pid, _ := b.RunPod(ctx, pc)
	for _, tc := range []struct {
		mode, want string
		err        error
	}{
		{PIDModeContainer, api.PIDNamespaceContainer, nil},
		{PIDModePod, "", nil},
		{"", "", nil},
		{PIDModeNode, "", errdefs.ErrInvalidArgument}, // the pod does not share the host's PID namespace
	} {
		c := ctrCfg("c-" + tc.mode)
		c.Security.PIDMode = tc.mode
		id, err := b.CreateContainer(ctx, pid, c)
		if tc.err != nil {
			wantClass(t, err, tc.err)
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		rec, _ := b.ContainerStatus(ctx, id)
		if rec.App.PIDNamespace != tc.want {
			t.Errorf("mode %q: PIDNamespace %q, want %q", tc.mode, rec.App.PIDNamespace, tc.want)
		}
	}
}

func TestPodWhoseAgentDiesBecomesNotReady(t *testing.T) {
	e := newEnv(t)
	b := e.broker(t)
	ctx := context.Background()
	id, _ := b.RunPod(ctx, podCfg("dies"))
	cid, _ := b.CreateContainer(ctx, id, ctrCfg("c"))
	if err := b.StartContainer(ctx, cid); err != nil {
		t.Fatal(err)
	}
	fp := e.be.Pod(id)
	lists := fp.Calls(api.OpList)
	// The agent's event stream ends: the broker notices without a list.
	fp.Die()
	waitFor(t, "the pod turns not ready", func() bool {
		st, err := b.PodStatus(ctx, id, false)
		return err == nil && !st.Ready && st.Record.Gone
	})
	rec := waitContainer(t, b, cid, func(r *ContainerRecord) bool { return r.State == ContainerExited })
	if rec.ExitCode != 255 {
		t.Fatalf("container after the agent died: %s/%d", rec.State, rec.ExitCode)
	}
	if n := fp.Calls(api.OpList); n != lists {
		t.Errorf("noticing the death took %d list calls", n-lists)
	}
	// Stop kills what the pod left; remove releases the rest.
	if err := b.StopPod(ctx, id); err != nil {
		t.Fatal(err)
	}
	if e.be.Destroyed(id) != 1 {
		t.Fatalf("stop of a dead pod did not release it: %d", e.be.Destroyed(id))
	}
	if err := b.RemovePod(ctx, id); err != nil {
		t.Fatal(err)
	}
}

func TestPodResourcesReachTheBackend(t *testing.T) {
	e := newEnv(t)
	b := e.broker(t)
	c := podCfg("sized")
	c.Resources = &Resources{MemoryLimit: 512 << 20, CPUQuota: 200000, CPUPeriod: 100000}
	id, err := b.RunPod(context.Background(), c)
	if err != nil {
		t.Fatal(err)
	}
	want := stage1.PodResources{MemoryLimit: 512 << 20, CPUQuota: 200000, CPUPeriod: 100000}
	if got := e.be.Spec(id).Resources; got != want {
		t.Fatalf("backend got %+v, want %+v", got, want)
	}
}

// TestExecSyncOneRoundTrip: an exec into a running container is one agent
// call; when the app has exited meanwhile the agent's refusal comes back
// as FailedPrecondition and the record learns the exit.
func TestExecSyncOneRoundTrip(t *testing.T) {
	e := newEnv(t)
	b := e.broker(t)
	ctx := context.Background()
	pid, _ := b.RunPod(ctx, podCfg("x"))
	cid, _ := b.CreateContainer(ctx, pid, ctrCfg("c"))
	if err := b.StartContainer(ctx, cid); err != nil {
		t.Fatal(err)
	}
	fp := e.be.Pod(pid)
	lists := fp.Calls(api.OpList)
	if res, err := b.ExecSync(ctx, cid, []string{"echo", "x"}, time.Second); err != nil || string(res.Stdout) != "x\n" {
		t.Fatalf("exec: %v %v", res, err)
	}
	if execs, n := fp.Calls(api.OpExec), fp.Calls(api.OpList); execs != 1 || n != lists {
		t.Fatalf("exec cost %d exec and %d list calls, want 1 and 0", execs, n-lists)
	}
	fp.ExitQuietly(cid, 5) // its event still on its way
	_, err := b.ExecSync(ctx, cid, []string{"true"}, time.Second)
	wantClass(t, err, errdefs.ErrFailedPrecondition)
	b.mu.Lock()
	rec := *b.ctrs[cid].rec
	b.mu.Unlock()
	if rec.State != ContainerExited || rec.ExitCode != 5 {
		t.Fatalf("record after the refusal: %s/%d", rec.State, rec.ExitCode)
	}
	// Now the record alone refuses, without asking the agent.
	_, err = b.ExecSync(ctx, cid, []string{"true"}, time.Second)
	wantClass(t, err, errdefs.ErrFailedPrecondition)
	if n := fp.Calls(api.OpExec); n != 2 {
		t.Fatalf("exec into an exited container asked the agent: %d calls", n)
	}
}

// IPC sysctls reach the pod (its agent, in the pod's IPC namespace) before
// RunPod returns; a host-IPC pod's are refused; only net.* sysctls go to
// the network namespace.
func TestIPCSysctlsGoToThePod(t *testing.T) {
	e := newEnv(t)
	b := e.broker(t)
	ctx := context.Background()
	c := podCfg("ipc")
	c.Sysctls = map[string]string{"kernel.shm_rmid_forced": "1", "fs.mqueue.msg_max": "100", "kernel.sem": "1 2 3 4"}
	id, err := b.RunPod(ctx, c)
	if err != nil {
		t.Fatal(err)
	}
	got := e.be.Pod(id).Sysctls()
	if !maps.Equal(got, c.Sysctls) {
		t.Errorf("the pod got sysctls %v, want %v", got, c.Sysctls)
	}

	h := podCfg("ipc-host")
	h.HostIPC = true
	h.Sysctls = map[string]string{"kernel.msgmax": "1"}
	_, err = b.RunPod(ctx, h)
	wantClass(t, err, errdefs.ErrInvalidArgument)
	if !strings.Contains(err.Error(), "kernel.msgmax") {
		t.Errorf("the refusal does not name the sysctl: %v", err)
	}
}

// The container security fields the CRI conformance suite checks: their
// validation, and what reaches the agent.
func TestContainerSecurityFields(t *testing.T) {
	b := newEnv(t).broker(t)
	ctx := context.Background()
	pod, err := b.RunPod(ctx, podCfg("sec"))
	if err != nil {
		t.Fatal(err)
	}
	other, err := b.RunPod(ctx, podCfg("other"))
	if err != nil {
		t.Fatal(err)
	}
	gid := int64(1002)
	for name, mut := range map[string]func(*ContainerConfig){
		"group without user": func(c *ContainerConfig) { c.Security.RunAsGroup = &gid },
		"relative masked":    func(c *ContainerConfig) { c.Security.MaskedPaths = []string{"proc/kcore"} },
		"relative read-only": func(c *ContainerConfig) { c.Security.ReadonlyPaths = []string{"tmp"} },
		"rro not read-only": func(c *ContainerConfig) {
			c.Mounts = []Mount{{ContainerPath: "/m", HostPath: "/tmp", RecursiveReadonly: true}}
		},
		"rro with rslave": func(c *ContainerConfig) {
			c.Mounts = []Mount{{ContainerPath: "/m", HostPath: "/tmp", Readonly: true, RecursiveReadonly: true, Propagation: "rslave"}}
		},
		"target without id": func(c *ContainerConfig) { c.Security.PIDMode = PIDModeTarget },
	} {
		c := ctrCfg("bad-" + strings.ReplaceAll(name, " ", "-"))
		mut(c)
		_, err := b.CreateContainer(ctx, pod, c)
		if !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("%s: %v, want InvalidArgument", name, err)
		}
	}
	uid := int64(1001)
	c := ctrCfg("fields")
	c.Security.RunAsUser, c.Security.RunAsGroup = &uid, &gid
	c.Security.MaskedPaths = []string{"/bin/ls"}
	c.Security.ReadonlyPaths = []string{"/tmp"}
	c.Mounts = []Mount{{ContainerPath: "/m", HostPath: "/tmp", Readonly: true, RecursiveReadonly: true}}
	target, err := b.CreateContainer(ctx, pod, c)
	if err != nil {
		t.Fatal(err)
	}
	rec, _ := b.ContainerStatus(ctx, target)
	a := rec.App
	if a.GID != 1002 || !slices.Equal(a.MaskedPaths, []string{"/bin/ls"}) || !slices.Equal(a.ReadonlyPaths, []string{"/tmp"}) || !a.Mounts[0].RecursiveReadonly {
		t.Errorf("app spec: gid %d masked %v read-only %v mounts %+v", a.GID, a.MaskedPaths, a.ReadonlyPaths, a.Mounts)
	}

	d := ctrCfg("debug")
	d.Security.PIDMode, d.Security.PIDTarget = PIDModeTarget, target
	id, err := b.CreateContainer(ctx, pod, d)
	if err != nil {
		t.Fatal(err)
	}
	rec, _ = b.ContainerStatus(ctx, id)
	if rec.App.PIDNamespace != api.PIDNamespaceTarget || rec.App.PIDTarget != target {
		t.Errorf("PID target: %q %q", rec.App.PIDNamespace, rec.App.PIDTarget)
	}
	// A target in another pod, or none at all, is not found.
	for _, tgt := range []string{target, "no-such-container"} {
		d := ctrCfg("debug-other-" + tgt[:4])
		d.Security.PIDMode, d.Security.PIDTarget = PIDModeTarget, tgt
		_, err := b.CreateContainer(ctx, other, d)
		wantClass(t, err, errdefs.ErrNotFound)
	}
}

// waitFor waits, at most 10 s, until cond holds.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	testutil.WaitFor(t, 10*time.Second, what, testutil.Holds(cond))
}

// waitContainer waits until a container's record satisfies cond and
// returns it.
func waitContainer(t *testing.T, b *Broker, id string, cond func(*ContainerRecord) bool) *ContainerRecord {
	t.Helper()
	var rec *ContainerRecord
	waitFor(t, "container "+id+" changes", func() bool {
		r, err := b.ContainerStatus(context.Background(), id)
		if err != nil {
			t.Fatal(err)
		}
		rec = r
		return cond(r)
	})
	return rec
}

// TestUpdateContainerResources: new limits reach the agent and the record
// (zero fields keep theirs); an OOM score cannot change; an exited
// container's limits cannot change.
func TestUpdateContainerResources(t *testing.T) {
	e := newEnv(t)
	b := e.broker(t)
	ctx := context.Background()
	pid, _ := b.RunPod(ctx, podCfg("r"))
	cfg := ctrCfg("c")
	cfg.Resources = Resources{MemoryLimit: 64 << 20, CPUShares: 512, CPUPeriod: 100000, CPUQuota: 50000, OOMScoreAdj: 10}
	cid, err := b.CreateContainer(ctx, pid, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.StartContainer(ctx, cid); err != nil {
		t.Fatal(err)
	}
	if err := b.UpdateContainerResources(ctx, cid, Resources{MemoryLimit: 128 << 20, CPUQuota: 150000, OOMScoreAdj: 10}); err != nil {
		t.Fatal(err)
	}
	sent := e.be.Pod(pid).Updated(cid)
	if sent != (api.Resources{MemoryLimit: 128 << 20, CPUQuota: 150000}) {
		t.Errorf("the agent got %+v", sent)
	}
	rec, _ := b.ContainerStatus(ctx, cid)
	want := Resources{MemoryLimit: 128 << 20, CPUShares: 512, CPUPeriod: 100000, CPUQuota: 150000, OOMScoreAdj: 10}
	if rec.Config.Resources != want {
		t.Errorf("record after the update: %+v, want %+v", rec.Config.Resources, want)
	}
	wantClass(t, b.UpdateContainerResources(ctx, cid, Resources{OOMScoreAdj: 500}), errdefs.ErrInvalidArgument)
	// A cpuset reaches the agent and the record; a bad list is refused
	// before it does.
	if err := b.UpdateContainerResources(ctx, cid, Resources{CpusetCpus: "0-1,3", CpusetMems: "0"}); err != nil {
		t.Fatal(err)
	}
	if sent := e.be.Pod(pid).Updated(cid); sent.CpusetCpus != "0-1,3" || sent.CpusetMems != "0" {
		t.Errorf("the agent got %+v", sent)
	}
	if rec, _ := b.ContainerStatus(ctx, cid); rec.Config.Resources.CpusetCpus != "0-1,3" || rec.Config.Resources.MemoryLimit != 128<<20 {
		t.Errorf("record after the cpuset update: %+v", rec.Config.Resources)
	}
	for _, bad := range []string{"1-0", "a", "0,,1", "-1", "01", "9000"} {
		err := b.UpdateContainerResources(ctx, cid, Resources{CpusetCpus: bad})
		wantClass(t, err, errdefs.ErrInvalidArgument)
		if !strings.Contains(err.Error(), "linux.cpuset_cpus") {
			t.Errorf("%q: %v does not name the field", bad, err)
		}
	}
	if err := b.StopContainer(ctx, cid, time.Second); err != nil {
		t.Fatal(err)
	}
	wantClass(t, b.UpdateContainerResources(ctx, cid, Resources{MemoryLimit: 1 << 30}), errdefs.ErrFailedPrecondition)
	wantClass(t, b.UpdateContainerResources(ctx, "nosuch", Resources{MemoryLimit: 1 << 30}), errdefs.ErrNotFound)
}

// TestUpdatePodResources: a pod beneath the kubelet's cgroup takes any new
// total; a VM pod takes what fits in its VM and refuses the rest, keeping
// its record as it was.
func TestUpdatePodResources(t *testing.T) {
	e := newEnv(t)
	e.net = newFakeNetwork(filepath.Join(e.run, "netns"))
	b := e.broker(t)
	ctx := context.Background()
	plain, err := b.RunPod(ctx, podNet("plain"))
	if err != nil {
		t.Fatal(err)
	}
	vmCfg := podNet("sized")
	vmCfg.RuntimeHandler = "vm"
	vmPod, err := b.RunPod(ctx, vmCfg)
	if err != nil {
		t.Fatal(err)
	}
	big := Resources{MemoryLimit: 1 << 30}
	if err := b.UpdatePodResources(ctx, plain, big); err != nil {
		t.Fatal(err)
	}
	if st, _ := b.PodStatus(ctx, plain, false); st.Record.Config.Resources == nil || *st.Record.Config.Resources != big {
		t.Errorf("the plain pod's record: %+v", st.Record.Config.Resources)
	}
	wantClass(t, b.UpdatePodResources(ctx, vmPod, big), errdefs.ErrFailedPrecondition)
	// A cpuset is a container's: a pod's is refused, and a VM's container
	// cannot have one (its vCPUs are not the host's CPUs).
	wantClass(t, b.UpdatePodResources(ctx, plain, Resources{CpusetCpus: "0"}), errdefs.ErrInvalidArgument)
	pinned := podNet("pinned")
	pinned.Resources = &Resources{CpusetCpus: "0"}
	_, err = b.RunPod(ctx, pinned)
	wantClass(t, err, errdefs.ErrInvalidArgument)
	vmCtr := ctrCfg("c")
	vmCtr.Resources.CpusetCpus = "0"
	_, err = b.CreateContainer(ctx, vmPod, vmCtr)
	wantClass(t, err, errdefs.ErrInvalidArgument)
	vmCid, err := b.CreateContainer(ctx, vmPod, ctrCfg("c"))
	if err != nil {
		t.Fatal(err)
	}
	wantClass(t, b.UpdateContainerResources(ctx, vmCid, Resources{CpusetCpus: "0"}), errdefs.ErrInvalidArgument)
	if st, _ := b.PodStatus(ctx, vmPod, false); st.Record.Config.Resources != nil {
		t.Errorf("a refused resize changed the VM pod's record: %+v", st.Record.Config.Resources)
	}
	small := Resources{MemoryLimit: 128 << 20}
	if err := b.UpdatePodResources(ctx, vmPod, small); err != nil {
		t.Fatal(err)
	}
	wantClass(t, b.UpdatePodResources(ctx, "nosuch", small), errdefs.ErrNotFound)
	if err := b.StopPod(ctx, plain); err != nil {
		t.Fatal(err)
	}
	wantClass(t, b.UpdatePodResources(ctx, plain, small), errdefs.ErrFailedPrecondition)
}

// TestUnreadableRecordsSetAside: a torn pod record is moved to quarantine
// and nothing it names is touched (its run directory, its network
// namespace, its containers' records and filesystems), across restarts; a
// record from a newer stagelet stays where it is, and what it names too.
func TestUnreadableRecordsSetAside(t *testing.T) {
	e := newEnv(t)
	e.net = newFakeNetwork(filepath.Join(e.run, "netns"))
	ctx := context.Background()
	b := e.broker(t)
	torn, _ := b.RunPod(ctx, podNet("torn"))
	tornCtr, _ := b.CreateContainer(ctx, torn, ctrCfg("a"))
	newer, _ := b.RunPod(ctx, podNet("newer"))
	newerCtr, _ := b.CreateContainer(ctx, newer, ctrCfg("b"))
	b.Close()

	keep := []string{
		filepath.Join(e.run, "pods", torn, "keep.txt"),
		filepath.Join(e.state, "containers-fs", tornCtr, "rootfs", "keep.txt"),
		filepath.Join(e.state, "containers-fs", newerCtr, "rootfs", "keep.txt"),
	}
	for _, f := range keep {
		if err := os.WriteFile(f, []byte("keep"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	podRec := filepath.Join(e.state, "pods", torn+".json")
	raw, err := os.ReadFile(podRec)
	if err != nil {
		t.Fatal(err)
	}
	os.WriteFile(podRec, raw[:len(raw)/2], 0o600) // a torn write
	ctrRec := filepath.Join(e.state, "containers", newerCtr+".json")
	raw, _ = os.ReadFile(ctrRec)
	var m map[string]any
	json.Unmarshal(raw, &m)
	m["version"] = recordVersion + 1
	raw, _ = json.Marshal(m)
	os.WriteFile(ctrRec, raw, 0o600)

	for restart := 1; restart <= 2; restart++ {
		b := e.broker(t)
		if _, err := os.Stat(podRec); !os.IsNotExist(err) {
			t.Errorf("restart %d: the torn record is still among the records: %v", restart, err)
		}
		if q, _ := filepath.Glob(filepath.Join(e.state, "quarantine", "pods-"+torn+".json*")); len(q) != 1 {
			t.Errorf("restart %d: quarantine holds %v", restart, q)
		}
		if n := b.QuarantinedRecords(); n != 1 {
			t.Errorf("restart %d: %d records in quarantine, want 1", restart, n)
		}
		for _, f := range keep {
			if _, err := os.Stat(f); err != nil {
				t.Errorf("restart %d: %v", restart, err)
			}
		}
		for _, r := range []string{filepath.Join(e.state, "containers", tornCtr+".json"), ctrRec} {
			if _, err := os.Stat(r); err != nil {
				t.Errorf("restart %d: a record set aside was removed: %v", restart, err)
			}
		}
		if _, ok := e.net.netns[torn]; !ok {
			t.Errorf("restart %d: the torn pod's network namespace was released", restart)
		}
		if _, err := b.PodStatus(ctx, newer, false); err != nil {
			t.Errorf("restart %d: the pod of a container set aside: %v", restart, err)
		}
		b.Close()
	}
}

// TestRecoveryInParallelUnderADeadline: pods are reattached several at a
// time; one whose backend does not answer by the deadline is left as it
// is (not ready, its record unchanged on disk) while the others recover.
func TestRecoveryInParallelUnderADeadline(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	b := e.broker(t)
	var ids []string
	for i := range 8 {
		id, err := b.RunPod(ctx, podCfg(fmt.Sprintf("p%d", i)))
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, id)
	}
	b.Close()
	stuck := ids[3]
	e.be.Hang(stuck)
	defer func(old time.Duration) { RecoverTimeout = old }(RecoverTimeout)
	RecoverTimeout = 2 * time.Second
	before, err := os.ReadFile(filepath.Join(e.state, "pods", stuck+".json"))
	if err != nil {
		t.Fatal(err)
	}

	b2, err := New(Options{
		StateDir: e.state, RunDir: e.run, CgroupParent: "test", Policy: e.policy(t),
		AgentBinary: "/nonexistent", Backends: stage1.Registry{"fake": e.be, "vm": e.vm}, Images: e.images,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b2.Close)
	res, err := b2.Recover(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if res.Pods != 8 || res.Ready != 7 || res.Unrecovered != 1 {
		t.Errorf("recovery result %+v, want 8 pods, 7 ready, 1 unrecovered", res)
	}
	if e.be.MaxRecovering() < 2 {
		t.Errorf("at most %d pods were reattached at once", e.be.MaxRecovering())
	}
	if st, err := b2.PodStatus(ctx, stuck, false); err != nil || st.Ready {
		t.Errorf("the pod past the deadline: %+v, %v", st, err)
	}
	after, _ := os.ReadFile(filepath.Join(e.state, "pods", stuck+".json"))
	if string(after) != string(before) {
		t.Errorf("the unrecovered pod's record changed on disk")
	}
	for _, id := range ids {
		if id == stuck {
			continue
		}
		if st, err := b2.PodStatus(ctx, id, false); err != nil || !st.Ready {
			t.Errorf("pod %s after recovery: %+v, %v", id, st, err)
		}
	}
}

// TestInterruptedRecordWriteCleared: the temporary file of a record write
// the daemon died in is removed at the next start; the record it was
// replacing is read as it was.
func TestInterruptedRecordWriteCleared(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	b := e.broker(t)
	id, err := b.RunPod(ctx, podCfg("p"))
	if err != nil {
		t.Fatal(err)
	}
	b.Close()
	tmp := filepath.Join(e.state, "pods", "."+id+".json.tmp-123456")
	if err := os.WriteFile(tmp, []byte(`{"half`), 0o600); err != nil {
		t.Fatal(err)
	}
	b = e.broker(t)
	defer b.Close()
	if _, err := os.Stat(tmp); !os.IsNotExist(err) {
		t.Errorf("the interrupted write is still there: %v", err)
	}
	if st, err := b.PodStatus(ctx, id, false); err != nil || st == nil {
		t.Errorf("the pod whose record was being replaced: %v", err)
	}
	if n := b.QuarantinedRecords(); n != 0 {
		t.Errorf("%d records in quarantine, want 0", n)
	}
}

// TestUserNamespace: a pod in a user namespace of its own reaches a
// stage1 that offers them with its mapping, its containers share it (one
// asking for another is refused), and a stage1 without them refuses it.
func TestUserNamespace(t *testing.T) {
	e := newEnv(t)
	e.be.Caps.UserNamespaces = true
	b := e.broker(t)
	ctx := context.Background()
	m := &stage1.IDMapping{HostID: 1 << 20, Size: 65536}
	c := podCfg("userns")
	c.UserNS = m
	id, err := b.RunPod(ctx, c)
	if err != nil {
		t.Fatal(err)
	}
	if got := e.be.Spec(id).UserNS; got == nil || *got != *m {
		t.Errorf("the stage1 got user namespace %+v, want %+v", got, m)
	}
	ctr := ctrCfg("c")
	ctr.Security.UserNS = &stage1.IDMapping{HostID: m.HostID, Size: m.Size}
	cid, err := b.CreateContainer(ctx, id, ctr)
	if err != nil {
		t.Errorf("a container sharing its pod's user namespace: %v", err)
	}
	// No masked and no read-only paths there: the kubelet's procMount
	// Unmasked; with them, or in the host's user namespace, not.
	masked := ctrCfg("masked")
	masked.Security.UserNS, masked.Security.MaskedPaths = ctr.Security.UserNS, []string{"/proc/kcore"}
	mid, err := b.CreateContainer(ctx, id, masked)
	if err != nil {
		t.Fatal(err)
	}
	hid, _ := b.RunPod(ctx, podCfg("host-users"))
	plain, err := b.CreateContainer(ctx, hid, ctrCfg("plain"))
	if err != nil {
		t.Fatal(err)
	}
	for id, want := range map[string]bool{cid: true, mid: false, plain: false} {
		if rec, _ := b.ContainerStatus(ctx, id); rec == nil || rec.App.Unmasked != want {
			t.Errorf("container %s: unmasked %v, want %v", id, rec != nil && rec.App.Unmasked, want)
		}
	}
	for name, ns := range map[string]*stage1.IDMapping{"the host's": nil, "another": {HostID: 2 << 20, Size: 65536}} {
		ctr := ctrCfg("other-" + strings.Fields(name)[0])
		ctr.Security.UserNS = ns
		_, err := b.CreateContainer(ctx, id, ctr)
		wantClass(t, err, errdefs.ErrInvalidArgument)
	}
	vm := podCfg("userns-vm")
	vm.RuntimeHandler, vm.UserNS = "vm", m
	_, err = b.RunPod(ctx, vm)
	wantClass(t, err, errdefs.ErrInvalidArgument)
	if caps, ok := b.HandlerCapabilities("vm"); !ok || caps.UserNamespaces {
		t.Errorf("vm handler capabilities: %+v, %v", caps, ok)
	}
}

func TestWaitCreatedTellsCancelFromDeadline(t *testing.T) {
	never := make(chan struct{})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := waitCreated(ctx, never); !errors.Is(err, context.Canceled) || errors.Is(err, errdefs.ErrDeadlineExceeded) {
		t.Errorf("a cancelled caller: %v, want Canceled", err)
	}
	ctx, cancel = context.WithTimeout(context.Background(), 0)
	defer cancel()
	if err := waitCreated(ctx, never); !errors.Is(err, errdefs.ErrDeadlineExceeded) {
		t.Errorf("a caller past its deadline: %v, want DeadlineExceeded", err)
	}
}

// An image a container being created uses is never removed: either the
// creation fails because the image went first, or the removal is refused
// because the container uses it.
func TestRemoveImageWhileAContainerIsCreated(t *testing.T) {
	e := newEnv(t)
	b := e.broker(t)
	ctx := context.Background()
	pid, err := b.RunPod(ctx, podCfg("p"))
	if err != nil {
		t.Fatal(err)
	}

	// The image is removed right after the creation found it.
	found := make(chan struct{})
	removed := make(chan struct{})
	var once sync.Once
	e.images.mu.Lock()
	e.images.afterGet = func(ref string, ok bool) {
		if ref == fakeImage.RepoTags[0] && ok {
			once.Do(func() {
				close(found)
				<-removed
			})
		}
	}
	e.images.mu.Unlock()
	createErr := make(chan error, 1)
	go func() {
		_, err := b.CreateContainer(ctx, pid, ctrCfg("late"))
		createErr <- err
	}()
	<-found
	if err := b.RemoveImage(ctx, fakeImage.ID); err != nil {
		t.Fatalf("remove of an image no container has claimed yet: %v", err)
	}
	close(removed)
	if err := <-createErr; !errdefs.IsNotFound(err) {
		t.Fatalf("creation from an image removed meanwhile: %v, want NotFound", err)
	}
	e.images.mu.Lock()
	e.images.afterGet = nil
	e.images.mu.Unlock()

	// Both at once, for the race detector.
	for i := range 20 {
		if _, err := b.PullImage(ctx, fakeImage.RepoTags[0], nil, ""); err != nil {
			t.Fatal(err)
		}
		var (
			wg                   sync.WaitGroup
			createErr, removeErr error
		)
		wg.Add(2)
		go func() {
			defer wg.Done()
			_, createErr = b.CreateContainer(ctx, pid, ctrCfg(fmt.Sprintf("c%d", i)))
		}()
		go func() {
			defer wg.Done()
			removeErr = b.RemoveImage(ctx, fakeImage.ID)
		}()
		wg.Wait()
		switch {
		case createErr == nil && removeErr == nil:
			t.Fatalf("round %d: the image was removed while a container was created from it", i)
		case createErr != nil && !errdefs.IsNotFound(createErr):
			t.Fatalf("round %d: create: %v", i, createErr)
		case removeErr != nil && !errors.Is(removeErr, errdefs.ErrFailedPrecondition):
			t.Fatalf("round %d: remove: %v", i, removeErr)
		}
		for _, c := range b.ListContainers(ctx, ContainerFilter{PodID: pid}) {
			if err := b.RemoveContainer(ctx, c.ID); err != nil {
				t.Fatal(err)
			}
		}
	}
}
