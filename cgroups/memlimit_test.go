package cgroups

import (
	"os"
	"path/filepath"
	"testing"
)

func TestMemoryLimit(t *testing.T) {
	for _, c := range []struct {
		name  string
		key   string
		file  string
		files map[string]string // dir beneath the root → file content
		want  uint64
	}{
		{"v1 lowest ancestor", "memory", "memory.limit_in_bytes",
			map[string]string{"": "9223372036854771712", "kubepods": "8000000000", "kubepods/pod": "36700160"}, 36700160},
		{"v1 unlimited", "memory", "memory.limit_in_bytes",
			map[string]string{"": "9223372036854771712", "kubepods": "9223372036854771712", "kubepods/pod": "9223372036854771712"}, 0},
		{"v1 child lower than parent's", "memory", "memory.limit_in_bytes",
			map[string]string{"kubepods": "1000", "kubepods/pod": "2000"}, 1000},
		{"v2", Unified, "memory.max",
			map[string]string{"kubepods": "max", "kubepods/pod": "209715200"}, 209715200},
		{"v2 unlimited", Unified, "memory.max",
			map[string]string{"kubepods": "max", "kubepods/pod": "max"}, 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			root := t.TempDir()
			for d, v := range c.files {
				if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(filepath.Join(root, d, c.file), []byte(v+"\n"), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			// The pod's own cgroup does not exist yet.
			cg := &Cgroup{Paths: map[string]string{c.key: filepath.Join(root, "kubepods/pod/stagelet-pod-x")}}
			got, err := cg.MemoryLimit()
			if err != nil || got != c.want {
				t.Fatalf("MemoryLimit() = %d, %v; want %d", got, err, c.want)
			}
		})
	}
	none := &Cgroup{Paths: map[string]string{"cpu": t.TempDir()}}
	if got, err := none.MemoryLimit(); err != nil || got != 0 {
		t.Fatalf("without a memory controller: %d, %v", got, err)
	}
}
