package node

import (
	"encoding/json"
	"os/exec"
	"strings"
	"testing"
)

// TestDoctor: on a node as distributions ship it (systemd as PID 1, pure
// cgroup v2) with the service running, stagelet doctor finds the default
// stage1 runnable, and says so in text and JSON: systemd is PID 1 with its
// version, the service's pod cgroups get their controllers (doctor reads
// where the daemon put them), systemd-nspawn is there. The report is
// logged for the operator's eyes.
func TestDoctor(t *testing.T) {
	e := nodeEnv(t)
	e.install(t, "")
	t.Cleanup(func() { stopService(t) })
	client(t)
	out, err := exec.Command(e.bin, "doctor").CombinedOutput()
	t.Logf("stagelet doctor:\n%s", out)
	if err != nil {
		t.Fatalf("stagelet doctor: %v", err)
	}
	text := strings.Join(strings.Fields(string(out)), " ")
	for _, want := range []string{"ok cgroups v2 (unified)", "ok systemd PID 1, systemd 252", "Delegate=yes", "ok nspawn /usr/bin/systemd-nspawn", "ok stage1 nspawn can run here (the default stage1)"} {
		if !strings.Contains(text, want) {
			t.Errorf("doctor does not say %q", want)
		}
	}
	js, err := exec.Command(e.bin, "doctor", "-o", "json").Output()
	if err != nil {
		t.Fatalf("stagelet doctor -o json: %v", err)
	}
	var rep struct {
		Checks        []struct{ Name, Status string }
		Stage1s       map[string]string
		DefaultStage1 string
	}
	if err := json.Unmarshal(js, &rep); err != nil {
		t.Fatalf("doctor -o json: %v\n%s", err, js)
	}
	if rep.DefaultStage1 != "nspawn" || rep.Stage1s["nspawn"] != "" || len(rep.Checks) < 10 {
		t.Errorf("doctor -o json: %+v", rep)
	}
}
