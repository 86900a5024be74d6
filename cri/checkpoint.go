package cri

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"time"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/broker"
	"github.com/stagelet/stagelet/errdefs"
)

// CheckpointContainer saves a running container into the archive file
// the request's location names (the kubelet's checkpoint API), within the
// request's timeout in seconds when it gives one.
func (s *Server) CheckpointContainer(ctx context.Context, r *runtimeapi.CheckpointContainerRequest) (*runtimeapi.CheckpointContainerResponse, error) {
	if r.GetContainerId() == "" {
		return nil, badRequest("container_id")
	}
	if r.GetTimeout() < 0 {
		return nil, errdefs.InvalidArgument("timeout: %d is negative", r.GetTimeout())
	}
	if t := r.GetTimeout(); t > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, time.Duration(t)*time.Second)
		defer cancel()
	}
	if err := s.b.CheckpointContainer(ctx, r.GetContainerId(), r.GetLocation()); err != nil {
		return nil, err
	}
	return &runtimeapi.CheckpointContainerResponse{}, nil
}

// CheckpointPod checkpoints a pod and the running containers named into
// the request's output directory (CRI v0.37).
func (s *Server) CheckpointPod(ctx context.Context, r *runtimeapi.CheckpointPodRequest) (*runtimeapi.CheckpointPodResponse, error) {
	if r.GetPodSandboxId() == "" {
		return nil, badRequest("pod_sandbox_id")
	}
	if err := noOptions(r.GetOptions()); err != nil {
		return nil, err
	}
	if err := s.b.CheckpointPod(ctx, r.GetPodSandboxId(), r.GetOutputPath(), r.GetContainerIds()); err != nil {
		return nil, err
	}
	return &runtimeapi.CheckpointPodResponse{}, nil
}

// RestorePod makes a pod from a CheckpointPod directory (CRI v0.37).
func (s *Server) RestorePod(ctx context.Context, r *runtimeapi.RestorePodRequest) (*runtimeapi.RestorePodResponse, error) {
	if err := noOptions(r.GetOptions()); err != nil {
		return nil, err
	}
	pc, err := podConfigFrom(&runtimeapi.RunPodSandboxRequest{Config: r.GetConfig(), RuntimeHandler: r.GetRuntimeHandler()})
	if err != nil {
		return nil, err
	}
	ctrs := make([]*broker.ContainerConfig, 0, len(r.GetContainerConfigs()))
	for i, c := range r.GetContainerConfigs() {
		if c.GetMetadata().GetName() == "" {
			return nil, errdefs.InvalidArgument("container_configs[%d]: metadata.name is required", i)
		}
		cc, err := containerConfigFrom(c)
		if err != nil {
			return nil, fmt.Errorf("container_configs[%d]: %w", i, err)
		}
		ctrs = append(ctrs, cc)
	}
	id, restored, err := s.b.RestorePod(ctx, r.GetCheckpointPath(), pc, ctrs)
	if err != nil {
		return nil, err
	}
	out := &runtimeapi.RestorePodResponse{PodSandboxId: id}
	for _, c := range restored {
		out.RestoredContainers = append(out.RestoredContainers, &runtimeapi.RestoredContainer{Name: c.Name, ContainerId: c.ID})
	}
	return out, nil
}

// noOptions refuses runtime-specific checkpoint and restore options:
// stagelet has none, and the CRI says unsupported keys are errors.
func noOptions(opts map[string]string) error {
	if len(opts) == 0 {
		return nil
	}
	keys := make([]string, 0, len(opts))
	for k := range opts {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return errdefs.InvalidArgument("options: stagelet has no checkpoint or restore options (%s)", strings.Join(keys, ", "))
}
