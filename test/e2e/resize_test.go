package e2e

import (
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/cgroups"
)

// appMemoryLimit finds the cgroup of container id beneath the daemon's own
// (the agent names it app-<id>, on the host for fly and nspawn) and reads
// its memory limit.
func (e *env) appMemoryLimit(id string) string {
	e.t.Helper()
	return e.appCgroupFile(id, "memory", "memory.limit_in_bytes", "memory.max")
}

// appCgroupFile reads a file of container id's cgroup on the host: v1File
// in the v1 hierarchy of controller ctl, or v2File in cgroup v2.
func (e *env) appCgroupFile(id, ctl, v1File, v2File string) string {
	e.t.Helper()
	cg, err := cgroups.OfProcess(e.d.PID())
	if err != nil {
		e.t.Fatal(err)
	}
	root, file := cg.Paths[ctl], v1File
	if root == "" {
		root, file = filepath.Dir(cg.Paths[cgroups.Unified]), v2File
	}
	var found string
	filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err == nil && d.IsDir() && d.Name() == "app-"+id {
			found = p
			return filepath.SkipAll
		}
		return nil
	})
	if found == "" {
		e.t.Fatalf("no cgroup app-%s beneath %s", id, root)
	}
	b, err := os.ReadFile(filepath.Join(found, file))
	if err != nil {
		e.t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}

// checkOwnLimit: container id reads the memory limit want, its cgroup's
// after an update, in its own view of its cgroups (/sys/fs/cgroup).
func checkOwnLimit(t *testing.T, e *env, id, want string) {
	t.Helper()
	got := strings.TrimSpace(e.execOK(id, "sh", "-c", "cat /sys/fs/cgroup/memory/memory.limit_in_bytes /sys/fs/cgroup/memory.max 2>/dev/null; true"))
	if got != want {
		t.Errorf("the container reads its memory limit %q at /sys/fs/cgroup, its cgroup's is %q", got, want)
	}
}

// TestResizeInPlace: UpdateContainerResources changes a running
// container's memory and CPU limits in its cgroup on the host, ContainerStatus
// reads them back, and what cannot be honoured is refused.
func TestResizeInPlace(t *testing.T) {
	forEachStage1(t, func(t *testing.T, e *env, s podStage1) {
		id := checkResize(t, e, s, false, e.appMemoryLimit)
		checkOwnLimit(t, e, id, e.appMemoryLimit(id))
		// A cpuset: the last CPU alone, in the app's cgroup and in what
		// the kernel lets a process of the container run on.
		last := strconv.Itoa(runtime.NumCPU() - 1)
		if _, err := e.rt().UpdateContainerResources(e.ctx(), &runtimeapi.UpdateContainerResourcesRequest{ContainerId: id,
			Linux: &runtimeapi.LinuxContainerResources{CpusetCpus: last, CpusetMems: "0"}}); err != nil {
			t.Fatal(err)
		}
		if got := e.appCgroupFile(id, "cpuset", "cpuset.cpus", "cpuset.cpus"); got != last {
			t.Errorf("cpuset.cpus after the update: %q, want %s", got, last)
		}
		if out := e.execOK(id, "grep", "Cpus_allowed_list", "/proc/self/status"); !strings.HasSuffix(strings.TrimSpace(out), "\t"+last) {
			t.Errorf("an exec in the container may run on %q, want CPU %s alone", out, last)
		}
		if got := e.containerStatus(id).GetResources().GetLinux().GetCpusetCpus(); got != last {
			t.Errorf("ContainerStatus cpuset_cpus: %q, want %s", got, last)
		}
		_, err := e.rt().UpdateContainerResources(e.ctx(), &runtimeapi.UpdateContainerResourcesRequest{ContainerId: id,
			Linux: &runtimeapi.LinuxContainerResources{CpusetCpus: "0-"}})
		requireCode(t, err, codes.InvalidArgument, "UpdateContainerResources with a bad cpuset")
		stopAndCheckExited(t, e, id)
	})
}

// TestResizeInPlaceKVM: the same in a VM, where the limits change in the
// guest's cgroup. A privileged container reads its limit there through
// the root of the guest's PID 1, the agent, which mounts the guest's
// cgroup hierarchies.
func TestResizeInPlaceKVM(t *testing.T) {
	e := newKVMEnv(t)
	id := checkResize(t, e, kvmStage1, true, func(id string) string {
		return strings.TrimSpace(e.execOK(id, "cat", "/proc/1/root/sys/fs/cgroup/memory/pod/app-"+id+"/memory.limit_in_bytes"))
	})
	checkOwnLimit(t, e, id, strings.TrimSpace(e.execOK(id, "cat", "/proc/1/root/sys/fs/cgroup/memory/pod/app-"+id+"/memory.limit_in_bytes")))
	// A cpuset names host CPUs, which a guest does not see: refused.
	_, err := e.rt().UpdateContainerResources(e.ctx(), &runtimeapi.UpdateContainerResourcesRequest{ContainerId: id,
		Linux: &runtimeapi.LinuxContainerResources{CpusetCpus: "0"}})
	requireCode(t, err, codes.InvalidArgument, "UpdateContainerResources with a cpuset in a VM")
	stopAndCheckExited(t, e, id)
}

// checkResize resizes a container of a pod on s, reading its memory limit
// where the stage1 puts its cgroup with memoryLimit, and returns the
// container, still running.
func checkResize(t *testing.T, e *env, s podStage1, privileged bool, memoryLimit func(id string) string) string {
	cfg := e.netPodConfig("resize", s)
	cfg.Linux.SecurityContext.Privileged = privileged
	podID := e.runStage1Pod(cfg, s)
	ctr := e.netContainer(s, "c", "sleep", "1000")
	ctr.Linux.SecurityContext.Privileged = privileged
	ctr.Linux.Resources = &runtimeapi.LinuxContainerResources{MemoryLimitInBytes: 64 << 20, CpuShares: 512, CpuPeriod: 100000, CpuQuota: 50000}
	id := e.createAndStart(podID, cfg, ctr)
	if got := memoryLimit(id); got != strconv.Itoa(64<<20) {
		t.Fatalf("memory limit before the resize: %s", got)
	}
	want := &runtimeapi.LinuxContainerResources{MemoryLimitInBytes: 128 << 20, CpuShares: 1024, CpuPeriod: 100000, CpuQuota: 150000}
	if _, err := e.rt().UpdateContainerResources(e.ctx(), &runtimeapi.UpdateContainerResourcesRequest{ContainerId: id, Linux: want}); err != nil {
		t.Fatal(err)
	}
	if got := memoryLimit(id); got != strconv.Itoa(128<<20) {
		t.Errorf("memory limit after the resize: %s, want %d", got, 128<<20)
	}
	got := e.containerStatus(id).GetResources().GetLinux()
	if got.GetMemoryLimitInBytes() != want.MemoryLimitInBytes || got.GetCpuQuota() != want.CpuQuota || got.GetCpuShares() != want.CpuShares {
		t.Errorf("ContainerStatus resources after the resize: %v", got)
	}
	_, err := e.rt().UpdateContainerResources(e.ctx(), &runtimeapi.UpdateContainerResourcesRequest{ContainerId: id,
		Linux: &runtimeapi.LinuxContainerResources{MemoryLimitInBytes: 256 << 20, HugepageLimits: []*runtimeapi.HugepageLimit{{PageSize: "2MB", Limit: 1 << 21}}}})
	requireCode(t, err, codes.InvalidArgument, "UpdateContainerResources with a hugepage limit")
	if got := memoryLimit(id); got != strconv.Itoa(128<<20) {
		t.Errorf("a refused update changed the memory limit to %s", got)
	}
	return id
}

// stopAndCheckExited stops container id: its limits then cannot change.
func stopAndCheckExited(t *testing.T, e *env, id string) {
	if _, err := e.rt().StopContainer(e.ctx(), &runtimeapi.StopContainerRequest{ContainerId: id}); err != nil {
		t.Fatal(err)
	}
	_, err := e.rt().UpdateContainerResources(e.ctx(), &runtimeapi.UpdateContainerResourcesRequest{ContainerId: id,
		Linux: &runtimeapi.LinuxContainerResources{MemoryLimitInBytes: 128 << 20}})
	requireCode(t, err, codes.FailedPrecondition, "UpdateContainerResources of an exited container")
}
