package e2e

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/test/e2e/harness"
)

// chaosRounds is how many times TestChaosKill9 kills the daemon
// (STAGELET_CHAOS_ROUNDS overrides it).
func chaosRounds(t *testing.T) int {
	if s := os.Getenv("STAGELET_CHAOS_ROUNDS"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 {
			t.Fatalf("STAGELET_CHAOS_ROUNDS=%q", s)
		}
		return n
	}
	return 10
}

// chaosPod is what the test knows of one pod it asked for.
type chaosPod struct {
	name string
	id   string // set once RunPodSandbox answered
	// ready: RunPodSandbox and the container's start both answered, and
	// no removal of the pod was asked for.
	ready bool
	// removing: StopPodSandbox or RemovePodSandbox was sent; removed: the
	// RemovePodSandbox answered.
	removing, removed bool
}

// chaosLedger records every pod the test asked for, by name.
type chaosLedger struct {
	mu   sync.Mutex
	pods map[string]*chaosPod
}

func (l *chaosLedger) update(name string, f func(p *chaosPod)) {
	l.mu.Lock()
	defer l.mu.Unlock()
	p := l.pods[name]
	if p == nil {
		p = &chaosPod{name: name}
		l.pods[name] = p
	}
	f(p)
}

// TestChaosKill9: 20 pods (fly and nspawn, each with a running
// container) run while workers create and remove more; the daemon is
// killed with SIGKILL at a random moment, restarted, and that several
// times. After each restart every pod that was ready before (its creation
// answered, no removal asked for) is still SANDBOX_READY with its
// container running, no pod exists twice, a pod whose removal answered is
// gone, and whatever was caught half-made can be removed. Once everything
// is removed no pod record, run directory, netns or container directory
// is left; the harness then checks processes, mounts, cgroups, veths,
// IPAM entries and iptables rules.
func TestChaosKill9(t *testing.T) {
	e := newEnvOpts(t, harness.Options{Policy: bothStage1sPolicy}, true)
	seed := uint64(time.Now().UnixNano())
	rng := rand.New(rand.NewPCG(seed, 0))
	t.Logf("seed %d (the kill points and the order of the workers' calls)", seed)
	stage1s := []podStage1{flyStage1, nspawnStage1}
	ledger := &chaosLedger{pods: map[string]*chaosPod{}}

	// createPod runs a pod with one long-running container, recording
	// each step that answered. It stops at the first call that fails.
	createPod := func(ctx context.Context, name string, s podStage1) error {
		cfg := e.netPodConfig(name, s)
		ledger.update(name, func(*chaosPod) {})
		resp, err := e.rt().RunPodSandbox(ctx, &runtimeapi.RunPodSandboxRequest{Config: cfg, RuntimeHandler: s.handler})
		if err != nil {
			return fmt.Errorf("RunPodSandbox %s: %w", name, err)
		}
		ledger.update(name, func(p *chaosPod) { p.id = resp.PodSandboxId })
		c := e.netContainer(s, "app", "sleep", "3600")
		cr, err := e.rt().CreateContainer(ctx, &runtimeapi.CreateContainerRequest{PodSandboxId: resp.PodSandboxId, Config: c, SandboxConfig: cfg})
		if err != nil {
			return fmt.Errorf("CreateContainer in %s: %w", name, err)
		}
		if _, err := e.rt().StartContainer(ctx, &runtimeapi.StartContainerRequest{ContainerId: cr.ContainerId}); err != nil {
			return fmt.Errorf("StartContainer in %s: %w", name, err)
		}
		ledger.update(name, func(p *chaosPod) {
			if !p.removing {
				p.ready = true
			}
		})
		return nil
	}
	removePod := func(ctx context.Context, name, id string) error {
		ledger.update(name, func(p *chaosPod) { p.removing, p.ready = true, false })
		if _, err := e.rt().StopPodSandbox(ctx, &runtimeapi.StopPodSandboxRequest{PodSandboxId: id}); err != nil {
			return fmt.Errorf("StopPodSandbox %s: %w", name, err)
		}
		if _, err := e.rt().RemovePodSandbox(ctx, &runtimeapi.RemovePodSandboxRequest{PodSandboxId: id}); err != nil {
			return fmt.Errorf("RemovePodSandbox %s: %w", name, err)
		}
		ledger.update(name, func(p *chaosPod) { p.removed = true })
		return nil
	}

	ctx := t.Context()
	for i := range 20 {
		if err := createPod(ctx, fmt.Sprintf("base-%02d", i), stage1s[i%2]); err != nil {
			t.Fatalf("base pod: %v", err)
		}
	}

	restart := func() time.Duration {
		t.Helper()
		start := time.Now()
		if err := e.d.Launch(); err != nil {
			t.Fatalf("restart the daemon: %v", err)
		}
		wctx, cancel := context.WithTimeout(ctx, startTimeout)
		defer cancel()
		if _, err := e.d.WaitReady(wctx, func(ctx context.Context) error {
			_, err := e.rt().ListPodSandbox(ctx, &runtimeapi.ListPodSandboxRequest{})
			return err
		}); err != nil {
			t.Fatalf("daemon after restart: %v", err)
		}
		return time.Since(start)
	}

	// check compares what the daemon lists with the ledger.
	check := func(round int) {
		t.Helper()
		pods, err := e.rt().ListPodSandbox(e.ctx(), &runtimeapi.ListPodSandboxRequest{})
		if err != nil {
			t.Fatalf("round %d: ListPodSandbox: %v", round, err)
		}
		ctrs, err := e.rt().ListContainers(e.ctx(), &runtimeapi.ListContainersRequest{})
		if err != nil {
			t.Fatalf("round %d: ListContainers: %v", round, err)
		}
		byName := map[string][]*runtimeapi.PodSandbox{}
		for _, p := range pods.Items {
			byName[p.GetMetadata().GetName()] = append(byName[p.GetMetadata().GetName()], p)
		}
		running := map[string]int{}
		for _, c := range ctrs.Containers {
			if c.State == runtimeapi.ContainerState_CONTAINER_RUNNING {
				running[c.PodSandboxId]++
			}
		}
		ledger.mu.Lock()
		defer ledger.mu.Unlock()
		for name, ps := range byName {
			if len(ps) > 1 {
				t.Errorf("round %d: pod %s exists %d times", round, name, len(ps))
			}
			if ledger.pods[name] == nil {
				t.Errorf("round %d: pod %s (%s) was never asked for", round, name, ps[0].Id)
			}
		}
		for name, p := range ledger.pods {
			listed := byName[name]
			switch {
			case p.ready:
				if len(listed) != 1 || listed[0].Id != p.id || listed[0].State != runtimeapi.PodSandboxState_SANDBOX_READY {
					t.Errorf("round %d: pod %s (%s) was ready; now listed as %v", round, name, p.id, listed)
				} else if running[p.id] != 1 {
					t.Errorf("round %d: ready pod %s (%s) has %d running containers, want 1", round, name, p.id, running[p.id])
				}
			case p.removed:
				if len(listed) != 0 {
					t.Errorf("round %d: pod %s was removed and is listed again: %v", round, name, listed)
				}
			}
		}
	}

	var restarts []time.Duration
	for round := range chaosRounds(t) {
		rctx, stop := context.WithCancel(ctx)
		// A call fails once the daemon is killed; before, none may.
		var killed atomic.Bool
		failed := func(err error) {
			if err != nil && !killed.Load() {
				t.Errorf("round %d, before the kill: %v", round, err)
			}
		}
		var wg sync.WaitGroup
		for w := range 3 {
			wrng := rand.New(rand.NewPCG(seed, uint64(round*10+w+1)))
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := 0; rctx.Err() == nil; i++ {
					// Creates and removals alike, around 20 ready pods.
					ledger.mu.Lock()
					ready := 0
					for _, p := range ledger.pods {
						if p.ready {
							ready++
						}
					}
					ledger.mu.Unlock()
					if ready < 18 || ready < 22 && wrng.IntN(2) == 0 {
						name := fmt.Sprintf("churn-%d-%d-%d", round, w, i)
						if err := createPod(rctx, name, stage1s[wrng.IntN(2)]); err != nil {
							failed(err)
							return
						}
						continue
					}
					// Remove a ready pod, churned or base; it is
					// marked as being removed before another worker
					// can pick it.
					ledger.mu.Lock()
					var victims []*chaosPod
					for _, p := range ledger.pods {
						if p.ready {
							victims = append(victims, p)
						}
					}
					var v chaosPod
					if len(victims) > 0 {
						pick := victims[wrng.IntN(len(victims))]
						pick.removing, pick.ready = true, false
						v = *pick
					}
					ledger.mu.Unlock()
					if v.id == "" {
						continue
					}
					if err := removePod(rctx, v.name, v.id); err != nil {
						failed(err)
						return
					}
				}
			}()
		}
		// The kill lands anywhere in a create or a removal.
		killAt := time.Duration(200+rng.IntN(2300)) * time.Millisecond
		select {
		case <-time.After(killAt):
		case <-ctx.Done():
		}
		killed.Store(true)
		if err := e.d.Kill9(ctx); err != nil {
			t.Fatal(err)
		}
		stop()
		wg.Wait()
		took := restart()
		restarts = append(restarts, took)
		check(round)
		if t.Failed() {
			t.Fatalf("round %d (kill after %s) went wrong; seed %d", round, killAt, seed)
		}
		// What the kill caught half-made (a pod without its running
		// container) is removed; ready pods stay.
		pods, err := e.rt().ListPodSandbox(e.ctx(), &runtimeapi.ListPodSandboxRequest{})
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range pods.Items {
			var ready bool
			ledger.mu.Lock()
			if lp := ledger.pods[p.GetMetadata().GetName()]; lp != nil {
				ready = lp.ready
				lp.id = p.Id
			}
			ledger.mu.Unlock()
			if ready {
				continue
			}
			if err := removePod(e.ctx(), p.GetMetadata().GetName(), p.Id); err != nil {
				t.Fatalf("round %d: a pod the kill caught half-made (%s): %v", round, p.Id, err)
			}
		}
		var n int
		ledger.mu.Lock()
		for _, p := range ledger.pods {
			if p.ready {
				n++
			}
		}
		ledger.mu.Unlock()
		t.Logf("round %d: killed after %s, restarted in %s, %d pods ready", round, killAt, took.Round(time.Millisecond), n)
	}

	// Everything goes, through the CRI.
	pods, err := e.rt().ListPodSandbox(e.ctx(), &runtimeapi.ListPodSandboxRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range pods.Items {
		if err := removePod(e.ctx(), p.GetMetadata().GetName(), p.Id); err != nil {
			t.Error(err)
		}
	}
	for _, dir := range []string{
		filepath.Join(e.d.StateDir, "pods"),
		filepath.Join(e.d.StateDir, "containers"),
		filepath.Join(e.d.StateDir, "containers-fs"),
		filepath.Join(e.d.RunDir, "pods"),
		filepath.Join(e.d.RunDir, "netns"),
	} {
		ents, err := os.ReadDir(dir)
		if err != nil && !os.IsNotExist(err) {
			t.Errorf("%s: %v", dir, err)
		}
		for _, ent := range ents {
			t.Errorf("left in %s after every pod was removed: %s", dir, ent.Name())
		}
	}
	t.Logf("restarts took %v", restarts)
}
