package cgroups

import (
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/stagelet/stagelet/internal/testutil"
)

// A pod cgroup no record names is released with its processes; one that
// is kept, and cgroups of other names, are left as they are.
func TestCollectPodCgroups(t *testing.T) {
	testutil.NeedRoot(t, "creates cgroups")
	if _, err := Self(); err != nil {
		t.Skipf("no cgroups: %v", err)
	}
	parent := fmt.Sprintf("stagelet-collect-test-%d", os.Getpid())
	pc, err := Resolve(parent)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := pc.Kill(); err != nil {
			t.Error(err)
		}
		if err := pc.Delete(); err != nil {
			t.Error(err)
		}
	})
	orphan, kept := strings.Repeat("a", 64), strings.Repeat("b", 64)
	// launch starts a process in cg; the channel is closed once it exited.
	launch := func(cg *Cgroup) (int, <-chan struct{}) {
		t.Helper()
		if err := cg.Create(); err != nil {
			t.Fatal(err)
		}
		cmd := exec.Command("/bin/sleep", "1000")
		if err := cg.Start(cmd); err != nil {
			t.Fatal(err)
		}
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		t.Cleanup(func() { _ = cmd.Process.Kill(); <-done })
		return cmd.Process.Pid, done
	}
	// The orphan holds a process in a nested cgroup too, as a kvm pod's
	// qemu and virtiofsd do.
	launch(pc.Child(PodCgroupName(orphan)))
	_, orphanDone := launch(pc.Child(PodCgroupName(orphan) + "/inner"))
	keptPID, _ := launch(pc.Child(PodCgroupName(kept)))
	other := pc.Child("stagelet-pod-notanid")
	if err := other.Create(); err != nil {
		t.Fatal(err)
	}

	found, err := CollectPodCgroups(parent, func(id string) bool { return id == kept })
	if err != nil {
		t.Fatal(err)
	}
	if len(found) != 1 || found[0].PodID != orphan || found[0].Err != nil || found[0].Procs != 2 {
		t.Fatalf("released %+v, want the orphan with its 2 processes", found)
	}
	select {
	case <-orphanDone:
	case <-time.After(10 * time.Second):
		t.Fatal("the orphan's process still runs")
	}
	for k, d := range pc.Child(PodCgroupName(orphan)).Paths {
		if _, err := os.Stat(d); !os.IsNotExist(err) {
			t.Errorf("the orphan's cgroup in %s is still there: %v", k, err)
		}
	}
	for _, c := range []*Cgroup{pc.Child(PodCgroupName(kept)), other} {
		for _, d := range c.Paths {
			if _, err := os.Stat(d); err != nil {
				t.Errorf("a cgroup that is not an orphan was removed: %v", err)
			}
		}
	}
	if pids, err := pc.Child(PodCgroupName(kept)).Procs(); err != nil || len(pids) != 1 || pids[0] != keptPID {
		t.Errorf("the kept pod's cgroup holds %v (%v), want %d", pids, err, keptPID)
	}

	// Nothing under a parent that does not exist.
	if found, err := CollectPodCgroups(parent+"-none", func(string) bool { return false }); err != nil || len(found) != 0 {
		t.Errorf("under a missing parent: %v, %v", found, err)
	}
}

// TestWithMemory: the memory directory is set to the memory cgroup's,
// the others stay, and the cgroup given is not modified.
func TestWithMemory(t *testing.T) {
	cg := &Cgroup{Paths: map[string]string{"memory": "/sys/fs/cgroup/memory/pod", "cpu": "/sys/fs/cgroup/cpu/pod"}}
	if got := WithMemory(cg, nil); got != cg {
		t.Errorf("WithMemory(cg, nil) = %v, want cg itself", got)
	}
	got := WithMemory(cg, &Cgroup{Paths: map[string]string{"memory": "/sys/fs/cgroup/memory/runtime"}})
	if got.Paths["memory"] != "/sys/fs/cgroup/memory/runtime" || got.Paths["cpu"] != "/sys/fs/cgroup/cpu/pod" {
		t.Errorf("WithMemory = %v", got.Paths)
	}
	if cg.Paths["memory"] != "/sys/fs/cgroup/memory/pod" {
		t.Errorf("the cgroup given was modified: %v", cg.Paths)
	}
	// One without a memory hierarchy of its own (nspawn's name=systemd
	// hierarchies) gets one.
	sd := &Cgroup{Paths: map[string]string{"name=systemd": "/sys/fs/cgroup/systemd/x"}}
	if got := WithMemory(sd, &Cgroup{Paths: map[string]string{"memory": "/m"}}); got.Paths["memory"] != "/m" || len(got.Paths) != 2 {
		t.Errorf("WithMemory of a cgroup without memory = %v", got.Paths)
	}
}

func TestValidPodID(t *testing.T) {
	for id, want := range map[string]bool{
		strings.Repeat("0a", 32): true,
		strings.Repeat("A", 64):  false,
		strings.Repeat("a", 63):  false,
		"notanid":                false,
	} {
		if got := ValidPodID(id); got != want {
			t.Errorf("ValidPodID(%q) = %v, want %v", id, got, want)
		}
	}
}
