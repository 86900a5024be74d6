package lsm

import (
	"os"
	"path/filepath"
	"testing"
)

func TestSELinuxLabelsWhereDisabled(t *testing.T) {
	if SELinuxEnabled() {
		t.Skip("SELinux is enabled here")
	}
	l, err := PodSELinuxLabels(nil)
	if err != nil || l != (Labels{}) {
		t.Errorf("no options: %+v %v", l, err)
	}
	l, err = PodSELinuxLabels(&SELinuxOptions{User: "user_u", Role: "user_r", Type: "t", Level: "s0:c1.c3"})
	if err != nil || l.Process != "user_u:user_r:t:s0:c1.c3" || l.Mount != "user_u:object_r:container_file_t:s0:c1.c3" {
		t.Errorf("options: %+v %v", l, err)
	}
	for _, bad := range []SELinuxOptions{{Type: "a b"}, {Role: "r:x"}, {Level: `s0"`}} {
		if _, err := PodSELinuxLabels(&bad); err == nil {
			t.Errorf("%+v accepted", bad)
		}
		if _, err := ContainerSELinuxLabels(Labels{Process: DefaultSELinuxProcessLabel, Mount: DefaultSELinuxMountLabel}, &bad); err == nil {
			t.Errorf("%+v accepted for a container", bad)
		}
	}
	if got := MountData("size=1m", "x:y:z:s0"); got != "size=1m" {
		t.Errorf("mount data without SELinux: %q", got)
	}
	if err := SetSELinuxExec("system_u:system_r:container_t:s0"); err != nil {
		t.Errorf("exec label without SELinux: %v", err)
	}
}

// A container runs at its pod's level unless it gives its own, and its
// options replace the pod's parts as label.InitLabels would.
func TestContainerSELinuxLabels(t *testing.T) {
	pod := Labels{Process: "system_u:system_r:container_t:s0:c7,c300", Mount: "system_u:object_r:container_file_t:s0:c7,c300"}
	for _, tc := range []struct {
		pod  Labels
		opts *SELinuxOptions
		want Labels
	}{
		{pod, nil, pod},
		{pod, &SELinuxOptions{}, pod},
		{pod, &SELinuxOptions{Type: "spc_t"}, Labels{"system_u:system_r:spc_t:s0:c7,c300", pod.Mount}},
		{pod, &SELinuxOptions{User: "u", Level: "s0:c1,c2"}, Labels{"u:system_r:container_t:s0:c1,c2", "u:object_r:container_file_t:s0:c1,c2"}},
		{Labels{}, nil, Labels{}},
		{Labels{}, &SELinuxOptions{Level: "s0:c3,c4"}, Labels{"system_u:system_r:container_t:s0:c3,c4", "system_u:object_r:container_file_t:s0:c3,c4"}},
		// A pod without separation (privileged, or in the node's PID or
		// IPC namespace): its type, unless a container gives options.
		{Labels{Process: "system_u:system_r:spc_t:s0"}, nil, Labels{Process: "system_u:system_r:spc_t:s0"}},
		{Labels{Process: "system_u:system_r:spc_t:s0"}, &SELinuxOptions{Level: "s0:c3,c4"}, Labels{"system_u:system_r:container_t:s0:c3,c4", "system_u:object_r:container_file_t:s0:c3,c4"}},
	} {
		got, err := ContainerSELinuxLabels(tc.pod, tc.opts)
		if err != nil || got != tc.want {
			t.Errorf("pod %+v, options %+v: got %+v %v, want %+v", tc.pod, tc.opts, got, err, tc.want)
		}
	}
}

func TestAgentSELinuxLabel(t *testing.T) {
	got, err := AgentSELinuxLabel("system_u:system_r:container_t:s0:c7,c300")
	if want := "system_u:system_r:spc_t:s0:c7,c300"; err != nil || got != want {
		t.Errorf("got %q %v, want %q", got, err, want)
	}
	if _, err := AgentSELinuxLabel("nonsense"); err == nil {
		t.Error("a label that is no context: no error")
	}
	got, err = withType("system_u:system_r:container_t:s0:c7,c300", VMMSELinuxType)
	if want := "system_u:system_r:container_kvm_t:s0:c7,c300"; err != nil || got != want {
		t.Errorf("qemu's label: got %q %v, want %q", got, err, want)
	}
}

func TestAppArmorFiles(t *testing.T) {
	defer func(a, b string) { appArmorEnabledPath, appArmorFSPath = a, b }(appArmorEnabledPath, appArmorFSPath)
	dir := t.TempDir()
	appArmorEnabledPath = filepath.Join(dir, "enabled")
	appArmorFSPath = filepath.Join(dir, "apparmor")
	if AppArmorEnabled() {
		t.Error("enabled without files")
	}
	os.WriteFile(appArmorEnabledPath, []byte("Y\n"), 0o644)
	if AppArmorEnabled() {
		t.Error("enabled without securityfs")
	}
	os.Mkdir(appArmorFSPath, 0o755)
	if !AppArmorEnabled() {
		t.Error("not enabled")
	}
	os.WriteFile(filepath.Join(appArmorFSPath, "profiles"), []byte("stagelet-default (enforce)\nk8s-nginx (complain)\n"), 0o644)
	if !AppArmorProfileLoaded("k8s-nginx") || AppArmorProfileLoaded("k8s") {
		t.Error("profile list misread")
	}
	os.WriteFile(appArmorEnabledPath, []byte("N\n"), 0o644)
	if err := SetAppArmorExec("k8s-nginx"); err == nil {
		t.Error("profile applied where AppArmor is disabled")
	}
}
