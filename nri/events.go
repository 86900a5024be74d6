package nri

import (
	"context"

	nriapi "github.com/containerd/nri/pkg/api"
)

// The daemon's pod and container events, relayed to the plugins
// subscribed to each. A plugin that fails to answer in time is
// disconnected by the library and the event goes on without it; an error
// is a plugin's refusal (or the stage1 validator's).

// BlockSync keeps a plugin from synchronizing until the returned function
// is called: a change to the daemon's pods between the event and its
// record is never missed by a plugin connecting meanwhile.
func (h *Host) BlockSync() (unblock func()) {
	b := h.a.BlockPluginSync()
	return b.Unblock
}

// RunPodSandbox relays a pod's start.
func (h *Host) RunPodSandbox(ctx context.Context, pod *nriapi.PodSandbox) error {
	return h.a.RunPodSandbox(ctx, &nriapi.RunPodSandboxRequest{Pod: pod})
}

// StopPodSandbox relays a pod's stop.
func (h *Host) StopPodSandbox(ctx context.Context, pod *nriapi.PodSandbox) error {
	return h.a.StopPodSandbox(ctx, &nriapi.StopPodSandboxRequest{Pod: pod})
}

// RemovePodSandbox relays a pod's removal.
func (h *Host) RemovePodSandbox(ctx context.Context, pod *nriapi.PodSandbox) error {
	return h.a.RemovePodSandbox(ctx, &nriapi.RemovePodSandboxRequest{Pod: pod})
}

// UpdatePodSandbox relays a change of a pod's resources.
func (h *Host) UpdatePodSandbox(ctx context.Context, pod *nriapi.PodSandbox, overhead, resources *nriapi.LinuxResources) error {
	_, err := h.a.UpdatePodSandbox(ctx, &nriapi.UpdatePodSandboxRequest{Pod: pod, OverheadLinuxResources: overhead, LinuxResources: resources})
	return err
}

// PostUpdatePodSandbox relays that a pod's resources changed.
func (h *Host) PostUpdatePodSandbox(ctx context.Context, pod *nriapi.PodSandbox) error {
	return h.a.PostUpdatePodSandbox(ctx, &nriapi.PostUpdatePodSandboxRequest{Pod: pod})
}

// Created is what plugins answer a container's creation: the adjustment
// of the container, and the updates and evictions of others.
type Created struct {
	Adjust *nriapi.ContainerAdjustment
	Update []*nriapi.ContainerUpdate
	Evict  []*nriapi.ContainerEviction
}

// CreateContainer asks the plugins for their adjustments of a container
// being created.
func (h *Host) CreateContainer(ctx context.Context, pod *nriapi.PodSandbox, ctr *nriapi.Container) (*Created, error) {
	r, err := h.a.CreateContainer(ctx, &nriapi.CreateContainerRequest{Pod: pod, Container: ctr})
	if err != nil {
		return nil, err
	}
	return &Created{Adjust: r.GetAdjust(), Update: r.GetUpdate(), Evict: r.GetEvict()}, nil
}

// PostCreateContainer relays that a container was created.
func (h *Host) PostCreateContainer(ctx context.Context, pod *nriapi.PodSandbox, ctr *nriapi.Container) error {
	return h.a.PostCreateContainer(ctx, &nriapi.PostCreateContainerRequest{Pod: pod, Container: ctr})
}

// StartContainer relays that a container is being started.
func (h *Host) StartContainer(ctx context.Context, pod *nriapi.PodSandbox, ctr *nriapi.Container) error {
	return h.a.StartContainer(ctx, &nriapi.StartContainerRequest{Pod: pod, Container: ctr})
}

// PostStartContainer relays that a container started.
func (h *Host) PostStartContainer(ctx context.Context, pod *nriapi.PodSandbox, ctr *nriapi.Container) error {
	return h.a.PostStartContainer(ctx, &nriapi.PostStartContainerRequest{Pod: pod, Container: ctr})
}

// Updated is what plugins answer a container's update: the updates (the
// container's own among them) and evictions.
type Updated struct {
	Update []*nriapi.ContainerUpdate
	Evict  []*nriapi.ContainerEviction
}

// UpdateContainer asks the plugins about a container's new resources.
func (h *Host) UpdateContainer(ctx context.Context, pod *nriapi.PodSandbox, ctr *nriapi.Container, res *nriapi.LinuxResources) (*Updated, error) {
	r, err := h.a.UpdateContainer(ctx, &nriapi.UpdateContainerRequest{Pod: pod, Container: ctr, LinuxResources: res})
	if err != nil {
		return nil, err
	}
	return &Updated{Update: r.GetUpdate(), Evict: r.GetEvict()}, nil
}

// PostUpdateContainer relays that a container's resources changed.
func (h *Host) PostUpdateContainer(ctx context.Context, pod *nriapi.PodSandbox, ctr *nriapi.Container) error {
	return h.a.PostUpdateContainer(ctx, &nriapi.PostUpdateContainerRequest{Pod: pod, Container: ctr})
}

// StopContainer relays a container's stop; plugins may answer updates of
// other containers.
func (h *Host) StopContainer(ctx context.Context, pod *nriapi.PodSandbox, ctr *nriapi.Container) ([]*nriapi.ContainerUpdate, error) {
	r, err := h.a.StopContainer(ctx, &nriapi.StopContainerRequest{Pod: pod, Container: ctr})
	return r.GetUpdate(), err
}

// RemoveContainer relays a container's removal.
func (h *Host) RemoveContainer(ctx context.Context, pod *nriapi.PodSandbox, ctr *nriapi.Container) error {
	return h.a.RemoveContainer(ctx, &nriapi.RemoveContainerRequest{Pod: pod, Container: ctr})
}
