package kvm

import (
	"context"
	"fmt"

	"github.com/stagelet/stagelet/agent"
	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/stage1"
)

// shared is the pod's propagating directory: <RunDir>/mounts on the host,
// exported by virtiofsd and mounted in the guest at agent.GuestMounts.
func (st *state) shared() stage1.SharedDir {
	return stage1.SharedDir{Host: st.Mounts, InPod: agent.GuestMounts}
}

// CreateContainer implements stage1.Pod. The container's rootfs, the
// directory of its log file and the source of each of its mounts are bound
// beneath the pod's shared directory on the host, whence they propagate to
// virtiofsd and so into the running guest, and the agent is given the
// paths it sees them at: the agent in the guest writes the container's
// log straight to the kubelet's file on the host. Errors: InvalidArgument
// (bad id), AlreadyExists (a known container), FailedPrecondition (a mount
// source that does not exist), and the agent's. On failure the binds are
// undone.
func (p *Pod) CreateContainer(ctx context.Context, spec *stage1.ContainerSpec) (*api.AppStatus, error) {
	sd := p.st.shared()
	inPod, err := sd.BindContainer(ctx, spec, p.known)
	if err != nil {
		return nil, fmt.Errorf("kvm: %w", err)
	}
	st, err := p.AgentPod.CreateContainer(ctx, inPod)
	if err != nil {
		if uerr := sd.UnbindContainer(spec.ID); uerr != nil {
			p.log.Warn("kvm: undoing a failed create", "container", spec.ID, "err", uerr)
		}
		return nil, err
	}
	return st, nil
}

// known tells whether the agent knows a container.
func (p *Pod) known(ctx context.Context, id string) (bool, error) {
	_, err := p.ContainerStatus(ctx, id)
	switch {
	case err == nil:
		return true, nil
	case errdefs.IsNotFound(err):
		return false, nil
	}
	return false, err
}

// RemoveContainer implements stage1.Pod: the agent forgets the container,
// then its binds are undone. Idempotent.
func (p *Pod) RemoveContainer(ctx context.Context, id string) error {
	if err := p.AgentPod.RemoveContainer(ctx, id); err != nil {
		return err
	}
	if err := p.st.shared().UnbindContainer(id); err != nil {
		return fmt.Errorf("kvm: container %s: %w", id, err)
	}
	return nil
}
