package broker

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/stage1"
)

type env struct {
	be     *fakeBackend
	images *fakeImages
	state  string
	run    string
}

func newEnv(t *testing.T) *env {
	t.Helper()
	dir := t.TempDir()
	return &env{be: newFakeBackend(), images: &fakeImages{}, state: filepath.Join(dir, "state"), run: filepath.Join(dir, "run")}
}

// broker starts a broker over the env's directories and recovers it, as
// the daemon does on every start.
func (e *env) broker(t *testing.T) *Broker {
	t.Helper()
	b, err := New(Options{
		StateDir: e.state, RunDir: e.run, CgroupParent: "test", DefaultStage1: "fake",
		AgentBinary: "/nonexistent", Backends: stage1.Registry{"fake": e.be}, Images: e.images,
	})
	if err != nil {
		t.Fatal(err)
	}
	if b.Ready() {
		t.Fatal("ready before recovery")
	}
	if err := b.Recover(context.Background()); err != nil {
		t.Fatal(err)
	}
	if !b.Ready() {
		t.Fatal("not ready after recovery")
	}
	return b
}

func podCfg(name string) *PodConfig {
	return &PodConfig{
		Metadata:    PodMetadata{Name: name, Namespace: "default", UID: "uid-" + name},
		Labels:      map[string]string{"app": name, "tier": "web"},
		Annotations: map[string]string{"note": "kept exactly"},
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
		{func(c *PodConfig) { c.RuntimeHandler = "nosuch" }, "runtime_handler"},
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
	if n := len(e.be.pods); n != 1 {
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
	if e.be.destroyed[id] != 1 {
		t.Fatalf("DestroyPod called %d times", e.be.destroyed[id])
	}
	if _, err := os.Stat(filepath.Join(e.state, "pods", id+".json")); !os.IsNotExist(err) {
		t.Fatal("record left after remove")
	}
}

func TestFailedStartReleasesEverything(t *testing.T) {
	e := newEnv(t)
	e.be.failStart = true
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
	if len(e.be.destroyed) != 1 {
		t.Fatal("backend resources not released")
	}
	e.be.failStart = false
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
	// The app exits on its own: the broker learns it from the agent.
	e.be.pods[pid].exit(cid, 3)
	rec, _ = b.ContainerStatus(ctx, cid)
	if rec.State != ContainerExited || rec.ExitCode != 3 || rec.Reason != api.ReasonError || rec.FinishedAt.IsZero() {
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
	if len(e.images.mounted) != 0 {
		t.Fatalf("rootfs left mounted: %v", e.images.mounted)
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
	e.be.pods[live].exit(c2, 7)
	e.be.pods[dead].mu.Lock()
	e.be.pods[dead].alive = false
	e.be.pods[dead].mu.Unlock()

	// A crash in the middle of a create leaves a "creating" record.
	half := &PodRecord{ID: "half", State: PodCreating, Config: *podCfg("half"), Stage1: "fake", RunDir: filepath.Join(e.run, "pods", "half")}
	os.MkdirAll(half.RunDir, 0o700)
	(&records{dir: e.state}).savePod(half)
	// And a record that cannot be read.
	os.WriteFile(filepath.Join(e.state, "pods", "garbage.json"), []byte("{not json"), 0o600)

	b2 := e.broker(t)
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
	if e.be.destroyed["half"] != 1 {
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
	wantClass(t, b.RemoveImage(fakeImage.ID), errdefs.ErrFailedPrecondition)
	if err := b.RemoveImage("absent.test/none:latest"); err != nil {
		t.Fatalf("removing an absent image: %v", err)
	}
}
