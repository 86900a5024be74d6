package main

import (
	"os"
	"path/filepath"
	"testing"
)

// TestChooseAssetsDir: guest assets beside the binary win over the
// packaged ones; the packaged ones are found when nothing is beside it;
// with neither, the directory beside the binary is named.
func TestChooseAssetsDir(t *testing.T) {
	withAssets := func(t *testing.T) string {
		d := t.TempDir()
		for _, f := range []string{"initrd.cpio", "vmlinux"} {
			if err := os.WriteFile(filepath.Join(d, f), nil, 0o644); err != nil {
				t.Fatal(err)
			}
		}
		return d
	}
	empty := func(t *testing.T) string { return t.TempDir() }
	missing := func(t *testing.T) string { return filepath.Join(t.TempDir(), "guest") }
	for _, tc := range []struct {
		name           string
		beside, packed func(*testing.T) string
		want           string // "beside" or "packed"
	}{
		{"beside wins", withAssets, withAssets, "beside"},
		{"packaged when none beside", missing, withAssets, "packed"},
		{"packaged when beside is incomplete", empty, withAssets, "packed"},
		{"beside named when neither", missing, missing, "beside"},
		{"beside when only beside", withAssets, missing, "beside"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, p := tc.beside(t), tc.packed(t)
			want := map[string]string{"beside": b, "packed": p}[tc.want]
			if got := chooseAssetsDir(b, p); got != want {
				t.Errorf("chooseAssetsDir(%s, %s) = %s, want %s", b, p, got, want)
			}
		})
	}
}
