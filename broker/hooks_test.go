package broker

import (
	"os"
	"path/filepath"
	"testing"
)

// TestHostPID: a container's process is found among the host's by its
// cgroup and its PID in its own namespace, which the agent reports.
func TestHostPID(t *testing.T) {
	root := t.TempDir()
	proc := func(pid, cgroup, nspid string) {
		dir := filepath.Join(root, pid)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		os.WriteFile(filepath.Join(dir, "cgroup"), []byte(cgroup), 0o644)
		os.WriteFile(filepath.Join(dir, "status"), []byte("Name:\tsh\nNSpid:\t"+nspid+"\n"), 0o644)
	}
	proc("100", "0::/pods/app-abc\n", "100\t7")                      // the init, in a pod's PID namespace
	proc("101", "0::/pods/app-abc\n", "101\t8")                      // an exec
	proc("7", "0::/system.slice/sshd.service\n", "7")                // the host's own PID 7
	proc("300", "12:pids:/pods/app-abc\n1:name=systemd:/x\n", "300") // fly: the host's namespace
	proc("self", "0::/\n", "1")
	old := procRoot
	procRoot = root
	t.Cleanup(func() { procRoot = old })
	for _, tc := range []struct {
		id   string
		pid  int
		want int
	}{
		{"abc", 7, 100}, {"abc", 8, 101}, {"abc", 300, 300}, {"abc", 9, 0}, {"other", 7, 0}, {"abc", 0, 0},
	} {
		if got := hostPID(tc.id, tc.pid); got != tc.want {
			t.Errorf("hostPID(%s, %d) = %d, want %d", tc.id, tc.pid, got, tc.want)
		}
	}
}
