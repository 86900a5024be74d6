package broker

import (
	"path/filepath"
	"strings"

	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/lsm"
	"github.com/stagelet/stagelet/seccomp"
)

// Where the broker learns about AppArmor on the node; variables for tests.
var (
	appArmorEnabled = lsm.AppArmorEnabled
	appArmorLoaded  = lsm.AppArmorProfileLoaded
)

// security is what a container's security context resolves to, beyond
// users and capabilities.
type security struct {
	seccomp        *seccomp.Profile
	seccompProfile string
	seLinuxProcess string
	seLinuxMount   string
	appArmor       string
}

// resolveSecurity resolves a container's seccomp, SELinux and AppArmor
// requests. caps is the container's capability set (the default seccomp
// profile allows what they guard). InvalidArgument for a bad request,
// FailedPrecondition for one this node cannot honour. Privileged
// containers get no seccomp filter, the privileged SELinux type and no
// default AppArmor profile, as in containerd and CRI-O. pod are the pod's SELinux labels,
// which the container's start from. guest: the container runs under a
// kernel of its own (a VM), whose modules are not the node's.
func resolveSecurity(sec *Security, caps []string, pod lsm.Labels, guest bool) (*security, error) {
	out := &security{}
	var err error
	if out.seccomp, out.seccompProfile, err = seccompFor(sec, caps); err != nil {
		return nil, err
	}
	l, err := containerSELinux(sec, pod, guest)
	if err != nil {
		return nil, err
	}
	out.seLinuxProcess, out.seLinuxMount = l.Process, l.Mount
	if out.appArmor, err = appArmorFor(sec, guest); err != nil {
		return nil, err
	}
	return out, nil
}

// containerSELinux computes a container's SELinux labels from its pod's:
// a privileged container gets the policy's privileged type and no mount
// label (lsm.PrivilegedSELinuxLabels). A container of a VM (guest) gets
// its pod's labels, whatever it asks for: the guest's kernel enforces no
// SELinux, and on the node its files are served by its pod's qemu,
// confined at the pod's level, which a root file system, log or volume
// at another level would be out of reach of. InvalidArgument for options
// that are no part of a context, or that the node's policy refuses, even
// where they are not applied.
func containerSELinux(sec *Security, pod lsm.Labels, guest bool) (lsm.Labels, error) {
	if sec.Privileged || guest {
		// Options a privileged container gives are not applied, but
		// bad ones are still refused, as in CRI-O and containerd.
		if sec.SELinux != nil {
			if _, err := lsm.ContainerSELinuxLabels(lsm.Labels{}, sec.SELinux.lsmOptions()); err != nil {
				return lsm.Labels{}, errdefs.InvalidArgument("config.linux.security_context.selinux_options: %w", err)
			}
		}
		if guest {
			return pod, nil
		}
		return lsm.PrivilegedSELinuxLabels(), nil
	}
	l, err := lsm.ContainerSELinuxLabels(pod, sec.SELinux.lsmOptions())
	if err != nil {
		return lsm.Labels{}, errdefs.InvalidArgument("config.linux.security_context.selinux_options: %w", err)
	}
	return l, nil
}

// lsmOptions is o as internal/lsm takes it; nil for nil.
func (o *SELinuxOptions) lsmOptions() *lsm.SELinuxOptions {
	if o == nil {
		return nil
	}
	return &lsm.SELinuxOptions{User: o.User, Role: o.Role, Type: o.Type, Level: o.Level}
}

// podSELinux computes a pod's SELinux labels, reserving their MCS level
// (lsm.PodSELinuxLabels). A privileged pod, and one in the node's PID or
// IPC namespace, is not separated, as in CRI-O: its containers run as the
// privileged type (lsm.PrivilegedSELinuxLabels) unless they ask for a
// context, while its mounts keep the pod's level; a process that shares
// the node's PIDs is meant to see the node's processes. InvalidArgument
// for options that are no part of a context.
func podSELinux(cfg *PodConfig) (lsm.Labels, error) {
	l, err := lsm.PodSELinuxLabels(cfg.SELinux.lsmOptions())
	if err != nil {
		return lsm.Labels{}, errdefs.InvalidArgument("config.linux.security_context.selinux_options: %w", err)
	}
	if cfg.Privileged || cfg.HostPID || cfg.HostIPC {
		// Its file systems keep the level (a level of its own, held as
		// any pod's), its processes do not. Without SELinux, or without
		// the type, it has no labels.
		p := lsm.PrivilegedSELinuxLabels().Process
		if p == "" {
			lsm.ReleaseSELinux(l)
			return lsm.Labels{}, nil
		}
		l.Process = p
	}
	return l, nil
}

// seccompFor returns the container's seccomp profile and where it comes
// from; nil for unconfined (the CRI's default when nothing is asked).
func seccompFor(sec *Security, caps []string) (*seccomp.Profile, string, error) {
	if sec.Privileged {
		return nil, "", nil
	}
	switch sec.Seccomp.Type {
	case "", ProfileUnconfined:
		return nil, "", nil
	case ProfileRuntimeDefault:
		return seccomp.RuntimeDefault(caps...), "runtime/default", nil
	case ProfileLocalhost:
		ref := sec.Seccomp.LocalhostRef
		if !filepath.IsAbs(ref) {
			return nil, "", errdefs.InvalidArgument("config.linux.security_context.seccomp: the Localhost profile %q must be an absolute path on the node", ref)
		}
		p, err := seccomp.Load(ref)
		if err != nil {
			return nil, "", errdefs.InvalidArgument("config.linux.security_context.seccomp: %w", err)
		}
		if _, err := seccomp.Compile(p); err != nil {
			return nil, "", errdefs.InvalidArgument("config.linux.security_context.seccomp: profile %s: %w", ref, err)
		}
		return p, "localhost/" + ref, nil
	default:
		return nil, "", errdefs.InvalidArgument("config.linux.security_context.seccomp: unknown profile type %q", sec.Seccomp.Type)
	}
}

// appArmorFor returns the AppArmor profile to execute the container's
// commands under; "" for unconfined. As in containerd and CRI-O, a
// container that asks for no profile gets the default one where AppArmor
// is enabled, unless it is privileged. A Localhost profile the kernel
// does not hold is InvalidArgument, naming it; a profile asked for where
// AppArmor is not enabled, or a default the daemon could not load, is
// FailedPrecondition. In a VM (guest) nothing is asked of the node's
// AppArmor for a container that asks for no profile: its kernel is the
// guest's.
func appArmorFor(sec *Security, guest bool) (string, error) {
	var name, asked string
	switch sec.AppArmor.Type {
	case ProfileUnconfined:
		return "", nil
	case "":
		if guest || !appArmorEnabled() || sec.Privileged {
			return "", nil
		}
		name, asked = lsm.DefaultAppArmorName, "the default"
	case ProfileRuntimeDefault:
		name, asked = lsm.DefaultAppArmorName, "runtime/default"
	case ProfileLocalhost:
		name = strings.TrimPrefix(sec.AppArmor.LocalhostRef, "localhost/")
		if name == "" {
			return "", errdefs.InvalidArgument("config.linux.security_context.apparmor: a Localhost profile needs a name")
		}
		asked = "localhost/" + name
	default:
		return "", errdefs.InvalidArgument("config.linux.security_context.apparmor: unknown profile type %q", sec.AppArmor.Type)
	}
	if !appArmorEnabled() {
		return "", errdefs.FailedPrecondition("AppArmor profile %s requested, but AppArmor is not enabled on this node", asked)
	}
	if sec.Privileged && sec.AppArmor.Type == ProfileRuntimeDefault {
		return "", nil
	}
	if !appArmorLoaded(name) {
		if name == lsm.DefaultAppArmorName {
			return "", errdefs.FailedPrecondition("AppArmor profile %s (%s) is not loaded on this node: the daemon loads it at start; stagelet doctor says why it could not", asked, name)
		}
		return "", errdefs.InvalidArgument("config.linux.security_context.apparmor: AppArmor profile %s is not loaded on this node", asked)
	}
	return name, nil
}
