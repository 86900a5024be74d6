// Package lsm holds what stagelet does with Linux security modules besides
// seccomp: it computes a container's SELinux labels (in the daemon) and
// applies them and an AppArmor profile to the command about to be
// executed (in the agent). Both the daemon and the agent ask it whether a
// module is enabled, each on its own side of the pod boundary.
package lsm

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/opencontainers/selinux/go-selinux"
	"github.com/opencontainers/selinux/go-selinux/label"
)

// Contexts a container gets where SELinux policy does not say: the usual
// container types of the targeted policy, at the lowest level.
const (
	DefaultSELinuxProcessLabel = "system_u:system_r:container_t:s0"
	DefaultSELinuxMountLabel   = "system_u:object_r:container_file_t:s0"
	// PrivilegedSELinuxType is the type privileged containers run as
	// where the policy has it (Fedora's container-selinux, and
	// contrib/selinux on Debian): unconfined, but named, so that ps -Z
	// tells a privileged container from the runtime.
	PrivilegedSELinuxType = "spc_t"
	// VMMSELinuxType is the type a VM pod's qemu runs as, at its pod's
	// level (Fedora's container-selinux names it so for Kata's VMMs;
	// contrib/selinux defines it on Debian): qemu reaches its own pod's
	// files, as sVirt's svirt_t does a libvirt guest's, and no other's.
	VMMSELinuxType = "container_kvm_t"
)

// SELinuxOptions are the parts of a context a container asks for; empty
// parts come from the policy (or the defaults above).
type SELinuxOptions struct {
	User, Role, Type, Level string
}

func (o *SELinuxOptions) labelOptions() []string {
	var opts []string
	for _, kv := range [][2]string{{"user", o.User}, {"role", o.Role}, {"type", o.Type}, {"level", o.Level}} {
		if kv[1] != "" {
			opts = append(opts, kv[0]+":"+kv[1])
		}
	}
	return opts
}

// SELinuxEnabled tells whether SELinux is enabled on this side (host or
// pod) of the caller.
func SELinuxEnabled() bool { return selinux.GetEnabled() }

// SELinuxMode says SELinux's mode on this side: "enforcing",
// "permissive" or "disabled".
func SELinuxMode() string {
	if !selinux.GetEnabled() {
		return "disabled"
	}
	if selinux.EnforceMode() == selinux.Enforcing {
		return "enforcing"
	}
	return "permissive"
}

// SELinuxContainerType is the type the policy's container contexts
// (lxc_contexts) run containers as; "" without SELinux or without them,
// when containers run unlabelled, as the agent that starts them.
func SELinuxContainerType() string {
	if !selinux.GetEnabled() {
		return ""
	}
	p, _, err := label.InitLabels(nil)
	if err != nil || p == "" {
		return ""
	}
	selinux.ReleaseLabel(p)
	c, err := selinux.NewContext(p)
	if err != nil {
		return ""
	}
	return c["type"]
}

// Labels are an SELinux process label and the mount label that goes with
// it (same user and level).
type Labels struct {
	Process string `json:"process,omitempty"`
	Mount   string `json:"mount,omitempty"`
}

// PodSELinuxLabels computes a pod's labels: its MCS level is the one every
// container of the pod shares (ContainerSELinuxLabels), as in CRI-O and
// containerd, so that they share volumes and processes while other pods
// cannot.
//
// Where SELinux is enabled, label.InitLabels computes them from the
// policy's container contexts and the options, and reserves their MCS
// level in the process's one allocator: a pair of categories no live pod
// holds, unless o.Level gives the level. ReleaseSELinux gives it back, and
// recovery reserves the levels of the pods it finds (ReserveSELinux), so
// that no two live pods share one across restarts. Where the policy has no
// container contexts (Debian's has none), the labels are empty. Where
// SELinux is disabled and o is not nil, the labels are still computed,
// from the defaults above with the options applied, so that records and
// status show what the pod would run as; nothing applies them there. With
// neither, both are empty.
func PodSELinuxLabels(o *SELinuxOptions) (Labels, error) {
	if selinux.GetEnabled() {
		var opts []string
		if o != nil {
			if err := o.check(); err != nil {
				return Labels{}, err
			}
			opts = o.labelOptions()
		}
		process, mount, err := label.InitLabels(opts)
		if err != nil {
			return Labels{}, fmt.Errorf("selinux labels: %w", err)
		}
		l := Labels{Process: process, Mount: mount}
		if err := l.check(); err != nil {
			ReleaseSELinux(l)
			return Labels{}, err
		}
		return l, nil
	}
	if o == nil {
		return Labels{}, nil
	}
	return derive(Labels{Process: DefaultSELinuxProcessLabel, Mount: DefaultSELinuxMountLabel}, o)
}

// ContainerSELinuxLabels computes a container's labels from its pod's
// (PodSELinuxLabels) and its own options: the parts it gives replace the
// pod's, so a container that gives none runs at the pod's level. Nothing is
// reserved: the pod holds the level. In a pod without labels (a policy
// without container contexts) or without separation (its processes of
// the privileged type) a container that gives options gets them over the
// defaults above, and one that gives none the pod's labels.
func ContainerSELinuxLabels(pod Labels, o *SELinuxOptions) (Labels, error) {
	if o == nil {
		return pod, nil
	}
	if pod.Process == "" || pod.Mount == "" || !pod.separated() {
		pod = Labels{Process: DefaultSELinuxProcessLabel, Mount: DefaultSELinuxMountLabel}
	}
	l, err := derive(pod, o)
	if err != nil {
		return Labels{}, err
	}
	if selinux.GetEnabled() {
		if err := l.check(); err != nil {
			return Labels{}, err
		}
	}
	return l, nil
}

// PrivilegedSELinuxLabels are a privileged container's labels: the
// process runs as system_u:system_r:PrivilegedSELinuxType:s0, and
// nothing it mounts is relabelled. Empty without SELinux, or where the
// policy has no such type: the process then runs as the agent that
// starts it does.
func PrivilegedSELinuxLabels() Labels {
	if !selinux.GetEnabled() {
		return Labels{}
	}
	c, err := selinux.NewContext(DefaultSELinuxProcessLabel)
	if err != nil {
		return Labels{}
	}
	c["type"], c["level"] = PrivilegedSELinuxType, "s0"
	if selinux.SecurityCheckContext(c.Get()) != nil {
		return Labels{}
	}
	return Labels{Process: c.Get()}
}

// AgentSELinuxLabel is the label of a pod's agent where the agent is the
// pod's PID 1 (nspawn): the privileged type at the pod's level, from the
// pod's process label.
func AgentSELinuxLabel(podProcess string) (string, error) {
	return withType(podProcess, PrivilegedSELinuxType)
}

// VMMSELinuxLabel is the label a VM pod's qemu runs with: the type of
// the policy's kvm_process context (lxc_contexts), else VMMSELinuxType,
// at the pod's level, from the pod's process label. A policy without
// that type is an error naming it: qemu would otherwise run unconfined,
// as the daemon does, beside confined containers.
func VMMSELinuxLabel(podProcess string) (string, error) {
	typ := VMMSELinuxType
	if c, err := selinux.NewContext(containerContext("kvm_process")); err == nil && c["type"] != "" {
		typ = c["type"]
	}
	l, err := withType(podProcess, typ)
	if err != nil {
		return "", err
	}
	if err := (Labels{Process: l}).check(); err != nil {
		return "", fmt.Errorf("a VM pod's qemu: %w", err)
	}
	return l, nil
}

// withType is the context label with its type replaced by typ.
func withType(label, typ string) (string, error) {
	c, err := selinux.NewContext(label)
	if err != nil {
		return "", err
	}
	c["type"] = typ
	return c.Get(), nil
}

// check asks the kernel's policy whether it knows l's contexts: one it
// does not is refused, naming its type, so that a container asking for a
// type the node's policy lacks learns which.
func (l Labels) check() error {
	for _, c := range []string{l.Process, l.Mount} {
		if c == "" {
			continue
		}
		if err := selinux.SecurityCheckContext(c); err != nil {
			typ := ""
			if ctx, perr := selinux.NewContext(c); perr == nil {
				typ = ctx["type"]
			}
			return fmt.Errorf("the node's SELinux policy does not accept the context %s (is type %s defined, and allowed with that user, role and level?): %w", c, typ, err)
		}
	}
	return nil
}

// LabelReadOnly gives dir and everything beneath it the policy's label
// for what containers read but do not own (lxc_contexts' ro_file:
// container_ro_file_t), unless dir has it already; what is made in dir
// later inherits it. The image store's layers need it: overlayfs checks a
// container's reads of a lower file against the file's own label, even
// where the overlay is mounted with the container's. A no-op without
// SELinux or without that label.
func LabelReadOnly(dir string) error {
	if !selinux.GetEnabled() {
		return nil
	}
	ro := containerContext("ro_file")
	if ro == "" {
		return nil
	}
	if cur, err := selinux.FileLabel(dir); err == nil && cur == ro {
		return nil
	}
	if err := selinux.Chcon(dir, ro, true); err != nil {
		return fmt.Errorf("selinux label %s as %s: %w", dir, ro, err)
	}
	return nil
}

// containerContext reads one of the policy's container contexts
// (lxc_contexts: key = "context"), as go-selinux does; "" where the
// policy has none.
func containerContext(key string) string {
	typ := "targeted"
	if b, err := os.ReadFile("/etc/selinux/config"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(strings.TrimSpace(line), "SELINUXTYPE="); ok {
				typ = strings.TrimSpace(v)
			}
		}
	}
	b, err := os.ReadFile(filepath.Join("/etc/selinux", typ, "contexts", "lxc_contexts"))
	if err != nil {
		return ""
	}
	for _, line := range strings.Split(string(b), "\n") {
		k, v, ok := strings.Cut(line, "=")
		if ok && strings.TrimSpace(k) == key {
			return strings.Trim(strings.TrimSpace(v), `"`)
		}
	}
	return ""
}

// Relabel gives path and everything beneath it the mount label, so that
// a container at that level may use it (a volume asking for
// selinux_relabel, the pod's own files). A no-op without SELinux or
// without a label. go-selinux refuses the node's system directories.
func Relabel(path, mountLabel string) error {
	if mountLabel == "" || !selinux.GetEnabled() {
		return nil
	}
	if err := label.Relabel(path, mountLabel, false); err != nil {
		return fmt.Errorf("selinux relabel %s to %s: %w", path, mountLabel, err)
	}
	return nil
}

// check refuses options that cannot be part of a context.
func (o *SELinuxOptions) check() error {
	for _, part := range []string{o.User, o.Role, o.Type, o.Level} {
		if strings.ContainsAny(part, " \t\n\"") {
			return fmt.Errorf("selinux option %q: blanks and quotes are not allowed", part)
		}
	}
	for _, part := range []string{o.User, o.Role, o.Type} {
		if strings.Contains(part, ":") {
			return fmt.Errorf("selinux option %q: only the level may contain ':'", part)
		}
	}
	return nil
}

// derive applies o to base, as label.InitLabels does: user, role, type and
// level set the process context; user and level the mount context.
func derive(base Labels, o *SELinuxOptions) (Labels, error) {
	if err := o.check(); err != nil {
		return Labels{}, err
	}
	pcon, err := selinux.NewContext(base.Process)
	if err != nil {
		return Labels{}, err
	}
	mcon, err := selinux.NewContext(base.Mount)
	if err != nil {
		return Labels{}, err
	}
	set := func(c selinux.Context, k, v string) {
		if v != "" {
			c[k] = v
		}
	}
	set(pcon, "user", o.User)
	set(pcon, "role", o.Role)
	set(pcon, "type", o.Type)
	set(pcon, "level", o.Level)
	set(mcon, "user", o.User)
	set(mcon, "level", o.Level)
	return Labels{Process: pcon.Get(), Mount: mcon.Get()}, nil
}

// ReserveSELinux marks a recovered pod's MCS level as in use, so that no
// new pod gets it. A no-op without SELinux.
func ReserveSELinux(l Labels) {
	if lv := l.held(); lv != "" && selinux.GetEnabled() {
		// An unparsable label reserves nothing; the process keeps it.
		_ = selinux.ReserveLabelV2(lv)
	}
}

// ReleaseSELinux gives back a removed pod's MCS level. A no-op without
// SELinux.
func ReleaseSELinux(l Labels) {
	if lv := l.held(); lv != "" && selinux.GetEnabled() {
		selinux.ReleaseLabel(lv)
	}
}

// separated tells whether the pod's processes run confined at its level,
// not as the privileged type.
func (l Labels) separated() bool {
	c, err := selinux.NewContext(l.Process)
	return err == nil && c["type"] != PrivilegedSELinuxType
}

// held is the label whose level the pod holds: the mount label's, which
// a pod without separation keeps while its processes run at s0
// (PodSELinuxLabels), else the process label's.
func (l Labels) held() string {
	if l.Mount != "" {
		return l.Mount
	}
	return l.Process
}

// SELinuxInKernel tells whether the kernel runs SELinux, as the agent
// asks it: go-selinux takes a read-only selinuxfs for SELinux disabled
// (its rule for containers), and systemd-nspawn gives its pods one, so the
// agent in an nspawn pod looks at the file system's type, as a
// runtime's process must still label what it starts. The answer is read
// once, in the mount namespace of the first call: an app's root need not
// have a selinuxfs (a privileged app's fresh /sys has none), so the agent
// asks before it enters one.
func SELinuxInKernel() bool { return selinuxInKernel() }

var selinuxInKernel = sync.OnceValue(func() bool {
	if selinux.GetEnabled() {
		return true
	}
	var st unix.Statfs_t
	return unix.Statfs("/sys/fs/selinux", &st) == nil && uint32(st.Type) == uint32(unix.SELINUX_MAGIC)
})

// SetSELinuxExec makes the next execve of the calling thread run in the
// process label. A no-op without SELinux or without a label. The caller
// must be locked to the thread that executes.
func SetSELinuxExec(process string) error {
	if process == "" || !selinuxInKernel() {
		return nil
	}
	if err := selinux.SetExecLabel(process); err != nil {
		return fmt.Errorf("selinux exec label %s: %w", process, err)
	}
	return nil
}

// LabelPodDevice gives a device node of the agent's own /dev the mount
// label, so that a container at that level may use it once bound into
// its /dev: in an nspawn pod that /dev is a tmpfs of the pod's, whose
// nodes are tmpfs_t, which no container type may open. A node elsewhere
// (the host's devtmpfs, for fly) keeps its label, which the policy lets
// containers use. A no-op without SELinux or without a label.
func LabelPodDevice(path, mountLabel string) error {
	if mountLabel == "" || !selinuxInKernel() {
		return nil
	}
	if !onPodTmpfs(path) {
		return nil
	}
	if cur, err := selinux.FileLabel(path); err == nil && cur == mountLabel {
		return nil // nspawn mounted its /dev with the pod's label
	}
	if err := selinux.SetFileLabel(path, mountLabel); errors.Is(err, unix.ENOTSUP) {
		return nil // a context= mount: its label is the mount's
	} else if err != nil {
		return fmt.Errorf("selinux label %s as %s: %w", path, mountLabel, err)
	}
	return nil
}

// onPodTmpfs tells whether path is on a tmpfs, and not on a devtmpfs,
// which has tmpfs's magic number but is the host's: by the mount table.
func onPodTmpfs(path string) bool {
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil || st.Type != unix.TMPFS_MAGIC {
		return false
	}
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return false
	}
	// The last mount at the deepest mount point above path decides.
	best, fstype := "", ""
	for _, line := range strings.Split(string(b), "\n") {
		pre, post, ok := strings.Cut(line, " - ")
		f, g := strings.Fields(pre), strings.Fields(post)
		if !ok || len(f) < 5 || len(g) < 1 {
			continue
		}
		mp := f[4]
		if (path == mp || strings.HasPrefix(path, strings.TrimSuffix(mp, "/")+"/")) && len(mp) >= len(best) {
			best, fstype = mp, g[0]
		}
	}
	return fstype == "tmpfs"
}

// MountData adds the mount label (context=) to the data of a mount the
// agent makes for an app. Unchanged without SELinux or without a label.
func MountData(data, mountLabel string) string {
	if mountLabel == "" || !selinuxInKernel() {
		return data
	}
	return label.FormatMountLabel(data, mountLabel)
}
