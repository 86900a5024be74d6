package nspawn

import "github.com/stagelet/stagelet/stage1"

// shared is the pod's propagating directory: <RunDir>/mounts on the host,
// bound at /mnt/stagelet in the container. Containers reach the pod
// through it (stage1.SharedDirPod).
func (st *state) shared() stage1.SharedDir {
	return stage1.SharedDir{Host: st.Mounts, InPod: podMounts}
}
