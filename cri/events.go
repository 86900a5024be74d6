package cri

import (
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/broker"
)

var eventTypes = map[string]runtimeapi.ContainerEventType{
	broker.EventCreated: runtimeapi.ContainerEventType_CONTAINER_CREATED_EVENT,
	broker.EventStarted: runtimeapi.ContainerEventType_CONTAINER_STARTED_EVENT,
	broker.EventStopped: runtimeapi.ContainerEventType_CONTAINER_STOPPED_EVENT,
	broker.EventDeleted: runtimeapi.ContainerEventType_CONTAINER_DELETED_EVENT,
}

// GetContainerEvents streams every container and pod sandbox event from
// the moment of the call, each with the pod's status and its containers'
// statuses, as the kubelet's evented PLEG reads them; a sandbox's events
// carry its ID as the container ID, as containerd's do. A client that
// falls behind the broker's buffer is dropped: the stream ends with
// ResourceExhausted and the client subscribes again.
func (s *Server) GetContainerEvents(_ *runtimeapi.GetEventsRequest, stream runtimeapi.RuntimeService_GetContainerEventsServer) error {
	sub := s.b.Subscribe()
	defer sub.Close()
	ctx := stream.Context()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-s.stopping:
			return status.Error(codes.Unavailable, "stagelet is stopping")
		case ev := <-sub.C:
			if err := stream.Send(containerEvent(&ev)); err != nil {
				return err
			}
		case <-sub.Dropped:
			s.log.WarnContext(ctx, "a GetContainerEvents client fell behind and was dropped")
			return status.Error(codes.ResourceExhausted, "this events client fell too far behind and was dropped; subscribe again")
		}
	}
}

func containerEvent(ev *broker.ContainerEvent) *runtimeapi.ContainerEventResponse {
	out := &runtimeapi.ContainerEventResponse{
		ContainerId:        ev.ContainerID,
		ContainerEventType: eventTypes[ev.Type],
		CreatedAt:          ev.At.UnixNano(),
		PodSandboxStatus:   podSandboxStatus(&ev.Pod),
	}
	for i := range ev.Containers {
		out.ContainersStatuses = append(out.ContainersStatuses, containerStatus(&ev.Containers[i]))
	}
	return out
}
