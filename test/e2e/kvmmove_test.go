package e2e

import (
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/encoding/protojson"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/internal/testutil"
	"github.com/stagelet/stagelet/test/e2e/harness"
)

// tokenCounterCmd draws a random token and notes it with its PID, then
// counts as testutil.CounterCmd does.
const tokenCounterCmd = `echo $$ $(head -c 8 /dev/urandom | od -An -tx1 | tr -d ' \n') > /tmp/token; ` + testutil.CounterCmd

// TestKVMPodMoves: a kvm pod's counter moves through the kubelet's own
// flow: CheckpointContainer saves its whole VM and the pod runs on; a
// container created in a new pod from the archive takes the saved VM:
// the counter keeps its PID, its token and its count, and the moved
// guest has the new pod's address. That pod, which asks to move live,
// moves on to a second daemon from the command line: its checkpoint is a
// ticket, and its VM streams to the other daemon, which runs it once the
// source stopped it for good. A pod with a hostPath volume is refused, naming the
// volume, and a pod of two containers.
func TestKVMPodMoves(t *testing.T) {
	e := newKVMEnvOpts(t, harness.Options{Policy: allStage1sPolicy, LiveAddress: "127.0.0.1"})
	s := kvmStage1
	cfgA := e.netPodConfig("vm-from", s)
	podA := e.runStage1Pod(cfgA, s)
	idA := e.createAndStart(podA, cfgA, e.netContainer(s, "counter", "sh", "-c", tokenCounterCmd))
	count := testutil.Counting(t, e.rt(), idA)
	token := strings.TrimSpace(e.execOK(idA, "cat", "/tmp/token"))

	archive := filepath.Join(t.TempDir(), "vm.tar")
	before := count()
	start := time.Now()
	if _, err := e.rt().CheckpointContainer(e.ctx(), &runtimeapi.CheckpointContainerRequest{ContainerId: idA, Location: archive, Timeout: 300}); err != nil {
		t.Fatalf("CheckpointContainer of a kvm pod's container: %v", err)
	}
	saved := time.Since(start)
	fi, err := os.Stat(archive)
	if err != nil {
		t.Fatal(err)
	}
	n0 := count()
	testutil.WaitFor(t, time.Minute, "the saved pod's counter counts on", func() (bool, string) {
		n := count()
		return n > n0, strconv.Itoa(n)
	})
	// The move: the source stops, the target takes the saved VM.
	if _, err := e.rt().StopPodSandbox(e.ctx(), &runtimeapi.StopPodSandboxRequest{PodSandboxId: podA}); err != nil {
		t.Fatal(err)
	}

	cfgB := e.netPodConfig("vm-to", s)
	// This one moves on live.
	if cfgB.Annotations == nil {
		cfgB.Annotations = map[string]string{}
	}
	cfgB.Annotations["stagelet.io/checkpoint"] = "live"
	podB := e.runStage1Pod(cfgB, s)
	idB := e.createContainer(podB, cfgB, &runtimeapi.ContainerConfig{
		Metadata: &runtimeapi.ContainerMetadata{Name: "counter"},
		Image:    &runtimeapi.ImageSpec{Image: archive},
		LogPath:  "counter.log",
	})
	start = time.Now()
	e.startContainer(idB)
	restored := time.Since(start)
	t.Logf("kvm pod moved: CheckpointContainer %v (archive %d bytes), StartContainer from it %v",
		saved.Round(time.Millisecond), fi.Size(), restored.Round(time.Millisecond))
	// The daemon's figures: the bytes, the guest's pause for the last
	// round and the load on the target.
	for _, l := range strings.Split(e.d.LogTail(2000), "\n") {
		if strings.Contains(l, "with its whole pod") || strings.Contains(l, "VM saved") {
			t.Log(l)
		}
	}
	if got := strings.TrimSpace(e.execOK(idB, "cat", "/tmp/token")); got != token {
		t.Errorf("the moved counter's PID and token: %q, want %q", got, token)
	}
	if n := testutil.Counting(t, e.rt(), idB)(); n < before {
		t.Errorf("the moved counter is at %d, before its count at the checkpoint (%d)", n, before)
	}
	first := testutil.CountsOn(t, filepath.Join(cfgB.LogDirectory, "counter.log"))
	t.Logf("the moved counter logs on from %d (checkpointed at %d or after)", first, before)
	ipB := e.podStatus(podB).GetNetwork().GetIp()
	if out := e.execOK(idB, "ip", "-4", "-o", "addr", "show", "dev", "eth0"); ipB == "" || !strings.Contains(out, " "+ipB+"/") {
		t.Errorf("the moved guest's eth0: %q, want the new pod's %s", out, ipB)
	}
	testutil.WaitFor(t, 30*time.Second, "the moved guest answers on "+ipB, func() (bool, string) {
		c, err := net.DialTimeout("tcp", net.JoinHostPort(ipB, "1"), 2*time.Second)
		if err == nil {
			c.Close()
			return true, ""
		}
		return strings.Contains(err.Error(), "connection refused"), err.Error()
	})

	// Live, between two daemons, from the command line: the pod asks
	// for it (stagelet.io/checkpoint: live), so its checkpoint holds a
	// ticket to this daemon, not the VM, and the pod runs on. The other
	// daemon, which pulled the image (its disk, made there, holds the
	// same bytes), takes the ticket and the VM streams to it.
	to := &env{t: t, reg: e.reg, image: e.image, d: startDaemonOpts(t, e.reg, harness.Options{Policy: allStage1sPolicy})}
	to.pull(e.image)
	offer := func(name string) string {
		dir := filepath.Join(t.TempDir(), name)
		if out, err := exec.Command(stageletBin, "checkpoint", "pod", "-socket", e.d.Socket, podB, dir).CombinedOutput(); err != nil {
			t.Fatalf("stagelet checkpoint pod: %v\n%s", err, out)
		}
		if _, err := os.Stat(filepath.Join(dir, "container-counter.tar")); err != nil {
			t.Fatal(err)
		}
		copied := filepath.Join(t.TempDir(), name+"-copied")
		if out, err := exec.Command("cp", "-a", dir, copied).CombinedOutput(); err != nil {
			t.Fatalf("cp: %v\n%s", err, out)
		}
		return copied
	}
	podFile := func(cfg *runtimeapi.PodSandboxConfig) string {
		b, err := protojson.Marshal(cfg)
		if err != nil {
			t.Fatal(err)
		}
		f := filepath.Join(t.TempDir(), cfg.Metadata.Name+".json")
		if err := os.WriteFile(f, b, 0o600); err != nil {
			t.Fatal(err)
		}
		return f
	}

	// A target that cannot take the VM (its own is of another size)
	// refuses it before anything changed: the source runs on.
	refusedDir := offer("refused")
	cfgBig := to.netPodConfig("vm-big", s)
	cfgBig.Linux.Resources = &runtimeapi.LinuxContainerResources{MemoryLimitInBytes: 256 << 20}
	nRefused := testutil.Counting(t, e.rt(), idB)()
	out, err := exec.Command(stageletBin, "checkpoint", "restore-pod", "-socket", to.d.Socket, "-runtime", s.handler, "-config", podFile(cfgBig), refusedDir).CombinedOutput()
	if err == nil || !strings.Contains(string(out), "give the pod the saved VM's size") {
		t.Fatalf("restore-pod into a VM of another size: %v\n%s", err, out)
	}
	testutil.WaitFor(t, time.Minute, "the source's counter counts on after the refused move", func() (bool, string) {
		n := testutil.Counting(t, e.rt(), idB)()
		return n > nRefused, strconv.Itoa(n)
	})

	copied := offer("moved")
	nB := testutil.Counting(t, e.rt(), idB)()
	cfgD := to.netPodConfig("vm-node2", s)
	start = time.Now()
	out, err = exec.Command(stageletBin, "checkpoint", "restore-pod", "-socket", to.d.Socket, "-runtime", s.handler, "-config", podFile(cfgD), copied).Output()
	if err != nil {
		t.Fatalf("stagelet checkpoint restore-pod: %v\n%s", err, out)
	}
	podD := strings.TrimSpace(string(out))
	to.cleanupPod(podD)
	t.Logf("stagelet checkpoint restore-pod on the second daemon, moving the pod live, took %v", time.Since(start).Round(time.Millisecond))
	for _, l := range strings.Split(e.d.LogTail(200)+"\n"+to.d.LogTail(200), "\n") {
		if strings.Contains(l, "live move") || strings.Contains(l, "moved live") {
			t.Log(l)
		}
	}
	// The source's pod is gone: its container exited, its VM stopped.
	if st := e.containerStatus(idB); st.GetState() != runtimeapi.ContainerState_CONTAINER_EXITED ||
		!strings.HasPrefix(st.GetMessage(), "the pod moved live to ") {
		t.Errorf("the container that moved away is %v on the source (message %q)", st.GetState(), st.GetMessage())
	}
	if ps := e.podStatus(podB); ps.GetState() != runtimeapi.PodSandboxState_SANDBOX_NOTREADY {
		t.Errorf("the pod that moved away is %v on the source", ps.GetState())
	}
	resp, err := to.rt().ListContainers(to.ctx(), &runtimeapi.ListContainersRequest{Filter: &runtimeapi.ContainerFilter{PodSandboxId: podD}})
	if err != nil || len(resp.Containers) != 1 {
		t.Fatalf("the pod restored on the second daemon: %v, %v", resp.GetContainers(), err)
	}
	idD := resp.Containers[0].Id
	if got := strings.TrimSpace(to.execOK(idD, "cat", "/tmp/token")); got != token {
		t.Errorf("the counter on the second daemon: PID and token %q, want %q", got, token)
	}
	ipD := to.podStatus(podD).GetNetwork().GetIp()
	if out := to.execOK(idD, "ip", "-4", "-o", "addr", "show", "dev", "eth0"); ipD == "" || !strings.Contains(out, " "+ipD+"/") {
		t.Errorf("the guest on the second daemon: eth0 %q, want its pod's %s", out, ipD)
	}
	if n := testutil.Counting(t, to.rt(), idD)(); n < nB {
		t.Errorf("the counter on the second daemon is at %d, below %d, read before its checkpoint", n, nB)
	}
	testutil.CountsOn(t, filepath.Join(cfgD.LogDirectory, "counter.log"))
	if _, err := e.rt().StopPodSandbox(e.ctx(), &runtimeapi.StopPodSandboxRequest{PodSandboxId: podB}); err != nil {
		t.Fatal(err)
	}

	// A pod with a hostPath volume cannot move, and says which.
	cfgC := e.netPodConfig("vm-hostpath", s)
	podC := e.runStage1Pod(cfgC, s)
	host := t.TempDir()
	hp := e.netContainer(s, "app", "sleep", "1000")
	hp.Mounts = []*runtimeapi.Mount{{ContainerPath: "/data", HostPath: host}}
	idC := e.createAndStart(podC, cfgC, hp)
	refused := filepath.Join(t.TempDir(), "refused.tar")
	_, err = e.rt().CheckpointContainer(e.ctx(), &runtimeapi.CheckpointContainerRequest{ContainerId: idC, Location: refused})
	requireCode(t, err, codes.FailedPrecondition, "CheckpointContainer of a kvm pod with a hostPath volume")
	if err != nil && (!strings.Contains(err.Error(), host) || !strings.Contains(err.Error(), "/data") || !strings.Contains(err.Error(), "9p share")) {
		t.Errorf("the refusal does not name the volume: %v", err)
	}
	if _, err := os.Lstat(refused); !os.IsNotExist(err) {
		t.Errorf("a refused checkpoint left %s: %v", refused, err)
	}

	// An archive carries one container: a pod of two is refused.
	cfgE := e.netPodConfig("vm-two", s)
	podE := e.runStage1Pod(cfgE, s)
	idE := e.createAndStart(podE, cfgE, e.netContainer(s, "one", "sleep", "1000"))
	e.createAndStart(podE, cfgE, e.netContainer(s, "two", "sleep", "1000"))
	_, err = e.rt().CheckpointContainer(e.ctx(), &runtimeapi.CheckpointContainerRequest{ContainerId: idE, Location: refused})
	requireCode(t, err, codes.FailedPrecondition, "CheckpointContainer of a kvm pod of two containers")
	if err != nil && !strings.Contains(err.Error(), "carries one container") {
		t.Errorf("the refusal does not say why: %v", err)
	}
}
