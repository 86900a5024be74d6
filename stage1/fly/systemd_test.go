package fly

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stagelet/stagelet/stage1"
	"github.com/stagelet/stagelet/stage1/stage1test"
)

// TestPodUnderSystemd runs a fly pod whose agent systemd starts as a
// transient unit: against a systemd booted with systemd-nspawn -b on the
// testbed tree (make systemd-testbed). The agent, the pod's run directory
// and the container's rootfs are in the directory the host shares with
// that container at the same path, so the backend's host paths are the
// unit's too. Checked: the pod starts, its agent is the unit's main
// process and answers, a second backend (a restarted daemon) recovers the
// pod, Stop ends the unit, DestroyPod leaves no unit.
func TestPodUnderSystemd(t *testing.T) {
	needRoot(t)
	bed := stage1test.BootSystemd(t)
	t.Logf("systemd booted in %v", bed.BootTime.Round(time.Millisecond))
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	c, err := bed.Conn()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()

	agentBin := filepath.Join(bed.Shared, "stagelet")
	rootfs := filepath.Join(bed.Shared, "rootfs")
	if out, err := exec.Command("cp", "-a", agentBinary, agentBin).CombinedOutput(); err != nil {
		t.Fatalf("cp: %v: %s", err, out)
	}
	if out, err := exec.Command("cp", "-a", stage1test.BusyboxRootfs(t), rootfs).CombinedOutput(); err != nil {
		t.Fatalf("cp: %v: %s", err, out)
	}
	runDir := filepath.Join(bed.Shared, "run")
	if err := os.Mkdir(runDir, 0o755); err != nil {
		t.Fatal(err)
	}

	l := bed.Launcher(testLogger(t))
	defer l.Close()
	b := NewWithLauncher(testLogger(t), l)
	spec := &stage1.PodSpec{
		ID:          "sd1",
		Name:        "under-systemd",
		Namespace:   "default",
		RunDir:      runDir,
		HostNetwork: true, // the container's network
		AgentBinary: agentBin,
	}
	var (
		mu    sync.Mutex
		state []byte
	)
	persist := func(st []byte) error {
		mu.Lock()
		defer mu.Unlock()
		state = append([]byte(nil), st...)
		return nil
	}
	last := func() []byte {
		mu.Lock()
		defer mu.Unlock()
		return state
	}
	defer func() {
		if err := b.DestroyPod(context.Background(), spec, last()); err != nil {
			t.Errorf("cleanup: DestroyPod: %v", err)
		}
	}()

	start := time.Now()
	pod, err := stage1test.Opened(b.StartPod(ctx, spec, persist))
	if err != nil {
		log, _ := os.ReadFile(filepath.Join(runDir, "agent.log"))
		t.Fatalf("StartPod: %v\nagent log:\n%s", err, log)
	}
	t.Logf("pod started in %v", time.Since(start).Round(time.Millisecond))
	persist(pod.State())

	st, err := parseState(last())
	if err != nil {
		t.Fatal(err)
	}
	const unit = "stagelet-pod-sd1.service"
	if st.agent().Unit != unit {
		t.Fatalf("agent unit %q, want %q", st.agent().Unit, unit)
	}
	props, err := c.GetUnitPropertiesContext(ctx, unit)
	if err != nil {
		t.Fatal(err)
	}
	if props["ActiveState"] != "active" {
		t.Errorf("unit %s is %v", unit, props["ActiveState"])
	}
	mainPID, err := c.GetServicePropertyContext(ctx, unit, "MainPID")
	if err != nil {
		t.Fatal(err)
	}
	if hp, err := bed.HostPID(int(mainPID.Value.Value().(uint32))); err != nil || hp != st.agent().PID {
		t.Errorf("unit main pid maps to %d (%v), want the agent %d", hp, err, st.agent().PID)
	}

	if _, err := pod.Info(ctx); err != nil {
		t.Fatalf("Info: %v", err)
	}
	// No container here: the testbed's systemd runs with the read-only
	// v1 controllers nspawn gives a container on this kind of host, so the
	// agent could not make the apps' cgroups (a host systemd delegates
	// writable ones).

	// A restarted daemon: a new launcher connection and backend recover
	// the pod from its state.
	l2 := bed.Launcher(testLogger(t))
	defer l2.Close()
	b2 := NewWithLauncher(testLogger(t), l2)
	pod2, err := stage1test.Opened(b2.RecoverPod(ctx, spec, last()))
	if err != nil {
		t.Fatalf("RecoverPod: %v", err)
	}
	if _, err := pod2.Info(ctx); err != nil {
		t.Errorf("recovered pod: Info: %v", err)
	}

	start = time.Now()
	if err := pod2.Stop(ctx, 5*time.Second); err != nil {
		t.Fatalf("Stop: %v", err)
	}
	t.Logf("pod stopped in %v", time.Since(start).Round(time.Millisecond))
	deadline := time.Now().Add(10 * time.Second)
	for {
		p, err := c.GetUnitPropertiesContext(ctx, unit)
		if err != nil {
			t.Fatal(err)
		}
		if p["LoadState"] == "not-found" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("unit %s still loaded after Stop: %v", unit, p["ActiveState"])
		}
		time.Sleep(20 * time.Millisecond) // polling the unit's state
	}
	if err := b2.DestroyPod(ctx, spec, last()); err != nil {
		t.Fatalf("DestroyPod: %v", err)
	}
	if err := b2.DestroyPod(ctx, spec, last()); err != nil {
		t.Errorf("second DestroyPod: %v", err)
	}
}
