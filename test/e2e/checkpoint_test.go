package e2e

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/encoding/protojson"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/checkpoint"
	"github.com/stagelet/stagelet/internal/testutil"
	"github.com/stagelet/stagelet/preflight"
	"github.com/stagelet/stagelet/test/e2e/harness"
)

// needCRIU skips a test where no criu works on this kernel, saying why
// (scripts/build-criu.sh, which make deps runs, installs one that does).
func needCRIU(t *testing.T) {
	t.Helper()
	requireRoot(t)
	path, ver, _, err := preflight.FindCRIU(context.Background(), "")
	if err != nil {
		t.Skipf("no criu works here: %v", err)
	}
	t.Logf("criu %s (%s)", ver, path)
}

// TestCheckpointRestore: on this host (its kernel, its cgroup hierarchy:
// v1 with the freezer, or v2), a counter of a fly pod and of an nspawn
// pod, each in its own PID namespace as the kubelet asks, is checkpointed
// into an archive and goes on counting. The archive is restored into a
// container of a new pod (the archive's path as its image, as CRI-O
// takes it), and, pushed as a checkpoint image by `stagelet checkpoint
// image` and pulled, into a container of another (the image's reference,
// as the kubelet names it): each counts on from where it was, with the
// checkpointed process's environment, and stops and goes as any
// container. The steps' times are logged.
func TestCheckpointRestore(t *testing.T) {
	needCRIU(t)
	forEachStage1(t, func(t *testing.T, e *env, s podStage1) {
		ctr := func(name string) *runtimeapi.ContainerConfig {
			c := e.netContainer(s, name, "sh", "-c", testutil.CounterCmd)
			c.Envs = []*runtimeapi.KeyValue{{Key: "MOVED_FROM", Value: []byte("the first pod")}}
			c.Linux.SecurityContext.NamespaceOptions.Pid = runtimeapi.NamespaceMode_CONTAINER
			return c
		}
		cfg := e.netPodConfig("ckpt", s)
		pod := e.runStage1Pod(cfg, s)
		id := e.createAndStart(pod, cfg, ctr("counter"))
		count := testutil.Counting(t, e.rt(), id)

		archive := filepath.Join(t.TempDir(), "counter.tar")
		before := count()
		start := time.Now()
		if _, err := e.rt().CheckpointContainer(e.ctx(), &runtimeapi.CheckpointContainerRequest{ContainerId: id, Location: archive, Timeout: 120}); err != nil {
			t.Fatalf("CheckpointContainer: %v", err)
		}
		took := time.Since(start)
		fi, err := os.Stat(archive)
		if err != nil {
			t.Fatal(err)
		}
		meta, err := checkpoint.ReadMeta(archive)
		if err != nil || meta.ID != id || meta.Stage1 != s.handler {
			t.Fatalf("the archive says %+v, %v", meta, err)
		}
		t.Logf("%s: CheckpointContainer took %v, archive %d bytes", s.handler, took.Round(time.Millisecond), fi.Size())
		n0 := count()
		testutil.WaitFor(t, time.Minute, "the counter counts on after its checkpoint", func() (bool, string) {
			n := count()
			return n > n0, strconv.Itoa(n)
		})
		if st := e.containerStatus(id); st.State != runtimeapi.ContainerState_CONTAINER_RUNNING {
			t.Errorf("after its checkpoint the container is %v", st.State)
		}

		// From the archive.
		e.restoreInto(s, "from-archive", archive, before)

		// From a checkpoint image.
		ref := e.reg.Host + "/e2e/checkpoint:" + s.handler
		start = time.Now()
		out, err := exec.Command(stageletBin, "checkpoint", "image", archive, ref).CombinedOutput()
		if err != nil {
			t.Fatalf("stagelet checkpoint image: %v\n%s", err, out)
		}
		pushed := time.Since(start)
		start = time.Now()
		e.pull(ref)
		t.Logf("%s: checkpoint image built and pushed in %v, pulled in %v", s.handler, pushed.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
		e.restoreInto(s, "from-image", ref, before)
	})
}

// restoreInto restores the counter checkpointed at before (its count just
// before the checkpoint) from image (an archive's path, a checkpoint
// image) into a container of a new pod of stage1 s: it counts on from
// there to its new log, with its environment, and stops and goes.
func (e *env) restoreInto(s podStage1, name, image string, before int) {
	t := e.t
	t.Helper()
	cfg := e.netPodConfig(name, s)
	pod := e.runStage1Pod(cfg, s)
	c := &runtimeapi.ContainerConfig{
		Metadata: &runtimeapi.ContainerMetadata{Name: "counter"},
		Image:    &runtimeapi.ImageSpec{Image: image},
		LogPath:  "counter.log",
	}
	id := e.createContainer(pod, cfg, c)
	start := time.Now()
	e.startContainer(id)
	took := time.Since(start)
	first := testutil.CountsOn(t, filepath.Join(cfg.LogDirectory, "counter.log"))
	if first-1 < before {
		t.Errorf("%s: the restored counter began its log at %d, before its count at the checkpoint (%d or more)", name, first, before)
	}
	env := e.execOK(id, "cat", "/proc/self/environ")
	if !strings.Contains(env, "MOVED_FROM=the first pod") {
		t.Errorf("%s: the restored container's environment lacks the checkpointed one's: %q", name, env)
	}
	// It is shown its new cgroup (its old one went with the first pod).
	procs := e.execOK(id, "sh", "-c", "cat /sys/fs/cgroup/cgroup.procs /sys/fs/cgroup/pids/cgroup.procs 2>/dev/null; true")
	if len(strings.Fields(procs)) == 0 {
		t.Errorf("%s: the restored container sees no process in its cgroup at /sys/fs/cgroup", name)
	}
	t.Logf("%s %s: restored in %v (StartContainer); its log goes on from %d (checkpointed at %d or after)", s.handler, name, took.Round(time.Millisecond), first, before)
	if _, err := e.rt().StopContainer(e.ctx(), &runtimeapi.StopContainerRequest{ContainerId: id, Timeout: 10}); err != nil {
		t.Errorf("%s: StopContainer (restored): %v", name, err)
	}
	if st := e.containerStatus(id); st.State != runtimeapi.ContainerState_CONTAINER_EXITED {
		t.Errorf("%s: restored container after its stop: %v", name, st.State)
	}
	if _, err := e.rt().RemoveContainer(e.ctx(), &runtimeapi.RemoveContainerRequest{ContainerId: id}); err != nil {
		t.Errorf("%s: RemoveContainer (restored): %v", name, err)
	}
}

// TestPodMovesBetweenDaemons: a pod of two counters moves from one
// daemon (a node) to another, driven from the command line as an
// operator would: `stagelet checkpoint pod` saves both, paused together,
// into a directory on the first; the directory is copied; `stagelet
// checkpoint restore-pod` makes a pod of it on the second, whose
// counters count on, together, from where they were.
func TestPodMovesBetweenDaemons(t *testing.T) {
	needCRIU(t)
	from := newEnvOpts(t, harness.Options{Policy: bothStage1sPolicy}, true)
	to := &env{t: t, reg: from.reg, image: from.image, d: startDaemonOpts(t, from.reg, harness.Options{Policy: bothStage1sPolicy})}
	s := nspawnStage1

	cfg := from.netPodConfig("mover", s)
	pod := from.runStage1Pod(cfg, s)
	counts := map[string]func() int{}
	for _, name := range []string{"one", "two"} {
		c := from.netContainer(s, name, "sh", "-c", testutil.CounterCmd)
		c.Linux.SecurityContext.NamespaceOptions.Pid = runtimeapi.NamespaceMode_CONTAINER
		counts[name] = testutil.Counting(t, from.rt(), from.createAndStart(pod, cfg, c))
	}
	before := map[string]int{}
	for name, count := range counts {
		before[name] = count()
	}
	saved := filepath.Join(t.TempDir(), "mover")
	start := time.Now()
	if out, err := exec.Command(stageletBin, "checkpoint", "pod", "-socket", from.d.Socket, pod, saved).CombinedOutput(); err != nil {
		t.Fatalf("stagelet checkpoint pod: %v\n%s", err, out)
	}
	t.Logf("stagelet checkpoint pod took %v", time.Since(start).Round(time.Millisecond))
	// The move: the copy goes to the other node, the pod stops here.
	copied := filepath.Join(t.TempDir(), "moved")
	if out, err := exec.Command("cp", "-a", saved, copied).CombinedOutput(); err != nil {
		t.Fatalf("cp: %v\n%s", err, out)
	}
	if _, err := from.rt().StopPodSandbox(from.ctx(), &runtimeapi.StopPodSandboxRequest{PodSandboxId: pod}); err != nil {
		t.Fatal(err)
	}

	newCfg := to.netPodConfig("mover", s)
	b, err := protojson.Marshal(newCfg)
	if err != nil {
		t.Fatal(err)
	}
	cfgFile := filepath.Join(t.TempDir(), "pod.json")
	if err := os.WriteFile(cfgFile, b, 0o600); err != nil {
		t.Fatal(err)
	}
	start = time.Now()
	out, err := exec.Command(stageletBin, "checkpoint", "restore-pod", "-socket", to.d.Socket, "-runtime", s.handler, "-config", cfgFile, copied).Output()
	if err != nil {
		t.Fatalf("stagelet checkpoint restore-pod: %v\n%s", err, out)
	}
	t.Logf("stagelet checkpoint restore-pod took %v", time.Since(start).Round(time.Millisecond))
	restored := strings.TrimSpace(string(out))
	to.cleanupPod(restored)
	if got := to.podStatus(restored).RuntimeHandler; got != s.handler {
		t.Errorf("the restored pod runs on %q, want %q", got, s.handler)
	}
	resp, err := to.rt().ListContainers(to.ctx(), &runtimeapi.ListContainersRequest{Filter: &runtimeapi.ContainerFilter{PodSandboxId: restored}})
	if err != nil || len(resp.Containers) != 2 {
		t.Fatalf("the restored pod's containers: %v, %v", resp.GetContainers(), err)
	}
	for _, c := range resp.Containers {
		if c.State != runtimeapi.ContainerState_CONTAINER_RUNNING {
			t.Errorf("restored container %s is %v", c.Metadata.Name, c.State)
		}
		first := testutil.CountsOn(t, filepath.Join(newCfg.LogDirectory, c.Metadata.Name+".log"))
		if first-1 < before[c.Metadata.Name] {
			t.Errorf("restored counter %s began its log at %d, before its count at the checkpoint (%d or more)", c.Metadata.Name, first, before[c.Metadata.Name])
		}
		t.Logf("%s: counts on from %d (checkpointed at %d or after)", c.Metadata.Name, first, before[c.Metadata.Name])
	}
}
