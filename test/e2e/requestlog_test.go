package e2e

import (
	"os"
	"regexp"
	"strings"
	"testing"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

var reqAttr = regexp.MustCompile(`\breq=([0-9a-f]+)\b`)

// requestLines are the daemon's log lines of the last call of method,
// found by the request ID its "CRI call" line carries.
func (e *env) requestLines(method string) []string {
	e.t.Helper()
	b, err := os.ReadFile(e.d.LogPath)
	if err != nil {
		e.t.Fatal(err)
	}
	lines := strings.Split(string(b), "\n")
	id := ""
	for _, l := range lines {
		if strings.Contains(l, `msg="CRI call"`) && strings.Contains(l, "method=/runtime.v1."+method+" ") {
			if m := reqAttr.FindStringSubmatch(l); m != nil {
				id = m[1]
			}
		}
	}
	if id == "" {
		e.t.Fatalf("no CRI call line of %s in the daemon's log", method)
	}
	var out []string
	for _, l := range lines {
		if strings.Contains(l, "req="+id+" ") || strings.HasSuffix(l, "req="+id) {
			out = append(out, l)
		}
	}
	return out
}

func hasLine(lines []string, msg string) bool {
	for _, l := range lines {
		if strings.Contains(l, `msg="`+msg+`"`) {
			return true
		}
	}
	return false
}

// What the broker logs on behalf of a request carries the request's ID,
// so a call's lines can be found from the interceptor's.
func TestRequestLinesCarryTheRequestID(t *testing.T) {
	e := newEnv(t)
	podID, ctrID, _ := e.runOne("req-log", e.containerConfig("c", "true"))
	if lines := e.requestLines("RuntimeService/CreateContainer"); !hasLine(lines, "container created") {
		t.Errorf("CreateContainer's lines lack \"container created\":\n%s", strings.Join(lines, "\n"))
	}
	e.waitContainerState(ctrID, runtimeapi.ContainerState_CONTAINER_EXITED, callTimeout)
	if _, err := e.rt().RemoveContainer(e.ctx(), &runtimeapi.RemoveContainerRequest{ContainerId: ctrID}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.rt().StopPodSandbox(e.ctx(), &runtimeapi.StopPodSandboxRequest{PodSandboxId: podID}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.is().RemoveImage(e.ctx(), &runtimeapi.RemoveImageRequest{Image: &runtimeapi.ImageSpec{Image: e.image}}); err != nil {
		t.Fatal(err)
	}
	if lines := e.requestLines("ImageService/RemoveImage"); !hasLine(lines, "image removed") {
		t.Errorf("RemoveImage's lines lack \"image removed\":\n%s", strings.Join(lines, "\n"))
	}
}
