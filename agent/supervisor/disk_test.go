package supervisor

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/errdefs"
)

func TestValidateDisk(t *testing.T) {
	ok := &api.Disk{Target: 3, Serial: "abc123", FSType: "erofs"}
	for _, c := range []struct {
		name  string
		spec  api.AppSpec
		wrong string
	}{
		{"none", api.AppSpec{ID: "a"}, ""},
		{"good", api.AppSpec{ID: "a", LocalUpper: true, RootfsDisk: ok}, ""},
		{"no local upper", api.AppSpec{ID: "a", RootfsDisk: ok}, "localUpper"},
		{"target", api.AppSpec{ID: "a", LocalUpper: true, RootfsDisk: &api.Disk{Target: 256, FSType: "erofs"}}, "target"},
		{"fstype", api.AppSpec{ID: "a", LocalUpper: true, RootfsDisk: &api.Disk{FSType: "ext4"}}, "erofs"},
		{"serial", api.AppSpec{ID: "a", LocalUpper: true, RootfsDisk: &api.Disk{Serial: "../x", FSType: "erofs"}}, "serial"},
	} {
		err := validateDisk(&c.spec)
		if c.wrong == "" {
			if err != nil {
				t.Errorf("%s: %v", c.name, err)
			}
			continue
		}
		if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), c.wrong) {
			t.Errorf("%s: %v, want InvalidArgument naming %s", c.name, err, c.wrong)
		}
	}
}

// fakeSCSI lays out sysfs's view of a SCSI disk at target under dir.
func fakeSCSI(t *testing.T, dir, hctl, block, dev, serial string) {
	t.Helper()
	d := filepath.Join(dir, hctl)
	if err := os.MkdirAll(filepath.Join(d, "block", block), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(d, "block", block, "dev"), []byte(dev+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if serial != "" {
		if err := os.WriteFile(filepath.Join(d, "vpd_pg80"), append([]byte{0, 0x80, 0, byte(len(serial))}, serial...), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

func TestFindDisk(t *testing.T) {
	dir := t.TempDir()
	old := sysSCSIDevices
	sysSCSIDevices = dir
	t.Cleanup(func() { sysSCSIDevices = old })
	d := &api.Disk{Target: 2, Serial: "feedbeef", FSType: "erofs"}
	if _, err := waitDisk(d, 20*time.Millisecond); !errors.Is(err, errdefs.ErrDeadlineExceeded) || !strings.Contains(err.Error(), "target 2") {
		t.Fatalf("no disk: %v", err)
	}
	// Another disk's leftover at that target, and one at target 12.
	fakeSCSI(t, dir, "0:0:2:0", "sda", "8:0", "oldserial")
	fakeSCSI(t, dir, "0:0:12:0", "sdb", "8:16", "feedbeef")
	if _, err := waitDisk(d, 20*time.Millisecond); err == nil || !strings.Contains(err.Error(), "another serial") {
		t.Fatalf("wrong serial: %v", err)
	}
	fakeSCSI(t, dir, "1:0:2:0", "sdc", "8:32", "feedbeef")
	dev, err := waitDisk(d, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if dev.name != "sdc" || dev.rdev != unix.Mkdev(8, 32) {
		t.Errorf("found %+v, want sdc 8:32", dev)
	}
}
