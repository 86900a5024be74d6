package stage1_test

import (
	"os/exec"
	"strings"
	"testing"
)

// TestLeaf: the contract links neither the agent (beyond its protocol's
// types, agent/api) nor D-Bus nor any
// backend's host bookkeeping, so that policy and the broker can read it
// without them.
func TestLeaf(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", "github.com/stagelet/stagelet/stage1").Output()
	if err != nil {
		t.Skipf("go list: %v", err)
	}
	deps := strings.Fields(string(out))
	if len(deps) == 0 {
		t.Fatal("go list named no dependency at all")
	}
	for _, d := range deps {
		for _, bad := range []string{"github.com/stagelet/stagelet/agent/supervisor", "github.com/stagelet/stagelet/agent/guestinit", "github.com/stagelet/stagelet/agent/client", "github.com/stagelet/stagelet/agent/transport", "github.com/godbus/", "github.com/coreos/go-systemd", "github.com/stagelet/stagelet/stage1/host", "github.com/stagelet/stagelet/cgroups"} {
			if d == bad || (strings.HasSuffix(bad, "/") && strings.HasPrefix(d, bad)) {
				t.Errorf("package stage1 depends on %s", d)
			}
		}
	}
}
