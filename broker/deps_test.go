package broker

import (
	"os/exec"
	"strings"
	"testing"
)

// TestBrokerConfigCRILinkNoDBus: the broker, the node configuration and
// the CRI server link no D-Bus and no backend's host bookkeeping
// (stage1/host, which launches systemd units over D-Bus): what they share
// with the backends (cgroup and slice names, pod cgroups, mounts) lives in
// the packages that own it (cgroups, internal/mountsafe,
// internal/bindmount), and the backends are linked by the stagelet
// command only, as the OpenTelemetry SDK is.
func TestBrokerConfigCRILinkNoDBus(t *testing.T) {
	pkgs := []string{"broker", "config", "cri"}
	for i, p := range pkgs {
		pkgs[i] = "github.com/stagelet/stagelet/" + p
	}
	out, err := exec.Command("go", append([]string{"list", "-deps"}, pkgs...)...).Output()
	if err != nil {
		t.Skipf("go list: %v", err)
	}
	deps := strings.Fields(string(out))
	if len(deps) < len(pkgs) {
		t.Fatalf("go list named %d packages for %d", len(deps), len(pkgs))
	}
	for _, dep := range deps {
		for _, banned := range []string{
			"github.com/godbus/dbus",
			"github.com/coreos/go-systemd/v22/dbus",
			"github.com/stagelet/stagelet/stage1/host",
			// Spans through the OpenTelemetry API (package tracing); its
			// SDK and exporter are the stagelet command's (tracing/otlp).
			"go.opentelemetry.io/otel/sdk",
			"go.opentelemetry.io/otel/exporters",
		} {
			if dep == banned || strings.HasPrefix(dep, banned+"/") {
				t.Errorf("one of %v links %s", pkgs, dep)
			}
		}
	}
}
