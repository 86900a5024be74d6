package supervisor

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/errdefs"
)

// An app whose spec names a disk (AppSpec.RootfsDisk) reads its image
// from it: a read-only file system on a SCSI disk the VM was given (hot-
// plugged by the host just before the app is created), mounted once
// beneath <StateDir>/disks for every app that names it and unmounted
// with the last. It is the lower layer of the app's overlay, whose upper
// is the app's tmpfs as with any local layer (layer.go); the overlay is
// mounted in that tmpfs, and becomes the app's Rootfs.

// diskWait bounds the wait for a plugged disk to show in the guest: the
// guest's SCSI scan after the host's plug (slow under emulation).
var diskWait = 60 * time.Second

// sysSCSIDevices is where the kernel lists SCSI devices (H:C:T:L);
// devDir is the guest's devtmpfs.
var (
	sysSCSIDevices = "/sys/bus/scsi/devices"
	devDir         = "/dev"
)

// diskMounts are the disks mounted for apps, by disk key.
type diskMounts struct {
	mu sync.Mutex
	m  map[string]*diskMount
}

type diskMount struct {
	dir   string
	users []string // app IDs
}

// diskKey names a disk: its target and serial.
func diskKey(d *api.Disk) string { return strconv.Itoa(d.Target) + "-" + d.Serial }

// validateDisk checks an app's RootfsDisk.
func validateDisk(s *api.AppSpec) error {
	d := s.RootfsDisk
	if d == nil {
		return nil
	}
	if !s.LocalUpper {
		return errdefs.InvalidArgument("app %s: a rootfs disk is the lower layer of a local writable layer: localUpper is not set", s.ID)
	}
	if d.Target < 0 || d.Target > 255 {
		return errdefs.InvalidArgument("app %s: rootfs disk target %d: want 0 to 255", s.ID, d.Target)
	}
	if d.FSType != "erofs" {
		return errdefs.InvalidArgument("app %s: rootfs disk file system %q: only erofs is mounted", s.ID, d.FSType)
	}
	for _, r := range d.Serial {
		if !(r >= '0' && r <= '9' || r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z') {
			return errdefs.InvalidArgument("app %s: rootfs disk serial %q: letters and digits only", s.ID, d.Serial)
		}
	}
	return nil
}

// acquireDisk mounts disk d for app id (or takes the mount another app
// has) and returns where. Errors name the disk and what failed.
func (a *Agent) acquireDisk(id string, d *api.Disk) (string, error) {
	a.disks.mu.Lock()
	defer a.disks.mu.Unlock()
	key := diskKey(d)
	if m := a.disks.m[key]; m != nil {
		if !slices.Contains(m.users, id) {
			m.users = append(m.users, id)
		}
		return m.dir, nil
	}
	deadline := time.Now().Add(diskWait)
	dev, err := waitDisk(d, diskWait)
	if err != nil {
		return "", err
	}
	base := filepath.Join(a.dir, "disks")
	if err := os.MkdirAll(base, 0o700); err != nil {
		return "", fmt.Errorf("disk %s: %w", key, err)
	}
	// The device node is our own, in the guest's devtmpfs (the state
	// directory's file system has nodev): the guest has no udev, and
	// devtmpfs may not show the disk yet.
	node := filepath.Join(devDir, "stagelet-disk-"+key)
	_ = os.Remove(node)
	if err := unix.Mknod(node, unix.S_IFBLK|0o600, int(dev.rdev)); err != nil {
		return "", fmt.Errorf("disk %s (%s): device node: %w", key, dev.name, err)
	}
	dir := filepath.Join(base, key)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		os.Remove(node)
		return "", fmt.Errorf("disk %s: %w", key, err)
	}
	if err := mountDisk(node, dir, d.FSType, deadline); err != nil {
		os.Remove(node)
		os.Remove(dir)
		return "", fmt.Errorf("disk %s (%s): mount %s read-only: %w", key, dev.name, d.FSType, err)
	}
	if a.disks.m == nil {
		a.disks.m = map[string]*diskMount{}
	}
	a.disks.m[key] = &diskMount{dir: dir, users: []string{id}}
	a.log.Info("disk mounted", "disk", key, "device", dev.name, "dir", dir)
	return dir, nil
}

// releaseDisk drops app id's use of disk d, unmounting it after the
// last. Idempotent.
func (a *Agent) releaseDisk(id string, d *api.Disk) error {
	a.disks.mu.Lock()
	defer a.disks.mu.Unlock()
	key := diskKey(d)
	m := a.disks.m[key]
	if m == nil || !slices.Contains(m.users, id) {
		return nil
	}
	m.users = slices.DeleteFunc(m.users, func(u string) bool { return u == id })
	if len(m.users) > 0 {
		return nil
	}
	if err := unmountIfMounted(m.dir); err != nil {
		m.users = append(m.users, id)
		return fmt.Errorf("disk %s: %w", key, err)
	}
	delete(a.disks.m, key)
	os.Remove(m.dir)
	os.Remove(filepath.Join(devDir, "stagelet-disk-"+key))
	return nil
}

// mountDisk mounts the file system on block device node at dir
// read-only. A disk the kernel lists before it can be opened (ENXIO,
// ENOMEDIUM while its SCSI probe ends) is tried again, polling with
// backoff, until deadline.
func mountDisk(node, dir, fstype string, deadline time.Time) error {
	for delay := 2 * time.Millisecond; ; delay = min(2*delay, 10*time.Millisecond) {
		err := unix.Mount(node, dir, fstype, unix.MS_RDONLY|unix.MS_NODEV, "")
		if err == nil {
			return nil
		}
		if !errors.Is(err, unix.ENXIO) && !errors.Is(err, unix.ENOMEDIUM) || time.Now().After(deadline) {
			return err
		}
		time.Sleep(delay) // polling: the guest has no udev to tell us
	}
}

// blockDev is a disk's block device as sysfs shows it.
type blockDev struct {
	name string // sdX
	rdev uint64
}

// waitDisk waits, polling sysfs with backoff until timeout, for the
// SCSI disk at d.Target (channel 0, LUN 0) to show with its block device
// and, where the kernel read it, serial number d.Serial.
func waitDisk(d *api.Disk, timeout time.Duration) (blockDev, error) {
	deadline := time.Now().Add(timeout)
	last := "no SCSI device at that target"
	for delay := 2 * time.Millisecond; ; delay = min(2*delay, 10*time.Millisecond) {
		dev, why, ok := findDisk(d)
		if ok {
			return dev, nil
		}
		last = why
		if time.Now().After(deadline) {
			return blockDev{}, errdefs.New(errdefs.ErrDeadlineExceeded, "disk at SCSI target %d (serial %s) did not show in %v: %s", d.Target, d.Serial, timeout, last)
		}
		time.Sleep(delay) // polling sysfs: the guest has no udev to tell us
	}
}

// findDisk looks once for d in sysfs; why says what is missing.
func findDisk(d *api.Disk) (blockDev, string, bool) {
	ents, err := os.ReadDir(sysSCSIDevices)
	if err != nil {
		return blockDev{}, err.Error(), false
	}
	suffix := ":0:" + strconv.Itoa(d.Target) + ":0"
	why := "no SCSI device at that target"
	for _, e := range ents {
		if !strings.HasSuffix(e.Name(), suffix) || strings.Count(e.Name(), ":") != 3 {
			continue
		}
		devDir := filepath.Join(sysSCSIDevices, e.Name())
		if d.Serial != "" {
			if vpd, err := os.ReadFile(filepath.Join(devDir, "vpd_pg80")); err == nil && !bytes.Contains(vpd, []byte(d.Serial)) {
				why = fmt.Sprintf("the device at %s has another serial number", e.Name())
				continue
			}
		}
		blocks, err := os.ReadDir(filepath.Join(devDir, "block"))
		if err != nil || len(blocks) == 0 {
			why = fmt.Sprintf("device %s has no block device yet", e.Name())
			continue
		}
		name := blocks[0].Name()
		if size, err := os.ReadFile(filepath.Join(devDir, "block", name, "size")); err == nil && strings.TrimSpace(string(size)) == "0" {
			why = fmt.Sprintf("block device %s has no size yet", name)
			continue
		}
		b, err := os.ReadFile(filepath.Join(devDir, "block", name, "dev"))
		if err != nil {
			why = fmt.Sprintf("block device %s: %v", name, err)
			continue
		}
		maj, min, ok := strings.Cut(strings.TrimSpace(string(b)), ":")
		ma, err1 := strconv.ParseUint(maj, 10, 32)
		mi, err2 := strconv.ParseUint(min, 10, 32)
		if !ok || err1 != nil || err2 != nil {
			why = fmt.Sprintf("block device %s: bad dev %q", name, b)
			continue
		}
		return blockDev{name: name, rdev: unix.Mkdev(uint32(ma), uint32(mi))}, "", true
	}
	return blockDev{}, why, false
}
