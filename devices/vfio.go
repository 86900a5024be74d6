package devices

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sort"
)

var vfioGroupPath = regexp.MustCompile(`^/dev/vfio/([0-9]+)$`)

// VFIOGroup tells whether path names a VFIO group (/dev/vfio/N) and, if so,
// lists the PCI addresses of the devices in IOMMU group N. dev and sysfs
// are where /dev and /sys are (other roots for tests). A group whose node
// or whose IOMMU group does not exist is an error saying which.
func VFIOGroup(path, dev, sysfs string) (ok bool, pci []string, err error) {
	m := vfioGroupPath.FindStringSubmatch(filepath.Clean(path))
	if m == nil {
		return false, nil, nil
	}
	if _, err := os.Stat(filepath.Join(dev, "vfio", m[1])); err != nil {
		return true, nil, fmt.Errorf("VFIO group %s: %w (is the device bound to vfio-pci, and does the host have an IOMMU?)", m[1], err)
	}
	ents, err := os.ReadDir(filepath.Join(sysfs, "kernel/iommu_groups", m[1], "devices"))
	if err != nil {
		return true, nil, fmt.Errorf("VFIO group %s: its IOMMU group: %w", m[1], err)
	}
	for _, e := range ents {
		pci = append(pci, e.Name())
	}
	if len(pci) == 0 {
		return true, nil, fmt.Errorf("VFIO group %s: its IOMMU group holds no device", m[1])
	}
	sort.Strings(pci)
	return true, pci, nil
}
