package broker

import (
	"context"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"
)

// recorder is an Observer that writes down what it is told.
type recorder struct {
	mu           sync.Mutex
	decided      []string // stage1/rule
	refused      []string
	started      []string // stage1
	disconnects  []string
	recovered    int
	verified     []string       // stage result
	agentRefused map[string]int // stage1 field reason
}

func (r *recorder) PolicyDecided(stage1, rule string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.decided = append(r.decided, stage1+"/"+rule)
}

func (r *recorder) PolicyRefused(reason string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.refused = append(r.refused, reason)
}

func (r *recorder) PodStarted(stage1 string, took time.Duration) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if took > 0 {
		r.started = append(r.started, stage1)
	}
}

func (r *recorder) AgentDisconnected(stage1 string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.disconnects = append(r.disconnects, stage1)
}

func (r *recorder) Recovered(RecoveryResult) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.recovered++
}

func (r *recorder) ImageVerified(stage, result string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.verified = append(r.verified, stage+" "+result)
}

func (r *recorder) AgentRefused(stage1, field, reason string, n int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.agentRefused == nil {
		r.agentRefused = map[string]int{}
	}
	r.agentRefused[stage1+" "+field+" "+reason] += n
}

// refusals is how many things of field the pods' agents of stage1 sent
// were refused for reason.
func (r *recorder) refusals(stage1, field, reason string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.agentRefused[stage1+" "+field+" "+reason]
}

func (r *recorder) snapshot() recorder {
	r.mu.Lock()
	defer r.mu.Unlock()
	return recorder{decided: slices.Clone(r.decided), refused: slices.Clone(r.refused), started: slices.Clone(r.started),
		disconnects: slices.Clone(r.disconnects), recovered: r.recovered}
}

// TestObserver: the broker tells its Observer of each decision (with the
// rule that chose) and refusal (with what refused), of a pod's first
// running container only, of an agent's stream ending, and of recovery;
// Census counts from memory.
func TestObserver(t *testing.T) {
	e := newEnv(t)
	rec := &recorder{}
	e.obs = rec
	e.net = newFakeNetwork(filepath.Join(e.run, "netns"))
	b := e.broker(t)
	ctx := context.Background()

	id, err := b.RunPod(ctx, podCfg("plain"))
	if err != nil {
		t.Fatal(err)
	}
	priv := podCfg("priv")
	priv.Privileged, priv.HostNetwork = true, false
	if _, err := b.RunPod(ctx, priv); err != nil {
		t.Fatal(err)
	}
	locked := podCfg("locked")
	locked.Metadata.Namespace, locked.Privileged = "locked", true
	if _, err := b.RunPod(ctx, locked); err == nil {
		t.Fatal("the refuse rule let a pod in")
	}
	for _, name := range []string{"a", "b"} {
		cid, err := b.CreateContainer(ctx, id, ctrCfg(name))
		if err != nil {
			t.Fatal(err)
		}
		if err := b.StartContainer(ctx, cid); err != nil {
			t.Fatal(err)
		}
	}
	c := b.Census()
	if n := c.Pods[StageState{"fake", PodReady}]; n != 1 {
		t.Errorf("census: %d ready fake pods, want 1 (%v)", n, c.Pods)
	}
	if n := c.Pods[StageState{"vm", PodReady}]; n != 1 {
		t.Errorf("census: %d ready vm pods, want 1 (%v)", n, c.Pods)
	}
	if n := c.Containers[StageState{"fake", ContainerRunning}]; n != 2 {
		t.Errorf("census: %d running fake containers, want 2 (%v)", n, c.Containers)
	}

	e.be.Pod(id).Die()
	waitFor(t, "the observer hears of the disconnect", func() bool { return len(rec.snapshot().disconnects) > 0 })

	got := rec.snapshot()
	if want := []string{"fake/", "vm/privileged-to-vm"}; !slices.Equal(got.decided, want) {
		t.Errorf("decisions %q, want %q", got.decided, want)
	}
	if want := []string{`rule "no-privileged-in-locked"`}; !slices.Equal(got.refused, want) {
		t.Errorf("refusals %q, want %q", got.refused, want)
	}
	if want := []string{"fake"}; !slices.Equal(got.started, want) {
		t.Errorf("pod starts %q, want %q: the first container only", got.started, want)
	}
	if want := []string{"fake"}; !slices.Equal(got.disconnects, want) {
		t.Errorf("disconnects %q, want %q", got.disconnects, want)
	}
	if got.recovered != 1 {
		t.Errorf("told of %d recoveries, want 1", got.recovered)
	}
}
