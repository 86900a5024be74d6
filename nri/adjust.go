package nri

import (
	"fmt"
	"path/filepath"
	"slices"
	"sort"
	"strings"

	nriapi "github.com/containerd/nri/pkg/api"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"google.golang.org/protobuf/proto"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/bindopts"
	"github.com/stagelet/stagelet/internal/rlimit"
	"github.com/stagelet/stagelet/seccomp"
)

// Adjusted is what of an adjustment the broker applies itself, as Adjust
// cannot: it is not part of an app spec.
type Adjusted struct {
	// Annotations to set on the container; a key marked for removal
	// (nriapi.IsMarkedForRemoval: "-KEY") removes KEY. Nil: none.
	Annotations map[string]string
	// Hooks are OCI hooks the daemon runs; nil: none.
	Hooks *nriapi.Hooks
	// CDIDevices are the fully qualified names of CDI devices to inject,
	// for the broker's own CDI resolution.
	CDIDevices []string
}

// unifiedOOMGroup is the one cgroup v2 file an adjustment may set
// directly: the agent applies it as Resources.OOMGroup.
const unifiedOOMGroup = "memory.oom.group"

// Adjust applies adj, the plugins' merged adjustment of a container being
// created, to its app spec, as containerd's spec generator applies one to
// an OCI spec: environment variables by name, mounts by destination and
// devices by path replacing what is there, keys marked "-" removing it,
// rlimits by type, limits field by field (only those set), args, OOM score
// and seccomp policy replaced. What it returns is the broker's to apply.
//
// Nothing is silently dropped: a field the agent has no way to apply
// (namespaces, sysctls, net devices, scheduler, I/O priority, memory
// policy, RDT, block I/O class, cgroups path, unified files but
// memory.oom.group, kernel memory, swappiness, realtime CPU, ...) is
// refused with ErrUnimplemented naming it, a bad value with
// InvalidArgument. On an error app is left as it was.
func Adjust(app *api.AppSpec, adj *nriapi.ContainerAdjustment) (Adjusted, error) {
	var out Adjusted
	if adj == nil {
		return out, nil
	}
	l := adj.GetLinux()
	if err := refuseLinux(l); err != nil {
		return out, err
	}
	// Work on a copy whose slices are the copy's own: app changes only
	// once every step succeeded.
	a := *app
	a.Env = slices.Clone(app.Env)
	a.Mounts = slices.Clone(app.Mounts)
	a.Devices = slices.Clone(app.Devices)
	a.DeviceCgroup = slices.Clone(app.DeviceCgroup)
	a.Rlimits = slices.Clone(app.Rlimits)
	a.HugepageLimits = slices.Clone(app.HugepageLimits)

	adjustEnv(&a, adj.GetEnv())
	if len(adj.GetArgs()) > 0 {
		a.Args = slices.Clone(adj.GetArgs())
	}
	steps := []func() error{
		func() error { return adjustMounts(&a, adj.GetMounts()) },
		func() error { return adjustDevices(&a, l.GetDevices()) },
		func() error { return adjustRlimits(&a, adj.GetRlimits()) },
		func() error { return adjustResources(&a, l.GetResources()) },
		func() error { return adjustSeccomp(&a, l.GetSeccompPolicy()) },
	}
	for _, step := range steps {
		if err := step(); err != nil {
			return out, err
		}
	}
	if v := l.GetOomScoreAdj(); v != nil {
		a.Resources.OOMScoreAdj = int(v.GetValue())
	}

	if len(adj.GetAnnotations()) > 0 {
		out.Annotations = nriapi.DupStringMap(adj.GetAnnotations())
	}
	if h := adj.GetHooks(); hasHooks(h) {
		out.Hooks = h
	}
	for _, d := range adj.GetCDIDevices() {
		out.CDIDevices = append(out.CDIDevices, d.GetName())
	}
	*app = a
	return out, nil
}

// UpdateResources merges u, the limits plugins set for a created or
// running container (their UpdateContainer answer, or an update they ask
// for on their own), into r: only the fields u sets. It refuses, with
// ErrUnimplemented naming the field, what Adjust refuses and what only a
// container's creation can set (huge pages, device rules); on an error r
// is left as it was.
func UpdateResources(r *api.Resources, u *nriapi.LinuxResources) error {
	if u == nil {
		return nil
	}
	const field = "linux.resources"
	if len(u.GetHugepageLimits()) > 0 {
		return unimplemented(field+".hugepage_limits", "huge page limits are set when a container is created and cannot change")
	}
	if len(u.GetDevices()) > 0 {
		return unimplemented(field+".devices", "device rules are set when a container is created and cannot change")
	}
	if err := refuseResources(field, u); err != nil {
		return err
	}
	merged := *r
	if err := mergeResources(&merged, u); err != nil {
		return err
	}
	*r = merged
	return nil
}

func unimplemented(field, why string) error {
	return errdefs.New(errdefs.ErrUnimplemented, "NRI %s: %s", field, why)
}

func invalid(field, format string, args ...any) error {
	return errdefs.InvalidArgument("NRI %s: %s", field, fmt.Sprintf(format, args...))
}

// refuseLinux refuses the parts of a container's Linux adjustment the
// agent has no way to apply.
func refuseLinux(l *nriapi.LinuxContainerAdjustment) error {
	if l == nil {
		return nil
	}
	switch {
	case l.GetCgroupsPath() != "":
		return unimplemented("linux.cgroups_path", "the agent places an app's cgroup beneath its pod's")
	case set(l.GetIoPriority()):
		return unimplemented("linux.io_priority", "the agent cannot set an I/O priority")
	case len(l.GetNamespaces()) > 0:
		return unimplemented("linux.namespaces", "an app's namespaces are its pod's or its own, as its spec says")
	case len(l.GetSysctl()) > 0:
		return unimplemented("linux.sysctl", "an app's sysctls are its pod's")
	case len(l.GetNetDevices()) > 0:
		return unimplemented("linux.net_devices", "the agent cannot move network devices into a pod")
	case set(l.GetScheduler()):
		return unimplemented("linux.scheduler", "the agent cannot set a scheduling policy")
	case rdtSet(l.GetRdt()):
		return unimplemented("linux.rdt", "the agent has no RDT support")
	case set(l.GetMemoryPolicy()):
		return unimplemented("linux.memory_policy", "the agent cannot set a memory policy")
	}
	return refuseResources("linux.resources", l.GetResources())
}

// set reports whether m asks for something: the library merges the
// plugins' answers into messages it creates empty.
func set(m proto.Message) bool { return m != nil && proto.Size(m) > 0 }

// rdtSet reports whether r asks for an RDT class, schemata or monitoring;
// a removal alone asks for nothing here, where no app has any.
func rdtSet(r *nriapi.LinuxRdt) bool {
	return r.GetClosId() != nil || r.GetSchemata() != nil || r.GetEnableMonitoring() != nil
}

// refuseResources refuses the limits of r the agent has no way to apply.
func refuseResources(field string, r *nriapi.LinuxResources) error {
	if r == nil {
		return nil
	}
	if m := r.GetMemory(); m != nil {
		for _, f := range []struct {
			name string
			set  bool
		}{
			{"kernel", m.GetKernel() != nil},
			{"kernel_tcp", m.GetKernelTcp() != nil},
			{"swappiness", m.GetSwappiness() != nil},
			{"disable_oom_killer", m.GetDisableOomKiller() != nil},
			{"use_hierarchy", m.GetUseHierarchy() != nil},
		} {
			if f.set {
				return unimplemented(field+".memory."+f.name, "the agent cannot set it")
			}
		}
	}
	if c := r.GetCpu(); c != nil && (c.GetRealtimeRuntime() != nil || c.GetRealtimePeriod() != nil) {
		return unimplemented(field+".cpu.realtime", "the agent cannot give apps realtime CPU time")
	}
	if r.GetBlockioClass() != nil {
		return unimplemented(field+".blockio_class", "the daemon has no block I/O classes")
	}
	if r.GetRdtClass() != nil {
		return unimplemented(field+".rdt_class", "the daemon has no RDT classes")
	}
	for k, v := range r.GetUnified() {
		if k != unifiedOOMGroup || (v != "0" && v != "1") {
			return unimplemented(field+".unified", fmt.Sprintf("%s=%s: only %s (0 or 1) can be set", k, v, unifiedOOMGroup))
		}
	}
	return nil
}

// mergeResources sets in dst the limits r sets (refuseResources passed).
func mergeResources(dst *api.Resources, r *nriapi.LinuxResources) error {
	if c := r.GetCpu(); c != nil {
		if v := c.GetShares(); v != nil {
			if v.GetValue() > 1<<62 {
				return invalid("linux.resources.cpu.shares", "%d is out of range", v.GetValue())
			}
			dst.CPUShares = int64(v.GetValue())
		}
		if v := c.GetQuota(); v != nil {
			dst.CPUQuota = v.GetValue()
		}
		if v := c.GetPeriod(); v != nil {
			if v.GetValue() > 1<<62 {
				return invalid("linux.resources.cpu.period", "%d is out of range", v.GetValue())
			}
			dst.CPUPeriod = int64(v.GetValue())
		}
		if c.GetCpus() != "" {
			dst.CpusetCpus = c.GetCpus()
		}
		if c.GetMems() != "" {
			dst.CpusetMems = c.GetMems()
		}
	}
	if m := r.GetMemory(); m != nil {
		if v := m.GetLimit(); v != nil && v.GetValue() != 0 {
			dst.MemoryLimit = v.GetValue()
		}
		if v := m.GetReservation(); v != nil {
			dst.MemoryReservation = v.GetValue()
		}
		if v := m.GetSwap(); v != nil {
			dst.MemorySwap = v.GetValue()
		}
	}
	if p := r.GetPids(); p != nil && p.GetLimit() != 0 {
		// Negative is unlimited, as for the OCI spec generator.
		dst.PidsLimit = max(p.GetLimit(), -1)
	}
	if v, ok := r.GetUnified()[unifiedOOMGroup]; ok {
		dst.OOMGroup = v == "1"
	}
	return nil
}

// adjustResources merges r into the app's limits, its huge page limits by
// page size and its device rules after the app's own.
func adjustResources(a *api.AppSpec, r *nriapi.LinuxResources) error {
	if r == nil {
		return nil
	}
	if err := mergeResources(&a.Resources, r); err != nil {
		return err
	}
	for _, h := range r.GetHugepageLimits() {
		a.HugepageLimits = slices.DeleteFunc(a.HugepageLimits, func(x api.HugepageLimit) bool { return x.PageSize == h.GetPageSize() })
		a.HugepageLimits = append(a.HugepageLimits, api.HugepageLimit{PageSize: h.GetPageSize(), Limit: h.GetLimit()})
	}
	for _, d := range r.GetDevices() {
		rule := specs.LinuxDeviceCgroup{Allow: d.GetAllow(), Type: d.GetType(), Major: d.GetMajor().Get(), Minor: d.GetMinor().Get(), Access: d.GetAccess()}
		if a.DeviceCgroup == nil {
			// Devices are not fenced (a VM's guest): an allow rule holds
			// already, a deny rule cannot.
			if !rule.Allow {
				return unimplemented("linux.resources.devices", "the app's device access is not fenced here, so a deny rule cannot be applied")
			}
			continue
		}
		a.DeviceCgroup = append(a.DeviceCgroup, rule)
	}
	return nil
}

// adjustEnv sets, replaces (in place) or removes ("-NAME") environment
// variables by name, in the order given.
func adjustEnv(a *api.AppSpec, env []*nriapi.KeyValue) {
	for _, e := range env {
		name, remove := e.IsMarkedForRemoval()
		i := slices.IndexFunc(a.Env, func(kv string) bool {
			n, _, _ := strings.Cut(kv, "=")
			return n == name
		})
		switch {
		case remove && i >= 0:
			a.Env = slices.Delete(a.Env, i, i+1)
		case remove:
		case i >= 0:
			a.Env[i] = name + "=" + e.GetValue()
		default:
			a.Env = append(a.Env, name+"="+e.GetValue())
		}
	}
}

// adjustMounts removes ("-DEST") or replaces mounts by destination, then
// orders the app's mounts parents first, as containerd does.
func adjustMounts(a *api.AppSpec, mounts []*nriapi.Mount) error {
	if len(mounts) == 0 {
		return nil
	}
	for _, m := range mounts {
		dest, remove := m.IsMarkedForRemoval()
		a.Mounts = slices.DeleteFunc(a.Mounts, func(x api.Mount) bool {
			return filepath.Clean(x.Destination) == filepath.Clean(dest)
		})
		if remove {
			continue
		}
		am, err := mountOf(m)
		if err != nil {
			return err
		}
		a.Mounts = append(a.Mounts, am)
	}
	sort.SliceStable(a.Mounts, func(i, j int) bool { return depth(a.Mounts[i].Destination) < depth(a.Mounts[j].Destination) })
	return nil
}

func depth(p string) int { return strings.Count(filepath.Clean(p), "/") }

// mountOf is an NRI mount as the agent makes mounts: a bind mount. The
// agent binds recursively, so "bind" is taken as "rbind" and a
// propagation ("slave", "shared") as its recursive form.
func mountOf(m *nriapi.Mount) (api.Mount, error) {
	field := "mounts[" + m.GetDestination() + "]"
	out := api.Mount{Source: m.GetSource(), Destination: m.GetDestination()}
	f, err := bindopts.Parse(m.GetType(), m.GetOptions())
	if err != nil {
		return out, unimplemented(field, "the agent makes bind mounts only: "+err.Error())
	}
	if !filepath.IsAbs(out.Source) || !filepath.IsAbs(out.Destination) {
		return out, invalid(field, "source %q and destination must be absolute paths", out.Source)
	}
	out.Readonly, out.RecursiveReadonly = f.Readonly, f.RecursiveReadonly
	out.NoSuid, out.NoDev, out.NoExec, out.Propagation = f.NoSuid, f.NoDev, f.NoExec, f.Propagation
	if out.RecursiveReadonly && out.Propagation != "" {
		return out, invalid(field, "recursive read-only needs private propagation")
	}
	return out, nil
}

// adjustDevices removes ("-PATH") or replaces device nodes by path; a new
// one is allowed by the app's device rules (when it has any), with the
// access its file mode gives, as containerd does.
func adjustDevices(a *api.AppSpec, devs []*nriapi.LinuxDevice) error {
	for _, d := range devs {
		path, remove := d.IsMarkedForRemoval()
		a.Devices = slices.DeleteFunc(a.Devices, func(x specs.LinuxDevice) bool { return x.Path == path })
		if remove {
			continue
		}
		field := "linux.devices[" + path + "]"
		if !filepath.IsAbs(path) {
			return invalid(field, "the path must be absolute")
		}
		switch d.GetType() {
		case "c", "b", "u", "p":
		default:
			return invalid(field, "unknown device type %q", d.GetType())
		}
		a.Devices = append(a.Devices, d.ToOCI())
		if a.DeviceCgroup != nil {
			major, minor := d.GetMajor(), d.GetMinor()
			a.DeviceCgroup = append(a.DeviceCgroup, specs.LinuxDeviceCgroup{
				Allow: true, Type: d.GetType(), Major: &major, Minor: &minor, Access: d.AccessString(),
			})
		}
	}
	return nil
}

// adjustRlimits sets resource limits, replacing one of the same type.
func adjustRlimits(a *api.AppSpec, ls []*nriapi.POSIXRlimit) error {
	for _, l := range ls {
		if l == nil {
			continue
		}
		lim := rlimit.Limit{Type: l.GetType(), Soft: l.GetSoft(), Hard: l.GetHard()}
		if err := rlimit.Check([]rlimit.Limit{lim}); err != nil {
			return errdefs.InvalidArgument("NRI rlimits[%s]: %w", l.GetType(), err)
		}
		a.Rlimits = slices.DeleteFunc(a.Rlimits, func(x rlimit.Limit) bool { return x.Type == lim.Type })
		a.Rlimits = append(a.Rlimits, lim)
	}
	return nil
}

// seccompFromNRI is the profile name an app spec's SeccompProfile holds
// for a filter a plugin gave.
const seccompFromNRI = "nri"

// adjustSeccomp replaces the app's system call filter with p, checked as
// the agent will compile it.
func adjustSeccomp(a *api.AppSpec, p *nriapi.LinuxSeccomp) error {
	if p == nil {
		return nil
	}
	prof := &specs.LinuxSeccomp{
		DefaultAction:    specs.LinuxSeccompAction(p.GetDefaultAction()),
		ListenerPath:     p.GetListenerPath(),
		ListenerMetadata: p.GetListenerMetadata(),
		Syscalls:         nriapi.ToOCILinuxSyscalls(p.GetSyscalls()),
	}
	if e := p.GetDefaultErrno(); e != nil {
		v := uint(e.GetValue())
		prof.DefaultErrnoRet = &v
	}
	for _, arch := range p.GetArchitectures() {
		prof.Architectures = append(prof.Architectures, specs.Arch(arch))
	}
	for _, f := range p.GetFlags() {
		prof.Flags = append(prof.Flags, specs.LinuxSeccompFlag(f))
	}
	if err := seccomp.Validate(prof); err != nil {
		return errdefs.InvalidArgument("NRI linux.seccomp_policy: %w", err)
	}
	a.Seccomp = prof
	a.SeccompProfile = seccompFromNRI
	return nil
}

// hasHooks tells whether h holds any hook.
func hasHooks(h *nriapi.Hooks) bool {
	return h != nil && len(h.GetPrestart())+len(h.GetCreateRuntime())+len(h.GetCreateContainer())+
		len(h.GetStartContainer())+len(h.GetPoststart())+len(h.GetPoststop()) > 0
}
