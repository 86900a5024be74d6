package cgroups

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// files makes empty, writable control files in dir, as a cgroup has.
func files(t *testing.T, dir string, names ...string) {
	t.Helper()
	for _, n := range names {
		if err := os.WriteFile(filepath.Join(dir, n), nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

func readCtl(t *testing.T, dir, name string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, name))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestSetMemoryAndHugepagesV2: swap is written as v2's swap alone,
// reservation as memory.low, huge pages per size; what cannot be written
// is refused naming its file.
func TestSetMemoryAndHugepagesV2(t *testing.T) {
	tests := []struct {
		name    string
		r       Resources
		want    map[string]string
		wantErr string
	}{
		{"swap above limit", Resources{MemoryLimit: 100, MemorySwap: 300}, map[string]string{"memory.max": "100", "memory.swap.max": "200"}, ""},
		{"swap unlimited", Resources{MemoryLimit: 100, MemorySwap: -1}, map[string]string{"memory.swap.max": "max"}, ""},
		{"swap without limit", Resources{MemorySwap: 300}, nil, "needs a memory limit"},
		{"swap below limit", Resources{MemoryLimit: 300, MemorySwap: 100}, nil, "below the memory limit"},
		{"reservation", Resources{MemoryReservation: 64}, map[string]string{"memory.low": "64"}, ""},
		{"reservation all", Resources{MemoryReservation: -1}, map[string]string{"memory.low": "max"}, ""},
		{"hugepages", Resources{HugepageLimits: []HugepageLimit{{"2MB", 4 << 20}, {"1GB", 0}}}, map[string]string{"hugetlb.2MB.max": "4194304", "hugetlb.1GB.max": "0"}, ""},
		{"page size as a path", Resources{HugepageLimits: []HugepageLimit{{"../x", 1}}}, nil, "bad huge page size"},
		{"page size without unit", Resources{HugepageLimits: []HugepageLimit{{"2", 1}}}, nil, "bad huge page size"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			d := t.TempDir()
			files(t, d, "memory.max", "memory.swap.max", "memory.low", "hugetlb.2MB.max", "hugetlb.1GB.max")
			err := (&Cgroup{Paths: map[string]string{Unified: d}}).Set(tc.r)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("Set: %v, want an error with %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			for f, v := range tc.want {
				if got := readCtl(t, d, f); got != v {
					t.Errorf("%s = %q, want %q", f, got, v)
				}
			}
		})
	}
}

// TestSetSwapV1: v1 takes OCI's memory+swap as it is (-1 for any
// unlimited value), the reservation as the soft limit, huge pages in the
// hugetlb hierarchy. (The order of the limit and memsw writes matters only
// to the kernel, which plain files do not imitate.)
func TestSetSwapV1(t *testing.T) {
	tests := []struct {
		name string
		cur  string
		r    Resources
		want map[string]string
	}{
		{"grow", "100", Resources{MemoryLimit: 300, MemorySwap: 600}, map[string]string{"memory.limit_in_bytes": "300", "memory.memsw.limit_in_bytes": "600"}},
		{"shrink", "300", Resources{MemoryLimit: 100, MemorySwap: 200}, map[string]string{"memory.limit_in_bytes": "100", "memory.memsw.limit_in_bytes": "200"}},
		{"unlimited", "100", Resources{MemoryLimit: 100, MemorySwap: -5}, map[string]string{"memory.memsw.limit_in_bytes": "-1"}},
		{"reservation", "100", Resources{MemoryReservation: 50}, map[string]string{"memory.soft_limit_in_bytes": "50"}},
		{"hugepages", "100", Resources{HugepageLimits: []HugepageLimit{{"2MB", 1 << 21}}}, map[string]string{"hugetlb.2MB.limit_in_bytes": "2097152"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			mem, huge := t.TempDir(), t.TempDir()
			files(t, mem, "memory.limit_in_bytes", "memory.memsw.limit_in_bytes", "memory.soft_limit_in_bytes")
			files(t, huge, "hugetlb.2MB.limit_in_bytes")
			if err := os.WriteFile(filepath.Join(mem, "memory.limit_in_bytes"), []byte(tc.cur), 0o644); err != nil {
				t.Fatal(err)
			}
			if err := (&Cgroup{Paths: map[string]string{"memory": mem, "hugetlb": huge}}).Set(tc.r); err != nil {
				t.Fatal(err)
			}
			for f, v := range tc.want {
				d := mem
				if strings.HasPrefix(f, "hugetlb.") {
					d = huge
				}
				if got := readCtl(t, d, f); got != v {
					t.Errorf("%s = %q, want %q", f, got, v)
				}
			}
		})
	}
}

// TestSetHugepagesV1WithoutHierarchy: a cgroup outside any hugetlb
// hierarchy refuses huge page limits rather than dropping them.
func TestSetHugepagesV1WithoutHierarchy(t *testing.T) {
	c := &Cgroup{Paths: map[string]string{"memory": t.TempDir()}}
	err := c.Set(Resources{HugepageLimits: []HugepageLimit{{"2MB", 1}}})
	if err == nil || !strings.Contains(err.Error(), "hugetlb") {
		t.Fatalf("Set: %v, want a refusal naming hugetlb", err)
	}
}
