package broker

import (
	"context"
	"path/filepath"
	"testing"
)

// TestNetworkReleasedOnce: the kubelet stops a pod, then removes it; the
// CNI DEL of its attachment runs once, at the stop (as containerd runs
// it), even with a second stop and a daemon restart in between, and the
// removal only removes the netns.
func TestNetworkReleasedOnce(t *testing.T) {
	e := newEnv(t)
	e.net = newFakeNetwork(filepath.Join(e.run, "netns"))
	ctx := context.Background()
	b := e.broker(t)
	id, err := b.RunPod(ctx, podNet("once"))
	if err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if err := b.StopPod(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	b.Close()
	b = e.broker(t)
	if err := b.StopPod(ctx, id); err != nil {
		t.Fatal(err)
	}
	if err := b.RemovePod(ctx, id); err != nil {
		t.Fatal(err)
	}
	if n := e.net.dels[id]; n != 1 {
		t.Errorf("CNI DEL ran %d times, want 1", n)
	}
	if _, ok := e.net.netns[id]; ok {
		t.Error("the netns is left after the removal")
	}
}
