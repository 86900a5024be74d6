package devices

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

func TestVFIOGroup(t *testing.T) {
	if ok, _, _ := VFIOGroup("/dev/null", "/dev", t.TempDir()); ok {
		t.Error("/dev/null is taken for a VFIO group")
	}
	ok, _, err := VFIOGroup("/dev/vfio/987654", "/dev", t.TempDir())
	if !ok || err == nil || !strings.Contains(err.Error(), "VFIO group 987654") {
		t.Errorf("a group that does not exist: ok=%v %v", ok, err)
	}
	// A group node (a file stands for it here) and its IOMMU group.
	dev, sys := t.TempDir(), t.TempDir()
	if err := os.MkdirAll(filepath.Join(dev, "vfio"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dev, "vfio/0"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	ok, _, err = VFIOGroup("/dev/vfio/0", dev, sys)
	if !ok || err == nil || !strings.Contains(err.Error(), "IOMMU group") {
		t.Errorf("a group node without its IOMMU group: ok=%v %v", ok, err)
	}
	for _, addr := range []string{"0000:01:00.1", "0000:01:00.0"} {
		if err := os.MkdirAll(filepath.Join(sys, "kernel/iommu_groups/0/devices", addr), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	ok, pci, err := VFIOGroup("/dev/vfio/0", dev, sys)
	if !ok || err != nil || !slices.Equal(pci, []string{"0000:01:00.0", "0000:01:00.1"}) {
		t.Errorf("group 0: %v %v %v", ok, pci, err)
	}
}
