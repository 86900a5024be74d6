package agent

import (
	"os/exec"
	"strings"
	"testing"
)

// TestHostSideLinksNoPodSide: the daemon's packages reach an agent
// through package client only; none links the supervisor or the VM's init
// (only the stagelet command does, to run them, and stage1/fake, a test
// double that runs the supervisor in-process).
func TestHostSideLinksNoPodSide(t *testing.T) {
	host := []string{"broker", "cri", "stage1/host", "stage1/fly", "stage1/nspawn", "stage1/kvm", "stage1/podconn", "agent/client"}
	for i, p := range host {
		host[i] = "github.com/stagelet/stagelet/" + p
	}
	out, err := exec.Command("go", append([]string{"list", "-deps"}, host...)...).Output()
	if err != nil {
		t.Skipf("go list: %v", err)
	}
	deps := strings.Fields(string(out))
	if len(deps) < len(host) {
		t.Fatalf("go list named %d packages for %d", len(deps), len(host))
	}
	for _, d := range deps {
		switch d {
		case "github.com/stagelet/stagelet/agent/supervisor", "github.com/stagelet/stagelet/agent/guestinit":
			t.Errorf("a host-side package (one of %v) links %s", host, d)
		}
	}
	for _, pod := range []string{"agent/supervisor", "agent/guestinit"} {
		out, err := exec.Command("go", "list", "-deps", "github.com/stagelet/stagelet/"+pod).Output()
		if err != nil {
			t.Fatalf("go list %s: %v", pod, err)
		}
		for _, d := range strings.Fields(string(out)) {
			if d == "github.com/stagelet/stagelet/agent/client" || strings.HasPrefix(d, "github.com/stagelet/stagelet/broker") {
				t.Errorf("%s links the daemon's %s", pod, d)
			}
		}
	}
}
