// Package lsm holds what stagelet does with Linux security modules besides
// seccomp: it computes a container's SELinux labels (in the daemon) and
// applies them and an AppArmor profile to the command about to be
// executed (in the agent). Both the daemon and the agent ask it whether a
// module is enabled, each on its own side of the pod boundary.
package lsm

import (
	"fmt"
	"strings"

	"github.com/opencontainers/selinux/go-selinux"
	"github.com/opencontainers/selinux/go-selinux/label"
)

// Contexts a container gets where SELinux policy does not say: the usual
// container types of the targeted policy, at the lowest level.
const (
	DefaultSELinuxProcessLabel = "system_u:system_r:container_t:s0"
	DefaultSELinuxMountLabel   = "system_u:object_r:container_file_t:s0"
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
		return Labels{Process: process, Mount: mount}, nil
	}
	if o == nil {
		return Labels{}, nil
	}
	return derive(Labels{Process: DefaultSELinuxProcessLabel, Mount: DefaultSELinuxMountLabel}, o)
}

// ContainerSELinuxLabels computes a container's labels from its pod's
// (PodSELinuxLabels) and its own options: the parts it gives replace the
// pod's, so a container that gives none runs at the pod's level. Nothing is
// reserved: the pod holds the level. In a pod without labels (privileged,
// or a policy without container contexts) a container gets labels only
// from options it gives, over the defaults above.
func ContainerSELinuxLabels(pod Labels, o *SELinuxOptions) (Labels, error) {
	if pod.Process == "" {
		if o == nil {
			return Labels{}, nil
		}
		pod = Labels{Process: DefaultSELinuxProcessLabel, Mount: DefaultSELinuxMountLabel}
	}
	if o == nil {
		return pod, nil
	}
	return derive(pod, o)
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

// ReserveSELinux marks a recovered pod's label as in use, so that no new
// pod gets its MCS level. A no-op without SELinux.
func ReserveSELinux(process string) {
	if process != "" && selinux.GetEnabled() {
		// An unparsable label reserves nothing; the process keeps it.
		_ = selinux.ReserveLabelV2(process)
	}
}

// ReleaseSELinux gives back a removed pod's MCS level. A no-op
// without SELinux.
func ReleaseSELinux(process string) {
	if process != "" && selinux.GetEnabled() {
		selinux.ReleaseLabel(process)
	}
}

// SetSELinuxExec makes the next execve of the calling thread run in the
// process label. A no-op without SELinux or without a label. The caller
// must be locked to the thread that executes.
func SetSELinuxExec(process string) error {
	if process == "" || !selinux.GetEnabled() {
		return nil
	}
	if err := selinux.SetExecLabel(process); err != nil {
		return fmt.Errorf("selinux exec label %s: %w", process, err)
	}
	return nil
}

// MountData adds the mount label (context=) to the data of a mount the
// agent makes for an app. Unchanged without SELinux or without a label.
func MountData(data, mountLabel string) string {
	if mountLabel == "" || !selinux.GetEnabled() {
		return data
	}
	return label.FormatMountLabel(data, mountLabel)
}
