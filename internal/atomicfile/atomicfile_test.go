package atomicfile

import (
	"os"
	"path/filepath"
	"testing"
)

func TestIsTemp(t *testing.T) {
	for name, want := range map[string]bool{
		".a.json.tmp-123": true,
		"a.json":          false,
		".a.json":         false,
		"a.json.tmp-1":    false, // not hidden: not Write's
		".tmp-1":          false,
		".a.json.tmp-":    false,
	} {
		if got := IsTemp(name); got != want {
			t.Errorf("IsTemp(%q) = %v, want %v", name, got, want)
		}
	}
	// What Write makes while it writes is what IsTemp recognises.
	dir := t.TempDir()
	f, err := os.CreateTemp(dir, "."+filepath.Base("x.json")+".tmp-*")
	if err != nil {
		t.Fatal(err)
	}
	f.Close()
	if !IsTemp(filepath.Base(f.Name())) {
		t.Errorf("IsTemp(%q) = false", filepath.Base(f.Name()))
	}
}
