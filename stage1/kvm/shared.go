package kvm

import (
	"github.com/stagelet/stagelet/agent/guest"
	"github.com/stagelet/stagelet/stage1/host"
)

// shared is the pod's propagating directory: <RunDir>/mounts on the host,
// exported by qemu over virtio-9p and mounted in the guest at
// guest.Mounts.
func (st *state) shared() host.SharedDir {
	return host.SharedDir{Host: st.mounts(), InPod: guest.Mounts}
}
