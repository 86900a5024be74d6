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

	"github.com/stagelet/stagelet/internal/testutil"
	"github.com/stagelet/stagelet/preflight"
	"github.com/stagelet/stagelet/test/e2e/harness"
)

// allStage1sPolicy lets a pod choose any stage1 by runtime handler.
const allStage1sPolicy = "version: 1\ndefault_stage1: nspawn\nhandlers:\n  fly: {stage1: fly}\n  nspawn: {stage1: nspawn}\n  kvm: {stage1: kvm}\n"

// kvmStage1 is a pod in a VM: its own network, PID and IPC namespaces.
var kvmStage1 = podStage1{"kvm", runtimeapi.NamespaceMode_POD, runtimeapi.NamespaceMode_POD}

// newKVMEnv starts a daemon that offers kvm, or skips when no guest assets
// were built (make guest, which `make test` runs, sets
// STAGELET_GUEST_ASSETS).
func newKVMEnv(t *testing.T) *env {
	t.Helper()
	return newKVMEnvOpts(t, harness.Options{Policy: allStage1sPolicy})
}

// newKVMEnvOpts is newKVMEnv with the daemon's options.
func newKVMEnvOpts(t *testing.T, opts harness.Options) *env {
	t.Helper()
	requireRoot(t)
	if os.Getenv("STAGELET_GUEST_ASSETS") == "" {
		t.Skip("no kvm guest assets: run through `make test` or `make e2e`, or set STAGELET_GUEST_ASSETS (make guest)")
	}
	e := newEnvOpts(t, opts, true)
	resp, err := e.rt().Status(e.ctx(), &runtimeapi.StatusRequest{Verbose: true})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(","+resp.Info["handlers"]+",", ",kvm,") {
		t.Fatalf("the daemon does not offer kvm (handlers %q, kvm info %q)", resp.Info["handlers"], resp.Info["kvm.error"])
	}
	if a := resp.Info["kvm.accelerator"]; a != "kvm" && a != "tcg" {
		t.Fatalf("Status does not say which accelerator kvm uses: %v", resp.Info)
	}
	t.Logf("kvm accelerator: %s, guest kernel %s", resp.Info["kvm.accelerator"], resp.Info["kvm.guestKernel"])
	return e
}

// TestKVMPodBesideNspawnPod: a kvm pod runs its own kernel while an nspawn
// pod on the same daemon runs the host's; exec and logs work in the VM.
func TestKVMPodBesideNspawnPod(t *testing.T) {
	e := newKVMEnv(t)
	var uts unix.Utsname
	if err := unix.Uname(&uts); err != nil {
		t.Fatal(err)
	}
	host := unix.ByteSliceToString(uts.Release[:])

	vmCfg := e.netPodConfig("vm", kvmStage1)
	vmPod := e.runStage1Pod(vmCfg, kvmStage1)
	app := e.netContainer(kvmStage1, "app", "sh", "-c", "echo hello from the vm; echo to stderr >&2; exec sleep 1000")
	// An image volume reaches the guest through the pod's share.
	app.Mounts = []*runtimeapi.Mount{
		{ContainerPath: "/image", Image: &runtimeapi.ImageSpec{Image: e.image}},
		{ContainerPath: "/image-bin", Image: &runtimeapi.ImageSpec{Image: e.image}, ImageSubPath: "bin"},
	}
	vmCtr := e.createAndStart(vmPod, vmCfg, app)

	// A host device node means nothing to the guest's kernel.
	withDevice := e.netContainer(kvmStage1, "device", "sleep", "1000")
	withDevice.Devices = []*runtimeapi.Device{{HostPath: "/dev/null", ContainerPath: "/dev/given", Permissions: "rw"}}
	_, err := e.rt().CreateContainer(e.ctx(), &runtimeapi.CreateContainerRequest{PodSandboxId: vmPod, Config: withDevice, SandboxConfig: vmCfg})
	requireCode(t, err, codes.InvalidArgument, "CreateContainer with a host device in a VM pod")
	if !strings.Contains(err.Error(), "config.devices") {
		t.Errorf("the refusal does not name config.devices: %v", err)
	}
	// A VFIO group is passed through, where the host has it (this one
	// has no IOMMU).
	withDevice.Devices = []*runtimeapi.Device{{HostPath: "/dev/vfio/4242", ContainerPath: "/dev/vfio/4242", Permissions: "rw"}}
	_, err = e.rt().CreateContainer(e.ctx(), &runtimeapi.CreateContainerRequest{PodSandboxId: vmPod, Config: withDevice, SandboxConfig: vmCfg})
	requireCode(t, err, codes.InvalidArgument, "CreateContainer with a VFIO group the host does not have")
	if !strings.Contains(err.Error(), "VFIO group 4242") {
		t.Errorf("the refusal does not name the VFIO group: %v", err)
	}

	nsCfg := e.netPodConfig("ns", nspawnStage1)
	nsPod := e.runStage1Pod(nsCfg, nspawnStage1)
	nsCtr := e.createAndStart(nsPod, nsCfg, e.netContainer(nspawnStage1, "app", "sleep", "1000"))

	checkImageVolume(t, e, vmCtr)
	checkGuestWritableLayer(t, e, vmCtr)
	checkCheckpointRefused(t, e, vmCtr, nsCtr)
	vmKernel := strings.TrimSpace(e.execOK(vmCtr, "uname", "-r"))
	nsKernel := strings.TrimSpace(e.execOK(nsCtr, "uname", "-r"))
	if nsKernel != host {
		t.Errorf("nspawn pod kernel %q, want the host's %q", nsKernel, host)
	}
	if want := guestKernel(); vmKernel == host || vmKernel != want {
		t.Errorf("kvm pod kernel %q: want the guest's Debian kernel %q, not the host's %q", vmKernel, want, host)
	}
	resp, err := e.rt().PodSandboxStatus(e.ctx(), &runtimeapi.PodSandboxStatusRequest{PodSandboxId: vmPod, Verbose: true})
	if err != nil {
		t.Fatal(err)
	}
	if resp.Info["agent.kernel"] != vmKernel || resp.Info["stage1.accelerator"] == "" {
		t.Errorf("verbose pod info: kernel %q accelerator %q", resp.Info["agent.kernel"], resp.Info["stage1.accelerator"])
	}
	// The VM's container logs reach the kubelet's path on the host.
	path := logPath(vmCfg, e.netContainer(kvmStage1, "app"))
	testutil.WaitFor(t, 30*time.Second, "the VM's log lines", func() (bool, string) {
		text := e.logText(path)
		return strings.Contains(text, "stdout F hello from the vm") && strings.Contains(text, "stderr F to stderr"), text
	})
	// Exit codes come back from the guest too.
	code := e.execSync(vmCtr, "sh", "-c", "exit 7")
	if code.ExitCode != 7 {
		t.Errorf("exec exit code %d, want 7", code.ExitCode)
	}
}

// checkGuestWritableLayer: what a VM pod's container writes into its
// rootfs stays in the guest, in a layer that ContainerStats counts, and
// never reaches the host's writable layer.
func checkGuestWritableLayer(t *testing.T, e *env, ctr string) {
	t.Helper()
	e.execOK(ctr, "dd", "if=/dev/zero", "of=/written", "bs=1k", "count=256")
	e.execOK(ctr, "rm", "/bin/true")
	if r := e.execSync(ctr, "test", "-e", "/bin/true"); r.ExitCode == 0 {
		t.Error("a removed file of the image still shows in the container")
	}
	resp, err := e.rt().ContainerStats(e.ctx(), &runtimeapi.ContainerStatsRequest{ContainerId: ctr})
	if err != nil {
		t.Fatal(err)
	}
	wl := resp.GetStats().GetWritableLayer()
	if wl.GetUsedBytes().GetValue() < 256<<10 || wl.GetInodesUsed().GetValue() < 2 {
		t.Errorf("writable layer after writing 256 KiB: %d bytes, %d inodes", wl.GetUsedBytes().GetValue(), wl.GetInodesUsed().GetValue())
	}
	upper := filepath.Join(wl.GetFsId().GetMountpoint(), "upper")
	if _, err := os.Stat(upper); err != nil {
		t.Fatalf("the host's writable layer: %v", err)
	}
	for _, p := range []string{"written", "bin/true"} {
		if _, err := os.Lstat(filepath.Join(upper, p)); !os.IsNotExist(err) {
			t.Errorf("the host's writable layer holds /%s (%v): the container's writes reached the host", p, err)
		}
	}
}

// TestKVMPodsReachEachOther: two VM pods get addresses from CNI and talk over
// the bridge, as pods of any other stage1 do; a pod's network sysctls are
// its VM's.
func TestKVMPodsReachEachOther(t *testing.T) {
	e := newKVMEnv(t)
	aCfg := e.netPodConfig("vm-a", kvmStage1)
	a := e.runStage1Pod(aCfg, kvmStage1)
	e.createAndStart(a, aCfg, e.netContainer(kvmStage1, "web", httpServer("served-from-vm-a")...))
	bCfg := e.netPodConfig("vm-b", kvmStage1)
	bCfg.Linux.Sysctls = guestSysctls
	b := e.runStage1Pod(bCfg, kvmStage1)
	bCtr := e.createAndStart(b, bCfg, e.netContainer(kvmStage1, "client", "sleep", "1000"))
	checkGuestSysctls(t, e, bCtr)

	ipA, ipB := e.podIP(a), e.podIP(b)
	if ipA == ipB {
		t.Fatalf("both VMs have %s", ipA)
	}
	if got := strings.TrimSpace(e.execOK(bCtr, "ip", "-4", "-o", "addr", "show", "eth0")); !strings.Contains(got, ipB.String()+"/") {
		t.Errorf("VM b's eth0: %q, want %s", got, ipB)
	}
	url := fmt.Sprintf("http://%s:8080/", ipA)
	testutil.WaitFor(t, 60*time.Second, "VM b reaching VM a", func() (bool, string) {
		r := e.execSync(bCtr, wget(url)...)
		return r.ExitCode == 0 && strings.TrimSpace(string(r.Stdout)) == "served-from-vm-a", string(r.Stdout) + string(r.Stderr)
	})
	// And the host reaches the VM's server on the bridge.
	e.waitHTTP(url, "served-from-vm-a\n")
}

// guestSysctls are network sysctls a kvm pod asks for, one with a space
// in its value.
var guestSysctls = map[string]string{"net.ipv4.ip_local_port_range": "20000 21000", "net.core.somaxconn": "1000"}

// checkGuestSysctls: the pod's network sysctls are set in its VM, whose
// network stack is the pod's, as its container sees them.
func checkGuestSysctls(t *testing.T, e *env, ctr string) {
	t.Helper()
	for k, want := range guestSysctls {
		got := strings.Join(strings.Fields(e.execOK(ctr, "cat", "/proc/sys/"+strings.ReplaceAll(k, ".", "/"))), " ")
		if got != want {
			t.Errorf("sysctl %s in the VM = %q, want %q", k, got, want)
		}
	}
}

// guestKernel is the kernel version in the guest assets' manifest.
func guestKernel() string {
	b, _ := os.ReadFile(filepath.Join(os.Getenv("STAGELET_GUEST_ASSETS"), "manifest"))
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "kernel "); ok {
			return strings.TrimSpace(v)
		}
	}
	return "(no manifest in $STAGELET_GUEST_ASSETS)"
}

// TestKVMProbeDiesWithDaemon: the VM the daemon boots at start to learn
// whether KVM works dies with the daemon, even one killed with SIGKILL
// mid-probe: on a host where a guest hangs under KVM it would otherwise
// stay, paused, holding its memory, for every daemon start.
func TestKVMProbeDiesWithDaemon(t *testing.T) {
	requireRoot(t)
	if os.Getenv("STAGELET_GUEST_ASSETS") == "" {
		t.Skip("no kvm guest assets: run through `make test` or `make e2e`, or set STAGELET_GUEST_ASSETS (make guest)")
	}
	e := newEnvOpts(t, harness.Options{Policy: allStage1sPolicy}, false)
	daemon := e.d.PID()
	var probe int
	testutil.WaitFor(t, 30*time.Second, "the daemon's KVM probe", func() (bool, string) {
		probe = childWith(daemon, "stagelet.probe=1")
		return probe != 0 || strings.Contains(e.d.LogTail(50), "kvm: a guest boots under KVM") ||
			strings.Contains(e.d.LogTail(50), "kvm: a guest does not boot under KVM"), "no probe VM yet"
	})
	if probe == 0 {
		// KVM works, or qemu failed under it at once (this machine's
		// /dev/kvm, at times).
		t.Skip("the probe ended before it could be seen")
	}
	if err := e.d.Kill9(t.Context()); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 10*time.Second, "the probe's exit", func() (bool, string) {
		_, err := os.Stat(fmt.Sprintf("/proc/%d", probe))
		return os.IsNotExist(err), fmt.Sprintf("qemu %d still runs", probe)
	})
}

// childWith is a child of ppid whose command line contains s, 0 if none.
func childWith(ppid int, s string) int {
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		st, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			continue
		}
		f := strings.Fields(string(st[strings.LastIndexByte(string(st), ')')+1:]))
		if len(f) < 2 || f[1] != strconv.Itoa(ppid) {
			continue
		}
		if cmd, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid)); strings.Contains(string(cmd), s) {
			return pid
		}
	}
	return 0
}

// checkCheckpointRefused: checkpoints say why they cannot be done here.
// A VM pod cannot be saved while its guest has the 9p share mounted; an
// nspawn container, or a pod to restore, needs a CRIU that works on this
// kernel (where one does, TestCheckpointRestore and
// TestPodMovesBetweenDaemons show them work).
func checkCheckpointRefused(t *testing.T, e *env, vmCtr, nsCtr string) {
	t.Helper()
	archive := filepath.Join(t.TempDir(), "checkpoint.tar")
	_, err := e.rt().CheckpointContainer(e.ctx(), &runtimeapi.CheckpointContainerRequest{ContainerId: vmCtr, Location: archive})
	requireCode(t, err, codes.FailedPrecondition, "CheckpointContainer in a VM pod")
	if !strings.Contains(err.Error(), "over the VM's 9p share") {
		t.Errorf("the refusal does not say why: %v", err)
	}
	if _, _, _, err := preflight.FindCRIU(e.ctx(), ""); err == nil {
		t.Log("criu works on this kernel: TestCheckpointRestore shows nspawn checkpoints")
		return
	}
	_, err = e.rt().CheckpointContainer(e.ctx(), &runtimeapi.CheckpointContainerRequest{ContainerId: nsCtr, Location: archive})
	requireCode(t, err, codes.FailedPrecondition, "CheckpointContainer in an nspawn pod, CRIU not working")
	if !strings.Contains(err.Error(), "CRIU") {
		t.Errorf("the refusal does not name CRIU: %v", err)
	}
	_, err = e.rt().RestorePod(e.ctx(), &runtimeapi.RestorePodRequest{
		CheckpointPath:   t.TempDir(),
		Config:           &runtimeapi.PodSandboxConfig{Metadata: &runtimeapi.PodSandboxMetadata{Name: "restored", Namespace: "default", Uid: "restored-1"}},
		ContainerConfigs: []*runtimeapi.ContainerConfig{{Metadata: &runtimeapi.ContainerMetadata{Name: "c"}, Image: &runtimeapi.ImageSpec{Image: "busybox"}}},
	})
	requireCode(t, err, codes.FailedPrecondition, "RestorePod, CRIU not working")
	if !strings.Contains(err.Error(), "CRIU") {
		t.Errorf("the refusal does not name CRIU: %v", err)
	}
	if _, err := os.Lstat(archive); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a refused checkpoint left %s: %v", archive, err)
	}
}
