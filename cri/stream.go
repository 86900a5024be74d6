package cri

import (
	"google.golang.org/grpc"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// streamBatch is how many items one message of a Stream* call carries:
// however long the list, no message comes near the 16 MiB a kubelet
// receives, which a List call's single reply can exceed.
const streamBatch = 100

// sendInBatches sends items in messages of at most streamBatch; an empty
// list is no message at all.
func sendInBatches[T any](items []T, send func([]T) error) error {
	for len(items) > 0 {
		n := min(streamBatch, len(items))
		if err := send(items[:n]); err != nil {
			return err
		}
		items = items[n:]
	}
	return nil
}

// StreamPodSandboxes is ListPodSandbox, with the same filter, in batches.
func (s *Server) StreamPodSandboxes(r *runtimeapi.StreamPodSandboxesRequest, stream grpc.ServerStreamingServer[runtimeapi.StreamPodSandboxesResponse]) error {
	resp, err := s.ListPodSandbox(stream.Context(), &runtimeapi.ListPodSandboxRequest{Filter: r.GetFilter()})
	if err != nil {
		return err
	}
	return sendInBatches(resp.Items, func(b []*runtimeapi.PodSandbox) error {
		return stream.Send(&runtimeapi.StreamPodSandboxesResponse{PodSandboxes: b})
	})
}

// StreamContainers is ListContainers, with the same filter, in batches.
func (s *Server) StreamContainers(r *runtimeapi.StreamContainersRequest, stream grpc.ServerStreamingServer[runtimeapi.StreamContainersResponse]) error {
	resp, err := s.ListContainers(stream.Context(), &runtimeapi.ListContainersRequest{Filter: r.GetFilter()})
	if err != nil {
		return err
	}
	return sendInBatches(resp.Containers, func(b []*runtimeapi.Container) error {
		return stream.Send(&runtimeapi.StreamContainersResponse{Containers: b})
	})
}

// StreamContainerStats is ListContainerStats, with the same filter, in
// batches.
func (s *Server) StreamContainerStats(r *runtimeapi.StreamContainerStatsRequest, stream grpc.ServerStreamingServer[runtimeapi.StreamContainerStatsResponse]) error {
	resp, err := s.ListContainerStats(stream.Context(), &runtimeapi.ListContainerStatsRequest{Filter: r.GetFilter()})
	if err != nil {
		return err
	}
	return sendInBatches(resp.Stats, func(b []*runtimeapi.ContainerStats) error {
		return stream.Send(&runtimeapi.StreamContainerStatsResponse{ContainerStats: b})
	})
}

// StreamPodSandboxStats is ListPodSandboxStats, with the same filter, in
// batches.
func (s *Server) StreamPodSandboxStats(r *runtimeapi.StreamPodSandboxStatsRequest, stream grpc.ServerStreamingServer[runtimeapi.StreamPodSandboxStatsResponse]) error {
	resp, err := s.ListPodSandboxStats(stream.Context(), &runtimeapi.ListPodSandboxStatsRequest{Filter: r.GetFilter()})
	if err != nil {
		return err
	}
	return sendInBatches(resp.Stats, func(b []*runtimeapi.PodSandboxStats) error {
		return stream.Send(&runtimeapi.StreamPodSandboxStatsResponse{PodSandboxStats: b})
	})
}

// StreamImages is ListImages, with the same filter, in batches.
func (s *Server) StreamImages(r *runtimeapi.StreamImagesRequest, stream grpc.ServerStreamingServer[runtimeapi.StreamImagesResponse]) error {
	resp, err := s.ListImages(stream.Context(), &runtimeapi.ListImagesRequest{Filter: r.GetFilter()})
	if err != nil {
		return err
	}
	return sendInBatches(resp.Images, func(b []*runtimeapi.Image) error {
		return stream.Send(&runtimeapi.StreamImagesResponse{Images: b})
	})
}
