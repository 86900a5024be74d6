package broker

import (
	"context"
	"errors"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/stagelet/stagelet/errdefs"
)

// A pod that asks to move live (stage1 fake's movingPod) goes, through
// CheckpointContainer and a container created from the archive in
// another pod, to that pod: its app runs on there under the new
// container's ID, and the source's container exits saying where the pod
// went. A target of another size refuses before anything moves, and the
// source runs on; a ticket is good once, and only while its pod runs.
func TestLiveMove(t *testing.T) {
	e := newEnv(t)
	e.vm.Caps.WholePodCheckpoint = true
	e.vm.MovesLive = true
	e.live = "127.0.0.1"
	e.net = newFakeNetwork(filepath.Join(e.run, "netns"))
	b := e.broker(t)
	ctx := context.Background()
	dir := t.TempDir()
	wantErr := func(err, class error, text string) {
		t.Helper()
		if !errors.Is(err, class) || !strings.Contains(err.Error(), text) {
			t.Errorf("err = %v, want class %v saying %q", err, class, text)
		}
	}
	vmPod := func(name, checkpoint string) string {
		t.Helper()
		cfg := podCfg(name)
		cfg.HostNetwork, cfg.RuntimeHandler = false, "vm"
		if checkpoint != "" {
			cfg.Annotations[AnnotationCheckpoint] = checkpoint
		}
		id, err := b.RunPod(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		return id
	}
	running := func(pod string) string {
		t.Helper()
		cfg := ctrCfg("counter")
		cfg.Command = []string{"sleep", "1000"}
		return startCheckpointable(t, b, pod, cfg)
	}
	fromArchive := func(pod, name, archive string) (string, error) {
		t.Helper()
		id, err := b.CreateContainer(ctx, pod, &ContainerConfig{Metadata: ContainerMetadata{Name: name}, Image: archive, LogPath: name + ".log"})
		if err != nil {
			t.Fatal(err)
		}
		if err := b.StartContainer(ctx, id); err != nil {
			// As the kubelet does, before it tries again.
			if rerr := b.RemoveContainer(ctx, id); rerr != nil {
				t.Fatal(rerr)
			}
			return "", err
		}
		return id, nil
	}
	status := func(id string) *ContainerRecord {
		t.Helper()
		st, err := b.ContainerStatus(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		return st
	}
	answers := func(id string) bool {
		res, err := b.ExecSync(ctx, id, []string{"echo", "here"}, 0)
		return err == nil && string(res.Stdout) == "here\n"
	}

	// Another value of the annotation is refused.
	odd := vmPod("odd", "yes")
	wantErr(b.CheckpointContainer(ctx, running(odd), filepath.Join(dir, "odd.tar")), errdefs.ErrInvalidArgument, `want "live"`)

	src := vmPod("src", "live")
	cid := running(src)
	started := status(cid).StartedAt
	first := filepath.Join(dir, "first.tar")
	if err := b.CheckpointContainer(ctx, cid, first); err != nil {
		t.Fatal(err)
	}
	if st := status(cid); st.State != ContainerRunning || !answers(cid) {
		t.Fatalf("the source after its checkpoint: %s, answers %v", st.State, answers(cid))
	}

	// A target of another size refuses; the source runs on.
	e.vm.PodMemory = 512 << 20
	big := vmPod("big", "")
	e.vm.PodMemory = 256 << 20
	_, err := fromArchive(big, "r", first)
	wantErr(err, errdefs.ErrFailedPrecondition, "memory")
	if st := status(cid); st.State != ContainerRunning || !answers(cid) {
		t.Fatalf("the source after a refused move: %s %q, answers %v", st.State, st.Message, answers(cid))
	}
	if got := e.vm.Running(src); !slices.Contains(got, cid) {
		t.Errorf("the source's apps after a refused move: %v", got)
	}
	waitFor(t, "the source followed again", func() bool { return e.vm.Pod(src).Subscribers() == 1 })

	// That ticket was taken; a new one moves the pod.
	dst := vmPod("dst", "")
	_, err = fromArchive(dst, "r", first)
	wantErr(err, errdefs.ErrUnavailable, "")
	second := filepath.Join(dir, "second.tar")
	if err := b.CheckpointContainer(ctx, cid, second); err != nil {
		t.Fatal(err)
	}
	rid, err := fromArchive(dst, "moved", second)
	if err != nil {
		t.Fatalf("the live move: %v", err)
	}
	if st := status(rid); st.State != ContainerRunning || !st.StartedAt.Equal(started) || !answers(rid) {
		t.Errorf("the moved container: %s, started %v (the source's %v), answers %v", st.State, st.StartedAt, started, answers(rid))
	}
	// The target runs the source's process (the toy knows it by the ID
	// it started under), and its own is gone.
	if got := e.vm.Running(dst); !slices.Equal(got, []string{cid}) {
		t.Errorf("the target's processes: %v, want only the source's %s", got, cid)
	}
	waitFor(t, "the source's container to exit", func() bool { return status(cid).State == ContainerExited })
	if st := status(cid); !strings.HasPrefix(st.Message, "the pod moved live to 127.0.0.1:") {
		t.Errorf("the source's container: %q", st.Message)
	}
	if ps, err := b.PodStatus(ctx, src, false); err != nil || ps.Ready {
		t.Errorf("the source pod after the move: %+v %v", ps, err)
	}
	if got := e.vm.Running(src); len(got) != 0 {
		t.Errorf("the source's apps after the move: %v", got)
	}

	// The ticket is spent; so is one whose pod stopped.
	again := vmPod("again", "")
	_, err = fromArchive(again, "r", second)
	wantErr(err, errdefs.ErrUnavailable, "")
	stopped := vmPod("stopped", "live")
	third := filepath.Join(dir, "third.tar")
	if err := b.CheckpointContainer(ctx, running(stopped), third); err != nil {
		t.Fatal(err)
	}
	if err := b.StopPod(ctx, stopped); err != nil {
		t.Fatal(err)
	}
	_, err = fromArchive(again, "s", third)
	wantErr(err, errdefs.ErrUnavailable, "")
	if !answers(rid) {
		t.Error("the moved container stopped answering")
	}
}
