package host

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stagelet/stagelet/cgroups"
	"github.com/stagelet/stagelet/internal/testutil"
)

// A pod cgroup no record names is released with its processes; one that
// is kept, and cgroups of other names, are left as they are.
func TestCollectPodCgroups(t *testing.T) {
	testutil.NeedRoot(t, "creates cgroups")
	if _, err := cgroups.Self(); err != nil {
		t.Skipf("no cgroups: %v", err)
	}
	parent := fmt.Sprintf("stagelet-collect-test-%d", os.Getpid())
	pc, err := cgroups.Resolve(parent)
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
	launch := func(cg *cgroups.Cgroup) *Process {
		t.Helper()
		if err := cg.Create(); err != nil {
			t.Fatal(err)
		}
		p, err := (&PlainLauncher{}).Launch(context.Background(), LaunchSpec{
			Name: "t", Path: "/bin/sleep", Args: []string{"1000"},
			LogPath: filepath.Join(t.TempDir(), "log"), Cgroup: cg,
		})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { p.Signal(9); p.Wait(context.Background()) })
		return p
	}
	// The orphan holds a process in a nested cgroup too, as a kvm pod's
	// qemu and virtiofsd do.
	launch(pc.Child(podCgroupPrefix + orphan))
	orphanProc := launch(pc.Child(podCgroupPrefix + orphan + "/inner"))
	keptProc := launch(pc.Child(podCgroupPrefix + kept))
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
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := orphanProc.Wait(ctx); err != nil {
		t.Fatalf("the orphan's process: %v", err)
	}
	for k, d := range pc.Child(podCgroupPrefix + orphan).Paths {
		if _, err := os.Stat(d); !os.IsNotExist(err) {
			t.Errorf("the orphan's cgroup in %s is still there: %v", k, err)
		}
	}
	for _, c := range []*cgroups.Cgroup{pc.Child(podCgroupPrefix + kept), other} {
		for _, d := range c.Paths {
			if _, err := os.Stat(d); err != nil {
				t.Errorf("a cgroup that is not an orphan was removed: %v", err)
			}
		}
	}
	if pids, err := pc.Child(podCgroupPrefix + kept).Procs(); err != nil || len(pids) != 1 || pids[0] != keptProc.PID {
		t.Errorf("the kept pod's cgroup holds %v (%v), want %d", pids, err, keptProc.PID)
	}

	// Nothing under a parent that does not exist.
	if found, err := CollectPodCgroups(parent+"-none", func(string) bool { return false }); err != nil || len(found) != 0 {
		t.Errorf("under a missing parent: %v, %v", found, err)
	}
}
