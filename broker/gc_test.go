package broker

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/atomicfile"
	"github.com/stagelet/stagelet/stage1"
)

// TestReleaseSetAside: an operator tool's broker (no recovery, no cgroup
// parent) lists the set-aside records with what they name, and releases a
// torn pod record's pod alone: its stage1 resources, network namespace,
// run directory and containers' file systems go, its records move to
// quarantine/released, and every other pod is untouched. A set-aside
// container of a managed pod is refused (FailedPrecondition); an unknown
// ID is NotFound. The next daemon sets nothing aside.
func TestReleaseSetAside(t *testing.T) {
	e := newEnv(t)
	e.net = newFakeNetwork(filepath.Join(e.run, "netns"))
	ctx := context.Background()
	b := e.broker(t)
	torn, _ := b.RunPod(ctx, podNet("torn"))
	tornCtr, _ := b.CreateContainer(ctx, torn, ctrCfg("a"))
	kept, _ := b.RunPod(ctx, podNet("kept"))
	keptCtr, _ := b.CreateContainer(ctx, kept, ctrCfg("b"))
	newerCtr, _ := b.CreateContainer(ctx, kept, ctrCfg("c"))
	b.Close()

	podRec := filepath.Join(e.state, "pods", torn+".json")
	raw, _ := os.ReadFile(podRec)
	os.WriteFile(podRec, raw[:len(raw)/2], 0o600)
	ctrRec := filepath.Join(e.state, "containers", newerCtr+".json")
	raw, _ = os.ReadFile(ctrRec)
	var m map[string]any
	json.Unmarshal(raw, &m)
	m["version"] = recordVersion + 1
	raw, _ = json.Marshal(m)
	os.WriteFile(ctrRec, raw, 0o600)
	e.broker(t).Close() // the torn record goes to quarantine

	tool, err := New(Options{StateDir: e.state, RunDir: e.run, Policy: e.policy(t), AgentBinary: "/nonexistent",
		Backends: stage1.Registry{"fake": e.be, "vm": e.vm}, Images: e.images, Network: e.net})
	if err != nil {
		t.Fatal(err)
	}
	recs, err := tool.SetAsideRecords(ctx)
	if err != nil {
		t.Fatal(err)
	}
	byID := map[string]SetAsideRecord{}
	for _, r := range recs {
		byID[r.ID] = r
	}
	if len(recs) != 2 || byID[torn].Kind != "pod" || byID[newerCtr].Kind != "container" || byID[newerCtr].PodID != kept {
		t.Fatalf("set-aside records: %+v", recs)
	}
	h := byID[torn].Holds
	if h.NetNS == "" || !slices.Equal(h.Containers, []string{tornCtr}) || len(h.Dirs) != 2 {
		t.Errorf("what the torn pod holds: %+v", h)
	}

	if _, err := tool.ReleaseSetAside(ctx, newerCtr); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Errorf("releasing a container of a managed pod: %v", err)
	}
	if _, err := tool.ReleaseSetAside(ctx, "nope"); !errdefs.IsNotFound(err) {
		t.Errorf("releasing an unknown ID: %v", err)
	}
	if _, err := tool.ReleaseSetAside(ctx, torn); err != nil {
		t.Fatalf("release: %v", err)
	}
	if e.be.Destroyed(torn) != 1 || e.be.Destroyed(kept) != 0 {
		t.Errorf("stage1 releases: torn %d, kept %d", e.be.Destroyed(torn), e.be.Destroyed(kept))
	}
	if _, ok := e.net.netns[torn]; ok {
		t.Error("the torn pod's network namespace is still there")
	}
	for _, gone := range []string{filepath.Join(e.run, "pods", torn), filepath.Join(e.state, "containers-fs", tornCtr)} {
		if _, err := os.Lstat(gone); !os.IsNotExist(err) {
			t.Errorf("%s after the release: %v", gone, err)
		}
	}
	for _, f := range []string{"pods-" + torn + ".json", "containers-" + tornCtr + ".json"} {
		if _, err := os.Stat(filepath.Join(e.state, "quarantine", releasedDir, f)); err != nil {
			t.Errorf("the released record %s is not kept: %v", f, err)
		}
	}
	if _, err := tool.ReleaseSetAside(ctx, torn); !errdefs.IsNotFound(err) {
		t.Errorf("a second release: %v", err)
	}

	b = e.broker(t)
	if n := b.QuarantinedRecords(); n != 0 {
		t.Errorf("%d records in quarantine after the release", n)
	}
	if _, err := b.PodStatus(ctx, kept, false); err != nil {
		t.Errorf("the kept pod: %v", err)
	}
	if _, err := b.ContainerStatus(ctx, keptCtr); err != nil {
		t.Errorf("the kept pod's container: %v", err)
	}
}

// TestSetAsideRecordsReadOnly: listing set-aside records beside a running
// daemon leaves its interrupted-looking writes alone (the daemon may be in
// the middle of one).
func TestSetAsideRecordsReadOnly(t *testing.T) {
	e := newEnv(t)
	b := e.broker(t)
	tmp := filepath.Join(e.state, "pods", ".0123.json.tmp-42")
	if err := os.WriteFile(tmp, []byte("{"), 0o600); err != nil {
		t.Fatal(err)
	}
	if !atomicfile.IsTemp(filepath.Base(tmp)) {
		t.Fatalf("%s is not an atomicfile temporary name", tmp)
	}
	if _, err := b.SetAsideRecords(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(tmp); err != nil {
		t.Errorf("the write in progress was removed: %v", err)
	}
}
