package e2e

import (
	"context"
	"slices"
	"strconv"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// Labels and annotations the kubelet stores its own data in; they must come
// back byte for byte.
func kubeletLikeLabels(t *testing.T) map[string]string {
	return map[string]string{
		"e2e-test":                     testLabel(t),
		"io.kubernetes.pod.name":       "web-0",
		"io.kubernetes.pod.namespace":  "e2e",
		"app.kubernetes.io/name":       "web",
		"empty":                        "",
		"dots.and-dashes_and_under":    "v.1-2_3",
		"example.com/long-label-value": "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_",
	}
}

func kubeletLikeAnnotations() map[string]string {
	return map[string]string{
		"kubernetes.io/config.source":                    "api",
		"kubernetes.io/config.seen":                      "2024-01-01T00:00:00.000000000Z",
		"io.kubernetes.container.terminationMessagePath": "/dev/termination-log",
		"json":    `{"a":[1,2,{"b":"c d"}],"e":"\u00e9\n\t"}`,
		"unicode": "ünïcødé ✓ 日本",
		"spaces":  "  leading and trailing  ",
		"empty":   "",
	}
}

func TestPodLifecycle(t *testing.T) {
	e := newEnvNoPull(t)
	cfg := e.podConfig("lifecycle")
	cfg.Labels = kubeletLikeLabels(t)
	cfg.Annotations = kubeletLikeAnnotations()
	before := time.Now()
	id := e.runPod(cfg)

	st := e.podStatus(id)
	if st.Id != id {
		t.Errorf("status id %q, want %q", st.Id, id)
	}
	if st.State != runtimeapi.PodSandboxState_SANDBOX_READY {
		t.Errorf("state %s, want SANDBOX_READY", st.State)
	}
	if !proto.Equal(st.Metadata, cfg.Metadata) {
		t.Errorf("metadata %v, want %v", st.Metadata, cfg.Metadata)
	}
	if !sameMap(st.Labels, cfg.Labels) {
		t.Errorf("labels came back changed:\n got %q\nwant %q", st.Labels, cfg.Labels)
	}
	if !sameMap(st.Annotations, cfg.Annotations) {
		t.Errorf("annotations came back changed:\n got %q\nwant %q", st.Annotations, cfg.Annotations)
	}
	if c := time.Unix(0, st.CreatedAt); c.Before(before.Add(-time.Second)) || c.After(time.Now()) {
		t.Errorf("created_at %s is not between %s and now", c, before)
	}

	list, err := e.rt().ListPodSandbox(e.ctx(), &runtimeapi.ListPodSandboxRequest{})
	if err != nil {
		t.Fatalf("ListPodSandbox: %v", err)
	}
	if len(list.Items) != 1 || list.Items[0].Id != id {
		t.Fatalf("ListPodSandbox = %v, want just %s", list.Items, id)
	}
	item := list.Items[0]
	if !sameMap(item.Labels, cfg.Labels) || !sameMap(item.Annotations, cfg.Annotations) {
		t.Errorf("ListPodSandbox labels/annotations changed: %q %q", item.Labels, item.Annotations)
	}
	if item.State != runtimeapi.PodSandboxState_SANDBOX_READY || !proto.Equal(item.Metadata, cfg.Metadata) || item.CreatedAt != st.CreatedAt {
		t.Errorf("ListPodSandbox item %v disagrees with status %v", item, st)
	}

	for i := 1; i <= 2; i++ {
		if _, err := e.rt().StopPodSandbox(e.ctx(), &runtimeapi.StopPodSandboxRequest{PodSandboxId: id}); err != nil {
			t.Fatalf("StopPodSandbox #%d: %v", i, err)
		}
		if st := e.podStatus(id); st.State != runtimeapi.PodSandboxState_SANDBOX_NOTREADY {
			t.Errorf("after StopPodSandbox #%d: state %s, want SANDBOX_NOTREADY", i, st.State)
		}
	}
	for i := 1; i <= 2; i++ {
		if _, err := e.rt().RemovePodSandbox(e.ctx(), &runtimeapi.RemovePodSandboxRequest{PodSandboxId: id}); err != nil {
			t.Fatalf("RemovePodSandbox #%d: %v", i, err)
		}
	}
	_, err = e.rt().PodSandboxStatus(e.ctx(), &runtimeapi.PodSandboxStatusRequest{PodSandboxId: id})
	requireCode(t, err, codes.NotFound, "PodSandboxStatus of a removed pod")
	if _, err := e.rt().StopPodSandbox(e.ctx(), &runtimeapi.StopPodSandboxRequest{PodSandboxId: id}); err != nil {
		t.Errorf("StopPodSandbox of a removed pod: %v, want success", err)
	}
	list, err = e.rt().ListPodSandbox(e.ctx(), &runtimeapi.ListPodSandboxRequest{})
	if err != nil {
		t.Fatalf("ListPodSandbox: %v", err)
	}
	if len(list.Items) != 0 {
		t.Errorf("ListPodSandbox after removal: %v, want none", list.Items)
	}
}

// Removing a ready pod without stopping it first stops it.
func TestRemoveRunningPod(t *testing.T) {
	e := newEnv(t)
	podID, ctr, _ := e.runOne("rm-running", e.containerConfig("sleeper", "sleep", "3600"))
	e.waitContainerState(ctr, runtimeapi.ContainerState_CONTAINER_RUNNING, stateTimeout)
	if _, err := e.rt().RemovePodSandbox(e.ctx(), &runtimeapi.RemovePodSandboxRequest{PodSandboxId: podID}); err != nil {
		// The CRI lets a runtime refuse to remove a running pod; then
		// stop and remove must work.
		if _, err := e.rt().StopPodSandbox(e.ctx(), &runtimeapi.StopPodSandboxRequest{PodSandboxId: podID}); err != nil {
			t.Fatalf("StopPodSandbox: %v", err)
		}
		if _, err := e.rt().RemovePodSandbox(e.ctx(), &runtimeapi.RemovePodSandboxRequest{PodSandboxId: podID}); err != nil {
			t.Fatalf("RemovePodSandbox after stop: %v", err)
		}
	}
	_, err := e.rt().PodSandboxStatus(e.ctx(), &runtimeapi.PodSandboxStatusRequest{PodSandboxId: podID})
	requireCode(t, err, codes.NotFound, "PodSandboxStatus of a removed pod")
	_, err = e.rt().ContainerStatus(e.ctx(), &runtimeapi.ContainerStatusRequest{ContainerId: ctr})
	requireCode(t, err, codes.NotFound, "ContainerStatus of a container of a removed pod")
}

// Stop and Remove of IDs the runtime never saw succeed (the kubelet retries
// them after a restart); Status of them is NotFound.
func TestStopRemoveUnknownIDs(t *testing.T) {
	e := newEnvNoPull(t)
	pod, ctr := randHex(32), randHex(32)
	if _, err := e.rt().StopPodSandbox(e.ctx(), &runtimeapi.StopPodSandboxRequest{PodSandboxId: pod}); err != nil {
		t.Errorf("StopPodSandbox unknown: %v", err)
	}
	if _, err := e.rt().RemovePodSandbox(e.ctx(), &runtimeapi.RemovePodSandboxRequest{PodSandboxId: pod}); err != nil {
		t.Errorf("RemovePodSandbox unknown: %v", err)
	}
	if _, err := e.rt().StopContainer(e.ctx(), &runtimeapi.StopContainerRequest{ContainerId: ctr, Timeout: 1}); err != nil {
		t.Errorf("StopContainer unknown: %v", err)
	}
	if _, err := e.rt().RemoveContainer(e.ctx(), &runtimeapi.RemoveContainerRequest{ContainerId: ctr}); err != nil {
		t.Errorf("RemoveContainer unknown: %v", err)
	}
	_, err := e.rt().PodSandboxStatus(e.ctx(), &runtimeapi.PodSandboxStatusRequest{PodSandboxId: pod})
	if s, _ := status.FromError(err); s.Code() != codes.NotFound {
		t.Errorf("PodSandboxStatus unknown: %v, want NotFound", err)
	}
	_, err = e.rt().ContainerStatus(e.ctx(), &runtimeapi.ContainerStatusRequest{ContainerId: ctr})
	if s, _ := status.FromError(err); s.Code() != codes.NotFound {
		t.Errorf("ContainerStatus unknown: %v, want NotFound", err)
	}
	_, err = e.rt().ExecSync(e.ctx(), &runtimeapi.ExecSyncRequest{ContainerId: ctr, Cmd: []string{"true"}})
	if s, _ := status.FromError(err); s.Code() != codes.NotFound {
		t.Errorf("ExecSync unknown: %v, want NotFound", err)
	}
}

// A pod name (name, namespace, uid, attempt) is taken once; another attempt
// is a new pod.
func TestPodNameUniquePerAttempt(t *testing.T) {
	e := newEnvNoPull(t)
	cfg := e.podConfig("unique")
	first := e.runPod(cfg)

	other := proto.Clone(cfg).(*runtimeapi.PodSandboxConfig)
	other.Hostname = "another-host"
	other.Labels["differs"] = "yes"
	resp, err := e.rt().RunPodSandbox(e.ctx(), &runtimeapi.RunPodSandboxRequest{Config: other})
	if err == nil {
		e.cleanupPod(resp.PodSandboxId)
		t.Fatalf("RunPodSandbox with a taken name and a different config returned pod %s (first %s), want AlreadyExists", resp.PodSandboxId, first)
	}
	requireCode(t, err, codes.AlreadyExists, "RunPodSandbox with a taken name and a different config")

	next := proto.Clone(cfg).(*runtimeapi.PodSandboxConfig)
	next.Metadata.Attempt = 1
	second := e.runPod(next)
	if second == first {
		t.Fatalf("attempt 1 got the same pod id as attempt 0")
	}
	// Once the first pod is removed its name is free again.
	if _, err := e.rt().StopPodSandbox(e.ctx(), &runtimeapi.StopPodSandboxRequest{PodSandboxId: first}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.rt().RemovePodSandbox(e.ctx(), &runtimeapi.RemovePodSandboxRequest{PodSandboxId: first}); err != nil {
		t.Fatal(err)
	}
	if third := e.runPod(other); third == first {
		t.Errorf("a new pod under a freed name reused the removed pod's id")
	}
}

// The kubelet retries a RunPodSandbox that timed out on its side with the
// same config; it must get the same pod, not a second one and not the
// first call's failure.
func TestRunPodSandboxRetryReturnsSamePod(t *testing.T) {
	e := newEnvNoPull(t)

	// How long starting a pod takes here, to time the first call out well
	// before it is done, while the daemon is still at work on it.
	began := time.Now()
	e.runPod(e.podConfig("calibrate"))
	deadline := max(time.Since(began)/4, 2*time.Millisecond)
	t.Logf("a pod starts in %s; the first calls time out after %s", time.Since(began).Round(time.Millisecond), deadline)

	for i := range 3 {
		name := "retry-" + strconv.Itoa(i)
		cfg := e.podConfig(name)
		short, cancel := context.WithTimeout(e.t.Context(), deadline)
		r1, err1 := e.rt().RunPodSandbox(short, &runtimeapi.RunPodSandboxRequest{Config: cfg})
		cancel()
		if err1 == nil {
			e.cleanupPod(r1.PodSandboxId)
			t.Logf("%s: the first RunPodSandbox finished within %s; the retry is a plain repeat", name, deadline)
		} else if s, _ := status.FromError(err1); s.Code() != codes.DeadlineExceeded {
			t.Fatalf("%s: first RunPodSandbox: %v", name, err1)
		}

		resp, err := e.rt().RunPodSandbox(e.ctx(), &runtimeapi.RunPodSandboxRequest{Config: cfg})
		if err != nil {
			t.Fatalf("%s: RunPodSandbox retried after the first call timed out: %v", name, err)
		}
		id := resp.PodSandboxId
		e.cleanupPod(id)
		if err1 == nil && id != r1.PodSandboxId {
			t.Errorf("%s: retry returned pod %s, the first call %s", name, id, r1.PodSandboxId)
		}
		if again := e.runPod(cfg); again != id {
			t.Errorf("%s: a second retry returned pod %s, the first retry %s", name, again, id)
		}
		list, err := e.rt().ListPodSandbox(e.ctx(), &runtimeapi.ListPodSandboxRequest{})
		if err != nil {
			t.Fatalf("ListPodSandbox: %v", err)
		}
		var ids []string
		for _, p := range list.Items {
			if p.GetMetadata().GetName() == name {
				ids = append(ids, p.Id)
			}
		}
		if !slices.Equal(ids, []string{id}) {
			t.Errorf("%s: pods after retries: %v, want just %s", name, ids, id)
		}
		if st := e.podStatus(id); st.State != runtimeapi.PodSandboxState_SANDBOX_READY {
			t.Errorf("%s: retried pod state %s, want SANDBOX_READY", name, st.State)
		}
	}
}

func TestListPodSandboxFilters(t *testing.T) {
	e := newEnvNoPull(t)
	ca := e.podConfig("pod-a")
	ca.Labels["role"] = "a"
	cb := e.podConfig("pod-b")
	cb.Labels["role"] = "b"
	a, b := e.runPod(ca), e.runPod(cb)
	if _, err := e.rt().StopPodSandbox(e.ctx(), &runtimeapi.StopPodSandboxRequest{PodSandboxId: b}); err != nil {
		t.Fatalf("StopPodSandbox: %v", err)
	}
	ready := &runtimeapi.PodSandboxStateValue{State: runtimeapi.PodSandboxState_SANDBOX_READY}
	notReady := &runtimeapi.PodSandboxStateValue{State: runtimeapi.PodSandboxState_SANDBOX_NOTREADY}
	cases := []struct {
		name   string
		filter *runtimeapi.PodSandboxFilter
		want   []string
	}{
		{"none", nil, []string{a, b}},
		{"id", &runtimeapi.PodSandboxFilter{Id: a}, []string{a}},
		{"unknown id", &runtimeapi.PodSandboxFilter{Id: randHex(32)}, nil},
		{"ready", &runtimeapi.PodSandboxFilter{State: ready}, []string{a}},
		{"not ready", &runtimeapi.PodSandboxFilter{State: notReady}, []string{b}},
		{"label", &runtimeapi.PodSandboxFilter{LabelSelector: map[string]string{"role": "b"}}, []string{b}},
		{"labels", &runtimeapi.PodSandboxFilter{LabelSelector: map[string]string{"role": "a", "e2e-test": testLabel(t)}}, []string{a}},
		{"label no match", &runtimeapi.PodSandboxFilter{LabelSelector: map[string]string{"role": "c"}}, nil},
		{"label and state", &runtimeapi.PodSandboxFilter{LabelSelector: map[string]string{"role": "a"}, State: notReady}, nil},
		{"id and state", &runtimeapi.PodSandboxFilter{Id: b, State: notReady}, []string{b}},
	}
	for _, tc := range cases {
		resp, err := e.rt().ListPodSandbox(e.ctx(), &runtimeapi.ListPodSandboxRequest{Filter: tc.filter})
		if err != nil {
			t.Errorf("%s: ListPodSandbox: %v", tc.name, err)
			continue
		}
		var got []string
		for _, p := range resp.Items {
			got = append(got, p.Id)
		}
		slices.Sort(got)
		want := slices.Clone(tc.want)
		slices.Sort(want)
		if !slices.Equal(got, want) {
			t.Errorf("%s: got %v, want %v", tc.name, got, want)
		}
	}
}
