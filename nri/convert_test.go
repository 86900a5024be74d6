package nri

import (
	"reflect"
	"testing"
	"time"

	nriapi "github.com/containerd/nri/pkg/api"
	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/internal/rlimit"
)

func TestContainerOf(t *testing.T) {
	created := time.Unix(100, 5)
	major := int64(10)
	app := &api.AppSpec{
		Args: []string{"/bin/app", "-x"},
		Env:  []string{"A=1"},
		Mounts: []api.Mount{
			{Source: "/h/a", Destination: "/a"},
			{Source: "/h/b", Destination: "/b", Readonly: true, RecursiveReadonly: true, NoSuid: true, Propagation: "rslave"},
		},
		Resources: api.Resources{
			CPUShares: 256, CPUQuota: -1, CPUPeriod: 100000, CpusetCpus: "0", MemoryLimit: 64 << 20,
			MemorySwap: 128 << 20, PidsLimit: -1, OOMScoreAdj: 999, OOMGroup: true,
		},
		HugepageLimits: []api.HugepageLimit{{PageSize: "1GB", Limit: 1 << 30}},
		UID:            1000, GID: 1000, AdditionalGIDs: []uint32{5},
		Rlimits:        []rlimit.Limit{{Type: "RLIMIT_NOFILE", Soft: 1, Hard: 2}},
		Devices:        []specs.LinuxDevice{{Path: "/dev/fuse", Type: "c", Major: 10, Minor: 229}},
		DeviceCgroup:   []specs.LinuxDeviceCgroup{{Allow: true, Type: "c", Major: &major, Access: "rwm"}},
		PIDNamespace:   api.PIDNamespaceContainer,
		Seccomp:        &specs.LinuxSeccomp{DefaultAction: specs.ActAllow},
		SeccompProfile: "localhost/p.json",
	}
	c := ContainerOf("pod1", ContainerInfo{
		ID: "c1", Name: "app", State: nriapi.ContainerState_CONTAINER_RUNNING,
		Labels: map[string]string{"l": "1"}, CreatedAt: created, ExitCode: 3, PID: 42, CgroupsPath: "/k/c1",
	}, app)

	if c.Id != "c1" || c.PodSandboxId != "pod1" || c.Name != "app" || c.State != nriapi.ContainerState_CONTAINER_RUNNING ||
		c.Labels["l"] != "1" || c.Pid != 42 || c.ExitCode != 3 || c.CreatedAt != created.UnixNano() || c.StartedAt != 0 {
		t.Errorf("identity and status: %+v", c)
	}
	if !reflect.DeepEqual(c.Args, app.Args) || !reflect.DeepEqual(c.Env, app.Env) {
		t.Errorf("args %q env %q", c.Args, c.Env)
	}
	wantMounts := []*nriapi.Mount{
		{Destination: "/a", Type: "bind", Source: "/h/a", Options: []string{"rbind", "rw", "rprivate"}},
		{Destination: "/b", Type: "bind", Source: "/h/b", Options: []string{"rbind", "rro", "nosuid", "rslave"}},
	}
	if !reflect.DeepEqual(c.Mounts, wantMounts) {
		t.Errorf("mounts %v, want %v", c.Mounts, wantMounts)
	}
	if u := c.User; u.Uid != 1000 || u.Gid != 1000 || !reflect.DeepEqual(u.AdditionalGids, []uint32{5}) {
		t.Errorf("user %+v", u)
	}
	if len(c.Rlimits) != 1 || c.Rlimits[0].Type != "RLIMIT_NOFILE" || c.Rlimits[0].Hard != 2 {
		t.Errorf("rlimits %+v", c.Rlimits)
	}
	l := c.Linux
	if l.CgroupsPath != "/k/c1" || l.OomScoreAdj.GetValue() != 999 || len(l.Devices) != 1 || l.Devices[0].Path != "/dev/fuse" {
		t.Errorf("linux %+v", l)
	}
	if l.SeccompProfile.GetProfileType() != nriapi.SecurityProfile_LOCALHOST || l.SeccompProfile.GetLocalhostRef() != "p.json" ||
		l.SeccompPolicy.GetDefaultAction() != string(specs.ActAllow) {
		t.Errorf("seccomp %+v %+v", l.SeccompProfile, l.SeccompPolicy)
	}
	var ns []string
	for _, n := range l.Namespaces {
		ns = append(ns, n.Type)
	}
	if !reflect.DeepEqual(ns, []string{"mount", "pid"}) {
		t.Errorf("namespaces %q", ns)
	}
	r := l.Resources
	if r.Cpu.Shares.GetValue() != 256 || r.Cpu.Quota.GetValue() != -1 || r.Cpu.Period.GetValue() != 100000 || r.Cpu.Cpus != "0" ||
		r.Memory.Limit.GetValue() != 64<<20 || r.Memory.Swap.GetValue() != 128<<20 || r.Memory.Reservation != nil ||
		r.Pids.GetLimit() != -1 || r.Unified["memory.oom.group"] != "1" ||
		len(r.HugepageLimits) != 1 || r.HugepageLimits[0].PageSize != "1GB" ||
		len(r.Devices) != 1 || r.Devices[0].Major.GetValue() != 10 || r.Devices[0].Minor != nil {
		t.Errorf("resources %+v", r)
	}
}

func TestSeccompProfileOf(t *testing.T) {
	tests := []struct {
		in   string
		want *nriapi.SecurityProfile
	}{
		{"", &nriapi.SecurityProfile{ProfileType: nriapi.SecurityProfile_UNCONFINED}},
		{"runtime/default", &nriapi.SecurityProfile{ProfileType: nriapi.SecurityProfile_RUNTIME_DEFAULT}},
		{"localhost/x", &nriapi.SecurityProfile{ProfileType: nriapi.SecurityProfile_LOCALHOST, LocalhostRef: "x"}},
		{seccompFromNRI, nil},
	}
	for _, tc := range tests {
		if got := seccompProfileOf(tc.in); !reflect.DeepEqual(got, tc.want) {
			t.Errorf("seccompProfileOf(%q) = %v, want %v", tc.in, got, tc.want)
		}
	}
}

func TestPodOf(t *testing.T) {
	tests := []struct {
		name string
		in   PodInfo
		want *nriapi.PodSandbox
	}{
		{"host network, nothing known", PodInfo{ID: "p", Name: "n"}, &nriapi.PodSandbox{Id: "p", Name: "n", Linux: &nriapi.LinuxPodSandbox{}}},
		{"full", PodInfo{
			ID: "p", Name: "n", UID: "u", Namespace: "ns", Labels: map[string]string{"a": "b"},
			RuntimeHandler: "kvm", CgroupParent: "/kubepods", NetNSPath: "/run/netns/x", IPs: []string{"10.0.0.2"},
			Resources: &api.Resources{CPUShares: 2}, PID: 7,
		}, &nriapi.PodSandbox{
			Id: "p", Name: "n", Uid: "u", Namespace: "ns", Labels: map[string]string{"a": "b"},
			RuntimeHandler: "kvm", Ips: []string{"10.0.0.2"}, Pid: 7,
			Linux: &nriapi.LinuxPodSandbox{
				CgroupParent: "/kubepods",
				Namespaces:   []*nriapi.LinuxNamespace{{Type: "network", Path: "/run/netns/x"}},
				PodResources: &nriapi.LinuxResources{Cpu: &nriapi.LinuxCPU{Shares: nriapi.UInt64(2)}, Memory: &nriapi.LinuxMemory{}},
			},
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := PodOf(tc.in); !reflect.DeepEqual(got, tc.want) {
				t.Errorf("PodOf = %v\nwant %v", got, tc.want)
			}
		})
	}
}
