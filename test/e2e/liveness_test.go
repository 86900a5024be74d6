package e2e

import (
	"strconv"
	"syscall"
	"testing"
	"time"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// TestPodWhoseAgentDiesIsNotReady: when a pod's agent dies while the daemon
// runs, the pod turns NotReady and its containers exited, so that the
// kubelet replaces it; stop and remove still release everything.
func TestPodWhoseAgentDiesIsNotReady(t *testing.T) {
	e := newEnv(t)
	podID, ctrID, _ := e.runOne("agent-dies", e.containerConfig("sleeper", "sleep", "1000"))
	resp, err := e.rt().PodSandboxStatus(e.ctx(), &runtimeapi.PodSandboxStatusRequest{PodSandboxId: podID, Verbose: true})
	if err != nil {
		t.Fatal(err)
	}
	pid, err := strconv.Atoi(resp.Info["agent.pid"])
	if err != nil || pid <= 1 {
		t.Fatalf("agent pid in the verbose info: %q", resp.Info["agent.pid"])
	}
	// The fly agent is a host process the daemon this test started made.
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "the pod to turn NotReady", func() (bool, string) {
		st := e.podStatus(podID)
		return st.State == runtimeapi.PodSandboxState_SANDBOX_NOTREADY, st.State.String()
	})
	st := e.waitContainerState(ctrID, runtimeapi.ContainerState_CONTAINER_EXITED, 30*time.Second)
	if st.ExitCode == 0 || st.Reason != "Error" {
		t.Errorf("container after its pod's agent died: code %d reason %q message %q", st.ExitCode, st.Reason, st.Message)
	}
	if _, err := e.rt().StopPodSandbox(e.ctx(), &runtimeapi.StopPodSandboxRequest{PodSandboxId: podID}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.rt().RemovePodSandbox(e.ctx(), &runtimeapi.RemovePodSandboxRequest{PodSandboxId: podID}); err != nil {
		t.Fatal(err)
	}
}
