package supervisor

import (
	"log/slog"
	"os"
	"path/filepath"
	"testing"

	"github.com/stagelet/stagelet/cgroups"
)

// TestWithMemory: the pod's memory cgroup given to the agent replaces the
// memory directory of the agent's own cgroup (the apps' go beneath it)
// only on cgroup v1 and only when it is a memory cgroup; otherwise the
// agent's own stands.
func TestWithMemory(t *testing.T) {
	pod := t.TempDir()
	if err := os.WriteFile(filepath.Join(pod, "memory.limit_in_bytes"), []byte("15728640\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	v1 := &cgroups.Cgroup{Paths: map[string]string{"memory": "/own/memory", "pids": "/own/pids"}}
	v2 := &cgroups.Cgroup{Paths: map[string]string{cgroups.Unified: "/own"}}
	log := slog.New(slog.DiscardHandler)
	for _, tc := range []struct {
		name string
		cg   *cgroups.Cgroup
		dir  string
		want map[string]string
	}{
		{"none given", v1, "", v1.Paths},
		{"v1", v1, pod, map[string]string{"memory": pod, "pids": "/own/pids"}},
		{"not a memory cgroup", v1, t.TempDir(), v1.Paths},
		{"missing", v1, filepath.Join(pod, "gone"), v1.Paths},
		{"v2", v2, pod, v2.Paths},
	} {
		got := withMemory(tc.cg, tc.dir, log)
		if len(got.Paths) != len(tc.want) {
			t.Errorf("%s: %v, want %v", tc.name, got.Paths, tc.want)
			continue
		}
		for k, v := range tc.want {
			if got.Paths[k] != v {
				t.Errorf("%s: %v, want %v", tc.name, got.Paths, tc.want)
			}
		}
	}
	if v1.Paths["memory"] != "/own/memory" {
		t.Errorf("the agent's own cgroup was changed: %v", v1.Paths)
	}
}
