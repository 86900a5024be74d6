package stage1

import "context"

// AppExitReporter is an optional interface of a Pod whose containers'
// exits need work on the host before the broker records them: a kvm
// pod copies a container's termination message from its guest to the
// file the kubelet reads. The broker calls AppExited once it learns
// that container id exited, before the container's status says so; an
// error is logged, and the exit is recorded all the same.
type AppExitReporter interface {
	AppExited(ctx context.Context, id string) error
}
