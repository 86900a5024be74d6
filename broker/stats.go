package broker

import (
	"context"
	"path/filepath"
	"time"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/internal/diskusage"
	"github.com/stagelet/stagelet/network"
)

// ContainerStats are a container's usage figures.
type ContainerStats struct {
	Record ContainerRecord
	Usage  *api.Stats
	// Writable layer usage.
	WritableBytes, WritableInodes uint64
	WritableMount                 string
}

// ContainerStats returns the usage of a container; a container that does
// not run has no CPU or memory figures.
func (b *Broker) ContainerStats(ctx context.Context, id string) (*ContainerStats, error) {
	c, p, err := b.containerAndPod(ctx, id)
	if err != nil {
		return nil, err
	}
	return b.containerStats(ctx, c, p), nil
}

// containerStats reads a container's figures: CPU and memory from its
// agent while it runs; its writable layer's from the agent where the
// agent keeps that layer itself (Capabilities.LocalLayers, a kvm guest's:
// also before the container runs and after it exits, until its removal),
// otherwise from the upper directory on the host. The agent is not asked
// about a container that does not run and whose layer is on the host.
func (b *Broker) containerStats(ctx context.Context, c *container, p *pod) *ContainerStats {
	b.mu.Lock()
	rec := *c.rec
	b.mu.Unlock()
	out := &ContainerStats{Record: rec, WritableMount: rec.Dir}
	local := false
	if rec.State == ContainerRunning || b.caps[p.rec.Stage1].LocalLayers {
		if st := b.agentStats(ctx, p, rec.ID); st != nil {
			if rec.State == ContainerRunning {
				out.Usage = st
			}
			if st.LocalLayer {
				local = true
				out.WritableBytes, out.WritableInodes = st.WritableBytes, st.WritableInodes
			}
		}
	}
	if !local {
		// What cannot be read counts as nothing: a figure, not a failure.
		out.WritableBytes, out.WritableInodes, _ = diskusage.Of(filepath.Join(rec.Dir, "upper"))
	}
	return out
}

// agentStats asks p's agent for container id's figures; nil when it
// cannot answer.
func (b *Broker) agentStats(ctx context.Context, p *pod, id string) *api.Stats {
	h, err := b.podHandle(p)
	if err != nil {
		return nil
	}
	actx, cancel := agentCtx(ctx, 5*time.Second)
	defer cancel()
	st, err := h.Stats(actx, id)
	if err != nil {
		return nil
	}
	return st
}

// ListContainerStats returns stats for the containers matching f.
func (b *Broker) ListContainerStats(ctx context.Context, f ContainerFilter) []*ContainerStats {
	var out []*ContainerStats
	for _, rec := range b.ListContainers(ctx, f) {
		c, p, err := b.containerAndPod(ctx, rec.ID)
		if err != nil {
			continue
		}
		out = append(out, b.containerStats(ctx, c, p))
	}
	return out
}

// PodStats are a pod's usage figures and its containers'.
type PodStats struct {
	Status     *PodStatus
	Usage      *api.Stats
	Containers []*ContainerStats
	// Network are the counters of the interfaces in the pod's network
	// namespace (none for a pod in the host's network), read at
	// NetworkTime. A VM pod's traffic crosses its namespace too.
	Network     []network.InterfaceStats
	NetworkTime time.Time
}

// PodStats returns a pod's usage.
func (b *Broker) PodStats(ctx context.Context, id string) (*PodStats, error) {
	st, err := b.PodStatus(ctx, id, false)
	if err != nil {
		return nil, err
	}
	return b.podStats(ctx, st), nil
}

func (b *Broker) podStats(ctx context.Context, st *PodStatus) *PodStats {
	out := &PodStats{Status: st}
	if p, err := b.lookupPod(st.Record.ID); err == nil {
		if h, err := b.podHandle(p); err == nil {
			actx, cancel := agentCtx(ctx, 5*time.Second)
			if u, err := h.Stats(actx, ""); err == nil {
				out.Usage = u
			}
			cancel()
		}
	}
	if rec := &st.Record; !rec.Config.HostNetwork && rec.NetNS != "" && st.Ready {
		if n, err := network.InterfaceCounters(rec.NetNS); err == nil {
			out.Network, out.NetworkTime = n, time.Now()
		} else {
			b.log.DebugContext(ctx, "pod network counters", "pod", rec.ID, "err", err)
		}
	}
	out.Containers = b.ListContainerStats(ctx, ContainerFilter{PodID: st.Record.ID, State: ContainerRunning})
	return out
}

// ListPodStats returns stats for the pods matching f.
func (b *Broker) ListPodStats(ctx context.Context, f PodFilter) []*PodStats {
	var out []*PodStats
	for _, s := range b.ListPods(f) {
		st, err := b.PodStatus(ctx, s.ID, false)
		if err != nil {
			continue // removed since
		}
		out = append(out, b.podStats(ctx, st))
	}
	return out
}
