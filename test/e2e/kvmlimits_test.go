package e2e

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/cgroups"
	"github.com/stagelet/stagelet/test/e2e/harness"
)

// kubeletPodCgroup makes a cgroup beneath the daemon's cgroup parent
// whose memory is limited to limit bytes, as the kubelet limits a pod's
// cgroup (pod<uid>: its containers' limits plus its RuntimeClass
// overhead), and returns its path as a pod's cgroup parent and its
// directory in the memory hierarchy. It is removed at cleanup, after the
// pods made later (their cleanups run first). Cgroup v1 only: it skips
// elsewhere.
func kubeletPodCgroup(t *testing.T, e *env, name string, limit int64) (parent, memDir string) {
	t.Helper()
	self, err := cgroups.Self()
	if err != nil {
		t.Skipf("no cgroups: %v", err)
	}
	mem, ok := self.Paths["memory"]
	if !ok {
		t.Skip("no cgroup v1 memory hierarchy")
	}
	parent = filepath.Join(e.d.CgroupParent, name)
	memDir = filepath.Join(mem, parent)
	if err := os.MkdirAll(memDir, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// The daemon made the parent in the other hierarchies.
		for _, h := range self.Paths {
			if err := unix.Rmdir(filepath.Join(h, parent)); err != nil && !errors.Is(err, unix.ENOENT) {
				t.Errorf("rmdir %s: %v", filepath.Join(h, parent), err)
			}
		}
	})
	if err := os.WriteFile(filepath.Join(memDir, "memory.limit_in_bytes"), []byte(strconv.FormatInt(limit, 10)), 0); err != nil {
		t.Fatal(err)
	}
	return parent, memDir
}

// qemuMemoryCgroup is the memory cgroup directory of a kvm pod's qemu,
// from its PID in the pod's verbose status.
func qemuMemoryCgroup(t *testing.T, info map[string]string) string {
	t.Helper()
	pid, err := strconv.Atoi(info["stage1.qemuPID"])
	if err != nil {
		t.Fatalf("no qemu PID in the pod's verbose info: %v", info)
	}
	cg, err := cgroups.OfProcess(pid)
	if err != nil {
		t.Fatal(err)
	}
	return cg.Paths["memory"]
}

// TestKVMPodLimitsWithoutOverhead: a kvm pod whose containers have memory
// limits and whose RuntimeClass gives no overhead (a pod the kubelet
// gives a cgroup of 64 MiB) runs: its VM is sized from its limits (64
// MiB and the guest's own 128), qemu runs in the overhead cgroup, capped
// at the VM and qemu's own memory, and nothing of the pod's is charged to
// the kubelet's cgroup. The containers' limits hold in the guest: a
// container past its limit is OOM-killed there while the VM and the
// other container live on.
func TestKVMPodLimitsWithoutOverhead(t *testing.T) {
	e := newKVMEnv(t)
	status, err := e.rt().Status(e.ctx(), &runtimeapi.StatusRequest{Verbose: true})
	if err != nil {
		t.Fatal(err)
	}
	if status.Info["kvm.placement"] != "auto" || !strings.HasPrefix(status.Info["kvm.overheadCgroup"], e.d.OverheadCgroup) {
		t.Errorf("Status does not say the node's placement and overhead cgroup: %q, %q", status.Info["kvm.placement"], status.Info["kvm.overheadCgroup"])
	}
	const limit = 64 << 20
	parent, memDir := kubeletPodCgroup(t, e, "kvm-limited", limit)
	cfg := e.netPodConfig("limited", kvmStage1)
	cfg.Linux.CgroupParent = parent
	cfg.Linux.Resources = &runtimeapi.LinuxContainerResources{MemoryLimitInBytes: limit, CpuQuota: 20000, CpuPeriod: 100000, CpuShares: 204}
	podID := e.runStage1Pod(cfg, kvmStage1)

	resp, err := e.rt().PodSandboxStatus(e.ctx(), &runtimeapi.PodSandboxStatusRequest{PodSandboxId: podID, Verbose: true})
	if err != nil {
		t.Fatal(err)
	}
	info := resp.Info
	if info["stage1.placement"] != "overhead" || info["stage1.memoryMiB"] != "192" || info["stage1.vcpus"] != "1" {
		t.Fatalf("placement %q, VM %s MiB %s vCPUs; want overhead, 192 MiB (64 + the guest's 128), 1 vCPU", info["stage1.placement"], info["stage1.memoryMiB"], info["stage1.vcpus"])
	}
	want := filepath.Join(filepath.Dir(filepath.Dir(memDir)), e.d.OverheadCgroup, "stagelet-pod-"+podID)
	qemuMem := qemuMemoryCgroup(t, info)
	if qemuMem != want {
		t.Errorf("qemu's memory cgroup %s, want %s (in the overhead cgroup)", qemuMem, want)
	}
	capMiB, _ := strconv.Atoi(info["stage1.qemuMemoryCapMiB"])
	if b, err := os.ReadFile(filepath.Join(qemuMem, "memory.limit_in_bytes")); err != nil || strings.TrimSpace(string(b)) != strconv.Itoa(capMiB<<20) || capMiB < 192+32 {
		t.Errorf("qemu's cgroup's cap %q (%v), want the VM and qemu's own: %d MiB", b, err, capMiB)
	}
	if _, err := os.Stat(filepath.Join(memDir, "stagelet-pod-"+podID)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a cgroup of the pod's in the kubelet's pod cgroup: %v", err)
	}
	if procs := readProcs(t, memDir); len(procs) != 0 {
		t.Errorf("processes in the kubelet's pod cgroup: %v", procs)
	}

	web := e.createAndStart(podID, cfg, e.netContainer(kvmStage1, "web", "sleep", "3600"))
	e.waitContainerState(web, running, stateTimeout)
	var totalKiB int
	mi := e.execOK(web, "grep", "MemTotal:", "/proc/meminfo")
	if _, err := fmt.Sscanf(mi, "MemTotal: %d kB", &totalKiB); err != nil || totalKiB > 192<<10 || totalKiB < 150<<10 {
		t.Errorf("the guest's memory: %q, want 192 MiB less what its kernel keeps", mi)
	}
	hogCfg := e.netContainer(kvmStage1, "hog", "sh", "-c", "sleep 1 && dd if=/dev/zero of=/dev/null bs=64M")
	hogCfg.Linux.Resources = &runtimeapi.LinuxContainerResources{MemoryLimitInBytes: 32 << 20}
	hog := e.createAndStart(podID, cfg, hogCfg)
	st := e.waitContainerState(hog, exited, 2*time.Minute)
	if st.ExitCode != 137 || st.Reason != "OOMKilled" {
		t.Errorf("dd past its 32 MiB limit in the guest: exit code %d reason %q message %q, want 137 OOMKilled", st.ExitCode, st.Reason, st.Message)
	}
	e.waitContainerState(web, running, stateTimeout)
	if out := e.execOK(web, "echo", "alive"); out != "alive\n" {
		t.Errorf("exec beside the OOM-killed container: %q", out)
	}
	if after := e.podStatus(podID); after.State != runtimeapi.PodSandboxState_SANDBOX_READY {
		t.Errorf("the pod after its container's OOM kill: %v", after.State)
	}
	if procs := readProcs(t, qemuMem); len(procs) == 0 {
		t.Errorf("qemu left its cgroup %s after the guest's OOM kill", qemuMem)
	}
}

// TestKVMPlacementPod: with kvm.placement pod, everything of a kvm pod
// stays in the pod's cgroup. A pod whose cgroup cannot hold its VM is
// refused at RunPodSandbox with FailedPrecondition naming the rule that
// chose kvm and the RuntimeClass overhead it lacks, and nothing of it is
// left; with that overhead it runs, qemu in the pod's cgroup.
func TestKVMPlacementPod(t *testing.T) {
	e := newKVMEnvOpts(t, harness.Options{KVMPlacement: "pod", Policy: allStage1sPolicy + `rules:
  - name: tenant-vms
    match: {namespaces: [tenant-a]}
    stage1: kvm
`})
	const limit = 64 << 20
	parent, _ := kubeletPodCgroup(t, e, "no-overhead", limit)
	cfg := e.netPodConfig("strict", kvmStage1)
	cfg.Metadata.Namespace = "tenant-a"
	cfg.Linux.CgroupParent = parent
	cfg.Linux.Resources = &runtimeapi.LinuxContainerResources{MemoryLimitInBytes: limit}
	_, err := e.rt().RunPodSandbox(e.ctx(), &runtimeapi.RunPodSandboxRequest{Config: cfg})
	requireCode(t, err, codes.FailedPrecondition, "RunPodSandbox of a 64 MiB pod without overhead, placement pod")
	for _, s := range []string{`stage1 kvm (chosen by rule "tenant-vms")`, "overhead.podFixed.memory of at least", "kvm.placement is pod"} {
		if !strings.Contains(err.Error(), s) {
			t.Errorf("the refusal does not say %q: %v", s, err)
		}
	}
	pods, err := e.rt().ListPodSandbox(e.ctx(), &runtimeapi.ListPodSandboxRequest{})
	if err != nil || len(pods.Items) != 0 {
		t.Errorf("pods after the refusal: %v (%v)", pods.GetItems(), err)
	}
	for _, dir := range []string{filepath.Join(e.d.RunDir, "pods"), filepath.Join(e.d.StateDir, "pods")} {
		if ents, err := os.ReadDir(dir); err == nil && len(ents) > 0 {
			t.Errorf("%s after the refusal: %d entries", dir, len(ents))
		}
	}

	const overhead = 256 << 20
	withOverhead, memDir := kubeletPodCgroup(t, e, "with-overhead", limit+overhead)
	cfg.Linux.CgroupParent = withOverhead
	cfg.Linux.Overhead = &runtimeapi.LinuxContainerResources{MemoryLimitInBytes: overhead}
	podID := e.runPodHandler(cfg, "")
	resp, err := e.rt().PodSandboxStatus(e.ctx(), &runtimeapi.PodSandboxStatusRequest{PodSandboxId: podID, Verbose: true})
	if err != nil {
		t.Fatal(err)
	}
	if resp.Info["stage1.placement"] != "pod" {
		t.Errorf("placement %q, want pod", resp.Info["stage1.placement"])
	}
	if got, want := qemuMemoryCgroup(t, resp.Info), filepath.Join(memDir, "stagelet-pod-"+podID); got != want {
		t.Errorf("qemu's memory cgroup %s, want the pod's %s", got, want)
	}
}
