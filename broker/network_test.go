package broker

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stagelet/stagelet/errdefs"
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

// CNI ADD runs while the pod's stage1 starts it, in its network namespace
// made first; for a stage1 that reads the pod's network when it starts
// (NetworkBeforeStart: a VM's interface takes eth0's addresses) it runs
// before. /etc/hosts, which names the pod's address, is written once
// both are done; a failed CNI ADD releases the started pod.
func TestCNIAddBesidePodStart(t *testing.T) {
	e := newEnv(t)
	e.vm.Caps.NetworkBeforeStart = true
	net := newFakeNetwork(filepath.Join(e.run, "netns"))
	e.net = net
	b := e.broker(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	// started waits until the namespace stage1 started the pod: CNI ADD
	// returns only then, which a start after CNI ADD never is.
	started := func(ctx context.Context, id string) error {
		for e.be.Pod(id) == nil {
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(time.Millisecond):
			}
		}
		return nil
	}
	net.setup = started
	cfg := podNet("beside")
	cfg.Hostname = "beside"
	id, err := b.RunPod(ctx, cfg)
	if err != nil {
		t.Fatalf("RunPod with CNI ADD waiting for the pod's start: %v", err)
	}
	st, err := b.PodStatus(ctx, id, false)
	if err != nil {
		t.Fatal(err)
	}
	if hosts, err := os.ReadFile(filepath.Join(st.Record.RunDir, "etc", "hosts")); err != nil || !strings.Contains(string(hosts), "10.213.0.2") {
		t.Errorf("/etc/hosts after CNI ADD: %q, %v; want the pod's address", hosts, err)
	}

	var vmStarted []bool
	net.setup = func(ctx context.Context, id string) error {
		vmStarted = append(vmStarted, e.vm.Pod(id) != nil)
		return nil
	}
	vmCfg := podNet("vm-pod")
	vmCfg.Annotations = map[string]string{"stagelet.io/stage1": "vm"}
	if _, err := b.RunPod(ctx, vmCfg); err != nil {
		t.Fatal(err)
	}
	if len(vmStarted) != 1 || vmStarted[0] {
		t.Errorf("CNI ADD of a NetworkBeforeStart pod saw its stage1 started: %v, want once, before the start", vmStarted)
	}

	// CNI ADD fails after the pod started: the pod is released.
	net.setup = func(ctx context.Context, id string) error {
		if err := started(ctx, id); err != nil {
			return err
		}
		return errors.New("no address left")
	}
	if _, err := b.RunPod(ctx, podNet("no-address")); err == nil || !strings.Contains(err.Error(), "no address left") {
		t.Fatalf("RunPod with a failing CNI ADD: %v", err)
	}
	if n := len(b.ListPods(PodFilter{})); n != 2 {
		t.Errorf("pods after a failed start: %d, want the 2 that started", n)
	}
	if n := e.be.DestroyedPods(); n != 1 {
		t.Errorf("pods destroyed after a failed CNI ADD: %d, want 1", n)
	}
}

// A pod refused because pod networking is not ready took no network: no
// CNI DEL, no namespace, no record left.
func TestPodRefusedForUnreadyNetworkTakesNothing(t *testing.T) {
	e := newEnv(t)
	net := newFakeNetwork(filepath.Join(e.run, "netns"))
	net.unready = "no CNI configuration"
	e.net = net
	b := e.broker(t)
	cfg := podCfg("p")
	cfg.HostNetwork = false
	_, err := b.RunPod(context.Background(), cfg)
	if !errors.Is(err, errdefs.ErrUnavailable) || !strings.Contains(err.Error(), "no CNI configuration") {
		t.Fatalf("RunPod: %v, want Unavailable naming the reason", err)
	}
	net.mu.Lock()
	dels, nss := len(net.dels), len(net.netns)
	net.mu.Unlock()
	if dels != 0 || nss != 0 {
		t.Errorf("%d CNI DELs, %d namespaces for a pod that never had a network", dels, nss)
	}
	if ents, _ := os.ReadDir(filepath.Join(e.state, "pods")); len(ents) != 0 {
		t.Errorf("records left: %v", ents)
	}
}
