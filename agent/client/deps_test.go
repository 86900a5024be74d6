package client

import (
	"os/exec"
	"strings"
	"testing"
)

// TestProtocolClientLinksNoStage1: the protocol client is the protocol
// only. What a backend adds around the calls (host paths shared into the
// pod, the pod's host figures) is stage1/podconn's, and the backends'
// readiness probes call this package, never the other way: it links no
// stage1 package (the contract, its backends, their host bookkeeping)
// and no broker.
func TestProtocolClientLinksNoStage1(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", ".").Output()
	if err != nil {
		t.Skipf("go list: %v", err)
	}
	deps := strings.Fields(string(out))
	if len(deps) == 0 {
		t.Fatal("go list named no dependency at all")
	}
	for _, dep := range deps {
		for _, banned := range []string{
			"github.com/stagelet/stagelet/stage1",
			"github.com/stagelet/stagelet/broker",
		} {
			if dep == banned || strings.HasPrefix(dep, banned+"/") {
				t.Errorf("agent/client links %s", dep)
			}
		}
	}
}
