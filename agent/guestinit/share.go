package guestinit

import (
	"sync"

	"github.com/stagelet/stagelet/errdefs"
)

// A guest told stagelet.fsdemand=1 mounts the pod's shared directory only
// when the host first asks (api.OpMountShare): qemu refuses to migrate a
// VM whose guest has its virtio-9p share mounted, so a pod none of whose
// containers needs a host path keeps its VM movable.

// podShare is this guest's shared directory to mount on demand.
var podShare onDemandShare

// onDemandShare is a shared directory mounted at the first call to mount.
type onDemandShare struct {
	mu          sync.Mutex
	tag, fsType string
	mounted     bool
}

// set names the directory to mount (personalize, at boot or OpSetup).
func (s *onDemandShare) set(tag, fsType string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.tag, s.fsType = tag, fsType
}

// mount mounts the directory once; later calls return nil.
// FailedPrecondition when the guest has none to mount on demand.
func (s *onDemandShare) mount() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.mounted {
		return nil
	}
	if s.tag == "" {
		return errdefs.FailedPrecondition("mountshare: the guest has no shared directory to mount on demand")
	}
	if err := mountShare(s.tag, s.fsType); err != nil {
		return err
	}
	s.mounted = true
	return nil
}
