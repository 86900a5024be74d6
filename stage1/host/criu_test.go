package host

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"slices"
	"testing"
	"time"

	"github.com/moby/sys/mountinfo"

	"github.com/stagelet/stagelet/cgroups"
	"github.com/stagelet/stagelet/errdefs"
)

// What a container's mountinfo holds under nspawn: its overlay root,
// fresh proc, sysfs and tmpfs mounts, and binds of single files of file
// systems it does not mount whole (the agent's /dev nodes, /etc/hosts, a
// masked /proc file bound from /dev/null).
func TestExternalMounts(t *testing.T) {
	ms := []*mountinfo.Info{
		{Major: 0, Minor: 40, Root: "/", Mountpoint: "/"},
		{Major: 0, Minor: 41, Root: "/", Mountpoint: "/proc"},
		{Major: 0, Minor: 42, Root: "/", Mountpoint: "/dev"},
		{Major: 0, Minor: 5, Root: "/null", Mountpoint: "/dev/null"},
		{Major: 0, Minor: 5, Root: "/null", Mountpoint: "/proc/kcore"},
		{Major: 254, Minor: 1, Root: "/run/stagelet/pods/x/etc/hosts", Mountpoint: "/etc/hosts"},
		{Major: 0, Minor: 41, Root: "/sys", Mountpoint: "/proc/sys"}, // a bind of the app's own proc
		{Major: 0, Minor: 43, Root: "/", Mountpoint: "/data"},        // a volume mounted whole
		// The app's own cgroup, shown at /sys/fs/cgroup.
		{Major: 0, Minor: 30, Root: "/k/pod-x/app-c", Mountpoint: "/sys/fs/cgroup/cpu,cpuacct", FSType: "cgroup", VFSOptions: "rw,cpu,cpuacct"},
		{Major: 0, Minor: 31, Root: "/k/pod-x/app-c", Mountpoint: "/sys/fs/cgroup/systemd", FSType: "cgroup", VFSOptions: "rw,xattr,name=systemd"},
	}
	want := []string{"/dev/null", "/proc/kcore", "/etc/hosts", "/sys/fs/cgroup/cpu,cpuacct", "/sys/fs/cgroup/systemd"}
	var got []string
	var hierarchies []string
	for _, m := range externalMounts(ms) {
		got = append(got, m.Mountpoint)
		if c := cgroupsOf(m); c != nil {
			hierarchies = append(hierarchies, *c)
		}
	}
	if !slices.Equal(got, want) {
		t.Errorf("externalMounts = %q, want %q", got, want)
	}
	if want := []string{"cpu,cpuacct", "name=systemd"}; !slices.Equal(hierarchies, want) {
		t.Errorf("the cgroup mounts' hierarchies: %q, want %q", hierarchies, want)
	}
	if k := MountKey("/dev/null"); k != "m_dev_null" {
		t.Errorf("MountKey = %q", k)
	}
}

func TestNSPIDs(t *testing.T) {
	for status, want := range map[string][]string{
		"Name:\tsh\nNSpid:\t615\t140\t1\nNSpgid:\t615\n": {"615", "140", "1"},
		"NSpid:\t42\n": {"42"},
		"Name:\tsh\n":  nil,
	} {
		if got := nsPIDs([]byte(status)); !slices.Equal(got, want) {
			t.Errorf("nsPIDs(%q) = %q, want %q", status, got, want)
		}
	}
}

// PodProcess finds a process of the pod's cgroup by its PID, and only
// one of the pod's.
func TestPodProcess(t *testing.T) {
	cg, p := sleepInCgroup(t, "stagelet-podprocess-test")
	if got, err := PodProcess(cg, 0, p.PID); err != nil || got != p.PID {
		t.Errorf("PodProcess(%d) = %d, %v", p.PID, got, err)
	}
	// This test's own process is not the pod's.
	if _, err := PodProcess(cg, 0, os.Getpid()); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("PodProcess of a process outside the pod: %v", err)
	}
	// Nor is a PID at a level the process has not.
	if _, err := PodProcess(cg, 1, p.PID); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("PodProcess at a nested level the process lacks: %v", err)
	}
}

// A criu dump its call ends says how the call ended, for the CRI to
// answer Canceled to a caller that went away and DeadlineExceeded to one
// whose deadline passed: a cancel is no deadline.
func TestCRIUDumpEndedByItsCall(t *testing.T) {
	criu, err := exec.LookPath("true") // never run: the call has ended
	if err != nil {
		t.Skipf("no true(1): %v", err)
	}
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	expired, cancel := context.WithDeadline(context.Background(), time.Now().Add(-time.Second))
	defer cancel()
	for _, tc := range []struct {
		name      string
		ctx       context.Context
		want, not error
	}{
		{"cancelled", cancelled, context.Canceled, context.DeadlineExceeded},
		{"deadline", expired, context.DeadlineExceeded, context.Canceled},
	} {
		_, err := CRIUDump(tc.ctx, criu, os.Getpid(), &cgroups.Cgroup{Paths: map[string]string{}}, t.TempDir())
		if !errors.Is(err, tc.want) || errors.Is(err, tc.not) {
			t.Errorf("%s: %v: want %v, not %v", tc.name, err, tc.want, tc.not)
		}
		if tc.want == context.Canceled && errors.Is(err, errdefs.ErrDeadlineExceeded) {
			t.Errorf("%s: %v: a cancel reads as DeadlineExceeded", tc.name, err)
		}
	}
}
