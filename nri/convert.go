// Package nri hosts NRI (Node Resource Interface) plugins for the daemon:
// it tells them of pods and containers, as the daemon's records and app
// specs describe them (ContainerOf, PodOf), applies what they ask to an
// app spec (Adjust, UpdateResources), refusing by name every adjustment
// the agent has no way to apply, and refuses for a pod in a VM what its
// guest cannot honour (CheckStage1). It does not know the broker: the
// broker hands it plain values.
package nri

import (
	"strings"
	"time"

	nriapi "github.com/containerd/nri/pkg/api"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/stagelet/stagelet/agent/api"
)

// ContainerInfo is what the NRI view of a container takes besides its
// app spec: the daemon's record of it.
type ContainerInfo struct {
	ID, Name    string
	State       nriapi.ContainerState
	Labels      map[string]string
	Annotations map[string]string
	// CreatedAt, StartedAt and FinishedAt: zero when not (yet) so.
	CreatedAt, StartedAt, FinishedAt time.Time
	ExitCode                         int32
	StatusReason, StatusMessage      string
	// PID is the container's process as the host sees it; 0 when unknown
	// (not running, or in a VM).
	PID int
	// CgroupsPath is the container's cgroup, as the host names it; "" when
	// the host has none for it (in a VM).
	CgroupsPath string
}

// PodInfo is what the NRI view of a pod takes: the daemon's record of it.
type PodInfo struct {
	ID, Name, UID, Namespace string
	Labels                   map[string]string
	Annotations              map[string]string
	RuntimeHandler           string
	// CgroupParent is the pod's cgroup parent, as the kubelet gave it.
	CgroupParent string
	// NetNSPath is the pod's network namespace; "" for the host's.
	NetNSPath string
	IPs       []string
	// Resources are the pod's limits (the sum of its containers'), nil
	// when unknown; Overhead the pod's overhead (a VM's).
	Resources, Overhead *api.Resources
	// PID is the pod's agent (its infra process); 0 when unknown.
	PID int
}

// PodOf is pod p as NRI plugins see it.
func PodOf(p PodInfo) *nriapi.PodSandbox {
	pod := &nriapi.PodSandbox{
		Id:             p.ID,
		Name:           p.Name,
		Uid:            p.UID,
		Namespace:      p.Namespace,
		Labels:         nriapi.DupStringMap(p.Labels),
		Annotations:    nriapi.DupStringMap(p.Annotations),
		RuntimeHandler: p.RuntimeHandler,
		Pid:            uint32(max(p.PID, 0)),
		Ips:            nriapi.DupStringSlice(p.IPs),
		Linux: &nriapi.LinuxPodSandbox{
			CgroupParent: p.CgroupParent,
		},
	}
	if p.Resources != nil {
		pod.Linux.PodResources = LinuxResourcesOf(p.Resources)
	}
	if p.Overhead != nil {
		pod.Linux.PodOverhead = LinuxResourcesOf(p.Overhead)
	}
	if p.NetNSPath != "" {
		pod.Linux.Namespaces = []*nriapi.LinuxNamespace{{Type: "network", Path: p.NetNSPath}}
	}
	return pod
}

// ContainerOf is the container of pod podID that c and app describe, as
// NRI plugins see it. Its hooks and CDI devices are the daemon's to add:
// an app spec has resolved them already.
func ContainerOf(podID string, c ContainerInfo, app *api.AppSpec) *nriapi.Container {
	ctr := &nriapi.Container{
		Id:            c.ID,
		PodSandboxId:  podID,
		Name:          c.Name,
		State:         c.State,
		Labels:        nriapi.DupStringMap(c.Labels),
		Annotations:   nriapi.DupStringMap(c.Annotations),
		Args:          nriapi.DupStringSlice(app.Args),
		Env:           nriapi.DupStringSlice(app.Env),
		Mounts:        mountsOf(app.Mounts),
		Pid:           uint32(max(c.PID, 0)),
		Rlimits:       rlimitsOf(app),
		CreatedAt:     unixNano(c.CreatedAt),
		StartedAt:     unixNano(c.StartedAt),
		FinishedAt:    unixNano(c.FinishedAt),
		ExitCode:      c.ExitCode,
		StatusReason:  c.StatusReason,
		StatusMessage: c.StatusMessage,
		User: &nriapi.User{
			Uid:            app.UID,
			Gid:            app.GID,
			AdditionalGids: append([]uint32(nil), app.AdditionalGIDs...),
		},
		Linux: &nriapi.LinuxContainer{
			Namespaces:     namespacesOf(app),
			Devices:        nriapi.FromOCILinuxDevices(app.Devices),
			Resources:      containerResourcesOf(app),
			OomScoreAdj:    nriapi.Int(app.Resources.OOMScoreAdj),
			CgroupsPath:    c.CgroupsPath,
			SeccompProfile: seccompProfileOf(app.SeccompProfile),
		},
	}
	if app.Seccomp != nil {
		ctr.Linux.SeccompPolicy = nriapi.FromOCILinuxSeccomp(app.Seccomp)
	}
	return ctr
}

// LinuxResourcesOf is r as NRI plugins see limits: only what r sets.
func LinuxResourcesOf(r *api.Resources) *nriapi.LinuxResources {
	out := &nriapi.LinuxResources{
		Cpu: &nriapi.LinuxCPU{
			Cpus: r.CpusetCpus,
			Mems: r.CpusetMems,
		},
		Memory: &nriapi.LinuxMemory{},
	}
	if r.CPUShares > 0 {
		out.Cpu.Shares = nriapi.UInt64(uint64(r.CPUShares))
	}
	if r.CPUQuota != 0 {
		out.Cpu.Quota = nriapi.Int64(r.CPUQuota)
	}
	if r.CPUPeriod > 0 {
		out.Cpu.Period = nriapi.UInt64(uint64(r.CPUPeriod))
	}
	if r.MemoryLimit != 0 {
		out.Memory.Limit = nriapi.Int64(r.MemoryLimit)
	}
	if r.MemorySwap != 0 {
		out.Memory.Swap = nriapi.Int64(r.MemorySwap)
	}
	if r.MemoryReservation != 0 {
		out.Memory.Reservation = nriapi.Int64(r.MemoryReservation)
	}
	if r.PidsLimit != 0 {
		out.Pids = &nriapi.LinuxPids{Limit: max(r.PidsLimit, nriapi.UnlimitedPidsLimit)}
	}
	if r.OOMGroup {
		out.Unified = map[string]string{unifiedOOMGroup: "1"}
	}
	return out
}

// containerResourcesOf are app's limits, its huge pages and device rules
// with them, as an OCI spec holds them.
func containerResourcesOf(app *api.AppSpec) *nriapi.LinuxResources {
	r := LinuxResourcesOf(&app.Resources)
	for _, h := range app.HugepageLimits {
		r.HugepageLimits = append(r.HugepageLimits, &nriapi.HugepageLimit{PageSize: h.PageSize, Limit: h.Limit})
	}
	for _, d := range app.DeviceCgroup {
		r.Devices = append(r.Devices, &nriapi.LinuxDeviceCgroup{
			Allow:  d.Allow,
			Type:   d.Type,
			Major:  nriapi.Int64(d.Major),
			Minor:  nriapi.Int64(d.Minor),
			Access: d.Access,
		})
	}
	return r
}

// mountsOf are an app's bind mounts as OCI mounts: the agent binds
// recursively, so rbind, with the flags and propagation the mount has.
func mountsOf(ms []api.Mount) []*nriapi.Mount {
	var out []*nriapi.Mount
	for _, m := range ms {
		opts := []string{"rbind"}
		switch {
		case m.Readonly && m.RecursiveReadonly:
			opts = append(opts, "rro")
		case m.Readonly:
			opts = append(opts, "ro")
		default:
			opts = append(opts, "rw")
		}
		for _, f := range []struct {
			set  bool
			name string
		}{{m.NoSuid, "nosuid"}, {m.NoDev, "nodev"}, {m.NoExec, "noexec"}} {
			if f.set {
				opts = append(opts, f.name)
			}
		}
		prop := m.Propagation
		if prop == "" || prop == "private" {
			prop = "rprivate"
		}
		out = append(out, &nriapi.Mount{
			Destination: m.Destination,
			Type:        "bind",
			Source:      m.Source,
			Options:     append(opts, prop),
		})
	}
	return out
}

// rlimitsOf are the limits the app's processes start with that its spec
// names.
func rlimitsOf(app *api.AppSpec) []*nriapi.POSIXRlimit {
	var out []*nriapi.POSIXRlimit
	for _, l := range app.Rlimits {
		out = append(out, &nriapi.POSIXRlimit{Type: l.Type, Hard: l.Hard, Soft: l.Soft})
	}
	return out
}

// namespacesOf are the namespaces an app has of its own, which need no
// path: its mount namespace always, its PID and UTS namespaces when its
// spec asks for them. The pod's namespaces it shares are the pod's.
func namespacesOf(app *api.AppSpec) []*nriapi.LinuxNamespace {
	ns := []*nriapi.LinuxNamespace{{Type: string(specs.MountNamespace)}}
	if app.PIDNamespace == api.PIDNamespaceContainer {
		ns = append(ns, &nriapi.LinuxNamespace{Type: string(specs.PIDNamespace)})
	}
	if app.OwnUTS() {
		ns = append(ns, &nriapi.LinuxNamespace{Type: string(specs.UTSNamespace)})
	}
	return ns
}

// seccompProfileOf is the kind of filter an app spec's SeccompProfile
// ("runtime/default", "localhost/PATH", "" for none) names.
func seccompProfileOf(profile string) *nriapi.SecurityProfile {
	switch {
	case profile == "runtime/default":
		return &nriapi.SecurityProfile{ProfileType: nriapi.SecurityProfile_RUNTIME_DEFAULT}
	case strings.HasPrefix(profile, "localhost/"):
		return &nriapi.SecurityProfile{
			ProfileType:  nriapi.SecurityProfile_LOCALHOST,
			LocalhostRef: strings.TrimPrefix(profile, "localhost/"),
		}
	case profile == "":
		return &nriapi.SecurityProfile{ProfileType: nriapi.SecurityProfile_UNCONFINED}
	}
	return nil
}

// unixNano is t in nanoseconds since the epoch, as NRI carries times; 0
// for the zero time.
func unixNano(t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return t.UnixNano()
}
