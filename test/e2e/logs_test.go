package e2e

import (
	"os"
	"regexp"
	"strings"
	"testing"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/test/e2e/harness"
)

// Every line a CRI call logs carries its request ID, from the call's own
// line down through the broker, the network and the stage1: one
// RunPodSandbox's lines are found by one ID. A failed call's line and the
// lines of its cause share theirs, with the pod and container the request
// names.
func TestLogLinesCarryRequestID(t *testing.T) {
	e := newEnvOpts(t, harness.Options{Policy: bothStage1sPolicy}, false)
	cfg := e.netPodConfig("logs", nspawnStage1)
	podID := e.runStage1Pod(cfg, nspawnStage1)

	log, err := os.ReadFile(e.d.LogPath)
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(string(log), "\n")
	rid := ""
	for _, l := range lines {
		if strings.Contains(l, `msg="CRI call"`) && strings.Contains(l, "method=/runtime.v1.RuntimeService/RunPodSandbox") {
			rid = field(l, "req")
		}
	}
	if rid == "" {
		t.Fatal("no RunPodSandbox line with a request ID in the daemon's log")
	}
	var call []string
	for _, l := range lines {
		if field(l, "req") == rid {
			call = append(call, l)
		}
	}
	t.Logf("RunPodSandbox req=%s:\n%s", rid, strings.Join(call, "\n"))
	for _, want := range []string{`msg="CNI ADD"`, `msg="pod started"`, `msg="CRI call"`} {
		if !anyContains(call, want) {
			t.Errorf("no line %s with req=%s", want, rid)
		}
	}
	for _, l := range call {
		if !strings.Contains(l, "msg=\"CRI call\"") && field(l, "pod") != podID {
			t.Errorf("a line of the pod's start names pod %q, not %s: %s", field(l, "pod"), podID, l)
		}
	}

	// A call that fails: its line names the request, pod and container.
	_, err = e.rt().CreateContainer(e.ctx(), &runtimeapi.CreateContainerRequest{
		PodSandboxId: podID, SandboxConfig: cfg,
		Config: e.netContainer(nspawnStage1, "missing", "true"),
	})
	if err == nil {
		t.Fatal("CreateContainer of an image never pulled succeeded")
	}
	log, err = os.ReadFile(e.d.LogPath)
	if err != nil {
		t.Fatal(err)
	}
	failed := ""
	for _, l := range strings.Split(string(log), "\n") {
		if strings.Contains(l, `msg="CRI call failed"`) && strings.Contains(l, "method=/runtime.v1.RuntimeService/CreateContainer") {
			failed = l
		}
	}
	if field(failed, "req") == "" || field(failed, "pod") != podID {
		t.Errorf("the failed CreateContainer's line has no request ID or pod %s: %q", podID, failed)
	}
}

var logField = regexp.MustCompile(`(?:^| )([a-z]+)=("(?:[^"\\]|\\.)*"|[^ ]*)`)

// field is the value of key in a text log line, "" when absent.
func field(line, key string) string {
	for _, m := range logField.FindAllStringSubmatch(line, -1) {
		if m[1] == key {
			return strings.Trim(m[2], `"`)
		}
	}
	return ""
}

func anyContains(lines []string, s string) bool {
	for _, l := range lines {
		if strings.Contains(l, s) {
			return true
		}
	}
	return false
}
