package cgroups

import (
	"reflect"
	"strings"
	"testing"
)

// An nspawn pod's agent on a hybrid host: its hierarchies rooted at its
// cgroup namespace, and the pod's memory cgroup, outside that namespace,
// bound in at /mnt/stagelet/cgroup.memory, where its apps' memory
// cgroups are.
const nspawnAppCgroup = `9:name=systemd:/
8:pids:/app-c1
7:blkio:/
6:freezer:/app-c1
5:devices:/app-c1
4:memory:/../../kubepods/pod-x/app-c1
3:cpuset:/app-c1
2:cpuacct:/app-c1
1:cpu:/app-c1
0::/
`

const nspawnMountinfo = `500 400 0:90 / / rw - tmpfs tmpfs rw
501 500 0:28 / /sys/fs/cgroup ro - tmpfs tmpfs ro,mode=755
502 501 0:29 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu
503 501 0:30 / /sys/fs/cgroup/cpuacct rw - cgroup cgroup rw,cpuacct
504 501 0:31 / /sys/fs/cgroup/cpuset rw - cgroup cgroup rw,cpuset
505 501 0:32 / /sys/fs/cgroup/memory ro - cgroup cgroup rw,memory
506 501 0:33 / /sys/fs/cgroup/devices rw - cgroup cgroup rw,devices
507 501 0:34 / /sys/fs/cgroup/freezer rw - cgroup cgroup rw,freezer
508 501 0:35 / /sys/fs/cgroup/blkio ro - cgroup cgroup rw,blkio
509 501 0:36 / /sys/fs/cgroup/pids rw - cgroup cgroup rw,pids
510 501 0:37 / /sys/fs/cgroup/systemd rw - cgroup cgroup rw,name=systemd
511 501 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw
512 500 0:32 /../../kubepods/pod-x /mnt/stagelet/cgroup.memory rw - cgroup cgroup rw,memory
520 500 0:32 / /mnt/stagelet/rootfs/c1/sys/fs/cgroup/memory rw - cgroup cgroup rw,memory
`

func TestViewOf(t *testing.T) {
	for _, tc := range []struct {
		name     string
		pc, mi   string
		v2       bool
		exclude  string
		want     []ViewDir
		wantErrs string
	}{{
		name: "hybrid host: every v1 hierarchy, not the hybrid cgroup2",
		pc:   hybridCgroup, mi: hybridMountinfo,
		want: []ViewDir{
			{"systemd", "/sys/fs/cgroup/systemd", []string{"name=systemd"}},
			{"pids", "/sys/fs/cgroup/pids", []string{"pids"}},
			{"blkio", "/sys/fs/cgroup/blkio", []string{"blkio"}},
			{"freezer", "/sys/fs/cgroup/freezer", []string{"freezer"}},
			{"devices", "/sys/fs/cgroup/devices", []string{"devices"}},
			{"memory", "/sys/fs/cgroup/memory/process_api/96fe", []string{"memory"}},
			{"cpuset", "/sys/fs/cgroup/cpuset", []string{"cpuset"}},
			{"cpuacct", "/sys/fs/cgroup/cpuacct", []string{"cpuacct"}},
			{"cpu", "/sys/fs/cgroup/cpu", []string{"cpu"}},
		},
	}, {
		name: "co-mounted controllers inside a container's mounts",
		pc:   comountCgroup, mi: comountMountinfo,
		want: []ViewDir{
			{"pids", "/sys/fs/cgroup/pids", []string{"pids"}},
			{"cpu,cpuacct", "/sys/fs/cgroup/cpu,cpuacct/sub", []string{"cpu", "cpuacct"}},
			{"memory", "/sys/fs/cgroup/memory", []string{"memory"}},
			{"freezer", "/sys/fs/cgroup/freezer", []string{"freezer"}},
			{"systemd", "/sys/fs/cgroup/systemd", []string{"name=systemd"}},
		},
	}, {
		name: "nspawn: memory outside the namespace, through the bound pod cgroup; the app's own root left out",
		pc:   nspawnAppCgroup, mi: nspawnMountinfo, exclude: "/mnt/stagelet/rootfs/c1",
		want: []ViewDir{
			{"systemd", "/sys/fs/cgroup/systemd", []string{"name=systemd"}},
			{"pids", "/sys/fs/cgroup/pids/app-c1", []string{"pids"}},
			{"blkio", "/sys/fs/cgroup/blkio", []string{"blkio"}},
			{"freezer", "/sys/fs/cgroup/freezer/app-c1", []string{"freezer"}},
			{"devices", "/sys/fs/cgroup/devices/app-c1", []string{"devices"}},
			{"memory", "/mnt/stagelet/cgroup.memory/app-c1", []string{"memory"}},
			{"cpuset", "/sys/fs/cgroup/cpuset/app-c1", []string{"cpuset"}},
			{"cpuacct", "/sys/fs/cgroup/cpuacct/app-c1", []string{"cpuacct"}},
			{"cpu", "/sys/fs/cgroup/cpu/app-c1", []string{"cpu"}},
		},
	}, {
		name: "pure v2",
		pc:   v2Cgroup, mi: v2Mountinfo, v2: true,
		want: []ViewDir{{"", "/sys/fs/cgroup/user.slice/session-1.scope", nil}},
	}, {
		name: "no mount reaches the cgroup",
		pc:   "4:memory:/../elsewhere\n", mi: hybridMountinfo,
		wantErrs: "no mounted hierarchy",
	}} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := viewOf(strings.NewReader(tc.pc), strings.NewReader(tc.mi), tc.v2, tc.exclude)
			if tc.wantErrs != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErrs) {
					t.Fatalf("err = %v, want one saying %q", err, tc.wantErrs)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, tc.want) {
				t.Errorf("got  %v\nwant %v", got, tc.want)
			}
		})
	}
}

func TestHolds(t *testing.T) {
	for _, tc := range []struct {
		root, p string
		want    bool
	}{
		{"/", "/", true},
		{"/", "/a/b", true},
		{"/", "/../a", false},
		{"/", "/..", false},
		{"/a", "/a", true},
		{"/a", "/a/b", true},
		{"/a", "/ab", false},
		{"/../../k/p", "/../../k/p/app", true},
		{"/../../k/p", "/../../k/q", false},
	} {
		if got := holds(tc.root, tc.p); got != tc.want {
			t.Errorf("holds(%q, %q) = %v, want %v", tc.root, tc.p, got, tc.want)
		}
	}
}
