package e2e

import (
	"errors"
	"io"
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

// recvAll reads a server stream to its end.
func recvAll[T any](t *testing.T, what string, stream interface{ Recv() (*T, error) }, err error) []*T {
	t.Helper()
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	var out []*T
	for {
		m, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return out
		}
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		out = append(out, m)
	}
}

// TestStreamLists: each Stream* call lists what its List twin lists, with
// the same filter.
func TestStreamLists(t *testing.T) {
	e := newEnv(t)
	podID, ctrID, _ := e.runOne("streams", e.containerConfig("c", "sleep", "1000"))
	ctx := e.ctx()
	var pods []string
	stStreamPodSandboxes, err := e.rt().StreamPodSandboxes(ctx, &runtimeapi.StreamPodSandboxesRequest{Filter: &runtimeapi.PodSandboxFilter{Id: podID}})
	for _, m := range recvAll(t, "StreamPodSandboxes", stStreamPodSandboxes, err) {
		for _, p := range m.PodSandboxes {
			pods = append(pods, p.Id)
		}
	}
	if !slices.Equal(pods, []string{podID}) {
		t.Errorf("StreamPodSandboxes: %v, want [%s]", pods, podID)
	}
	var ctrs []string
	stStreamContainers, err := e.rt().StreamContainers(ctx, &runtimeapi.StreamContainersRequest{Filter: &runtimeapi.ContainerFilter{PodSandboxId: podID}})
	for _, m := range recvAll(t, "StreamContainers", stStreamContainers, err) {
		for _, c := range m.Containers {
			ctrs = append(ctrs, c.Id)
		}
	}
	if !slices.Equal(ctrs, []string{ctrID}) {
		t.Errorf("StreamContainers: %v, want [%s]", ctrs, ctrID)
	}
	var stats []string
	stStreamContainerStats, err := e.rt().StreamContainerStats(ctx, &runtimeapi.StreamContainerStatsRequest{Filter: &runtimeapi.ContainerStatsFilter{Id: ctrID}})
	for _, m := range recvAll(t, "StreamContainerStats", stStreamContainerStats, err) {
		for _, s := range m.ContainerStats {
			stats = append(stats, s.GetAttributes().GetId())
		}
	}
	if !slices.Equal(stats, []string{ctrID}) {
		t.Errorf("StreamContainerStats: %v, want [%s]", stats, ctrID)
	}
	var podStats []string
	stStreamPodSandboxStats, err := e.rt().StreamPodSandboxStats(ctx, &runtimeapi.StreamPodSandboxStatsRequest{Filter: &runtimeapi.PodSandboxStatsFilter{Id: podID}})
	for _, m := range recvAll(t, "StreamPodSandboxStats", stStreamPodSandboxStats, err) {
		for _, s := range m.PodSandboxStats {
			podStats = append(podStats, s.GetAttributes().GetId())
		}
	}
	if !slices.Equal(podStats, []string{podID}) {
		t.Errorf("StreamPodSandboxStats: %v, want [%s]", podStats, podID)
	}
	list, err := e.is().ListImages(ctx, &runtimeapi.ListImagesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	stStreamImages, err := e.is().StreamImages(ctx, &runtimeapi.StreamImagesRequest{})
	for _, m := range recvAll(t, "StreamImages", stStreamImages, err) {
		n += len(m.Images)
	}
	if n != len(list.Images) || n == 0 {
		t.Errorf("StreamImages listed %d images, ListImages %d", n, len(list.Images))
	}
}

// TestPodSandboxMetrics: the metrics of a running container come with
// their descriptors, one label value per key, and the stream lists the
// same pods.
func TestPodSandboxMetrics(t *testing.T) {
	e := newEnv(t)
	podID, ctrID, _ := e.runOne("metrics", e.containerConfig("c", "sleep", "1000"))
	ctx := e.ctx()
	descs, err := e.rt().ListMetricDescriptors(ctx, &runtimeapi.ListMetricDescriptorsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	keys := map[string]int{}
	for _, d := range descs.Descriptors {
		keys[d.Name] = len(d.LabelKeys)
	}
	resp, err := e.rt().ListPodSandboxMetrics(ctx, &runtimeapi.ListPodSandboxMetricsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	var ws uint64
	found := false
	for _, pm := range resp.PodMetrics {
		if pm.PodSandboxId != podID {
			continue
		}
		for _, cm := range pm.ContainerMetrics {
			if cm.ContainerId != ctrID {
				continue
			}
			found = true
			for _, m := range cm.Metrics {
				if n, ok := keys[m.Name]; !ok || n != len(m.LabelValues) {
					t.Errorf("metric %s: %d label values for %d keys (described: %v)", m.Name, len(m.LabelValues), n, ok)
				}
				if m.Name == "container_memory_working_set_bytes" {
					ws = m.GetValue().GetValue()
				}
			}
		}
	}
	if !found || ws == 0 {
		t.Errorf("no metrics for the running container (found %v, working set %d)", found, ws)
	}
	st, err := e.rt().StreamPodSandboxMetrics(ctx, &runtimeapi.StreamPodSandboxMetricsRequest{})
	n := 0
	for _, m := range recvAll(t, "StreamPodSandboxMetrics", st, err) {
		n += len(m.PodSandboxMetrics)
	}
	if n != len(resp.PodMetrics) {
		t.Errorf("StreamPodSandboxMetrics listed %d pods, ListPodSandboxMetrics %d", n, len(resp.PodMetrics))
	}
}
