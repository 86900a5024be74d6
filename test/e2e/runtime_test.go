package e2e

import (
	"errors"
	"io"
	"slices"
	"strings"
	"testing"

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

// Container events are not implemented yet; they must say so with
// Unimplemented, not Unknown.
func TestUnimplementedCalls(t *testing.T) {
	e := newEnv(t)
	stream, err := e.rt().GetContainerEvents(e.ctx(), &runtimeapi.GetEventsRequest{})
	if err == nil {
		_, err = stream.Recv()
	}
	if errors.Is(err, io.EOF) {
		t.Fatalf("GetContainerEvents: stream ended without a status, want gRPC Unimplemented")
	}
	requireCode(t, err, codes.Unimplemented, "GetContainerEvents")
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
