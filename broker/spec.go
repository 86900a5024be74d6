package broker

import (
	"cmp"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/image"
	"github.com/stagelet/stagelet/internal/lsm"
)

// DefaultCapabilities are what an unprivileged container gets, as in
// containerd and CRI-O.
var DefaultCapabilities = []string{
	"CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD",
	"CAP_NET_RAW", "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP",
	"CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE",
}

// commandLine merges the image's entrypoint and cmd with the container's
// command and args as Kubernetes defines it: command replaces the
// entrypoint (and drops the image cmd); args replace the cmd.
func commandLine(img *image.ImageConfig, command, args []string) []string {
	var out []string
	switch {
	case len(command) > 0:
		out = append(out, command...)
		out = append(out, args...)
	case len(args) > 0:
		out = append(out, img.Entrypoint...)
		out = append(out, args...)
	default:
		out = append(out, img.Entrypoint...)
		out = append(out, img.Cmd...)
	}
	return out
}

// mergeEnv returns the image env overridden by the container's, keeping
// the image's order and appending new keys in the container's order.
func mergeEnv(imageEnv []string, env []KeyValue) []string {
	out := slices.Clone(imageEnv)
	index := map[string]int{}
	for i, kv := range out {
		k, _, _ := strings.Cut(kv, "=")
		index[k] = i
	}
	for _, kv := range env {
		s := kv.Key + "=" + kv.Value
		if i, ok := index[kv.Key]; ok {
			out[i] = s
			continue
		}
		index[kv.Key] = len(out)
		out = append(out, s)
	}
	return out
}

func normalizeCap(c string) string {
	c = strings.ToUpper(strings.TrimSpace(c))
	if c != "ALL" && !strings.HasPrefix(c, "CAP_") {
		c = "CAP_" + c
	}
	return c
}

// capabilities computes a container's capability set from the default set
// and the security context's add and drop lists ("ALL" allowed in both).
func capabilities(sec *Security, all []string) []string {
	set := map[string]bool{}
	for _, c := range DefaultCapabilities {
		set[c] = true
	}
	for _, c := range sec.DropCapabilities {
		if c = normalizeCap(c); c == "ALL" {
			clear(set)
		} else {
			delete(set, c)
		}
	}
	for _, c := range sec.AddCapabilities {
		if c = normalizeCap(c); c == "ALL" {
			for _, a := range all {
				set[a] = true
			}
		} else {
			set[c] = true
		}
	}
	out := make([]string, 0, len(set))
	for c := range set {
		out = append(out, c)
	}
	slices.Sort(out)
	return out
}

// AllCapabilities lists the capability names "ALL" expands to.
var AllCapabilities = []string{
	"CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER", "CAP_FSETID",
	"CAP_KILL", "CAP_SETGID", "CAP_SETUID", "CAP_SETPCAP", "CAP_LINUX_IMMUTABLE",
	"CAP_NET_BIND_SERVICE", "CAP_NET_BROADCAST", "CAP_NET_ADMIN", "CAP_NET_RAW",
	"CAP_IPC_LOCK", "CAP_IPC_OWNER", "CAP_SYS_MODULE", "CAP_SYS_RAWIO", "CAP_SYS_CHROOT",
	"CAP_SYS_PTRACE", "CAP_SYS_PACCT", "CAP_SYS_ADMIN", "CAP_SYS_BOOT", "CAP_SYS_NICE",
	"CAP_SYS_RESOURCE", "CAP_SYS_TIME", "CAP_SYS_TTY_CONFIG", "CAP_MKNOD", "CAP_LEASE",
	"CAP_AUDIT_WRITE", "CAP_AUDIT_CONTROL", "CAP_SETFCAP", "CAP_MAC_OVERRIDE",
	"CAP_MAC_ADMIN", "CAP_SYSLOG", "CAP_WAKE_ALARM", "CAP_BLOCK_SUSPEND", "CAP_AUDIT_READ",
	"CAP_PERFMON", "CAP_BPF", "CAP_CHECKPOINT_RESTORE",
}

func validCap(c string) bool { return slices.Contains(AllCapabilities, c) }

// userOf returns the user string to resolve in the image: the security
// context wins over the image's USER.
func userOf(sec *Security, imgUser string) string {
	switch {
	case sec.RunAsUser != nil:
		u := strconv.FormatInt(*sec.RunAsUser, 10)
		if _, g, ok := strings.Cut(imgUser, ":"); ok && sec.RunAsGroup == nil {
			return u + ":" + g
		}
		return u
	case sec.RunAsUsername != "":
		return sec.RunAsUsername
	default:
		return imgUser
	}
}

// buildAppSpec turns a container's configuration and image into what the
// agent runs. rootfs and paths are host paths.
// podSELinux are the pod's SELinux labels.
func buildAppSpec(id string, pod *PodConfig, podSELinux lsm.Labels, cfg *ContainerConfig, img *image.Image, rootfs string, guest bool) (*api.AppSpec, error) {
	args := commandLine(&img.Config, cfg.Command, cfg.Args)
	if len(args) == 0 {
		return nil, errdefs.InvalidArgument("config.command: the image %s has no entrypoint or cmd, and none was given", cfg.Image)
	}
	sec := &cfg.Security
	user, err := appUser(sec, img, rootfs)
	if err != nil {
		return nil, err
	}
	for _, c := range append(slices.Clone(sec.AddCapabilities), sec.DropCapabilities...) {
		if n := normalizeCap(c); n != "ALL" && !validCap(n) {
			return nil, errdefs.InvalidArgument("config.linux.security_context.capabilities: unknown capability %q", c)
		}
	}
	caps := capabilities(sec, AllCapabilities)
	if sec.Privileged {
		caps = slices.Clone(AllCapabilities)
	}
	cwd := cmp.Or(cfg.WorkingDir, img.Config.WorkingDir, "/")
	if !filepath.IsAbs(cwd) {
		return nil, errdefs.InvalidArgument("config.working_dir: %q must be absolute", cwd)
	}
	mounts := appMounts(cfg.Mounts)
	logPath := ""
	if pod.LogDirectory != "" && cfg.LogPath != "" {
		logPath = filepath.Join(pod.LogDirectory, cfg.LogPath)
	}
	hostname := ""
	if !pod.HostNetwork {
		hostname = podHostname(pod)
	}
	pidns, err := pidNamespace(sec.PIDMode, pod)
	if err != nil {
		return nil, err
	}
	lsmSec, err := resolveSecurity(sec, caps, podSELinux, guest)
	if err != nil {
		return nil, err
	}
	spec := &api.AppSpec{
		ID:             id,
		Name:           cfg.Metadata.Name,
		Rootfs:         rootfs,
		Args:           args,
		Env:            mergeEnv(img.Config.Env, cfg.Env),
		Cwd:            cwd,
		Hostname:       hostname,
		PrivateUTS:     !pod.HostNetwork,
		UID:            user.UID,
		GID:            user.GID,
		AdditionalGIDs: user.AdditionalGIDs,
		Capabilities:   caps,
		Privileged:     sec.Privileged,
		NoNewPrivs:     sec.NoNewPrivs && !sec.Privileged,
		ReadonlyRootfs: sec.ReadonlyRootfs,
		Mounts:         mounts,
		Resources:      appResources(cfg.Resources),
		PIDNamespace:   pidns,
		PIDTarget:      sec.PIDTarget,
		MaskedPaths:    slices.Clone(sec.MaskedPaths),
		ReadonlyPaths:  slices.Clone(sec.ReadonlyPaths),
		// The kubelet sends no paths at all only for procMount
		// Unmasked, which needs the pod's own user namespace; a
		// container in the host's that names none gets the defaults.
		Unmasked:            pod.UserNS != nil && len(sec.MaskedPaths) == 0 && len(sec.ReadonlyPaths) == 0,
		Seccomp:             lsmSec.seccomp,
		SeccompProfile:      lsmSec.seccompProfile,
		SELinuxProcessLabel: lsmSec.seLinuxProcess,
		SELinuxMountLabel:   lsmSec.seLinuxMount,
		AppArmorProfile:     lsmSec.appArmor,
		LogPath:             logPath,
		TTY:                 cfg.TTY,
		Stdin:               cfg.Stdin,
		StdinOnce:           cfg.Stdin && cfg.StdinOnce,
	}
	spec.Env = defaultEnv(spec.Env, podHostname(pod), user.Home, cfg.TTY)
	return spec, nil
}

// appMounts are the CRI mounts as the agent takes them.
func appMounts(ms []Mount) []api.Mount {
	var out []api.Mount
	for _, m := range ms {
		out = append(out, api.Mount{
			Source:            m.HostPath,
			Destination:       m.ContainerPath,
			Readonly:          m.Readonly,
			Propagation:       m.Propagation,
			RecursiveReadonly: m.RecursiveReadonly,
			NoSuid:            m.NoSuid,
			NoDev:             m.NoDev,
			NoExec:            m.NoExec,
		})
	}
	return out
}

// appResources are a container's limits as the agent applies them.
func appResources(r Resources) api.Resources {
	return api.Resources{
		CPUShares:   r.CPUShares,
		CPUQuota:    r.CPUQuota,
		CPUPeriod:   r.CPUPeriod,
		MemoryLimit: r.MemoryLimit,
		OOMScoreAdj: int(r.OOMScoreAdj),
		CpusetCpus:  r.CpusetCpus,
		CpusetMems:  r.CpusetMems,
		OOMGroup:    r.OOMGroup,
	}
}

// pidNamespace is the app's api.AppSpec.PIDNamespace for a CRI PID mode.
func pidNamespace(mode string, pod *PodConfig) (string, error) {
	switch mode {
	case PIDModeContainer:
		return api.PIDNamespaceContainer, nil
	case PIDModeNode:
		if !pod.HostPID {
			return "", errdefs.InvalidArgument("config.linux.security_context.namespace_options.pid: NODE, but the pod sandbox does not share the host's PID namespace")
		}
	case PIDModeTarget:
		return api.PIDNamespaceTarget, nil
	}
	return "", nil
}

// appUser is the app's user, group, supplementary groups and home: the
// security context's, else the image's, resolved in rootfs.
func appUser(sec *Security, img *image.Image, rootfs string) (image.User, error) {
	if sec.RunAsUser != nil && *sec.RunAsUser < 0 {
		return image.User{}, errdefs.InvalidArgument("config.linux.security_context.run_as_user: %d is negative", *sec.RunAsUser)
	}
	u, err := image.ResolveUser(rootfs, userOf(sec, img.Config.User))
	if err != nil {
		return image.User{}, err
	}
	if sec.RunAsGroup != nil {
		if *sec.RunAsGroup < 0 {
			return image.User{}, errdefs.InvalidArgument("config.linux.security_context.run_as_group: %d is negative", *sec.RunAsGroup)
		}
		u.GID = uint32(*sec.RunAsGroup)
	}
	// The process's groups, as containerd gives them and the CRI's
	// ContainerUser reports them: its group, the pod's supplemental
	// groups, then (policy Merge) those the image's /etc/group gives its
	// user.
	imageGroups := u.AdditionalGIDs
	groups := []uint32{u.GID}
	for _, g := range sec.SupplementalGroups {
		if g < 0 || g > 1<<32-1 {
			return image.User{}, errdefs.InvalidArgument("config.linux.security_context.supplemental_groups: %d is out of range", g)
		}
		if !slices.Contains(groups, uint32(g)) {
			groups = append(groups, uint32(g))
		}
	}
	if !sec.StrictGroups {
		for _, g := range imageGroups {
			if !slices.Contains(groups, g) {
				groups = append(groups, g)
			}
		}
	}
	u.AdditionalGIDs = groups
	return u, nil
}

// defaultEnv adds what an app's environment lacks: HOSTNAME (the pod's,
// also in the node's network, as containerd sets it), HOME (the user's
// home, as runc sets it), TERM for a terminal, as Docker and containerd
// give it, and a PATH.
func defaultEnv(env []string, hostname, home string, tty bool) []string {
	if hasEnv(env, "HOSTNAME") == "" && hostname != "" {
		env = append(env, "HOSTNAME="+hostname)
	}
	if hasEnv(env, "HOME") == "" && home != "" {
		// runc's rule: unset or empty.
		env = append(slices.DeleteFunc(env, func(kv string) bool { return kv == "HOME=" }), "HOME="+home)
	}
	if tty && hasEnv(env, "TERM") == "" {
		env = append(env, "TERM=xterm")
	}
	if hasEnv(env, "PATH") == "" {
		env = append(env, "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
	}
	return env
}

func hasEnv(env []string, key string) string {
	for _, kv := range env {
		if k, v, _ := strings.Cut(kv, "="); k == key {
			return v
		}
	}
	return ""
}
