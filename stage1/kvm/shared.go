package kvm

import (
	"os"

	"github.com/stagelet/stagelet/agent/guest"
	"github.com/stagelet/stagelet/internal/bindmount"
	"github.com/stagelet/stagelet/stage1/host"
)

// shared is the pod's propagating directory: <RunDir>/mounts on the host,
// exported by qemu over virtio-9p and mounted in the guest at
// guest.Mounts. In a pod with a user namespace of its own a container's
// rootfs, log directory and volumes are bound there idmapped, so that the
// guest sees their files owned by the IDs that map to theirs. qemu, which
// writes the containers' logs, may run confined: log directories get the
// containers' SELinux labels.
func (st *state) shared() host.SharedDir {
	d := host.SharedDir{Host: st.mounts(), InPod: guest.Mounts, LabelLogs: true}
	if m := st.UserNS; m != nil {
		// qemu's 9p server, the host's root, makes the pod's files.
		d.UserNS = func() (*os.File, error) { return bindmount.ServedUserNSFile(m.HostID, m.Size) }
	}
	return d
}
