package cgroups

import (
	"reflect"
	"strings"
	"testing"
)

const hybridCgroup = `9:name=systemd:/
8:pids:/
7:blkio:/
6:freezer:/
5:devices:/
4:memory:/process_api/96fe
3:cpuset:/
2:cpuacct:/
1:cpu:/
0::/
`

const hybridMountinfo = `22 1 8:1 / / rw,relatime - ext4 /dev/vda rw
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
34 31 0:31 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
36 31 0:33 / /sys/fs/cgroup/devices rw,relatime - cgroup cgroup rw,devices
37 31 0:34 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer
38 31 0:35 / /sys/fs/cgroup/blkio rw,relatime - cgroup cgroup rw,blkio
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
`

// A v1 host with cpu and cpuacct co-mounted, inside a container whose
// cgroup mounts are rooted at its own cgroup.
const comountCgroup = `12:pids:/docker/abc
11:cpu,cpuacct:/docker/abc/sub
10:memory:/docker/abc
5:freezer:/docker/abc
1:name=systemd:/docker/abc
`

const comountMountinfo = `100 99 0:50 /docker/abc /sys/fs/cgroup/cpu,cpuacct ro,nosuid master:1 - cgroup cgroup rw,cpu,cpuacct
101 99 0:51 /docker/abc /sys/fs/cgroup/memory ro,nosuid - cgroup cgroup rw,memory
102 99 0:52 /docker/abc /sys/fs/cgroup/pids ro,nosuid - cgroup cgroup rw,pids
103 99 0:53 /docker/abc /sys/fs/cgroup/freezer ro,nosuid - cgroup cgroup rw,freezer
104 99 0:54 /docker/abc /sys/fs/cgroup/systemd ro,nosuid - cgroup cgroup rw,xattr,name=systemd
`

const v2Cgroup = "0::/user.slice/session-1.scope\n"

const v2Mountinfo = `30 24 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot
`

func mustEnv(t *testing.T, pc, mi string, v2 bool) *env {
	t.Helper()
	e, err := parseEnv(strings.NewReader(pc), strings.NewReader(mi), v2)
	if err != nil {
		t.Fatal(err)
	}
	return e
}

func TestSelfAndResolve(t *testing.T) {
	tests := []struct {
		name        string
		pc, mi      string
		v2          bool
		wantSelf    map[string]string
		parent      string
		wantResolve map[string]string
	}{
		{
			name: "hybrid relative",
			pc:   hybridCgroup, mi: hybridMountinfo,
			wantSelf: map[string]string{
				"cpu":     "/sys/fs/cgroup/cpu",
				"cpuacct": "/sys/fs/cgroup/cpuacct",
				"cpuset":  "/sys/fs/cgroup/cpuset",
				"memory":  "/sys/fs/cgroup/memory/process_api/96fe",
				"pids":    "/sys/fs/cgroup/pids",
				"freezer": "/sys/fs/cgroup/freezer",
				"devices": "/sys/fs/cgroup/devices",
			},
			parent: "stagelet",
			wantResolve: map[string]string{
				"cpu":     "/sys/fs/cgroup/cpu/stagelet",
				"cpuacct": "/sys/fs/cgroup/cpuacct/stagelet",
				"cpuset":  "/sys/fs/cgroup/cpuset/stagelet",
				"memory":  "/sys/fs/cgroup/memory/process_api/96fe/stagelet",
				"pids":    "/sys/fs/cgroup/pids/stagelet",
				"freezer": "/sys/fs/cgroup/freezer/stagelet",
				"devices": "/sys/fs/cgroup/devices/stagelet",
			},
		},
		{
			name: "hybrid absolute",
			pc:   hybridCgroup, mi: hybridMountinfo,
			parent: "/stagelet/pods",
			wantResolve: map[string]string{
				"cpu":     "/sys/fs/cgroup/cpu/stagelet/pods",
				"cpuacct": "/sys/fs/cgroup/cpuacct/stagelet/pods",
				"cpuset":  "/sys/fs/cgroup/cpuset/stagelet/pods",
				"memory":  "/sys/fs/cgroup/memory/stagelet/pods",
				"pids":    "/sys/fs/cgroup/pids/stagelet/pods",
				"freezer": "/sys/fs/cgroup/freezer/stagelet/pods",
				"devices": "/sys/fs/cgroup/devices/stagelet/pods",
			},
		},
		{
			name: "co-mounted in a container",
			pc:   comountCgroup, mi: comountMountinfo,
			wantSelf: map[string]string{
				"cpu":     "/sys/fs/cgroup/cpu,cpuacct/sub",
				"cpuacct": "/sys/fs/cgroup/cpu,cpuacct/sub",
				"memory":  "/sys/fs/cgroup/memory",
				"pids":    "/sys/fs/cgroup/pids",
				"freezer": "/sys/fs/cgroup/freezer",
			},
			parent: "/docker/abc/x",
			wantResolve: map[string]string{
				"cpu":     "/sys/fs/cgroup/cpu,cpuacct/x",
				"cpuacct": "/sys/fs/cgroup/cpu,cpuacct/x",
				"memory":  "/sys/fs/cgroup/memory/x",
				"pids":    "/sys/fs/cgroup/pids/x",
				"freezer": "/sys/fs/cgroup/freezer/x",
			},
		},
		{
			name: "pure v2",
			pc:   v2Cgroup, mi: v2Mountinfo, v2: true,
			wantSelf: map[string]string{
				Unified: "/sys/fs/cgroup/user.slice/session-1.scope",
			},
			parent: "pods/p1",
			wantResolve: map[string]string{
				Unified: "/sys/fs/cgroup/user.slice/session-1.scope/pods/p1",
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := mustEnv(t, tt.pc, tt.mi, tt.v2)
			if tt.wantSelf != nil {
				got, err := e.self()
				if err != nil {
					t.Fatal(err)
				}
				if !reflect.DeepEqual(got.Paths, tt.wantSelf) {
					t.Errorf("self = %v, want %v", got.Paths, tt.wantSelf)
				}
			}
			got, err := e.resolve(tt.parent)
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got.Paths, tt.wantResolve) {
				t.Errorf("resolve(%q) = %v, want %v", tt.parent, got.Paths, tt.wantResolve)
			}
			if got.IsV2() != tt.v2 {
				t.Errorf("IsV2 = %v", got.IsV2())
			}
		})
	}
}

func TestCoMountedDirsOnce(t *testing.T) {
	e := mustEnv(t, comountCgroup, comountMountinfo, false)
	c, err := e.resolve("/docker/abc/x")
	if err != nil {
		t.Fatal(err)
	}
	if n := len(c.dirs()); n != 4 {
		t.Errorf("dirs = %v, want 4 distinct", c.dirs())
	}
}

func TestChild(t *testing.T) {
	c := &Cgroup{Paths: map[string]string{"cpu": "/a", "memory": "/b/c"}}
	got := c.Child("../x").Paths
	want := map[string]string{"cpu": "/a/x", "memory": "/b/c/x"}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("Child = %v, want %v (no escape upward)", got, want)
	}
}

func TestParseProcCgroupBad(t *testing.T) {
	if _, err := parseProcCgroup(strings.NewReader("garbage\n")); err == nil {
		t.Error("want error")
	}
}

func TestSharesToWeight(t *testing.T) {
	for _, tt := range []struct{ in, want int64 }{
		{0, 0}, {2, 1}, {1024, 39}, {262144, 10000}, {1 << 30, 10000},
	} {
		if got := SharesToWeight(tt.in); got != tt.want {
			t.Errorf("SharesToWeight(%d) = %d, want %d", tt.in, got, tt.want)
		}
	}
}
