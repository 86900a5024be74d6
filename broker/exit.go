package broker

import (
	"context"

	"github.com/stagelet/stagelet/stage1"
)

// reportExit tells the backend of container c's pod that c exited, when
// it asks to know (stage1.AppExitReporter) and the record does not say
// so yet: before the status does, so that what the backend does then
// (a kvm pod's termination message copied to the host) is there when
// the kubelet reads the exit. A failure is logged.
func (b *Broker) reportExit(ctx context.Context, c *container) {
	b.mu.Lock()
	rec := c.rec
	var r stage1.AppExitReporter
	if p := b.pods[rec.PodID]; p != nil && p.handle != nil && rec.State != ContainerExited {
		r, _ = p.handle.Pod.(stage1.AppExitReporter)
	}
	id := rec.ID
	b.mu.Unlock()
	if r == nil {
		return
	}
	if err := r.AppExited(ctx, id); err != nil {
		b.log.WarnContext(ctx, "report a container's exit to its pod's backend", "container", id, "err", err)
	}
}
