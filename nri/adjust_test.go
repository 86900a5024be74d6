package nri

import (
	"errors"
	"reflect"
	"strings"
	"testing"

	nriapi "github.com/containerd/nri/pkg/api"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/rlimit"
)

func baseApp() *api.AppSpec {
	return &api.AppSpec{
		ID:   "c1",
		Args: []string{"/bin/app"},
		Env:  []string{"A=1", "B=2", "C=3"},
		Mounts: []api.Mount{
			{Source: "/host/data", Destination: "/data"},
			{Source: "/host/x", Destination: "/x", Readonly: true},
		},
		Resources:    api.Resources{CPUShares: 1024, MemoryLimit: 1 << 30, OOMScoreAdj: 500},
		Rlimits:      []rlimit.Limit{{Type: "RLIMIT_NOFILE", Soft: 1024, Hard: 4096}},
		Devices:      []specs.LinuxDevice{{Path: "/dev/fuse", Type: "c", Major: 10, Minor: 229}},
		DeviceCgroup: []specs.LinuxDeviceCgroup{{Allow: false, Access: "rwm"}},
	}
}

func TestAdjustApplies(t *testing.T) {
	major, minor := int64(1), int64(3)
	tests := []struct {
		name  string
		adj   *nriapi.ContainerAdjustment
		check func(t *testing.T, a *api.AppSpec, out Adjusted)
	}{
		{"nil", nil, func(t *testing.T, a *api.AppSpec, _ Adjusted) {
			if !reflect.DeepEqual(a, baseApp()) {
				t.Errorf("app changed: %+v", a)
			}
		}},
		{"env by name, in place, removal, new", &nriapi.ContainerAdjustment{Env: []*nriapi.KeyValue{
			{Key: "B", Value: "20"}, {Key: "-A"}, {Key: "D", Value: "4"}, {Key: "-NONE"},
		}}, func(t *testing.T, a *api.AppSpec, _ Adjusted) {
			if want := []string{"B=20", "C=3", "D=4"}; !reflect.DeepEqual(a.Env, want) {
				t.Errorf("env %q, want %q", a.Env, want)
			}
		}},
		{"args replaced", &nriapi.ContainerAdjustment{Args: []string{"/bin/other", "-v"}}, func(t *testing.T, a *api.AppSpec, _ Adjusted) {
			if want := []string{"/bin/other", "-v"}; !reflect.DeepEqual(a.Args, want) {
				t.Errorf("args %q, want %q", a.Args, want)
			}
		}},
		{"mounts by destination, parents first", &nriapi.ContainerAdjustment{Mounts: []*nriapi.Mount{
			{Destination: "/data/sub", Source: "/host/sub", Type: "bind", Options: []string{"rbind", "rro", "nosuid", "nodev", "noexec"}},
			{Destination: "/data", Source: "/host/new", Options: []string{"bind", "ro", "rslave"}},
			{Destination: "-/x"},
		}}, func(t *testing.T, a *api.AppSpec, _ Adjusted) {
			want := []api.Mount{
				{Source: "/host/new", Destination: "/data", Readonly: true, Propagation: "rslave"},
				{Source: "/host/sub", Destination: "/data/sub", Readonly: true, RecursiveReadonly: true, NoSuid: true, NoDev: true, NoExec: true},
			}
			if !reflect.DeepEqual(a.Mounts, want) {
				t.Errorf("mounts %+v, want %+v", a.Mounts, want)
			}
		}},
		{"devices by path, allowed by a rule", &nriapi.ContainerAdjustment{Linux: &nriapi.LinuxContainerAdjustment{Devices: []*nriapi.LinuxDevice{
			{Path: "-/dev/fuse"},
			{Path: "/dev/null2", Type: "c", Major: 1, Minor: 3, FileMode: nriapi.FileMode(uint32(0o666))},
		}}}, func(t *testing.T, a *api.AppSpec, _ Adjusted) {
			if len(a.Devices) != 1 || a.Devices[0].Path != "/dev/null2" || a.Devices[0].Major != 1 {
				t.Errorf("devices %+v", a.Devices)
			}
			wantRule := specs.LinuxDeviceCgroup{Allow: true, Type: "c", Major: &major, Minor: &minor, Access: "rw"}
			if n := len(a.DeviceCgroup); n != 2 || !reflect.DeepEqual(a.DeviceCgroup[1], wantRule) {
				t.Errorf("device rules %+v, want the app's and %+v", a.DeviceCgroup, wantRule)
			}
		}},
		{"rlimits by type", &nriapi.ContainerAdjustment{Rlimits: []*nriapi.POSIXRlimit{
			{Type: "RLIMIT_NOFILE", Soft: 10, Hard: 20}, {Type: "RLIMIT_NPROC", Soft: 5, Hard: 5},
		}}, func(t *testing.T, a *api.AppSpec, _ Adjusted) {
			want := []rlimit.Limit{{Type: "RLIMIT_NOFILE", Soft: 10, Hard: 20}, {Type: "RLIMIT_NPROC", Soft: 5, Hard: 5}}
			if !reflect.DeepEqual(a.Rlimits, want) {
				t.Errorf("rlimits %+v, want %+v", a.Rlimits, want)
			}
		}},
		{"resources merged, only what is set", &nriapi.ContainerAdjustment{Linux: &nriapi.LinuxContainerAdjustment{
			Resources: &nriapi.LinuxResources{
				Cpu:            &nriapi.LinuxCPU{Quota: nriapi.Int64(50000), Period: nriapi.UInt64(100000), Cpus: "0-1"},
				Memory:         &nriapi.LinuxMemory{Swap: nriapi.Int64(2 << 30), Reservation: nriapi.Int64(1 << 29)},
				HugepageLimits: []*nriapi.HugepageLimit{{PageSize: "2MB", Limit: 4 << 20}},
				Pids:           &nriapi.LinuxPids{Limit: 100},
				Unified:        map[string]string{"memory.oom.group": "1"},
			},
			OomScoreAdj: nriapi.Int(-10),
		}}, func(t *testing.T, a *api.AppSpec, _ Adjusted) {
			want := api.Resources{
				CPUShares: 1024, CPUQuota: 50000, CPUPeriod: 100000, CpusetCpus: "0-1",
				MemoryLimit: 1 << 30, MemorySwap: 2 << 30, MemoryReservation: 1 << 29,
				PidsLimit: 100, OOMGroup: true, OOMScoreAdj: -10,
			}
			if a.Resources != want {
				t.Errorf("resources %+v, want %+v", a.Resources, want)
			}
			if want := []api.HugepageLimit{{PageSize: "2MB", Limit: 4 << 20}}; !reflect.DeepEqual(a.HugepageLimits, want) {
				t.Errorf("hugepages %+v, want %+v", a.HugepageLimits, want)
			}
		}},
		{"seccomp replaced", &nriapi.ContainerAdjustment{Linux: &nriapi.LinuxContainerAdjustment{SeccompPolicy: &nriapi.LinuxSeccomp{
			DefaultAction: "SCMP_ACT_ERRNO", DefaultErrno: nriapi.UInt32(uint32(1)), Architectures: []string{"SCMP_ARCH_X86_64"},
			Syscalls: []*nriapi.LinuxSyscall{{Names: []string{"read"}, Action: "SCMP_ACT_ALLOW"}},
		}}}, func(t *testing.T, a *api.AppSpec, _ Adjusted) {
			s := a.Seccomp
			if s == nil || s.DefaultAction != specs.ActErrno || s.DefaultErrnoRet == nil || *s.DefaultErrnoRet != 1 ||
				len(s.Syscalls) != 1 || s.Syscalls[0].Names[0] != "read" || a.SeccompProfile != seccompFromNRI {
				t.Errorf("seccomp %+v (%q)", s, a.SeccompProfile)
			}
		}},
		{"the broker's part returned", &nriapi.ContainerAdjustment{
			Annotations: map[string]string{"a": "1", "-b": ""},
			Hooks:       &nriapi.Hooks{Prestart: []*nriapi.Hook{{Path: "/bin/hook"}}},
			CDIDevices:  []*nriapi.CDIDevice{{Name: "vendor.com/gpu=0"}},
		}, func(t *testing.T, a *api.AppSpec, out Adjusted) {
			if !reflect.DeepEqual(out.Annotations, map[string]string{"a": "1", "-b": ""}) ||
				out.Hooks == nil || out.Hooks.Prestart[0].Path != "/bin/hook" ||
				!reflect.DeepEqual(out.CDIDevices, []string{"vendor.com/gpu=0"}) {
				t.Errorf("adjusted %+v", out)
			}
		}},
		{"empty parts as the library sends them", &nriapi.ContainerAdjustment{
			Annotations: map[string]string{}, Hooks: &nriapi.Hooks{},
			Linux: &nriapi.LinuxContainerAdjustment{
				Resources:  &nriapi.LinuxResources{Memory: &nriapi.LinuxMemory{}, Cpu: &nriapi.LinuxCPU{}, Unified: map[string]string{}},
				Namespaces: []*nriapi.LinuxNamespace{}, Sysctl: map[string]string{}, NetDevices: map[string]*nriapi.LinuxNetDevice{},
			},
		}, func(t *testing.T, a *api.AppSpec, out Adjusted) {
			if !reflect.DeepEqual(a, baseApp()) || out.Hooks != nil || out.Annotations != nil {
				t.Errorf("app %+v, adjusted %+v", a, out)
			}
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			a := baseApp()
			out, err := Adjust(a, tc.adj)
			if err != nil {
				t.Fatal(err)
			}
			tc.check(t, a, out)
		})
	}
}

// TestAdjustRefuses: every field the agent cannot apply is refused, naming
// it, and the app is left as it was.
func TestAdjustRefuses(t *testing.T) {
	linux := func(l *nriapi.LinuxContainerAdjustment) *nriapi.ContainerAdjustment {
		// An env change first: a refusal later must undo it too.
		return &nriapi.ContainerAdjustment{Env: []*nriapi.KeyValue{{Key: "A", Value: "x"}}, Linux: l}
	}
	res := func(r *nriapi.LinuxResources) *nriapi.ContainerAdjustment {
		return linux(&nriapi.LinuxContainerAdjustment{Resources: r})
	}
	tests := []struct {
		name  string
		adj   *nriapi.ContainerAdjustment
		class error
		field string
	}{
		{"cgroups path", linux(&nriapi.LinuxContainerAdjustment{CgroupsPath: "/x"}), errdefs.ErrUnimplemented, "linux.cgroups_path"},
		{"io priority", linux(&nriapi.LinuxContainerAdjustment{IoPriority: &nriapi.LinuxIOPriority{Priority: 4}}), errdefs.ErrUnimplemented, "linux.io_priority"},
		{"namespaces", linux(&nriapi.LinuxContainerAdjustment{Namespaces: []*nriapi.LinuxNamespace{{Type: "network", Path: "/x"}}}), errdefs.ErrUnimplemented, "linux.namespaces"},
		{"sysctl", linux(&nriapi.LinuxContainerAdjustment{Sysctl: map[string]string{"net.x": "1"}}), errdefs.ErrUnimplemented, "linux.sysctl"},
		{"net devices", linux(&nriapi.LinuxContainerAdjustment{NetDevices: map[string]*nriapi.LinuxNetDevice{"eth1": {Name: "x"}}}), errdefs.ErrUnimplemented, "linux.net_devices"},
		{"scheduler", linux(&nriapi.LinuxContainerAdjustment{Scheduler: &nriapi.LinuxScheduler{Nice: 5}}), errdefs.ErrUnimplemented, "linux.scheduler"},
		{"rdt", linux(&nriapi.LinuxContainerAdjustment{Rdt: &nriapi.LinuxRdt{ClosId: nriapi.String("gold")}}), errdefs.ErrUnimplemented, "linux.rdt"},
		{"memory policy", linux(&nriapi.LinuxContainerAdjustment{MemoryPolicy: &nriapi.LinuxMemoryPolicy{Nodes: "0"}}), errdefs.ErrUnimplemented, "linux.memory_policy"},
		{"kernel memory", res(&nriapi.LinuxResources{Memory: &nriapi.LinuxMemory{Kernel: nriapi.Int64(1)}}), errdefs.ErrUnimplemented, "memory.kernel"},
		{"kernel tcp", res(&nriapi.LinuxResources{Memory: &nriapi.LinuxMemory{KernelTcp: nriapi.Int64(1)}}), errdefs.ErrUnimplemented, "memory.kernel_tcp"},
		{"swappiness", res(&nriapi.LinuxResources{Memory: &nriapi.LinuxMemory{Swappiness: nriapi.UInt64(1)}}), errdefs.ErrUnimplemented, "memory.swappiness"},
		{"oom killer", res(&nriapi.LinuxResources{Memory: &nriapi.LinuxMemory{DisableOomKiller: nriapi.Bool(true)}}), errdefs.ErrUnimplemented, "memory.disable_oom_killer"},
		{"realtime", res(&nriapi.LinuxResources{Cpu: &nriapi.LinuxCPU{RealtimeRuntime: nriapi.Int64(1)}}), errdefs.ErrUnimplemented, "cpu.realtime"},
		{"blockio class", res(&nriapi.LinuxResources{BlockioClass: nriapi.String("x")}), errdefs.ErrUnimplemented, "blockio_class"},
		{"rdt class", res(&nriapi.LinuxResources{RdtClass: nriapi.String("x")}), errdefs.ErrUnimplemented, "rdt_class"},
		{"unified", res(&nriapi.LinuxResources{Unified: map[string]string{"io.max": "x"}}), errdefs.ErrUnimplemented, "unified"},
		{"deny rule unfenced", nil, errdefs.ErrUnimplemented, "linux.resources.devices"},
		{"tmpfs mount", &nriapi.ContainerAdjustment{Mounts: []*nriapi.Mount{{Destination: "/t", Type: "tmpfs", Source: "tmpfs"}}}, errdefs.ErrUnimplemented, "mounts[/t]"},
		{"relabel", &nriapi.ContainerAdjustment{Mounts: []*nriapi.Mount{{Destination: "/t", Type: "bind", Source: "/s", Options: []string{"rbind", "z"}}}}, errdefs.ErrUnimplemented, "mounts[/t]"},
		{"no bind", &nriapi.ContainerAdjustment{Mounts: []*nriapi.Mount{{Destination: "/t", Source: "/s"}}}, errdefs.ErrUnimplemented, "mounts[/t]"},
		{"relative source", &nriapi.ContainerAdjustment{Mounts: []*nriapi.Mount{{Destination: "/t", Type: "bind", Source: "s"}}}, errdefs.ErrInvalidArgument, "mounts[/t]"},
		{"rro shared", &nriapi.ContainerAdjustment{Mounts: []*nriapi.Mount{{Destination: "/t", Type: "bind", Source: "/s", Options: []string{"rro", "rshared"}}}}, errdefs.ErrInvalidArgument, "mounts[/t]"},
		{"device type", linux(&nriapi.LinuxContainerAdjustment{Devices: []*nriapi.LinuxDevice{{Path: "/dev/x", Type: "q"}}}), errdefs.ErrInvalidArgument, "linux.devices[/dev/x]"},
		{"rlimit name", &nriapi.ContainerAdjustment{Rlimits: []*nriapi.POSIXRlimit{{Type: "RLIMIT_BOGUS"}}}, errdefs.ErrInvalidArgument, "rlimits[RLIMIT_BOGUS]"},
		{"seccomp listener", linux(&nriapi.LinuxContainerAdjustment{SeccompPolicy: &nriapi.LinuxSeccomp{DefaultAction: "SCMP_ACT_ALLOW", ListenerPath: "/run/l"}}), errdefs.ErrInvalidArgument, "seccomp_policy"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			a := baseApp()
			adj := tc.adj
			if adj == nil { // a VM's app: no device rules
				a.DeviceCgroup = nil
				adj = res(&nriapi.LinuxResources{Devices: []*nriapi.LinuxDeviceCgroup{{Allow: false, Type: "c", Access: "rwm"}}})
			}
			before := *a
			before.DeviceCgroup = a.DeviceCgroup
			_, err := Adjust(a, adj)
			if !errors.Is(err, tc.class) || !strings.Contains(err.Error(), tc.field) {
				t.Fatalf("Adjust: %v, want %v naming %s", err, tc.class, tc.field)
			}
			if !reflect.DeepEqual(*a, before) {
				t.Errorf("app changed by a refused adjustment: %+v", a)
			}
		})
	}
}

func TestUpdateResources(t *testing.T) {
	base := api.Resources{CPUShares: 512, MemoryLimit: 1 << 30, PidsLimit: 10, OOMScoreAdj: 3}
	tests := []struct {
		name    string
		u       *nriapi.LinuxResources
		want    api.Resources
		wantErr string
	}{
		{"nil", nil, base, ""},
		{"set fields only", &nriapi.LinuxResources{
			Cpu:    &nriapi.LinuxCPU{Shares: nriapi.UInt64(2048), Mems: "0"},
			Memory: &nriapi.LinuxMemory{Limit: nriapi.Int64(2 << 30), Swap: nriapi.Int64(-1)},
		}, api.Resources{CPUShares: 2048, CpusetMems: "0", MemoryLimit: 2 << 30, MemorySwap: -1, PidsLimit: 10, OOMScoreAdj: 3}, ""},
		{"pids unlimited", &nriapi.LinuxResources{Pids: &nriapi.LinuxPids{Limit: -1}}, api.Resources{CPUShares: 512, MemoryLimit: 1 << 30, PidsLimit: -1, OOMScoreAdj: 3}, ""},
		{"round trip", LinuxResourcesOf(&base), base, ""},
		{"hugepages", &nriapi.LinuxResources{HugepageLimits: []*nriapi.HugepageLimit{{PageSize: "2MB", Limit: 1}}}, base, "hugepage_limits"},
		{"device rules", &nriapi.LinuxResources{Devices: []*nriapi.LinuxDeviceCgroup{{Allow: true}}}, base, "linux.resources.devices"},
		{"kernel memory", &nriapi.LinuxResources{Memory: &nriapi.LinuxMemory{Kernel: nriapi.Int64(1)}}, base, "memory.kernel"},
		{"unified", &nriapi.LinuxResources{Unified: map[string]string{"memory.high": "1"}}, base, "unified"},
		{"shares out of range", &nriapi.LinuxResources{Cpu: &nriapi.LinuxCPU{Shares: nriapi.UInt64(uint64(1) << 63)}}, base, "cpu.shares"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			r := base
			err := UpdateResources(&r, tc.u)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("UpdateResources: %v, want an error naming %s", err, tc.wantErr)
				}
			} else if err != nil {
				t.Fatal(err)
			}
			if r != tc.want {
				t.Errorf("resources %+v, want %+v", r, tc.want)
			}
		})
	}
}

// TestAdjustTakesTheLibrarysEmptyMessages: the library merges plugins'
// answers into messages it creates empty (an RDT removal among them);
// those ask for nothing and are no refusal.
func TestAdjustTakesTheLibrarysEmptyMessages(t *testing.T) {
	adj := &nriapi.ContainerAdjustment{Linux: &nriapi.LinuxContainerAdjustment{
		IoPriority: &nriapi.LinuxIOPriority{}, Scheduler: &nriapi.LinuxScheduler{},
		Rdt: &nriapi.LinuxRdt{Remove: true}, MemoryPolicy: &nriapi.LinuxMemoryPolicy{},
	}}
	if _, err := Adjust(&api.AppSpec{}, adj); err != nil {
		t.Fatal(err)
	}
}
