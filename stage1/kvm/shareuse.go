package kvm

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"

	"github.com/stagelet/stagelet/agent/client"
	"github.com/stagelet/stagelet/agent/guest"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/atomicfile"
	"github.com/stagelet/stagelet/stage1"
)

// A pod's guest mounts the VM's 9p share only when a container needs a
// path on it (its rootfs, CRI log or a mount source bound into the
// pod's shared directory): qemu refuses to migrate a VM whose guest has
// it mounted, so a pod that never needed it can move. The first container
// that needed it is recorded, in memory and in the VM directory, and
// named by moveBlocker. A pod with a user namespace of its own mounts it
// at boot: its agent's mount namespace is made from the guest's then.

// shareUseName is the record of the share's use, in the VM directory.
const shareUseName = "share-use.json"

// shareUse is why a pod's guest mounted the share: the first container
// whose spec had a path on it, that path on the host and in the
// container.
type shareUse struct {
	Container string `json:"container"`
	Name      string `json:"name,omitempty"`
	HostPath  string `json:"hostPath"`
	CtrPath   string `json:"ctrPath"`
}

// podShare is a pod's share state: whether its guest mounted the share,
// and why. Shared by the Pod's values; safe for concurrent use.
type podShare struct {
	mu  sync.Mutex
	use *shareUse // nil: not mounted
}

// shareOnDemand tells whether a pod's guest mounts the share only when a
// container needs it: not in a pod with a user namespace of its own.
func shareOnDemand(spec *stage1.PodSpec) bool { return spec.UserNS == nil }

// loadShareUse reads a pod's record of its share's use; a missing or
// unreadable record is "not mounted" (an unreadable one is logged by the
// caller through the error).
func loadShareUse(st *state) (*shareUse, error) {
	b, err := os.ReadFile(filepath.Join(st.dir(), shareUseName))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var u shareUse
	if err := json.Unmarshal(b, &u); err != nil || u.Container == "" {
		return nil, fmt.Errorf("kvm: bad record %s: %v", shareUseName, err)
	}
	return &u, nil
}

// shareNeed is the first path of a container's in-pod spec (out, shared
// from in) on the share: a mount source, else its rootfs (unless the
// image comes from a disk), else its log; nil when none is.
func shareNeed(in, out *stage1.ContainerSpec) *shareUse {
	u := &shareUse{Container: out.ID, Name: out.Name}
	for i, m := range out.Mounts {
		if onShare(m.Source) {
			u.HostPath, u.CtrPath = m.Source, m.Destination
			if i < len(in.Mounts) && in.Mounts[i].Destination == m.Destination {
				u.HostPath = in.Mounts[i].Source
			}
			return u
		}
	}
	if out.RootfsDisk == nil && onShare(out.Rootfs) {
		u.HostPath, u.CtrPath = in.Rootfs, "/"
		return u
	}
	if out.LogPath != "" && onShare(out.LogPath) {
		u.HostPath, u.CtrPath = in.LogPath, "its CRI log"
		return u
	}
	return nil
}

// onShare tells whether a guest path is on the share (guest.Mounts).
func onShare(p string) bool {
	p = filepath.Clean(p)
	return p == guest.Mounts || strings.HasPrefix(p, guest.Mounts+"/")
}

// needShare has the guest mount the share when the container's in-pod
// spec out (shared from in) has a path on it and the share is not
// mounted yet, and records why.
func (p *Pod) needShare(ctx context.Context, in, out *stage1.ContainerSpec) error {
	if !p.st.ShareOnDemand {
		return nil
	}
	need := shareNeed(in, out)
	if need == nil {
		return nil
	}
	p.share.mu.Lock()
	defer p.share.mu.Unlock()
	if p.share.use != nil {
		return nil
	}
	// Recorded first, and kept when the mount fails: a guest that
	// mounted it and a record that says otherwise would let a move fail
	// in qemu rather than here.
	b, _ := json.Marshal(need)
	if err := atomicfile.Write(filepath.Join(p.st.dir(), shareUseName), b, 0o600); err != nil {
		return fmt.Errorf("kvm: record the 9p share's use: %w", err)
	}
	p.share.use = need
	err := client.NewClient(p.dial).MountShare(ctx)
	if errors.Is(err, errdefs.ErrInvalidArgument) {
		// A guest agent older than its host knows no such operation: it
		// mounted the share at boot (guest assets of another build).
		p.log.WarnContext(ctx, "kvm: the guest's agent does not mount the 9p share on demand; it mounted it at boot", "err", err)
		err = nil
	}
	if err != nil {
		return fmt.Errorf("kvm: container %s: mounting the VM's 9p share in the guest: %w", out.ID, err)
	}
	p.log.InfoContext(ctx, "kvm: the guest mounted the VM's 9p share: the pod cannot move", "container", need.Container, "hostPath", need.HostPath, "ctrPath", need.CtrPath)
	return nil
}

// moveBlocker is why the pod's VM cannot be migrated, FailedPrecondition;
// nil when it can be as far as its share goes.
func (p *Pod) moveBlocker() error {
	if !p.st.ShareOnDemand {
		return errdefs.FailedPrecondition("kvm: pod cannot move: its guest mounted the VM's 9p share at boot (a pod with a user namespace of its own, or started by an earlier version)")
	}
	p.share.mu.Lock()
	u := p.share.use
	p.share.mu.Unlock()
	if u == nil {
		return nil
	}
	ctr := u.Container
	if u.Name != "" {
		ctr = u.Name + " (" + u.Container + ")"
	}
	return errdefs.FailedPrecondition("kvm: pod cannot move: container %s mounts %s at %s over the VM's 9p share", ctr, u.HostPath, u.CtrPath)
}
