package e2e

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/test/e2e/harness"
)

// fill writes path until its file system is full, to the last page.
func fill(t *testing.T, path string) {
	t.Helper()
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, n := range []int{1 << 20, 4 << 10, 1} {
		buf := make([]byte, n)
		for {
			if _, err := f.Write(buf); err != nil {
				if !errors.Is(err, syscall.ENOSPC) {
					t.Fatal(err)
				}
				break
			}
		}
	}
}

// A full state file system: RunPodSandbox and CreateContainer answer
// ResourceExhausted naming it, nothing is half created, the daemon holds
// up and restarts while it is full, and works again once there is room.
func TestFullStateFileSystem(t *testing.T) {
	requireRoot(t)
	e := newEnvOpts(t, harness.Options{StateTmpfs: "64m"}, true)
	podCfg := e.podConfig("before")
	podID := e.runPod(podCfg)
	filler := filepath.Join(e.d.StateDir, "filler")
	// Room again before the teardown, also when the test fails.
	t.Cleanup(func() { os.Remove(filler) })
	fill(t, filler)

	full := func(what string, err error) {
		t.Helper()
		st, _ := status.FromError(err)
		if st.Code() != codes.ResourceExhausted || !strings.Contains(st.Message(), "the file system of "+e.d.StateDir) || !strings.Contains(st.Message(), "no space left on device") {
			t.Fatalf("%s on a full file system: %v, want ResourceExhausted naming %s", what, err, e.d.StateDir)
		}
	}
	_, err := e.rt().RunPodSandbox(e.ctx(), &runtimeapi.RunPodSandboxRequest{Config: e.podConfig("full")})
	full("RunPodSandbox", err)
	_, err = e.rt().CreateContainer(e.ctx(), &runtimeapi.CreateContainerRequest{PodSandboxId: podID, Config: e.containerConfig("c", "true"), SandboxConfig: podCfg})
	full("CreateContainer", err)
	pods, err := e.rt().ListPodSandbox(e.ctx(), &runtimeapi.ListPodSandboxRequest{})
	if err != nil || len(pods.Items) != 1 || pods.Items[0].Id != podID {
		t.Fatalf("pods after the refusals: %v, %v; want %s only", pods.GetItems(), err, podID)
	}
	ctrs, err := e.rt().ListContainers(e.ctx(), &runtimeapi.ListContainersRequest{})
	if err != nil || len(ctrs.Containers) != 0 {
		t.Fatalf("containers after the refusal: %v, %v", ctrs.GetContainers(), err)
	}

	// A restart while full recovers the pod.
	if err := e.d.Stop(e.ctx(), 15*time.Second); err != nil {
		t.Fatal(err)
	}
	if err := e.d.Restart(e.ctx()); err != nil {
		t.Fatalf("restart on a full file system: %v", err)
	}
	if st := e.podStatus(podID); st.State != runtimeapi.PodSandboxState_SANDBOX_READY {
		t.Fatalf("the pod after a restart on a full file system: %v", st.State)
	}

	// Room again: the same calls work.
	if err := os.Remove(filler); err != nil {
		t.Fatal(err)
	}
	e.runPod(e.podConfig("after"))
	e.createAndStart(podID, podCfg, e.containerConfig("c", "true"))
}
