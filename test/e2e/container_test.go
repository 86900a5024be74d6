package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/agent/supervisor"
	"github.com/stagelet/stagelet/internal/testutil"
	"github.com/stagelet/stagelet/test/e2e/harness"
	"github.com/stagelet/stagelet/test/testregistry"
)

const (
	running = runtimeapi.ContainerState_CONTAINER_RUNNING
	exited  = runtimeapi.ContainerState_CONTAINER_EXITED
	created = runtimeapi.ContainerState_CONTAINER_CREATED
)

func TestContainerLifecycle(t *testing.T) {
	e := newEnv(t)
	podCfg := e.podConfig("lifecycle")
	podID := e.runPod(podCfg)

	cfg := e.containerConfig("app", "sh", "-c", "echo started; exec sleep 3600")
	cfg.Labels = kubeletLikeLabels(t)
	cfg.Annotations = kubeletLikeAnnotations()
	cfg.Envs = []*runtimeapi.KeyValue{{Key: "FOO", Value: []byte("bar baz")}, {Key: "EMPTY", Value: []byte{}}}
	cfg.WorkingDir = "/tmp"
	before := time.Now()
	id := e.createContainer(podID, podCfg, cfg)

	st := e.containerStatus(id)
	if st.State != created {
		t.Errorf("after CreateContainer: state %s, want CONTAINER_CREATED", st.State)
	}
	if st.Id != id || !proto.Equal(st.Metadata, cfg.Metadata) {
		t.Errorf("status id %q metadata %v, want %q %v", st.Id, st.Metadata, id, cfg.Metadata)
	}
	if !sameMap(st.Labels, cfg.Labels) {
		t.Errorf("labels came back changed:\n got %q\nwant %q", st.Labels, cfg.Labels)
	}
	if !sameMap(st.Annotations, cfg.Annotations) {
		t.Errorf("annotations came back changed:\n got %q\nwant %q", st.Annotations, cfg.Annotations)
	}
	if st.GetImage().GetImage() == "" || st.ImageRef == "" {
		t.Errorf("status image %v image_ref %q, want both set", st.Image, st.ImageRef)
	}
	if want := logPath(podCfg, cfg); st.LogPath != want {
		t.Errorf("status log_path %q, want %q", st.LogPath, want)
	}
	if st.CreatedAt < before.UnixNano() || st.StartedAt != 0 || st.FinishedAt != 0 {
		t.Errorf("created container times: created %d (test began %d), started %d, finished %d", st.CreatedAt, before.UnixNano(), st.StartedAt, st.FinishedAt)
	}

	e.startContainer(id)
	st = e.waitContainerState(id, running, stateTimeout)
	if st.StartedAt < st.CreatedAt || st.StartedAt > time.Now().UnixNano() {
		t.Errorf("started_at %d not between created_at %d and now", st.StartedAt, st.CreatedAt)
	}
	e.waitLogLine(logPath(podCfg, cfg), "stdout", "started")

	if out := e.execOK(id, "sh", "-c", `echo "$FOO"; echo "[$EMPTY]"; pwd; id -u`); out != "bar baz\n[]\n/tmp\n0\n" {
		t.Errorf("environment, working dir and user seen by exec:\n%s", out)
	}
	// The rootfs is writable unless asked otherwise, and exec output does
	// not go to the container's log.
	e.execOK(id, "sh", "-c", "echo exec-marker; touch /newfile")
	if strings.Contains(e.logText(logPath(podCfg, cfg)), "exec-marker") {
		t.Errorf("ExecSync output went to the container log")
	}

	list, err := e.rt().ListContainers(e.ctx(), &runtimeapi.ListContainersRequest{})
	if err != nil {
		t.Fatalf("ListContainers: %v", err)
	}
	if len(list.Containers) != 1 || list.Containers[0].Id != id {
		t.Fatalf("ListContainers = %v, want just %s", list.Containers, id)
	}
	c := list.Containers[0]
	if c.PodSandboxId != podID || c.State != running || !sameMap(c.Labels, cfg.Labels) || !sameMap(c.Annotations, cfg.Annotations) || c.ImageRef == "" {
		t.Errorf("ListContainers item %v disagrees with the container", c)
	}

	stopAt := time.Now()
	if _, err := e.rt().StopContainer(e.ctx(), &runtimeapi.StopContainerRequest{ContainerId: id, Timeout: 10}); err != nil {
		t.Fatalf("StopContainer: %v", err)
	}
	st = e.containerStatus(id)
	if st.State != exited {
		t.Fatalf("after StopContainer returned: state %s, want CONTAINER_EXITED", st.State)
	}
	if st.ExitCode != 143 && st.ExitCode != 137 {
		t.Errorf("stopped sleep: exit code %d, want 143 (SIGTERM) or 137", st.ExitCode)
	}
	if st.FinishedAt < stopAt.UnixNano() || st.FinishedAt > time.Now().UnixNano() {
		t.Errorf("finished_at %s is not within the StopContainer call (from %s)", time.Unix(0, st.FinishedAt), stopAt)
	}
	if _, err := e.rt().StopContainer(e.ctx(), &runtimeapi.StopContainerRequest{ContainerId: id, Timeout: 10}); err != nil {
		t.Errorf("second StopContainer: %v, want success", err)
	}
	if again := e.containerStatus(id); again.ExitCode != st.ExitCode || again.FinishedAt != st.FinishedAt {
		t.Errorf("second stop changed the record: %v, was %v", again, st)
	}

	for i := 1; i <= 2; i++ {
		if _, err := e.rt().RemoveContainer(e.ctx(), &runtimeapi.RemoveContainerRequest{ContainerId: id}); err != nil {
			t.Fatalf("RemoveContainer #%d: %v", i, err)
		}
	}
	_, err = e.rt().ContainerStatus(e.ctx(), &runtimeapi.ContainerStatusRequest{ContainerId: id})
	requireCode(t, err, codes.NotFound, "ContainerStatus of a removed container")
	if _, err := e.rt().StopContainer(e.ctx(), &runtimeapi.StopContainerRequest{ContainerId: id, Timeout: 1}); err != nil {
		t.Errorf("StopContainer of a removed container: %v, want success", err)
	}
	list, err = e.rt().ListContainers(e.ctx(), &runtimeapi.ListContainersRequest{})
	if err != nil {
		t.Fatalf("ListContainers: %v", err)
	}
	if len(list.Containers) != 0 {
		t.Errorf("ListContainers after removal: %v", list.Containers)
	}
	// The log stays: the kubelet owns log files.
	if _, err := os.Stat(logPath(podCfg, cfg)); err != nil {
		t.Errorf("log file after RemoveContainer: %v", err)
	}
}

// Container names are unique per pod and attempt: a retry with the same
// config is the same container, another config under the name is refused.
func TestContainerNameUniquePerAttempt(t *testing.T) {
	e := newEnv(t)
	podCfg := e.podConfig("names")
	podID := e.runPod(podCfg)
	cfg := e.containerConfig("dup", "sleep", "3600")
	first := e.createContainer(podID, podCfg, cfg)
	if retry := e.createContainer(podID, podCfg, cfg); retry != first {
		t.Errorf("CreateContainer retried with the same config returned %s, first %s", retry, first)
	}
	differs := proto.Clone(cfg).(*runtimeapi.ContainerConfig)
	differs.Command = []string{"sleep", "7200"}
	_, err := e.rt().CreateContainer(e.ctx(), &runtimeapi.CreateContainerRequest{PodSandboxId: podID, Config: differs, SandboxConfig: podCfg})
	requireCode(t, err, codes.AlreadyExists, "CreateContainer with a taken name and another config")

	next := proto.Clone(cfg).(*runtimeapi.ContainerConfig)
	next.Metadata.Attempt = 1
	next.LogPath = "dup-1.log"
	if second := e.createContainer(podID, podCfg, next); second == first {
		t.Fatalf("attempt 1 got the same id as attempt 0")
	}
	// The same name in another pod is another container.
	otherCfg := e.podConfig("names-other")
	other := e.runPod(otherCfg)
	e.createContainer(other, otherCfg, cfg)

	if _, err := e.rt().RemoveContainer(e.ctx(), &runtimeapi.RemoveContainerRequest{ContainerId: first}); err != nil {
		t.Fatalf("RemoveContainer: %v", err)
	}
	if again := e.createContainer(podID, podCfg, differs); again == first {
		t.Errorf("a container under a freed name reused the removed container's id")
	}
	list, err := e.rt().ListContainers(e.ctx(), &runtimeapi.ListContainersRequest{Filter: &runtimeapi.ContainerFilter{PodSandboxId: podID}})
	if err != nil {
		t.Fatalf("ListContainers: %v", err)
	}
	if len(list.Containers) != 2 {
		t.Errorf("pod holds %d containers, want 2 (attempt 0 re-created, attempt 1): %v", len(list.Containers), list.Containers)
	}
}

func TestExitCodesReasonsAndTimes(t *testing.T) {
	e := newEnv(t)
	podCfg := e.podConfig("exits")
	podID := e.runPod(podCfg)
	cases := []struct {
		name   string
		cmd    []string
		code   int32
		reason string
		minRun time.Duration
	}{
		{"ok", []string{"true"}, 0, "Completed", 0},
		{"three", []string{"sh", "-c", "exit 3"}, 3, "Error", 0},
		{"slow", []string{"sh", "-c", "sleep 1; exit 42"}, 42, "Error", time.Second},
		{"killed", []string{"sh", "-c", "kill -KILL $$"}, 137, "Error", 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			before := time.Now()
			id := e.createAndStart(podID, podCfg, e.containerConfig(tc.name, tc.cmd...))
			st := e.waitContainerState(id, exited, stateTimeout)
			after := time.Now()
			if st.ExitCode != tc.code || st.Reason != tc.reason {
				t.Errorf("exit code %d reason %q, want %d %q", st.ExitCode, st.Reason, tc.code, tc.reason)
			}
			ct, sa, fi := st.CreatedAt, st.StartedAt, st.FinishedAt
			if !(before.UnixNano() <= ct && ct <= sa && sa <= fi && fi <= after.UnixNano()) {
				t.Errorf("times out of order: test began %d, created %d, started %d, finished %d, observed exited %d",
					before.UnixNano(), ct, sa, fi, after.UnixNano())
			}
			if ran := time.Duration(fi - sa); ran < tc.minRun {
				t.Errorf("ran %s by its times, but its command takes at least %s", ran, tc.minRun)
			}
		})
	}
}

func TestOOMKilledReason(t *testing.T) {
	e := newEnv(t)
	cfg := e.containerConfig("hog", "tail", "/dev/zero")
	cfg.Linux.Resources.MemoryLimitInBytes = 32 << 20
	_, id, _ := e.runOne("oom", cfg)
	st := e.waitContainerState(id, exited, 60*time.Second)
	if st.Reason != "OOMKilled" || st.ExitCode != 137 {
		t.Errorf("memory hog beyond its limit: reason %q exit code %d, want OOMKilled 137", st.Reason, st.ExitCode)
	}
}

// A pod's memory limit bounds its containers, not its runtime. In a pod
// whose cgroup is limited as the kubelet limits it (the OOMKiller node
// conformance spec: 15 MiB for one container of 15 MiB running dd with a
// 20 MiB buffer), the OOM killer takes the container's dd, which exits
// 137 OOMKilled, and the pod's agent lives on: on cgroup v1 it and
// systemd-nspawn are charged to a memory cgroup outside the pod's, where
// before the OOM killer chose the agent (its mapped binary counts as
// resident) and the container was reported exited 255. On fly likewise
// for the agent alone.
func TestPodMemoryLimitSparesAgent(t *testing.T) {
	forEachStage1(t, func(t *testing.T, e *env, s podStage1) {
		podMemoryLimitSparesAgent(t, e, s)
	})
}

func podMemoryLimitSparesAgent(t *testing.T, e *env, s podStage1) {
	// The pod cgroup's parent, limited as the kubelet's pod<uid>.
	parent, dir := kubeletPodCgroup(t, e, "oom-pod", 15<<20)
	podCfg := e.netPodConfig("oom-pod", s)
	podCfg.Linux.CgroupParent = parent
	podID := e.runStage1Pod(podCfg, s)
	podMem := filepath.Join(dir, "stagelet-pod-"+podID)
	if procs := readProcs(t, podMem); len(procs) != 0 {
		t.Errorf("processes charged to the pod's memory cgroup %s itself (the pod's agent belongs elsewhere): %v", podMem, procs)
	}

	cfg := e.netContainer(s, "hog", "sh", "-c", "sleep 1 && dd if=/dev/zero of=/dev/null bs=20M")
	cfg.Linux.Resources.MemoryLimitInBytes = 15 << 20
	id := e.createAndStart(podID, podCfg, cfg)
	st := e.waitContainerState(id, exited, 60*time.Second)
	if st.ExitCode != 137 || st.Reason != "OOMKilled" {
		t.Errorf("dd beyond its pod's and its own 15 MiB: exit code %d reason %q message %q, want 137 OOMKilled", st.ExitCode, st.Reason, st.Message)
	}
	if procs := readProcs(t, filepath.Join(podMem, "app-"+id)); len(procs) != 0 {
		t.Errorf("processes left in the exited container's memory cgroup: %v", procs)
	}
	// The agent survived: the pod takes another container.
	next := e.createAndStart(podID, podCfg, e.netContainer(s, "next", "sleep", "3600"))
	e.waitContainerState(next, running, stateTimeout)
	if out := e.execOK(next, "echo", "alive"); out != "alive\n" {
		t.Errorf("exec in the pod after the OOM kill: %q", out)
	}
	if procs := readProcs(t, filepath.Join(podMem, "app-"+next)); len(procs) == 0 {
		t.Errorf("the running container's process is not in its memory cgroup beneath the pod's %s", podMem)
	}
}

// readProcs lists the processes of the cgroup directory dir.
func readProcs(t *testing.T, dir string) []string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
	if err != nil {
		t.Fatalf("cgroup %s: %v", dir, err)
	}
	return strings.Fields(string(b))
}

// StopContainer gives a container the timeout to react to SIGTERM, then
// kills it.
func TestStopTimeoutEscalatesToKill(t *testing.T) {
	e := newEnv(t)
	cfg := e.containerConfig("stubborn", "sh", "-c", `trap "" TERM; echo ready; while true; do sleep 1; done`)
	_, id, podCfg := e.runOne("stop-timeout", cfg)
	e.waitContainerState(id, running, stateTimeout)
	e.waitLogLine(logPath(podCfg, cfg), "stdout", "ready") // the trap is set

	const timeout = 2
	began := time.Now()
	if _, err := e.rt().StopContainer(e.ctx(), &runtimeapi.StopContainerRequest{ContainerId: id, Timeout: timeout}); err != nil {
		t.Fatalf("StopContainer: %v", err)
	}
	took := time.Since(began)
	st := e.containerStatus(id)
	if st.State != exited || st.ExitCode != 137 {
		t.Errorf("container ignoring SIGTERM: state %s exit code %d, want CONTAINER_EXITED 137", st.State, st.ExitCode)
	}
	if took < timeout*time.Second {
		t.Errorf("StopContainer returned after %s, before the %ds timeout had passed", took, timeout)
	}
	if ran := time.Duration(st.FinishedAt - began.UnixNano()); ran < timeout*time.Second {
		t.Errorf("finished_at is %s after the stop began, before the %ds timeout", ran, timeout)
	}
}

func TestStopIsPromptOnSIGTERM(t *testing.T) {
	e := newEnv(t)
	_, id, _ := e.runOne("stop-prompt", e.containerConfig("sleeper", "sleep", "3600"))
	e.waitContainerState(id, running, stateTimeout)
	const timeout = 30
	began := time.Now()
	if _, err := e.rt().StopContainer(e.ctx(), &runtimeapi.StopContainerRequest{ContainerId: id, Timeout: timeout}); err != nil {
		t.Fatalf("StopContainer: %v", err)
	}
	took := time.Since(began)
	st := e.containerStatus(id)
	if st.State != exited || (st.ExitCode != 143 && st.ExitCode != 137) {
		t.Errorf("stopped sleep: state %s exit code %d, want CONTAINER_EXITED 143 (or 137)", st.State, st.ExitCode)
	}
	if took > timeout*time.Second/2 {
		t.Errorf("stopping a container that dies on SIGTERM took %s of its %ds timeout", took, timeout)
	}
}

func TestExecSync(t *testing.T) {
	e := newEnv(t)
	_, id, _ := e.runOne("exec", e.containerConfig("sleeper", "sleep", "3600"))
	e.waitContainerState(id, running, stateTimeout)

	r := e.execSync(id, "sh", "-c", "echo out; echo err >&2; exit 3")
	if string(r.Stdout) != "out\n" || string(r.Stderr) != "err\n" || r.ExitCode != 3 {
		t.Errorf("ExecSync: stdout %q stderr %q exit %d, want \"out\\n\" \"err\\n\" 3", r.Stdout, r.Stderr, r.ExitCode)
	}
	// Large output comes back whole.
	r = e.execSync(id, "sh", "-c", "head -c 1000000 /dev/zero | tr '\\0' x")
	if len(r.Stdout) != 1000000 || strings.Trim(string(r.Stdout), "x") != "" {
		t.Errorf("ExecSync of 1000000 bytes returned %d bytes", len(r.Stdout))
	}
	// The command runs inside the container's rootfs.
	if out := e.execOK(id, "cat", "/etc/passwd"); !strings.Contains(out, "app:x:1000:1000") {
		t.Errorf("/etc/passwd seen by exec is not the image's:\n%s", out)
	}
	// A missing binary is a failed call or a non-zero exit, either way.
	if r, err := e.rt().ExecSync(e.ctx(), &runtimeapi.ExecSyncRequest{ContainerId: id, Cmd: []string{"/no/such/binary"}, Timeout: 10}); err == nil && r.ExitCode == 0 {
		t.Errorf("exec of a missing binary succeeded with exit code 0")
	}

	// The timeout is enforced and reported as DeadlineExceeded, which the
	// kubelet reads as a probe timeout.
	began := time.Now()
	_, err := e.rt().ExecSync(e.ctx(), &runtimeapi.ExecSyncRequest{ContainerId: id, Cmd: []string{"sleep", "30"}, Timeout: 1})
	took := time.Since(began)
	if s, _ := status.FromError(err); s.Code() != codes.DeadlineExceeded {
		t.Errorf("ExecSync beyond its 1s timeout: %v, want DeadlineExceeded", err)
	}
	if took > 10*time.Second {
		t.Errorf("ExecSync with a 1s timeout took %s", took)
	}
}

// TestExecSyncLargeOutput: output beyond the cap is cut, so the reply fits
// the kubelet's 16 MiB receive limit (the harness's client has the
// kubelet's limit), and the daemon's memory comes back down afterwards.
func TestExecSyncLargeOutput(t *testing.T) {
	e := newEnv(t)
	_, id, _ := e.runOne("exec-large", e.containerConfig("sleeper", "sleep", "3600"))
	e.waitContainerState(id, running, stateTimeout)
	e.execOK(id, "true")
	idle, err := e.d.RSS()
	if err != nil {
		t.Fatal(err)
	}
	r := e.execSync(id, "sh", "-c", "head -c 30000000 /dev/zero | tr '\\0' x; head -c 30000000 /dev/zero | tr '\\0' y >&2")
	if n := len(r.Stdout) + len(r.Stderr); n != supervisor.ExecOutputLimit || strings.Trim(string(r.Stdout), "x") != "" || strings.Trim(string(r.Stderr), "y") != "" {
		t.Errorf("ExecSync of 60 MB: %d bytes of stdout and %d of stderr, want %d together", len(r.Stdout), len(r.Stderr), supervisor.ExecOutputLimit)
	}
	if r.ExitCode != 0 {
		t.Errorf("ExecSync of 60 MB: exit code %d", r.ExitCode)
	}
	testutil.WaitFor(t, stateTimeout, "the daemon's memory back near its idle level", func() (bool, string) {
		rss, err := e.d.RSS()
		if err != nil {
			return false, err.Error()
		}
		return rss < idle+16<<20, fmt.Sprintf("RSS %d MiB, idle %d MiB", rss>>20, idle>>20)
	})
}

func TestExecSyncInExitedContainer(t *testing.T) {
	e := newEnv(t)
	_, id, _ := e.runOne("exec-exited", e.containerConfig("done", "true"))
	e.waitContainerState(id, exited, stateTimeout)
	_, err := e.rt().ExecSync(e.ctx(), &runtimeapi.ExecSyncRequest{ContainerId: id, Cmd: []string{"true"}, Timeout: 5})
	if err == nil {
		t.Fatalf("ExecSync in an exited container succeeded")
	}
	if s, _ := status.FromError(err); s.Code() == codes.Unknown {
		t.Errorf("ExecSync in an exited container: %v; want a classified code (FailedPrecondition)", err)
	}
}

func TestCRILogFormat(t *testing.T) {
	e := newEnv(t)
	long := 20000
	cfg := e.containerConfig("talker", "sh", "-c",
		`echo out1; echo err1 >&2; echo; echo out2; head -c `+strconv.Itoa(long)+` /dev/zero | tr '\0' x; echo; echo err2 >&2`)
	_, id, podCfg := e.runOne("crilog", cfg)
	st := e.waitContainerState(id, exited, stateTimeout)
	if st.ExitCode != 0 {
		t.Fatalf("talker exited %d", st.ExitCode)
	}
	// The log may be flushed just after the exit is recorded.
	e.waitLogLine(logPath(podCfg, cfg), "stderr", "err2")
	lines := e.readCRILog(logPath(podCfg, cfg))

	stdout := harness.JoinPartial(lines, "stdout")
	want := []string{"out1", "", "out2", strings.Repeat("x", long)}
	if !slices.Equal(stdout, want) {
		t.Errorf("stdout lines: got %d lines %.80q..., want %d lines %.80q", len(stdout), stdout, len(want), want)
	}
	if stderr := harness.JoinPartial(lines, "stderr"); !slices.Equal(stderr, []string{"err1", "err2"}) {
		t.Errorf("stderr lines %q, want [err1 err2]", stderr)
	}
	start, end := time.Unix(0, st.StartedAt), time.Unix(0, st.FinishedAt)
	for i, l := range lines {
		if l.Time.Before(start.Add(-time.Second)) || l.Time.After(end.Add(5*time.Second)) {
			t.Errorf("line %d time %s is outside the container's run (%s to %s)", i, l.Time.Format(time.RFC3339Nano), start, end)
		}
		if i > 0 && l.Time.Before(lines[i-1].Time) {
			t.Errorf("line %d time %s is before the line above (%s)", i, l.Time.Format(time.RFC3339Nano), lines[i-1].Time.Format(time.RFC3339Nano))
		}
	}
}

func TestReopenContainerLog(t *testing.T) {
	e := newEnv(t)
	cfg := e.containerConfig("ticker", "sh", "-c", `i=0; while true; do echo "tick $i"; i=$((i+1)); sleep 0.1; done`)
	_, id, podCfg := e.runOne("reopen", cfg)
	e.waitContainerState(id, running, stateTimeout)
	path := logPath(podCfg, cfg)
	e.waitLogLine(path, "stdout", "tick 1")

	// What the kubelet's log rotation does: rename, then ask to reopen.
	rotated := path + ".20240101-000000"
	if err := os.Rename(path, rotated); err != nil {
		t.Fatal(err)
	}
	if _, err := e.rt().ReopenContainerLog(e.ctx(), &runtimeapi.ReopenContainerLogRequest{ContainerId: id}); err != nil {
		t.Fatalf("ReopenContainerLog: %v", err)
	}
	testutil.WaitFor(t, stateTimeout, "new lines in the reopened log", func() (bool, string) {
		lines := e.readCRILog(path)
		return len(harness.JoinPartial(lines, "stdout")) >= 2, e.logText(path)
	})
	// The rotated file stops growing once the new file is written to.
	size1 := fileSize(t, rotated)
	n := len(e.readCRILog(path))
	testutil.WaitFor(t, stateTimeout, "more lines in the new log", func() (bool, string) {
		return len(e.readCRILog(path)) >= n+3, e.logText(path)
	})
	if size2 := fileSize(t, rotated); size2 != size1 {
		t.Errorf("the rotated log still grows after reopen (%d -> %d bytes)", size1, size2)
	}
}

func fileSize(t *testing.T, p string) int64 {
	t.Helper()
	fi, err := os.Stat(p)
	if err != nil {
		t.Fatal(err)
	}
	return fi.Size()
}

func TestListContainersFilters(t *testing.T) {
	e := newEnv(t)
	p1Cfg, p2Cfg := e.podConfig("filters-1"), e.podConfig("filters-2")
	p1, p2 := e.runPod(p1Cfg), e.runPod(p2Cfg)
	mk := func(pod string, podCfg *runtimeapi.PodSandboxConfig, name, k string, cmd ...string) string {
		cfg := e.containerConfig(name, cmd...)
		cfg.Labels["k"] = k
		return e.createAndStart(pod, podCfg, cfg)
	}
	c1 := mk(p1, p1Cfg, "c1", "1", "sleep", "3600")
	c2 := mk(p1, p1Cfg, "c2", "2", "true")
	c3 := mk(p2, p2Cfg, "c3", "1", "sleep", "3600")
	c4 := e.createContainer(p2, p2Cfg, e.containerConfig("c4", "true")) // never started
	e.waitContainerState(c1, running, stateTimeout)
	e.waitContainerState(c2, exited, stateTimeout)
	e.waitContainerState(c3, running, stateTimeout)

	state := func(s runtimeapi.ContainerState) *runtimeapi.ContainerStateValue {
		return &runtimeapi.ContainerStateValue{State: s}
	}
	cases := []struct {
		name   string
		filter *runtimeapi.ContainerFilter
		want   []string
	}{
		{"none", nil, []string{c1, c2, c3, c4}},
		{"id", &runtimeapi.ContainerFilter{Id: c3}, []string{c3}},
		{"unknown id", &runtimeapi.ContainerFilter{Id: randHex(32)}, nil},
		{"pod", &runtimeapi.ContainerFilter{PodSandboxId: p1}, []string{c1, c2}},
		{"running", &runtimeapi.ContainerFilter{State: state(running)}, []string{c1, c3}},
		{"exited", &runtimeapi.ContainerFilter{State: state(exited)}, []string{c2}},
		{"created", &runtimeapi.ContainerFilter{State: state(created)}, []string{c4}},
		{"pod and state", &runtimeapi.ContainerFilter{PodSandboxId: p2, State: state(running)}, []string{c3}},
		{"label", &runtimeapi.ContainerFilter{LabelSelector: map[string]string{"k": "1"}}, []string{c1, c3}},
		{"label and pod", &runtimeapi.ContainerFilter{LabelSelector: map[string]string{"k": "1"}, PodSandboxId: p2}, []string{c3}},
		{"labels", &runtimeapi.ContainerFilter{LabelSelector: map[string]string{"k": "2", "e2e-container": "c2"}}, []string{c2}},
		{"label no match", &runtimeapi.ContainerFilter{LabelSelector: map[string]string{"k": "3"}}, nil},
		{"id and other pod", &runtimeapi.ContainerFilter{Id: c1, PodSandboxId: p2}, nil},
	}
	for _, tc := range cases {
		resp, err := e.rt().ListContainers(e.ctx(), &runtimeapi.ListContainersRequest{Filter: tc.filter})
		if err != nil {
			t.Errorf("%s: ListContainers: %v", tc.name, err)
			continue
		}
		var got []string
		for _, c := range resp.Containers {
			got = append(got, c.Id)
		}
		slices.Sort(got)
		want := slices.Clone(tc.want)
		slices.Sort(want)
		if !slices.Equal(got, want) {
			t.Errorf("%s: got %v, want %v", tc.name, got, want)
		}
	}
}

// Stopping a pod stops its containers; they stay listed as exited until the
// pod is removed, which removes them.
func TestStopPodStopsContainers(t *testing.T) {
	e := newEnv(t)
	podID, id, _ := e.runOne("stop-pod", e.containerConfig("sleeper", "sleep", "3600"))
	e.waitContainerState(id, running, stateTimeout)
	if _, err := e.rt().StopPodSandbox(e.ctx(), &runtimeapi.StopPodSandboxRequest{PodSandboxId: podID}); err != nil {
		t.Fatalf("StopPodSandbox: %v", err)
	}
	st := e.containerStatus(id)
	if st.State != exited || st.FinishedAt == 0 {
		t.Errorf("container of a stopped pod: state %s finished_at %d, want CONTAINER_EXITED with a time", st.State, st.FinishedAt)
	}
	if _, err := e.rt().RemovePodSandbox(e.ctx(), &runtimeapi.RemovePodSandboxRequest{PodSandboxId: podID}); err != nil {
		t.Fatalf("RemovePodSandbox: %v", err)
	}
	_, err := e.rt().ContainerStatus(e.ctx(), &runtimeapi.ContainerStatusRequest{ContainerId: id})
	requireCode(t, err, codes.NotFound, "ContainerStatus after its pod was removed")
}

func TestContainerAndPodStats(t *testing.T) {
	e := newEnv(t)
	// Burns CPU for as long as it runs.
	cfg := e.containerConfig("burner", "sh", "-c", "while :; do :; done")
	podID, id, _ := e.runOne("stats", cfg)
	e.waitContainerState(id, running, stateTimeout)

	var first *runtimeapi.ContainerStats
	testutil.WaitFor(t, stateTimeout, "non-zero CPU and memory in ContainerStats", func() (bool, string) {
		ctx, cancel := e.pollCtx()
		defer cancel()
		resp, err := e.rt().ContainerStats(ctx, &runtimeapi.ContainerStatsRequest{ContainerId: id})
		if err != nil {
			return false, err.Error()
		}
		first = resp.Stats
		return first.GetCpu().GetUsageCoreNanoSeconds().GetValue() > 0 && first.GetMemory().GetWorkingSetBytes().GetValue() > 0, first.String()
	})
	if a := first.GetAttributes(); a.GetId() != id || !proto.Equal(a.GetMetadata(), cfg.Metadata) || !sameMap(a.GetLabels(), cfg.Labels) {
		t.Errorf("stats attributes %v do not describe the container", a)
	}
	// The numbers are live: CPU time grows while the container burns.
	testutil.WaitFor(t, stateTimeout, "growing CPU usage", func() (bool, string) {
		ctx, cancel := e.pollCtx()
		defer cancel()
		resp, err := e.rt().ContainerStats(ctx, &runtimeapi.ContainerStatsRequest{ContainerId: id})
		if err != nil {
			return false, err.Error()
		}
		c := resp.Stats.GetCpu()
		return c.GetUsageCoreNanoSeconds().GetValue() > first.GetCpu().GetUsageCoreNanoSeconds().GetValue()+50_000_000 &&
			c.Timestamp > first.GetCpu().Timestamp, c.String()
	})

	list, err := e.rt().ListContainerStats(e.ctx(), &runtimeapi.ListContainerStatsRequest{
		Filter: &runtimeapi.ContainerStatsFilter{PodSandboxId: podID},
	})
	if err != nil {
		t.Fatalf("ListContainerStats: %v", err)
	}
	if len(list.Stats) != 1 || list.Stats[0].GetAttributes().GetId() != id || list.Stats[0].GetCpu().GetUsageCoreNanoSeconds().GetValue() == 0 {
		t.Errorf("ListContainerStats for the pod = %v, want one entry for %s with CPU usage", list.Stats, id)
	}
	all, err := e.rt().ListContainerStats(e.ctx(), &runtimeapi.ListContainerStatsRequest{})
	if err != nil {
		t.Fatalf("ListContainerStats without filter: %v", err)
	}
	if len(all.Stats) != 1 {
		t.Errorf("ListContainerStats without filter: %d entries, want 1", len(all.Stats))
	}

	ps, err := e.rt().PodSandboxStats(e.ctx(), &runtimeapi.PodSandboxStatsRequest{PodSandboxId: podID})
	if err != nil {
		t.Fatalf("PodSandboxStats: %v", err)
	}
	s := ps.GetStats()
	if s.GetAttributes().GetId() != podID {
		t.Errorf("PodSandboxStats attributes %v, want pod %s", s.GetAttributes(), podID)
	}
	lx := s.GetLinux()
	if lx.GetCpu().GetUsageCoreNanoSeconds().GetValue() == 0 || lx.GetMemory().GetWorkingSetBytes().GetValue() == 0 {
		t.Errorf("PodSandboxStats: cpu %v memory %v, want non-zero usage", lx.GetCpu(), lx.GetMemory())
	}
	var ids []string
	for _, c := range lx.GetContainers() {
		ids = append(ids, c.GetAttributes().GetId())
	}
	if !slices.Contains(ids, id) {
		t.Errorf("PodSandboxStats lists containers %v, want %s among them", ids, id)
	}
	if _, err := e.rt().StopContainer(e.ctx(), &runtimeapi.StopContainerRequest{ContainerId: id, Timeout: 5}); err != nil {
		t.Errorf("StopContainer: %v", err)
	}
}

func TestRunAsUser(t *testing.T) {
	e := newEnv(t)
	cfg := e.containerConfig("uid", "sleep", "3600")
	cfg.Linux.SecurityContext.RunAsUser = &runtimeapi.Int64Value{Value: 1000}
	_, id, _ := e.runOne("run-as-user", cfg)
	e.waitContainerState(id, running, stateTimeout)
	if out := strings.TrimSpace(e.execOK(id, "id", "-u")); out != "1000" {
		t.Errorf("id -u = %q, want 1000", out)
	}
	if r := e.execSync(id, "touch", "/root/x"); r.ExitCode == 0 {
		t.Errorf("uid 1000 could write to /root (mode 0700, owned by root)")
	}
}

func TestRunAsUsername(t *testing.T) {
	e := newEnv(t)
	cfg := e.containerConfig("uname", "sleep", "3600")
	cfg.Linux.SecurityContext.RunAsUsername = "app"
	_, id, _ := e.runOne("run-as-username", cfg)
	e.waitContainerState(id, running, stateTimeout)
	if out := strings.TrimSpace(e.execOK(id, "id", "-u")); out != "1000" {
		t.Errorf("id -u = %q, want 1000 (app)", out)
	}
	if out := strings.TrimSpace(e.execOK(id, "id", "-g")); out != "1000" {
		t.Errorf("id -g = %q, want 1000 (app's primary group)", out)
	}
	groups := strings.Fields(e.execOK(id, "id", "-G"))
	if !slices.Contains(groups, "2000") {
		t.Errorf("id -G = %v, want the supplementary group 2000 (extra) from /etc/group", groups)
	}
}

// An image's own ENTRYPOINT, CMD and USER apply when the container config
// names none; args replace the image's CMD and keep its ENTRYPOINT.
func TestImageConfigEntrypointCmdUser(t *testing.T) {
	e := newEnvNoPull(t)
	img := testregistry.WithConfig(testregistry.BusyboxImage(t),
		[]string{"sh", "-c"}, []string{"echo image-cmd; exec sleep 3600"}, "app")
	ref := e.reg.Push(t, "e2e/app-user", "v1", img)
	e.pull(ref)
	podCfg := e.podConfig("image-config")
	podID := e.runPod(podCfg)

	plain := e.containerConfig("from-image")
	plain.Image.Image = ref
	id := e.createAndStart(podID, podCfg, plain)
	e.waitContainerState(id, running, stateTimeout)
	e.waitLogLine(logPath(podCfg, plain), "stdout", "image-cmd")
	if out := strings.TrimSpace(e.execOK(id, "id", "-u")); out != "1000" {
		t.Errorf("id -u = %q, want 1000 from the image's USER app", out)
	}

	withArgs := e.containerConfig("with-args")
	withArgs.Image.Image = ref
	withArgs.Args = []string{"echo args-override; exec sleep 3600"}
	id = e.createAndStart(podID, podCfg, withArgs)
	e.waitContainerState(id, running, stateTimeout)
	e.waitLogLine(logPath(podCfg, withArgs), "stdout", "args-override")
}

func TestReadonlyRootfs(t *testing.T) {
	e := newEnv(t)
	cfg := e.containerConfig("ro", "sleep", "3600")
	cfg.Linux.SecurityContext.ReadonlyRootfs = true
	_, id, _ := e.runOne("readonly", cfg)
	e.waitContainerState(id, running, stateTimeout)
	r := e.execSync(id, "touch", "/newfile")
	if r.ExitCode == 0 {
		t.Fatalf("touch /newfile succeeded on a read-only rootfs")
	}
	if !strings.Contains(string(r.Stderr), "Read-only file system") {
		t.Errorf("touch /newfile failed, but not for a read-only file system: %q", r.Stderr)
	}
	if out := e.execOK(id, "cat", "/etc/group"); !strings.Contains(out, "extra:x:2000") {
		t.Errorf("the read-only rootfs does not hold the image's files")
	}
}

func TestBindMounts(t *testing.T) {
	e := newEnv(t)
	roDir := filepath.Join(e.d.Root, "host-ro")
	rwDir := filepath.Join(e.d.Root, "host-rw")
	for _, d := range []string{roDir, rwDir} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(roDir, "hello.txt"), []byte("hello from the host\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg := e.containerConfig("mounts", "sleep", "3600")
	cfg.Mounts = []*runtimeapi.Mount{
		{ContainerPath: "/data", HostPath: roDir, Readonly: true},
		{ContainerPath: "/out", HostPath: rwDir},
		{ContainerPath: "/deep/new/dir", HostPath: rwDir},
	}
	_, id, _ := e.runOne("bind", cfg)
	e.waitContainerState(id, running, stateTimeout)

	if out := e.execOK(id, "cat", "/data/hello.txt"); out != "hello from the host\n" {
		t.Errorf("cat /data/hello.txt = %q", out)
	}
	if r := e.execSync(id, "touch", "/data/written"); r.ExitCode == 0 {
		t.Errorf("writing into the read-only mount succeeded")
	}
	if _, err := os.Stat(filepath.Join(roDir, "written")); err == nil {
		t.Errorf("a write through the read-only mount reached the host")
	}
	e.execOK(id, "sh", "-c", "echo from the container > /out/f")
	if b, err := os.ReadFile(filepath.Join(rwDir, "f")); err != nil || string(b) != "from the container\n" {
		t.Errorf("host file written through the rw mount: %q, %v", b, err)
	}
	if out := e.execOK(id, "cat", "/deep/new/dir/f"); out != "from the container\n" {
		t.Errorf("a mount point that is not in the image was not created: %q", out)
	}
	// The host's own files stay as they were.
	if fi, err := os.Stat(roDir); err != nil || !fi.IsDir() {
		t.Errorf("host dir after the container mounted it: %v", err)
	}
}

// TestLogPathSymlinkRefused: a symlink planted at a container's log path
// is never written through, on fly as on nspawn: the container does not
// start, and the link's target keeps its contents.
func TestLogPathSymlinkRefused(t *testing.T) {
	forEachStage1(t, func(t *testing.T, e *env, s podStage1) {
		cfg := e.netPodConfig("loglink", s)
		podID := e.runStage1Pod(cfg, s)
		ctr := e.netContainer(s, "c", "echo", "written-through-the-link")
		path := logPath(cfg, ctr)
		target := filepath.Join(t.TempDir(), "victim")
		if err := os.WriteFile(target, []byte("keep\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(target, path); err != nil {
			t.Fatal(err)
		}
		resp, err := e.rt().CreateContainer(e.ctx(), &runtimeapi.CreateContainerRequest{PodSandboxId: podID, Config: ctr, SandboxConfig: cfg})
		if err == nil {
			_, err = e.rt().StartContainer(e.ctx(), &runtimeapi.StartContainerRequest{ContainerId: resp.ContainerId})
		}
		if err == nil {
			t.Error("a container whose log path is a symlink started")
		}
		if b, _ := os.ReadFile(target); string(b) != "keep\n" {
			t.Errorf("the link's target was written: %q", b)
		}
	})
}

// TestBadInputRefusedAtCreate: input no kernel or agent takes is refused
// by the CRI call itself, as InvalidArgument naming the field, and
// nothing is left; the smallest memory limit accepted runs a container.
func TestBadInputRefusedAtCreate(t *testing.T) {
	e := newEnv(t)
	long := e.podConfig("long-hostname")
	long.Hostname = strings.Repeat("h", 65)
	_, err := e.rt().RunPodSandbox(e.ctx(), &runtimeapi.RunPodSandboxRequest{Config: long})
	requireCode(t, err, codes.InvalidArgument, "RunPodSandbox with a 65-character hostname")
	if err == nil || !strings.Contains(err.Error(), "config.hostname") {
		t.Errorf("the refusal does not name config.hostname: %v", err)
	}
	lowPod := e.podConfig("low-pod-memory")
	lowPod.Linux.Resources = &runtimeapi.LinuxContainerResources{MemoryLimitInBytes: 1}
	_, err = e.rt().RunPodSandbox(e.ctx(), &runtimeapi.RunPodSandboxRequest{Config: lowPod})
	requireCode(t, err, codes.InvalidArgument, "RunPodSandbox with a 1-byte pod memory limit")

	podCfg := e.podConfig("bad-input")
	podID := e.runPod(podCfg)
	for name, edit := range map[string]func(c *runtimeapi.ContainerConfig){
		"a NUL byte in an argument": func(c *runtimeapi.ContainerConfig) { c.Args = []string{"a\x00b"} },
		"a NUL byte in the env": func(c *runtimeapi.ContainerConfig) {
			c.Envs = []*runtimeapi.KeyValue{{Key: "K", Value: []byte("v\x00")}}
		},
		"a 1-byte memory limit": func(c *runtimeapi.ContainerConfig) { c.Linux.Resources.MemoryLimitInBytes = 1 },
	} {
		cfg := e.containerConfig("bad", "true")
		edit(cfg)
		_, err := e.rt().CreateContainer(e.ctx(), &runtimeapi.CreateContainerRequest{PodSandboxId: podID, Config: cfg, SandboxConfig: podCfg})
		requireCode(t, err, codes.InvalidArgument, "CreateContainer with "+name)
	}
	cfg := e.containerConfig("smallest", "sh", "-c", "echo fits; exec sleep 3600")
	cfg.Linux.Resources.MemoryLimitInBytes = 12 << 20
	id := e.createAndStart(podID, podCfg, cfg)
	e.waitContainerState(id, running, stateTimeout)
	_, err = e.rt().ExecSync(e.ctx(), &runtimeapi.ExecSyncRequest{ContainerId: id, Cmd: []string{"echo", "a\x00b"}, Timeout: 10})
	requireCode(t, err, codes.InvalidArgument, "ExecSync with a NUL byte in an argument")
	if out := e.execOK(id, "echo", "still-here"); out != "still-here\n" {
		t.Errorf("ExecSync after the refusals: %q", out)
	}
}
