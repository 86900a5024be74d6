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
	p, m, err := SELinuxLabels(nil)
	if err != nil || p != "" || m != "" {
		t.Errorf("no options: %q %q %v", p, m, err)
	}
	p, m, err = SELinuxLabels(&SELinuxOptions{User: "user_u", Role: "user_r", Type: "t", Level: "s0:c1.c3"})
	if err != nil || p != "user_u:user_r:t:s0:c1.c3" || m != "user_u:object_r:container_file_t:s0:c1.c3" {
		t.Errorf("options: %q %q %v", p, m, err)
	}
	for _, bad := range []SELinuxOptions{{Type: "a b"}, {Role: "r:x"}, {Level: `s0"`}} {
		if _, _, err := SELinuxLabels(&bad); err == nil {
			t.Errorf("%+v accepted", bad)
		}
	}
	if got := MountData("size=1m", "x:y:z:s0"); got != "size=1m" {
		t.Errorf("mount data without SELinux: %q", got)
	}
	if err := SetSELinuxExec("system_u:system_r:container_t:s0"); err != nil {
		t.Errorf("exec label without SELinux: %v", err)
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
