package harness

import (
	"strings"
	"testing"
)

// The teardown looks for pod cgroups beneath the daemon's cgroup in every
// hierarchy, v1 and v2, and on a pure v2 host beneath the cgroup above the
// supervisor leaf the daemon moved into.
func TestDaemonCgroupDirs(t *testing.T) {
	v2 := []cgroupMount{{point: "/sys/fs/cgroup", v2: true}}
	got := daemonCgroupDirs("0::/system.slice/ci.service/supervisor\n", v2)
	if len(got) != 1 || got[0] != "/sys/fs/cgroup/system.slice/ci.service" {
		t.Errorf("pure v2, daemon in its leaf: %v", got)
	}
	got = daemonCgroupDirs("0::/system.slice/ci.service\n", v2)
	if len(got) != 1 || got[0] != "/sys/fs/cgroup/system.slice/ci.service" {
		t.Errorf("pure v2, daemon not moved yet: %v", got)
	}
	hybrid := []cgroupMount{
		{point: "/sys/fs/cgroup/unified", v2: true},
		{point: "/sys/fs/cgroup/memory", opts: map[string]bool{"rw": true, "memory": true}},
		{point: "/sys/fs/cgroup/cpu,cpuacct", opts: map[string]bool{"cpu": true, "cpuacct": true}},
	}
	got = daemonCgroupDirs("5:memory:/ci\n4:cpu,cpuacct:/ci\n0::/ci\n", hybrid)
	want := []string{"/sys/fs/cgroup/memory/ci", "/sys/fs/cgroup/cpu,cpuacct/ci", "/sys/fs/cgroup/unified/ci"}
	if strings.Join(got, " ") != strings.Join(want, " ") {
		t.Errorf("hybrid: %v, want %v", got, want)
	}
}
