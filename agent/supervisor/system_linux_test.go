package supervisor

import (
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"syscall"
	"testing"
	"time"

	"github.com/stagelet/stagelet/cgroups"
	"github.com/stagelet/stagelet/internal/testutil"
)

// TestWithMemory: the pod's memory cgroup given to the agent replaces the
// memory directory of the agent's own cgroup (the apps' go beneath it)
// only on cgroup v1 and only when it is a memory cgroup; otherwise the
// agent's own stands.
func TestWithMemory(t *testing.T) {
	pod := t.TempDir()
	if err := os.WriteFile(filepath.Join(pod, "memory.limit_in_bytes"), []byte("15728640\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	v1 := &cgroups.Cgroup{Paths: map[string]string{"memory": "/own/memory", "pids": "/own/pids"}}
	v2 := &cgroups.Cgroup{Paths: map[string]string{cgroups.Unified: "/own"}}
	log := slog.New(slog.DiscardHandler)
	for _, tc := range []struct {
		name string
		cg   *cgroups.Cgroup
		dir  string
		want map[string]string
	}{
		{"none given", v1, "", v1.Paths},
		{"v1", v1, pod, map[string]string{"memory": pod, "pids": "/own/pids"}},
		{"not a memory cgroup", v1, t.TempDir(), v1.Paths},
		{"missing", v1, filepath.Join(pod, "gone"), v1.Paths},
		{"v2", v2, pod, v2.Paths},
	} {
		got := withMemory(tc.cg, tc.dir, log)
		if len(got.Paths) != len(tc.want) {
			t.Errorf("%s: %v, want %v", tc.name, got.Paths, tc.want)
			continue
		}
		for k, v := range tc.want {
			if got.Paths[k] != v {
				t.Errorf("%s: %v, want %v", tc.name, got.Paths, tc.want)
			}
		}
	}
	if v1.Paths["memory"] != "/own/memory" {
		t.Errorf("the agent's own cgroup was changed: %v", v1.Paths)
	}
}

// TestKillWaitsForAgentThread: a Kill of an app's cgroup (its process
// exited while an exec was being started from a thread of the agent)
// waits for that thread to leave the app's cgroups. On cgroup v1 it would
// otherwise freeze the thread, stalling the agent's Go runtime for good,
// and SIGKILL the agent itself, whose PID the cgroup lists meanwhile:
// here the test's own process.
func TestKillWaitsForAgentThread(t *testing.T) {
	testutil.NeedRoot(t, "creates cgroups")
	self, err := cgroups.Self()
	if err != nil {
		t.Skipf("no usable cgroups: %v", err)
	}
	parent := self.Child(fmt.Sprintf("stagelet-gate-test-%d-%d", os.Getpid(), time.Now().UnixNano()))
	if err := parent.Create(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := parent.Delete(); err != nil {
			t.Error(err)
		}
	})
	l := &linuxSystem{cg: parent}
	gc := l.appCgroup("app").(*guardedCgroup)
	if err := gc.Create(); err != nil {
		t.Fatal(err)
	}
	app := exec.Command("sleep", "600")
	if err := gc.Start(app); err != nil {
		t.Fatal(err)
	}

	placed, release, left := make(chan struct{}), make(chan struct{}), make(chan error, 1)
	go func() {
		runtime.LockOSThread() // retired with the goroutine: it was in the app's cgroups
		left <- gc.place(func() error {
			tp, err := gc.PlaceThread(nil)
			if err != nil {
				close(placed)
				return err
			}
			close(placed)
			<-release
			return tp.Release()
		})
	}()
	<-placed
	killed := make(chan error, 1)
	go func() { killed <- gc.Kill() }()
	// The Kill waits for the gate (a writer waiting keeps new readers
	// out), while the thread is still in the app's cgroups.
	testutil.WaitFor(t, 10*time.Second, "the Kill waiting for the agent's thread", testutil.Holds(func() bool {
		if gc.gate.TryRLock() {
			gc.gate.RUnlock()
			return false
		}
		return true
	}))
	close(release)
	if err := <-left; err != nil {
		t.Fatal(err)
	}
	if err := <-killed; err != nil {
		t.Fatal(err)
	}
	if err := app.Wait(); err == nil || app.ProcessState.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
		t.Errorf("the app's process: %v, want killed", err)
	}
	if err := gc.Delete(); err != nil {
		t.Fatal(err)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, ok := l.gates["app"]; ok {
		t.Error("the app's gate outlives its cgroup")
	}
}
