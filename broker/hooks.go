package broker

import (
	"context"

	"github.com/opencontainers/runtime-spec/specs-go"

	"github.com/stagelet/stagelet/ocihooks"
)

// A container's OCI hooks (what NRI plugins inject: ContainerRecord.Hooks)
// run as runc runs them, the daemon standing in for runc (package
// ocihooks): prestart, createRuntime and createContainer once the agent
// created the container and before it counts as created; startContainer
// right before the agent starts it; poststart once it runs; poststop once
// it is removed. A failing hook of any stage but poststop fails the CRI
// call that ran it, the container stopped or forgotten. The pod's
// stage1 must run its containers on this host (NRIValidate refuses hooks
// for a pod in a VM).

// runHooks runs container c's hooks of stages, with the container's state
// (status, and the PID pidOf says, asked only when there are hooks) on
// their stdin; a failure of a stage that is not fatal is logged and nil.
func (b *Broker) runHooks(ctx context.Context, c *container, status string, pidOf func() int, stages ...ocihooks.Stage) error {
	b.mu.Lock()
	hooks, dir, id := c.rec.Hooks, c.rec.Dir, c.rec.ID
	ann := c.rec.OCIAnnotations
	b.mu.Unlock()
	if hooks == nil {
		return nil
	}
	pid := pidOf()
	st := ocihooks.State{Version: specs.Version, ID: id, Status: specs.ContainerState(status), Pid: pid, Bundle: dir, Annotations: ann}
	for _, stage := range stages {
		list := stage.Of(hooks)
		if len(list) == 0 {
			continue
		}
		var err error
		if stage.InContainer() {
			err = ocihooks.RunInNamespaces(ctx, stage, list, st, pid)
		} else {
			err = ocihooks.Run(ctx, stage, list, st)
		}
		if err == nil {
			continue
		}
		if stage.Fatal() {
			return err
		}
		b.log.WarnContext(ctx, "an OCI hook failed", "container", id, "stage", stage, "err", err)
	}
	return nil
}
