package supervisor

import (
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/internal/testutil"
)

// TestDiskMountShared: two apps naming one disk share one read-only
// erofs mount of it, which goes with the last; the disk is found through
// sysfs as the guest shows a SCSI disk (here a loop device stands in).
func TestDiskMountShared(t *testing.T) {
	testutil.NeedRoot(t, "makes a loop device and mounts erofs")
	if _, err := exec.LookPath("mkfs.erofs"); err != nil {
		t.Skip("mkfs.erofs is not installed (erofs-utils)")
	}
	tmp := t.TempDir()
	src := filepath.Join(tmp, "src")
	if err := os.MkdirAll(filepath.Join(src, "etc"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(src, "etc", "hello"), []byte("from the disk\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	img := filepath.Join(tmp, "disk.erofs")
	if out, err := exec.Command("mkfs.erofs", "--quiet", img, src).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.erofs: %v: %s", err, out)
	}
	out, err := exec.Command("losetup", "--find", "--show", "--read-only", img).Output()
	if err != nil {
		t.Skipf("no loop device here: %v", err)
	}
	loop := strings.TrimSpace(string(out))
	t.Cleanup(func() { exec.Command("losetup", "-d", loop).Run() })
	var st unix.Stat_t
	if err := unix.Stat(loop, &st); err != nil {
		t.Fatal(err)
	}
	sys := filepath.Join(tmp, "sys")
	fakeSCSI(t, sys, "2:0:4:0", filepath.Base(loop), fmt.Sprintf("%d:%d", unix.Major(st.Rdev), unix.Minor(st.Rdev)), "abc")
	if err := os.WriteFile(filepath.Join(sys, "2:0:4:0", "block", filepath.Base(loop), "size"), []byte("8\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	dev := filepath.Join(tmp, "dev")
	if err := os.Mkdir(dev, 0o755); err != nil {
		t.Fatal(err)
	}
	oldSys, oldDev := sysSCSIDevices, devDir
	sysSCSIDevices, devDir = sys, dev
	t.Cleanup(func() { sysSCSIDevices, devDir = oldSys, oldDev })

	a := &Agent{dir: filepath.Join(tmp, "state"), log: slog.New(slog.DiscardHandler)}
	d := &api.Disk{Target: 4, Serial: "abc", FSType: "erofs"}
	dir1, err := a.acquireDisk("one", d)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(dir1, unix.MNT_DETACH) })
	dir2, err := a.acquireDisk("two", d)
	if err != nil || dir2 != dir1 {
		t.Fatalf("second app: %s, %v; want the first's mount %s", dir2, err, dir1)
	}
	if b, err := os.ReadFile(filepath.Join(dir1, "etc", "hello")); err != nil || string(b) != "from the disk\n" {
		t.Errorf("file on the disk: %q, %v", b, err)
	}
	if err := os.WriteFile(filepath.Join(dir1, "new"), nil, 0o644); err == nil {
		t.Error("the disk's mount is writable")
	}
	mounted := func() bool {
		m, err := mountinfo.Mounted(dir1)
		return err == nil && m
	}
	if err := a.releaseDisk("one", d); err != nil || !mounted() {
		t.Fatalf("after the first app let go: %v, mounted %v; want it still mounted", err, mounted())
	}
	if err := a.releaseDisk("one", d); err != nil {
		t.Errorf("releasing twice: %v", err)
	}
	if err := a.releaseDisk("two", d); err != nil || mounted() {
		t.Fatalf("after the last app let go: %v, mounted %v; want it unmounted", err, mounted())
	}
	if ents, _ := os.ReadDir(dev); len(ents) != 0 {
		t.Errorf("device nodes left: %v", ents)
	}
}
