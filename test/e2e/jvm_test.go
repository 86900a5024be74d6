package e2e

import (
	"os"
	"strings"
	"testing"

	"github.com/stagelet/stagelet/test/e2e/harness"
	"github.com/stagelet/stagelet/test/runcview"
)

// TestJVMSizesToItsContainer: a real program that sizes itself from its
// cgroups, OpenJDK 17, reports its container's memory limit and CPU
// count on every stage1 (as under runc: "Memory Limit: 256.00M",
// "Effective CPU Count: 1" for a 256 MiB container of half a CPU),
// where it reported none before and sized its heap to the node.
func TestJVMSizesToItsContainer(t *testing.T) {
	requireRoot(t)
	stage1s := []podStage1{flyStage1, nspawnStage1, kvmStage1}
	if os.Getenv("STAGELET_GUEST_ASSETS") == "" {
		t.Log("no kvm guest assets (make guest): kvm is not tried")
		stage1s = stage1s[:2]
	}
	e := newEnvOpts(t, harness.Options{Policy: allStage1sPolicy}, true)
	jre := e.reg.PushJRE(t, "e2e/jre", "17")
	e.pull(jre)
	for _, s := range stage1s {
		t.Run(s.handler, func(t *testing.T) {
			out := runcview.RunJVM(t, e.rt(), e.d.LogsDir, jre, runcview.Pod{Handler: s.handler, Namespace: "e2e", Name: "jvm-" + s.handler, NS: s.podNetNS()})
			for _, want := range runcview.JVMReports {
				if !strings.Contains(out, want) {
					t.Errorf("the JVM does not report %q:\n%s", want, out)
				}
			}
		})
	}
}
