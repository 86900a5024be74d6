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
	ch := e.events()
	podID, ctrID, _ := e.runOne("agent-dies", e.containerConfig("sleeper", "sleep", "1000"))
	// The subscription is in place once it delivered the pod's start.
	e.waitEvent(ch, runtimeapi.ContainerEventType_CONTAINER_STARTED_EVENT, podID)
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
	// The daemon learns it from the agent's channel closing, without a
	// list or status call: the event says so.
	ev := e.waitEvent(ch, runtimeapi.ContainerEventType_CONTAINER_STOPPED_EVENT, podID)
	if ev.PodSandboxStatus.GetState() != runtimeapi.PodSandboxState_SANDBOX_NOTREADY {
		t.Errorf("the pod's stopped event: sandbox %v", ev.PodSandboxStatus.GetState())
	}
	if st := e.podStatus(podID); st.State != runtimeapi.PodSandboxState_SANDBOX_NOTREADY {
		t.Errorf("the pod after its agent died: %s", st.State)
	}
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
