package supervisor_test

import (
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/stagelet/stagelet/agent/api"
)

// TestContainerPIDNamespace: an app with a PID namespace of its own is PID
// 1 there, sees only its own processes, and ExecSync joins that namespace;
// an app in the pod's namespace does not.
func TestContainerPIDNamespace(t *testing.T) {
	ta := startAgent(t)
	rootfs := makeRootfs(t)
	ta.run(&api.AppSpec{ID: "own", Rootfs: rootfs, Args: []string{"sleep", "1000"}, Env: []string{"PATH=/bin"},
		PIDNamespace: api.PIDNamespaceContainer})
	ta.run(&api.AppSpec{ID: "shared", Rootfs: rootfs, Args: []string{"sleep", "1001"}, Env: []string{"PATH=/bin"}})

	self, err := os.Readlink("/proc/self/ns/pid")
	if err != nil {
		t.Fatal(err)
	}
	ownNS := strings.TrimSpace(string(ta.exec("own", "readlink", "/proc/self/ns/pid").Stdout))
	sharedNS := strings.TrimSpace(string(ta.exec("shared", "readlink", "/proc/self/ns/pid").Stdout))
	if ownNS == "" || ownNS == sharedNS {
		t.Fatalf("own %q, shared %q: the app has no PID namespace of its own", ownNS, sharedNS)
	}
	agentNS, _ := os.Readlink(fmt.Sprintf("/proc/%d/ns/pid", ta.cmd.Process.Pid))
	if sharedNS != agentNS {
		t.Errorf("shared app in %q, agent in %q", sharedNS, agentNS)
	}
	if cmd := ta.exec("own", "cat", "/proc/1/cmdline").Stdout; !strings.HasPrefix(string(cmd), "sleep\x001000") {
		t.Errorf("PID 1 of the app's namespace runs %q, want the app", cmd)
	}
	// The other app is not visible from inside; the app itself is.
	all := string(ta.exec("own", "sh", "-c", "cat /proc/[0-9]*/cmdline | tr '\\0' ' '").Stdout)
	if !strings.Contains(all, "sleep 1000") || strings.Contains(all, "sleep 1001") {
		t.Errorf("processes seen from the app's namespace: %q", all)
	}
	// The agent's own thread returned to its namespace.
	if now, _ := os.Readlink("/proc/self/ns/pid"); now != self {
		t.Errorf("the test process changed PID namespace: %s -> %s", self, now)
	}
}
