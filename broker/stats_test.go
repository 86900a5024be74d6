package broker

import (
	"context"
	"path/filepath"
	"testing"

	"github.com/stagelet/stagelet/agent/api"
)

// A container's stats ask its agent while it runs, and after it exited
// only where the agent keeps its writable layer (Capabilities.LocalLayers).
func TestContainerStatsAsksAgentOnlyWhenItKnows(t *testing.T) {
	e := newEnv(t)
	e.vm.Caps.LocalLayers = true
	e.net = newFakeNetwork(filepath.Join(e.run, "netns"))
	b := e.broker(t)
	ctx := context.Background()
	for _, tc := range []struct {
		stage1     string
		afterExit  int // the agent's stats calls for the exited container
		agentCalls func(string) int
	}{
		{"fake", 0, func(id string) int { return e.be.Pod(id).Calls(api.OpStats) }},
		{"vm", 1, func(id string) int { return e.vm.Pod(id).Calls(api.OpStats) }},
	} {
		cfg := podCfg("p-" + tc.stage1)
		if tc.stage1 == "vm" {
			cfg.HostNetwork, cfg.RuntimeHandler = false, "vm"
		}
		pid, err := b.RunPod(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		cid, _ := b.CreateContainer(ctx, pid, ctrCfg("c"))
		if err := b.StartContainer(ctx, cid); err != nil {
			t.Fatal(err)
		}
		if _, err := b.ContainerStats(ctx, cid); err != nil {
			t.Fatal(err)
		}
		if n := tc.agentCalls(pid); n != 1 {
			t.Errorf("%s: stats of a running container: %d agent calls, want 1", tc.stage1, n)
		}
		fp := e.be.Pod
		if tc.stage1 == "vm" {
			fp = e.vm.Pod
		}
		fp(pid).Exit(cid, 0)
		waitContainer(t, b, cid, func(r *ContainerRecord) bool { return r.State == ContainerExited })
		if _, err := b.ContainerStats(ctx, cid); err != nil {
			t.Fatal(err)
		}
		if n := tc.agentCalls(pid) - 1; n != tc.afterExit {
			t.Errorf("%s: stats of an exited container: %d agent calls, want %d", tc.stage1, n, tc.afterExit)
		}
	}
}
