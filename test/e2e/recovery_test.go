package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/internal/testutil"
)

// ctlDir is a host directory bind-mounted at /ctl in a container, through
// which the test and the container's command signal each other.
func (e *env) ctlDir(name string) string {
	e.t.Helper()
	dir := filepath.Join(e.d.Root, "ctl-"+name)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		e.t.Fatal(err)
	}
	return dir
}

// readPID waits for the container to write its PID to ctl/pid.
func (e *env) readPID(ctl string) int {
	e.t.Helper()
	var pid int
	testutil.WaitFor(e.t, stateTimeout, "the container's pid file", func() (bool, string) {
		b, err := os.ReadFile(filepath.Join(ctl, "pid"))
		if err != nil {
			return false, err.Error()
		}
		if !strings.HasSuffix(string(b), "\n") {
			return false, "incomplete"
		}
		pid, err = strconv.Atoi(strings.TrimSpace(string(b)))
		return err == nil, fmt.Sprint(err)
	})
	return pid
}

// alive reports whether a host process runs (and is not a zombie).
func alive(pid int) bool {
	if err := syscall.Kill(pid, 0); err != nil {
		return false
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	return i >= 0 && i+2 < len(s) && s[i+2] != 'Z'
}

func mountCtl(cfg *runtimeapi.ContainerConfig, ctl string) {
	cfg.Mounts = append(cfg.Mounts, &runtimeapi.Mount{ContainerPath: "/ctl", HostPath: ctl})
}

// The daemon is killed with SIGKILL while two pods run. While it is down one
// container exits. After a restart the daemon answers only Unavailable
// until it has recovered, then reports both pods as they really are, and
// everything tears down cleanly.
func TestDaemonKill9Recovery(t *testing.T) {
	e := newEnv(t)

	ctlA, ctlB := e.ctlDir("a"), e.ctlDir("b")
	cfgA := e.containerConfig("survivor", "sh", "-c", "echo $$ > /ctl/pid; exec sleep 3600")
	mountCtl(cfgA, ctlA)
	cfgB := e.containerConfig("quitter", "sh", "-c",
		"echo $$ > /ctl/pid; while [ ! -e /ctl/exit ]; do sleep 0.1; done; echo bye; exit 7")
	mountCtl(cfgB, ctlB)
	podA, ctrA, podCfgA := e.runOne("kill9-a", cfgA)
	podB, ctrB, podCfgB := e.runOne("kill9-b", cfgB)
	stA := e.waitContainerState(ctrA, running, stateTimeout)
	e.waitContainerState(ctrB, running, stateTimeout)
	pidA, pidB := e.readPID(ctlA), e.readPID(ctlB)

	killedAt := time.Now()
	if err := e.d.Kill9(t.Context()); err != nil {
		t.Fatalf("kill -9 the daemon: %v", err)
	}
	if !alive(pidA) || !alive(pidB) {
		t.Fatalf("containers died with the daemon: pid %d alive %v, pid %d alive %v", pidA, alive(pidA), pidB, alive(pidB))
	}

	// B's command exits while the daemon is down.
	if err := os.WriteFile(filepath.Join(ctlB, "exit"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, stateTimeout, "container B to exit while the daemon is down", func() (bool, string) {
		return !alive(pidB), fmt.Sprintf("pid %d still runs", pidB)
	})
	if !alive(pidA) {
		t.Fatalf("container A (pid %d) died while the daemon was down", pidA)
	}

	// Restart. Until recovery ends every answer is Unavailable; the first
	// successful list already holds both pods.
	if err := e.d.Launch(); err != nil {
		t.Fatalf("restart the daemon: %v", err)
	}
	var firstList []*runtimeapi.PodSandbox
	ctx, cancel := context.WithTimeout(t.Context(), startTimeout)
	defer cancel()
	seen, err := e.d.WaitReady(ctx, func(ctx context.Context) error {
		resp, err := e.rt().ListPodSandbox(ctx, &runtimeapi.ListPodSandboxRequest{})
		if err == nil {
			firstList = resp.Items
		}
		return err
	})
	if err != nil {
		t.Fatalf("daemon after restart: %v", err)
	}
	t.Logf("after the restart the daemon answered %d times before serving; it recovered %s after the kill", len(seen), time.Since(killedAt).Round(time.Millisecond))
	for _, err := range seen {
		if s, _ := status.FromError(err); s.Code() != codes.Unavailable {
			t.Errorf("while recovering the daemon answered %v, want only Unavailable", err)
			break
		}
	}
	var ids []string
	for _, p := range firstList {
		ids = append(ids, p.Id)
		if p.State != runtimeapi.PodSandboxState_SANDBOX_READY {
			t.Errorf("recovered pod %s (%s) is %s, want SANDBOX_READY", p.Id, p.GetMetadata().GetName(), p.State)
		}
	}
	slices.Sort(ids)
	want := []string{podA, podB}
	slices.Sort(want)
	if !slices.Equal(ids, want) {
		t.Fatalf("first ListPodSandbox after restart: %v, want %v", ids, want)
	}

	// A still runs, is the same process, and answers exec.
	a := e.containerStatus(ctrA)
	if a.State != running {
		t.Errorf("container A after recovery: %s, want CONTAINER_RUNNING", a.State)
	}
	if a.StartedAt != stA.StartedAt {
		t.Errorf("container A started_at changed across the restart: %d, was %d", a.StartedAt, stA.StartedAt)
	}
	if !alive(pidA) {
		t.Errorf("container A's process %d is gone after recovery", pidA)
	}
	if out := e.execOK(ctrA, "cat", "/ctl/pid"); strings.TrimSpace(out) != strconv.Itoa(pidA) {
		t.Errorf("exec in A after recovery reads pid %q, want %d", out, pidA)
	}

	// B exited during the downtime with its real exit code.
	b := e.waitContainerState(ctrB, exited, stateTimeout)
	if b.ExitCode != 7 || b.Reason != "Error" {
		t.Errorf("container B: exit code %d reason %q, want 7 Error", b.ExitCode, b.Reason)
	}
	if b.FinishedAt < killedAt.UnixNano() || b.FinishedAt < b.StartedAt {
		t.Errorf("container B finished_at %s, but it exited after the daemon was killed at %s", time.Unix(0, b.FinishedAt), killedAt)
	}
	e.waitLogLine(logPath(podCfgB, cfgB), "stdout", "bye")

	// Logs of A are still written by its pod; A's log file is where it was.
	if _, err := os.Stat(logPath(podCfgA, cfgA)); err != nil {
		t.Errorf("container A's log after recovery: %v", err)
	}

	// The recovered daemon runs new pods too.
	_, ctrC, _ := e.runOne("kill9-c", e.containerConfig("newcomer", "sleep", "3600"))
	e.waitContainerState(ctrC, running, stateTimeout)

	// A clean teardown of the recovered pods.
	for _, pod := range []string{podA, podB} {
		if _, err := e.rt().StopPodSandbox(e.ctx(), &runtimeapi.StopPodSandboxRequest{PodSandboxId: pod}); err != nil {
			t.Errorf("StopPodSandbox %s after recovery: %v", pod, err)
		}
		if _, err := e.rt().RemovePodSandbox(e.ctx(), &runtimeapi.RemovePodSandboxRequest{PodSandboxId: pod}); err != nil {
			t.Errorf("RemovePodSandbox %s after recovery: %v", pod, err)
		}
		_, err := e.rt().PodSandboxStatus(e.ctx(), &runtimeapi.PodSandboxStatusRequest{PodSandboxId: pod})
		if s, _ := status.FromError(err); s.Code() != codes.NotFound {
			t.Errorf("PodSandboxStatus %s after removal: %v, want NotFound", pod, err)
		}
	}
	testutil.WaitFor(t, stateTimeout, "container A's process to end after its pod was removed", func() (bool, string) {
		return !alive(pidA), fmt.Sprintf("pid %d still runs", pidA)
	})
}

// A daemon stopped with SIGTERM leaves its pods running as well, and finds
// them again when it starts.
func TestDaemonGracefulRestartKeepsPods(t *testing.T) {
	e := newEnv(t)
	ctl := e.ctlDir("a")
	cfg := e.containerConfig("survivor", "sh", "-c", "echo $$ > /ctl/pid; exec sleep 3600")
	mountCtl(cfg, ctl)
	podID, ctr, _ := e.runOne("graceful", cfg)
	before := e.waitContainerState(ctr, running, stateTimeout)
	pid := e.readPID(ctl)

	if err := e.d.Stop(t.Context(), 30*time.Second); err != nil {
		t.Fatalf("stop the daemon: %v", err)
	}
	if st := e.d.ExitStatus(); st != "exit status 0" {
		t.Errorf("daemon exit on SIGTERM: %s, want exit status 0", st)
	}
	if !alive(pid) {
		t.Fatalf("the container (pid %d) died with the daemon's graceful stop", pid)
	}
	ctx, cancel := context.WithTimeout(t.Context(), startTimeout)
	defer cancel()
	if err := e.d.Restart(ctx); err != nil {
		t.Fatalf("restart: %v", err)
	}
	st := e.waitContainerState(ctr, running, stateTimeout)
	if st.StartedAt != before.StartedAt {
		t.Errorf("started_at changed across the restart: %d, was %d", st.StartedAt, before.StartedAt)
	}
	if p := e.podStatus(podID); p.State != runtimeapi.PodSandboxState_SANDBOX_READY {
		t.Errorf("pod after restart: %s, want SANDBOX_READY", p.State)
	}
	e.execOK(ctr, "true")
}
