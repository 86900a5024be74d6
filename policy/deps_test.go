package policy

import (
	"os/exec"
	"strings"
	"testing"
)

// Policy reads the stage1 contract's capability facts only: it links no
// backend, agent, cgroup or D-Bus code.
func TestPolicyLinksNoBackendCode(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", ".").Output()
	if err != nil {
		t.Skipf("go list: %v", err)
	}
	for _, dep := range strings.Fields(string(out)) {
		for _, banned := range []string{
			"github.com/stagelet/stagelet/stage1",
			"github.com/stagelet/stagelet/agent",
			"github.com/stagelet/stagelet/cgroups",
			"github.com/coreos/go-systemd",
			"github.com/godbus/dbus",
		} {
			if dep == banned || strings.HasPrefix(dep, banned+"/") && dep != "github.com/stagelet/stagelet/stage1/caps" {
				t.Errorf("policy links %s", dep)
			}
		}
	}
}
