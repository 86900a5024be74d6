package kvm

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/lsm"
	"github.com/stagelet/stagelet/stage1"
	"github.com/stagelet/stagelet/stage1/host"
)

// A VM pod's qemu is confined as libvirt's sVirt confines a guest's: were
// the guest to take over its qemu, it would still reach no other pod's
// files. Where SELinux gives pods levels, qemu runs as lsm.VMMSELinuxType
// at its pod's level, and the pod's VM directory and shared directory
// carry the pod's mount label (the root file systems mounted beneath the
// latter carry it already); other pods' files are at other levels. Where
// AppArmor is enabled, qemu runs under a profile of the pod's own
// (lsm.VMMAppArmorProfile) that names only the pod's directories and the
// guest's assets, loaded before qemu starts and removed with the pod. A
// confined VM boots its kernel rather than being restored from a template
// (podTemplate).

// kindAppArmor is an AppArmor profile (Name) loaded for the pod's qemu.
const kindAppArmor host.Kind = "apparmor-profile"

const roleAppArmor = "qemu AppArmor profile"

// confinement is how a pod's qemu is confined from its exec on: its
// SELinux label and its AppArmor profile (empty: none).
type confinement struct {
	selinux, apparmor string
}

// confine prepares the confinement of the pod's qemu: its SELinux label,
// with the pod's directories labelled for it, and its AppArmor profile,
// loaded and recorded first, so that the pod's release removes it. It is
// called before qemu's unit or process is recorded: the release goes in
// reverse, and the kernel lets the processes of a removed profile run
// unconfined. Errors: FailedPrecondition when the node's policy lacks the
// type qemu runs as, or its profile cannot be loaded.
func confine(ctx context.Context, spec *stage1.PodSpec, st *state, res *tools, save func() error) (confinement, error) {
	var c confinement
	if spec.SELinuxProcessLabel != "" {
		l, err := lsm.VMMSELinuxLabel(spec.SELinuxProcessLabel)
		if err != nil {
			return c, errdefs.FailedPrecondition("kvm: %w", err)
		}
		// qemu's files made before it starts, so that they get the pod's
		// label too.
		for _, name := range []string{consoleName, qemuLogName} {
			f, err := os.OpenFile(filepath.Join(st.dir(), name), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o640)
			if err != nil {
				return c, fmt.Errorf("kvm: %w", err)
			}
			f.Close()
		}
		for _, dir := range []string{st.dir(), st.mounts()} {
			if err := lsm.Relabel(dir, spec.SELinuxMountLabel); err != nil {
				return c, fmt.Errorf("kvm: %w", err)
			}
		}
		c.selinux = l
	}
	if !lsm.AppArmorEnabled() {
		return c, nil
	}
	files := lsm.VMMFiles{QEMU: res.qemu, Read: []string{res.kernel, res.initrd}, Own: []string{st.dir(), st.mounts()}}
	name := lsm.VMMAppArmorName(spec.ID)
	text, err := lsm.VMMAppArmorProfile(name, files)
	if err != nil {
		return c, errdefs.FailedPrecondition("kvm: %w", err)
	}
	if err := st.Take(host.Resource{Kind: kindAppArmor, Role: roleAppArmor, Name: name}, save); err != nil {
		return c, fmt.Errorf("kvm: persist: %w", err)
	}
	if err := lsm.LoadAppArmorProfile(ctx, name, text); err != nil {
		return c, errdefs.FailedPrecondition("kvm: %w", err)
	}
	c.apparmor = name
	return c, nil
}

// confined tells whether qemu runs confined at all.
func (c confinement) confined() bool { return c.selinux != "" || c.apparmor != "" }

// apply gives launch the confinement.
func (c confinement) apply(launch *host.LaunchSpec) {
	launch.SELinuxLabel, launch.AppArmorProfile = c.selinux, c.apparmor
}

// removeProfile is the release of a kindAppArmor resource, once qemu is
// gone.
func removeProfile(_ context.Context, r host.Resource) error {
	return lsm.RemoveAppArmorProfile(r.Name)
}
