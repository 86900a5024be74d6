package e2e

import (
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

func TestVersion(t *testing.T) {
	e := newEnvNoPull(t)
	v, err := e.rt().Version(e.ctx(), &runtimeapi.VersionRequest{Version: "v1"})
	if err != nil {
		t.Fatalf("Version: %v", err)
	}
	if v.RuntimeApiVersion != "v1" {
		t.Errorf("runtime_api_version = %q, want v1", v.RuntimeApiVersion)
	}
	if v.RuntimeName == "" || v.RuntimeVersion == "" || v.Version == "" {
		t.Errorf("Version has empty fields: %+v", v)
	}
}

func TestStatusListsRuntimeHandlers(t *testing.T) {
	e := newEnvNoPull(t)
	resp, err := e.rt().Status(e.ctx(), &runtimeapi.StatusRequest{})
	if err != nil {
		t.Fatalf("Status: %v", err)
	}
	var ready *runtimeapi.RuntimeCondition
	for _, c := range resp.GetStatus().GetConditions() {
		if c.Type == runtimeapi.RuntimeReady {
			ready = c
		}
	}
	if ready == nil || !ready.Status {
		t.Errorf("RuntimeReady condition = %v, want true (all conditions: %v)", ready, resp.GetStatus().GetConditions())
	}
	var names []string
	for _, h := range resp.RuntimeHandlers {
		if h.Name != "" { // the default handler may be listed under ""
			names = append(names, h.Name)
		}
		// Every stage1's agent makes recursively read-only mounts.
		if !h.GetFeatures().GetRecursiveReadOnlyMounts() {
			t.Errorf("handler %q: recursive read-only mounts not advertised", h.Name)
		}
	}
	slices.Sort(names)
	if !slices.Equal(names, []string{"fly"}) {
		t.Errorf("runtime_handlers = %v, want [fly]", names)
	}
}

// events subscribes to GetContainerEvents for the rest of the test and
// returns the events as they arrive. The call returns before the daemon
// has subscribed: the first event delivered proves it has.
func (e *env) events() <-chan *runtimeapi.ContainerEventResponse {
	e.t.Helper()
	stream, err := e.rt().GetContainerEvents(e.t.Context(), &runtimeapi.GetEventsRequest{})
	if err != nil {
		e.t.Fatalf("GetContainerEvents: %v", err)
	}
	ch := make(chan *runtimeapi.ContainerEventResponse, 100)
	go func() {
		defer close(ch)
		for {
			ev, err := stream.Recv()
			if err != nil {
				return
			}
			ch <- ev
		}
	}()
	return ch
}

// waitEvent reads events until one of typ about id arrives.
func (e *env) waitEvent(ch <-chan *runtimeapi.ContainerEventResponse, typ runtimeapi.ContainerEventType, id string) *runtimeapi.ContainerEventResponse {
	e.t.Helper()
	timeout := time.After(60 * time.Second)
	var seen []string
	for {
		select {
		case ev, ok := <-ch:
			if !ok {
				e.t.Fatalf("the event stream ended waiting for %s of %s; seen %v", typ, id, seen)
			}
			if ev.ContainerEventType == typ && ev.ContainerId == id {
				return ev
			}
			seen = append(seen, ev.ContainerEventType.String()+" "+ev.ContainerId)
		case <-timeout:
			e.t.Fatalf("no %s event for %s in 60s; seen %v", typ, id, seen)
		}
	}
}

// TestContainerEvents: GetContainerEvents streams a pod's and its
// container's lifecycle, an exit the container makes on its own included,
// each event with the pod's status and its containers' statuses.
func TestContainerEvents(t *testing.T) {
	e := newEnv(t)
	ch := e.events()
	podID, ctrID, podCfg := e.runOne("events", e.containerConfig("waits", "sleep", "1000"))
	for _, typ := range []runtimeapi.ContainerEventType{runtimeapi.ContainerEventType_CONTAINER_CREATED_EVENT, runtimeapi.ContainerEventType_CONTAINER_STARTED_EVENT} {
		ev := e.waitEvent(ch, typ, podID)
		if ev.PodSandboxStatus.GetId() != podID || ev.PodSandboxStatus.GetState() != runtimeapi.PodSandboxState_SANDBOX_READY {
			t.Errorf("%s of the pod: sandbox status %v", typ, ev.PodSandboxStatus)
		}
	}
	e.waitEvent(ch, runtimeapi.ContainerEventType_CONTAINER_CREATED_EVENT, ctrID)
	e.waitEvent(ch, runtimeapi.ContainerEventType_CONTAINER_STARTED_EVENT, ctrID)
	if _, err := e.rt().StopContainer(e.ctx(), &runtimeapi.StopContainerRequest{ContainerId: ctrID, Timeout: 10}); err != nil {
		t.Fatal(err)
	}
	ev := e.waitEvent(ch, runtimeapi.ContainerEventType_CONTAINER_STOPPED_EVENT, ctrID)
	var st *runtimeapi.ContainerStatus
	for _, s := range ev.ContainersStatuses {
		if s.Id == ctrID {
			st = s
		}
	}
	if st == nil || st.State != runtimeapi.ContainerState_CONTAINER_EXITED || st.FinishedAt == 0 {
		t.Errorf("the stopped event's container statuses: %v", ev.ContainersStatuses)
	}
	if ev.CreatedAt == 0 {
		t.Error("an event without a time")
	}
	// An exit nobody asked for reaches the stream too, with its code.
	quits := e.createAndStart(podID, podCfg, e.containerConfig("quits", "sh", "-c", "exit 3"))
	ev = e.waitEvent(ch, runtimeapi.ContainerEventType_CONTAINER_STOPPED_EVENT, quits)
	st = nil
	for _, s := range ev.ContainersStatuses {
		if s.Id == quits {
			st = s
		}
	}
	if st == nil || st.ExitCode != 3 {
		t.Errorf("the exit's event carries %v, want exit code 3", st)
	}
}

// Malformed requests get InvalidArgument with a message naming the field.
func TestMalformedRequestsAreInvalidArgument(t *testing.T) {
	e := newEnv(t)
	podCfg := e.podConfig("malformed")
	podID := e.runPod(podCfg)
	good := func() *runtimeapi.ContainerConfig { return e.containerConfig("c", "sleep", "1") }

	cases := []struct {
		name  string
		field string // the message must name it (case-insensitive)
		call  func() error
	}{
		{"RunPodSandbox without config", "config", func() error {
			_, err := e.rt().RunPodSandbox(e.ctx(), &runtimeapi.RunPodSandboxRequest{})
			return err
		}},
		{"RunPodSandbox without metadata", "metadata", func() error {
			c := e.podConfig("x")
			c.Metadata = nil
			_, err := e.rt().RunPodSandbox(e.ctx(), &runtimeapi.RunPodSandboxRequest{Config: c})
			return err
		}},
		{"RunPodSandbox without name", "name", func() error {
			c := e.podConfig("x")
			c.Metadata.Name = ""
			_, err := e.rt().RunPodSandbox(e.ctx(), &runtimeapi.RunPodSandboxRequest{Config: c})
			return err
		}},
		{"CreateContainer without pod id", "sandbox", func() error {
			_, err := e.rt().CreateContainer(e.ctx(), &runtimeapi.CreateContainerRequest{Config: good(), SandboxConfig: podCfg})
			return err
		}},
		{"CreateContainer without config", "config", func() error {
			_, err := e.rt().CreateContainer(e.ctx(), &runtimeapi.CreateContainerRequest{PodSandboxId: podID, SandboxConfig: podCfg})
			return err
		}},
		{"CreateContainer without metadata", "metadata", func() error {
			c := good()
			c.Metadata = nil
			_, err := e.rt().CreateContainer(e.ctx(), &runtimeapi.CreateContainerRequest{PodSandboxId: podID, Config: c, SandboxConfig: podCfg})
			return err
		}},
		{"CreateContainer without name", "name", func() error {
			c := good()
			c.Metadata.Name = ""
			_, err := e.rt().CreateContainer(e.ctx(), &runtimeapi.CreateContainerRequest{PodSandboxId: podID, Config: c, SandboxConfig: podCfg})
			return err
		}},
		{"CreateContainer without image", "image", func() error {
			c := good()
			c.Image = nil
			_, err := e.rt().CreateContainer(e.ctx(), &runtimeapi.CreateContainerRequest{PodSandboxId: podID, Config: c, SandboxConfig: podCfg})
			return err
		}},
		{"CreateContainer with empty image", "image", func() error {
			c := good()
			c.Image = &runtimeapi.ImageSpec{}
			_, err := e.rt().CreateContainer(e.ctx(), &runtimeapi.CreateContainerRequest{PodSandboxId: podID, Config: c, SandboxConfig: podCfg})
			return err
		}},
		{"PullImage without image", "image", func() error {
			_, err := e.is().PullImage(e.ctx(), &runtimeapi.PullImageRequest{})
			return err
		}},
		{"PullImage with empty image", "image", func() error {
			_, err := e.is().PullImage(e.ctx(), &runtimeapi.PullImageRequest{Image: &runtimeapi.ImageSpec{}})
			return err
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.call()
			if err == nil {
				t.Fatalf("succeeded, want InvalidArgument")
			}
			s, _ := status.FromError(err)
			if s.Code() != codes.InvalidArgument {
				t.Fatalf("got %v, want InvalidArgument", err)
			}
			if !strings.Contains(lower(s.Message()), tc.field) {
				t.Errorf("message %q does not name the field %q", s.Message(), tc.field)
			}
		})
	}

	// ExecSync needs a running container.
	ctr := e.createAndStart(podID, podCfg, e.containerConfig("sleeper", "sleep", "3600"))
	e.waitContainerState(ctr, runtimeapi.ContainerState_CONTAINER_RUNNING, stateTimeout)
	t.Run("ExecSync without cmd", func(t *testing.T) {
		_, err := e.rt().ExecSync(e.ctx(), &runtimeapi.ExecSyncRequest{ContainerId: ctr})
		if err == nil {
			t.Fatalf("succeeded, want InvalidArgument")
		}
		s, _ := status.FromError(err)
		if s.Code() != codes.InvalidArgument {
			t.Fatalf("got %v, want InvalidArgument", err)
		}
		if !strings.Contains(lower(s.Message()), "cmd") {
			t.Errorf("message %q does not name the field %q", s.Message(), "cmd")
		}
	})
}
