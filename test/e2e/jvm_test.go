package e2e

import (
	"os"
	"strings"
	"testing"
	"time"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/test/e2e/harness"
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
			e := &env{t: t, reg: e.reg, d: e.d, image: e.image}
			podCfg := e.netPodConfig("jvm-"+s.handler, s)
			// The sum of its containers' limits, as the kubelet sends
			// it (a VM is sized from it and the guest's own memory).
			limits := &runtimeapi.LinuxContainerResources{MemoryLimitInBytes: 256 << 20, CpuQuota: 50000, CpuPeriod: 100000}
			podCfg.Linux.Resources = limits
			pod := e.runStage1Pod(podCfg, s)
			cfg := e.netContainer(s, "java", "java", "-XshowSettings:system", "-version")
			cfg.Image = &runtimeapi.ImageSpec{Image: jre}
			cfg.Linux.Resources = limits
			id := e.createAndStart(pod, podCfg, cfg)
			// Under TCG (kvm here) the JVM starts in minutes, not seconds.
			st := e.waitContainerState(id, runtimeapi.ContainerState_CONTAINER_EXITED, 5*time.Minute)
			out := e.logText(logPath(podCfg, cfg))
			if st.ExitCode != 0 {
				t.Fatalf("java exited %d:\n%s", st.ExitCode, out)
			}
			for _, want := range []string{"Memory Limit: 256.00M", "Effective CPU Count: 1"} {
				if !strings.Contains(out, want) {
					t.Errorf("the JVM does not report %q:\n%s", want, out)
				}
			}
		})
	}
}
