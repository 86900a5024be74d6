package broker

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"sync"

	nriapi "github.com/containerd/nri/pkg/api"
	"github.com/opencontainers/runtime-spec/specs-go"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/nri"
	"github.com/stagelet/stagelet/ocihooks"
)

// The broker's side of NRI (package nri). Every event goes to the plugins
// through one ordered queue, in the order the broker's state changed:
// the calls whose answer the broker needs (a pod's start, a container's
// creation, start and update) wait for it; the notifications that follow
// a change (a container created, started, stopped or removed, a pod
// stopped or removed, whoever caused it: a CRI call, an exit, a pod's
// end) do not. Without NRI (Options.NRI nil) none of this runs.

// NRI is the host of NRI plugins the broker tells its events (nil: off).
func (b *Broker) NRI() *nri.Host { return b.opts.NRI }

// nriQueue runs NRI calls one at a time, in the order they were queued.
type nriQueue struct {
	mu      sync.Mutex
	pending []func()
	running bool
}

// post queues fn; it may be called with b.mu held.
func (q *nriQueue) post(fn func()) {
	q.mu.Lock()
	q.pending = append(q.pending, fn)
	if q.running {
		q.mu.Unlock()
		return
	}
	q.running = true
	q.mu.Unlock()
	go q.drain()
}

func (q *nriQueue) drain() {
	for {
		q.mu.Lock()
		if len(q.pending) == 0 {
			q.running = false
			q.mu.Unlock()
			return
		}
		fn := q.pending[0]
		q.pending[0] = nil
		q.pending = q.pending[1:]
		q.mu.Unlock()
		fn()
	}
}

// nriWait runs fn, an NRI call, in its turn and waits for it: its error
// is the plugins' refusal (FailedPrecondition).
func (b *Broker) nriWait(fn func() error) error {
	var err error
	b.nriq.do(func() { err = fn() })
	if err != nil {
		return errdefs.New(errdefs.ErrFailedPrecondition, "NRI: %w", err)
	}
	return nil
}

// do queues fn and waits for it to have run.
func (q *nriQueue) do(fn func()) {
	done := make(chan struct{})
	q.post(func() { fn(); close(done) })
	<-done
}

// nriPodLocked is pod p as NRI plugins see it; b.mu is held.
func (b *Broker) nriPodLocked(p *pod) *nriapi.PodSandbox {
	rec := p.rec
	c := &rec.Config
	return nri.PodOf(nri.PodInfo{
		ID:             rec.ID,
		Name:           c.Metadata.Name,
		UID:            c.Metadata.UID,
		Namespace:      c.Metadata.Namespace,
		Labels:         c.Labels,
		Annotations:    c.Annotations,
		RuntimeHandler: c.RuntimeHandler,
		CgroupParent:   b.podCgroupParent(&rec.Config),
		NetNSPath:      rec.NetNS,
		IPs:            rec.IPs,
	})
}

// nriViews are pod p and, unless c is nil, its container c (with app
// spec app, or its record's) as NRI plugins see them.
func (b *Broker) nriViews(p *pod, c *container, app *api.AppSpec) (*nriapi.PodSandbox, *nriapi.Container) {
	b.mu.Lock()
	defer b.mu.Unlock()
	pod := b.nriPodLocked(p)
	if c == nil {
		return pod, nil
	}
	return pod, b.nriContainerLocked(c, app)
}

// nriContainerLocked is container c as NRI plugins see it, from its app
// spec (app, or its record's); b.mu is held.
func (b *Broker) nriContainerLocked(c *container, app *api.AppSpec) *nriapi.Container {
	rec := c.rec
	if app == nil {
		app = rec.App
	}
	if app == nil {
		app = &api.AppSpec{ID: rec.ID, Name: rec.Config.Metadata.Name}
	}
	return nri.ContainerOf(rec.PodID, nri.ContainerInfo{
		ID:            rec.ID,
		Name:          rec.Config.Metadata.Name,
		State:         nriState(rec.State),
		Labels:        rec.Config.Labels,
		Annotations:   rec.Config.Annotations,
		CreatedAt:     rec.CreatedAt,
		StartedAt:     rec.StartedAt,
		FinishedAt:    rec.FinishedAt,
		ExitCode:      rec.ExitCode,
		StatusReason:  rec.Reason,
		StatusMessage: rec.Message,
	}, app)
}

func nriState(s string) nriapi.ContainerState {
	switch s {
	case ContainerCreating:
		return nriapi.ContainerState_CONTAINER_UNKNOWN
	case ContainerCreated:
		return nriapi.ContainerState_CONTAINER_CREATED
	case ContainerRunning:
		return nriapi.ContainerState_CONTAINER_RUNNING
	case ContainerExited:
		return nriapi.ContainerState_CONTAINER_STOPPED
	}
	return nriapi.ContainerState_CONTAINER_UNKNOWN
}

// nriPublishLocked queues the NRI notification of a change the broker
// publishes (publishLocked); b.mu is held.
func (b *Broker) nriPublishLocked(typ string, p *pod, c *container) {
	h := b.opts.NRI
	if h == nil {
		return
	}
	pod := b.nriPodLocked(p)
	ctx := context.Background()
	var fn func() error
	if c == nil {
		switch typ {
		case EventStopped:
			fn = func() error { return h.StopPodSandbox(ctx, pod) }
		case EventDeleted:
			fn = func() error { return h.RemovePodSandbox(ctx, pod) }
		}
	} else {
		ctr := b.nriContainerLocked(c, nil)
		switch typ {
		case EventCreated:
			fn = func() error { return h.PostCreateContainer(ctx, pod, ctr) }
		case EventStarted:
			fn = func() error { return h.PostStartContainer(ctx, pod, ctr) }
		case EventStopped:
			fn = func() error {
				upd, err := h.StopContainer(ctx, pod, ctr)
				b.nriApplyLater("a container's stop", upd, nil)
				return err
			}
		case EventDeleted:
			fn = func() error { return h.RemoveContainer(ctx, pod, ctr) }
		}
	}
	if fn == nil {
		return
	}
	b.nriq.post(func() {
		if err := fn(); err != nil {
			b.log.WarnContext(ctx, "NRI plugins failed a notification", "event", typ, "pod", pod.GetId(), "container", c != nil, "err", err)
		}
	})
}

// nriRunPod tells the plugins pod p starts, and waits for them: a refusal
// fails the start.
func (b *Broker) nriRunPod(ctx context.Context, p *pod) error {
	h := b.opts.NRI
	if h == nil {
		return nil
	}
	pod, _ := b.nriViews(p, nil, nil)
	return b.nriWait(func() error { return h.RunPodSandbox(ctx, pod) })
}

// nriUndoRunPod tells the plugins that a pod they were told of did not
// start after all, as a stop and a removal.
func (b *Broker) nriUndoRunPod(p *pod) {
	h := b.opts.NRI
	if h == nil {
		return
	}
	pod, _ := b.nriViews(p, nil, nil)
	b.nriq.post(func() {
		ctx := context.Background()
		if err := h.StopPodSandbox(ctx, pod); err != nil {
			b.log.Warn("NRI: undoing a failed pod start", "pod", pod.GetId(), "err", err)
		}
		if err := h.RemovePodSandbox(ctx, pod); err != nil {
			b.log.Warn("NRI: undoing a failed pod start", "pod", pod.GetId(), "err", err)
		}
	})
}

// nriUpdatePod tells the plugins pod p's limits change to res, and
// waits: a refusal fails the change.
func (b *Broker) nriUpdatePod(ctx context.Context, p *pod, res api.Resources) error {
	h := b.opts.NRI
	if h == nil {
		return nil
	}
	pod, _ := b.nriViews(p, nil, nil)
	return b.nriWait(func() error { return h.UpdatePodSandbox(ctx, pod, nil, nri.LinuxResourcesOf(&res)) })
}

// nriPostUpdatePod tells the plugins pod p's limits changed.
func (b *Broker) nriPostUpdatePod(p *pod) {
	h := b.opts.NRI
	if h == nil {
		return
	}
	pod, _ := b.nriViews(p, nil, nil)
	b.nriq.post(func() {
		if err := h.PostUpdatePodSandbox(context.Background(), pod); err != nil {
			b.log.Warn("NRI plugins failed a notification", "event", "PostUpdatePodSandbox", "pod", pod.GetId(), "err", err)
		}
	})
}

// nriCreateContainer asks the plugins to adjust container c's app spec
// and applies what they answer: app is changed in place, c's record takes
// the annotations and hooks. The updates and evictions of other
// containers they answer are applied after. A refusal, or an adjustment
// the pod's stage1 cannot honour, fails the creation.
func (b *Broker) nriCreateContainer(ctx context.Context, p *pod, c *container, app *api.AppSpec) error {
	h := b.opts.NRI
	if h == nil {
		return nil
	}
	pod, ctr := b.nriViews(p, c, app)
	var (
		created *nri.Created
		err     error
	)
	b.nriq.do(func() { created, err = h.CreateContainer(ctx, pod, ctr) })
	if err != nil {
		return errdefs.New(errdefs.ErrFailedPrecondition, "NRI: %w", err)
	}
	adjusted, err := nri.Adjust(app, created.Adjust)
	if err != nil {
		return fmt.Errorf("NRI adjustment: %w", err)
	}
	if err := b.applyAdjusted(c, app, adjusted); err != nil {
		return fmt.Errorf("NRI adjustment: %w", err)
	}
	b.nriApplyLater("a container's creation", created.Update, created.Evict)
	return nil
}

// nriApplyLater applies, on a goroutine of their own, the updates and
// evictions of other containers plugins answered an event (what): never
// on the queue's goroutine nor the caller's, which may hold the op lock
// of a container they name, or wait on the queue for a call of one that
// does.
func (b *Broker) nriApplyLater(what string, updates []*nriapi.ContainerUpdate, evictions []*nriapi.ContainerEviction) {
	if len(updates) == 0 && len(evictions) == 0 {
		return
	}
	go func() {
		ctx := context.Background()
		if _, err := b.NRIUpdate(ctx, updates); err != nil {
			b.log.WarnContext(ctx, "NRI: updates plugins asked for at "+what, "err", err)
		}
		if err := b.NRIEvict(ctx, evictions); err != nil {
			b.log.WarnContext(ctx, "NRI: evictions plugins asked for at "+what, "err", err)
		}
	}()
}

// nriUndoCreate tells the plugins that a container they adjusted was not
// created after all, as a stop and a removal.
func (b *Broker) nriUndoCreate(ctx context.Context, p *pod, c *container) {
	h := b.opts.NRI
	if h == nil {
		return
	}
	pod, ctr := b.nriViews(p, c, nil)
	b.nriq.post(func() {
		ctx := context.WithoutCancel(ctx)
		if _, err := h.StopContainer(ctx, pod, ctr); err != nil {
			b.log.WarnContext(ctx, "NRI: undoing a failed creation", "container", ctr.GetId(), "err", err)
		}
		if err := h.RemoveContainer(ctx, pod, ctr); err != nil {
			b.log.WarnContext(ctx, "NRI: undoing a failed creation", "container", ctr.GetId(), "err", err)
		}
	})
}

// nriStartContainer tells the plugins container c starts, and waits: a
// refusal fails the start.
func (b *Broker) nriStartContainer(ctx context.Context, p *pod, c *container) error {
	h := b.opts.NRI
	if h == nil {
		return nil
	}
	pod, ctr := b.nriViews(p, c, nil)
	return b.nriWait(func() error { return h.StartContainer(ctx, pod, ctr) })
}

// nriUpdateContainer asks the plugins about container c's new resources
// upd, and returns them as the plugins adjusted them; the updates of
// other containers and evictions they answer are applied after.
func (b *Broker) nriUpdateContainer(ctx context.Context, p *pod, c *container, upd api.Resources) (api.Resources, error) {
	h := b.opts.NRI
	if h == nil {
		return upd, nil
	}
	pod, ctr := b.nriViews(p, c, nil)
	var (
		res *nri.Updated
		err error
	)
	b.nriq.do(func() { res, err = h.UpdateContainer(ctx, pod, ctr, nri.LinuxResourcesOf(&upd)) })
	if err != nil {
		return upd, errdefs.New(errdefs.ErrFailedPrecondition, "NRI: %w", err)
	}
	var others []*nriapi.ContainerUpdate
	for _, u := range res.Update {
		if u.GetContainerId() != ctr.GetId() {
			others = append(others, u)
			continue
		}
		b.mu.Lock()
		stage1 := p.rec.Stage1
		b.mu.Unlock()
		if err := nri.CheckUpdateStage1(b.caps[stage1].KernelIsolated, stage1, "", u.GetLinux().GetResources()); err != nil {
			return upd, err
		}
		if err := nri.UpdateResources(&upd, u.GetLinux().GetResources()); err != nil {
			return upd, fmt.Errorf("NRI update: %w", err)
		}
	}
	b.nriApplyLater("a container's update", others, res.Evict)
	return upd, nil
}

// nriPostUpdate tells the plugins container c's resources changed.
func (b *Broker) nriPostUpdate(p *pod, c *container) {
	h := b.opts.NRI
	if h == nil {
		return
	}
	pod, ctr := b.nriViews(p, c, nil)
	b.nriq.post(func() {
		if err := h.PostUpdateContainer(context.Background(), pod, ctr); err != nil {
			b.log.Warn("NRI plugins failed a notification", "event", "PostUpdateContainer", "container", ctr.GetId(), "err", err)
		}
	})
}

// NRIState is every ready pod and every container of one, for a plugin's
// synchronization (nri.Runtime).
func (b *Broker) NRIState(context.Context) ([]*nriapi.PodSandbox, []*nriapi.Container) {
	b.mu.Lock()
	defer b.mu.Unlock()
	var pods []*nriapi.PodSandbox
	var ctrs []*nriapi.Container
	for _, p := range b.pods {
		if p.rec.State != PodReady {
			continue
		}
		pods = append(pods, b.nriPodLocked(p))
	}
	for _, c := range b.ctrs {
		if c.rec.State == ContainerCreating {
			continue
		}
		if p := b.pods[c.rec.PodID]; p == nil || p.rec.State != PodReady {
			continue
		}
		ctrs = append(ctrs, b.nriContainerLocked(c, nil))
	}
	return pods, ctrs
}

// NRIUpdate applies plugins' updates of containers' resources
// (nri.Runtime): each as the kubelet's UpdateContainerResources would be.
// It returns those it could not apply, unless the plugin marked them
// IgnoreFailure.
func (b *Broker) NRIUpdate(ctx context.Context, updates []*nriapi.ContainerUpdate) ([]*nriapi.ContainerUpdate, error) {
	var failed []*nriapi.ContainerUpdate
	var errs []error
	for _, u := range updates {
		if err := b.nriApplyUpdate(ctx, u); err != nil {
			b.log.WarnContext(ctx, "NRI: a plugin's container update failed", "container", u.GetContainerId(), "err", err)
			if !u.GetIgnoreFailure() {
				failed = append(failed, u)
				errs = append(errs, err)
			}
		}
	}
	return failed, errors.Join(errs...)
}

func (b *Broker) nriApplyUpdate(ctx context.Context, u *nriapi.ContainerUpdate) error {
	c, p, err := b.containerAndPod(ctx, u.GetContainerId())
	if err != nil {
		return err
	}
	c.op.Lock()
	defer c.op.Unlock()
	b.mu.Lock()
	var upd api.Resources
	if c.rec.App != nil {
		upd = c.rec.App.Resources
	}
	state := c.rec.State
	b.mu.Unlock()
	if state != ContainerCreated && state != ContainerRunning {
		return errdefs.FailedPrecondition("container %s is %s: its limits cannot change", c.rec.ID, state)
	}
	b.mu.Lock()
	stage1 := p.rec.Stage1
	b.mu.Unlock()
	if err := nri.CheckUpdateStage1(b.caps[stage1].KernelIsolated, stage1, "", u.GetLinux().GetResources()); err != nil {
		return err
	}
	if err := nri.UpdateResources(&upd, u.GetLinux().GetResources()); err != nil {
		return err
	}
	return b.applyResources(ctx, p, c, upd)
}

// NRIEvict stops the containers plugins evict (nri.Runtime), as a stop
// with no grace period.
func (b *Broker) NRIEvict(ctx context.Context, evictions []*nriapi.ContainerEviction) error {
	var errs []error
	for _, e := range evictions {
		b.log.InfoContext(ctx, "NRI: a plugin evicts a container", "container", e.GetContainerId(), "reason", e.GetReason())
		if err := b.StopContainer(ctx, e.GetContainerId(), 0); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// NRIValidate refuses an adjustment the pod's stage1 cannot honour
// (nri.Runtime).
func (b *Broker) NRIValidate(_ context.Context, req *nriapi.ValidateContainerAdjustmentRequest) error {
	b.mu.Lock()
	p := b.pods[req.GetPod().GetId()]
	var stage1 string
	if p != nil {
		stage1 = p.rec.Stage1
	}
	b.mu.Unlock()
	if p == nil {
		return errdefs.NotFound("pod sandbox %q not found", req.GetPod().GetId())
	}
	if h := req.GetAdjust().GetHooks(); len(h.GetCreateContainer())+len(h.GetStartContainer()) > 0 {
		owner, _ := req.GetOwners().HooksOwner(req.GetContainer().GetId())
		return errdefs.New(errdefs.ErrUnimplemented, "NRI plugin %s asked for createContainer or startContainer hooks: they run in the namespaces of the container's process before its command, and the agent starts that process with its command, at StartContainer, in one step", cmp.Or(owner, "(unknown)"))
	}
	return nri.CheckStage1(b.caps[stage1].KernelIsolated, stage1, req)
}

// applyAdjusted applies what of the plugins' adjustment of container c
// the broker holds (nri.Adjusted): the CDI devices they inject, resolved
// as the container's own (app takes their nodes, rules and edits), and
// the annotations and OCI hooks, which c's record keeps for its hooks.
func (b *Broker) applyAdjusted(c *container, app *api.AppSpec, a nri.Adjusted) error {
	if len(a.CDIDevices) > 0 {
		edits, err := b.opts.CDI.Resolve(a.CDIDevices, "NRI CDI devices")
		if err != nil {
			return err
		}
		app.Devices = append(app.Devices, edits.Nodes...)
		if !app.Privileged {
			app.DeviceCgroup = append(app.DeviceCgroup, edits.Rules...)
		}
		applyCDI(app, edits)
	}
	var hooks *specs.Hooks
	if a.Hooks != nil {
		hooks = &specs.Hooks{
			//lint:ignore SA1019 deprecated, and still run as runc runs it
			Prestart:        ociHooks(a.Hooks.Prestart),
			CreateRuntime:   ociHooks(a.Hooks.CreateRuntime),
			CreateContainer: ociHooks(a.Hooks.CreateContainer),
			StartContainer:  ociHooks(a.Hooks.StartContainer),
			Poststart:       ociHooks(a.Hooks.Poststart),
			Poststop:        ociHooks(a.Hooks.Poststop),
		}
		if err := ocihooks.Validate(hooks); err != nil {
			return err
		}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	ann := maps.Clone(c.rec.Config.Annotations)
	for k, v := range a.Annotations {
		if key, remove := nriapi.IsMarkedForRemoval(k); remove {
			delete(ann, key)
			continue
		}
		if ann == nil {
			ann = map[string]string{}
		}
		ann[k] = v
	}
	c.rec.OCIAnnotations, c.rec.Hooks = ann, hooks
	return nil
}

func ociHooks(hs []*nriapi.Hook) []specs.Hook {
	out := make([]specs.Hook, 0, len(hs))
	for _, h := range hs {
		out = append(out, h.ToOCI())
	}
	if len(out) == 0 {
		return nil
	}
	return out
}
