package host

import (
	"errors"
	"fmt"
	"testing"

	"github.com/godbus/dbus/v5"
	"github.com/stagelet/stagelet/cgroups"
	"github.com/stagelet/stagelet/internal/lsm"
)

func TestSystemdProperties(t *testing.T) {
	l := &SystemdLauncher{}
	props := map[string]any{}
	for _, p := range l.properties(LaunchSpec{
		Name: "stagelet-pod-x", Path: "/bin/agent", Args: []string{"agent", "--socket", "s"},
		Env: []string{"A=1"}, LogPath: "/var/log/x.log",
	}) {
		props[p.Name] = p.Value.Value()
	}
	for k, want := range map[string]any{
		"Type":                       "exec",
		"Slice":                      cgroups.DefaultSlice,
		"WorkingDirectory":           "/",
		"KillMode":                   "mixed",
		"Delegate":                   true,
		"CollectMode":                "inactive-or-failed",
		"StandardInput":              "null",
		"StandardOutputFileToAppend": "/var/log/x.log",
		"StandardErrorFileToAppend":  "/var/log/x.log",
	} {
		if props[k] != want {
			t.Errorf("%s = %v, want %v", k, props[k], want)
		}
	}
	if env, _ := props["Environment"].([]string); len(env) != 1 || env[0] != "A=1" {
		t.Errorf("Environment = %v", props["Environment"])
	}
	if _, ok := props["ExecStart"]; !ok {
		t.Error("no ExecStart")
	}
	l.Slice = "pods.slice"
	for _, p := range l.properties(LaunchSpec{Name: "n", Path: "/p", LogPath: "/l"}) {
		if p.Name == "Slice" && p.Value.Value() != "pods.slice" {
			t.Errorf("Slice = %v, want pods.slice", p.Value.Value())
		}
	}
}

// TestReleaseLaunchedPlain: the plain launcher keeps nothing to release.
func TestReleaseLaunchedPlain(t *testing.T) {
	if err := ReleaseLaunched(t.Context(), &PlainLauncher{}, "stagelet-pod-x"); err != nil {
		t.Fatal(err)
	}
	if _, ok := Launcher(&PlainLauncher{}).(UnitLauncher); ok {
		t.Fatal("the plain launcher claims to be a unit launcher")
	}
}

// TestPodSliceAndNetNS: a launch's own slice (the kubelet's pod slice)
// wins over the launcher's, and a network namespace becomes the unit's.
func TestPodSliceAndNetNS(t *testing.T) {
	l := &SystemdLauncher{Slice: "stagelet.slice"}
	props := map[string]any{}
	for _, p := range l.properties(LaunchSpec{
		Name: "n", Path: "/p", LogPath: "/l",
		Slice: "kubepods-burstable-pod1234.slice", NetNS: "/run/stagelet/netns/x",
	}) {
		props[p.Name] = p.Value.Value()
	}
	if props["Slice"] != "kubepods-burstable-pod1234.slice" {
		t.Errorf("Slice = %v", props["Slice"])
	}
	if props["NetworkNamespacePath"] != "/run/stagelet/netns/x" {
		t.Errorf("NetworkNamespacePath = %v", props["NetworkNamespacePath"])
	}
	for _, p := range l.properties(LaunchSpec{Name: "n", Path: "/p", LogPath: "/l"}) {
		if p.Name == "NetworkNamespacePath" {
			t.Error("NetworkNamespacePath set without a NetNS")
		}
	}
}

// TestPlainLauncherRefusesNetNS: a field the plain launcher cannot honour
// is refused, not ignored.
func TestPlainLauncherRefusesNetNS(t *testing.T) {
	_, err := (&PlainLauncher{}).Launch(t.Context(), LaunchSpec{Name: "n", Path: "/bin/true", LogPath: t.TempDir() + "/log", NetNS: "/run/netns/x"})
	if err == nil {
		t.Fatal("launched with a network namespace it cannot join")
	}
}

// TestConfinementProperties: a launch's SELinux label and AppArmor
// profile become its unit's SELinuxContext= and AppArmorProfile=, both
// "(bs)" with failures not ignored; without them the unit has neither.
func TestConfinementProperties(t *testing.T) {
	l := &SystemdLauncher{}
	props := map[string]dbus.Variant{}
	for _, p := range l.properties(LaunchSpec{
		Name: "n", Path: "/p", LogPath: "/l",
		SELinuxLabel: "system_u:system_r:container_kvm_t:s0:c1,c2", AppArmorProfile: "stagelet-vm-x",
	}) {
		props[p.Name] = p.Value
	}
	for name, want := range map[string]string{"SELinuxContext": "system_u:system_r:container_kvm_t:s0:c1,c2", "AppArmorProfile": "stagelet-vm-x"} {
		v, ok := props[name]
		if !ok {
			t.Errorf("no %s", name)
			continue
		}
		if sig := v.Signature().String(); sig != "(bs)" {
			t.Errorf("%s has signature %s, want (bs)", name, sig)
		}
		if got := fmt.Sprint(v.Value()); got != "{false "+want+"}" {
			t.Errorf("%s = %s, want {false %s}", name, got, want)
		}
	}
	for _, p := range l.properties(LaunchSpec{Name: "n", Path: "/p", LogPath: "/l"}) {
		if p.Name == "SELinuxContext" || p.Name == "AppArmorProfile" {
			t.Errorf("%s set without being asked for", p.Name)
		}
	}
}

// TestPlainLauncherRefusesAppArmorWithout: a profile asked for where
// AppArmor is off is refused, not ignored.
func TestPlainLauncherRefusesAppArmorWithout(t *testing.T) {
	if lsm.AppArmorKernelEnabled() {
		t.Skip("AppArmor is enabled here")
	}
	_, err := (&PlainLauncher{}).Launch(t.Context(), LaunchSpec{Name: "n", Path: "/bin/true", LogPath: t.TempDir() + "/log", AppArmorProfile: "stagelet-vm-x"})
	if !errors.Is(err, lsm.ErrAppArmorDisabled) {
		t.Fatalf("launched under a profile AppArmor cannot apply: %v", err)
	}
}

// TestGoneByName: whether a unit is gone is decided by the bus error's
// name, wrapped or not, never by its text.
func TestGoneByName(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want bool
	}{
		{dbus.Error{Name: "org.freedesktop.systemd1.NoSuchUnit", Body: []any{"Unit x.service not loaded."}}, true},
		{fmt.Errorf("reset: %w", &dbus.Error{Name: "org.freedesktop.systemd1.LoadFailed"}), true},
		{dbus.Error{Name: "org.freedesktop.DBus.Error.AccessDenied", Body: []any{"Unit x.service not loaded."}}, false},
		{errors.New("Unit x.service not loaded."), false},
	} {
		if got := gone(tc.err); got != tc.want {
			t.Errorf("gone(%v) = %v, want %v", tc.err, got, tc.want)
		}
	}
}
