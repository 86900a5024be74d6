package e2e

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/internal/testutil"
	"github.com/stagelet/stagelet/test/testregistry"
)

// vmDisks is a kvm pod's record of the image disks plugged into its VM.
type vmDisks struct {
	Disks []struct {
		ImageID string   `json:"imageId"`
		SHA256  string   `json:"sha256"`
		Path    string   `json:"path"`
		Target  int      `json:"target"`
		Users   []string `json:"users"`
	} `json:"disks"`
}

func (e *env) vmDisks(podID string) vmDisks {
	e.t.Helper()
	var d vmDisks
	b, err := os.ReadFile(filepath.Join(e.d.RunDir, "pods", podID, "vm", "disks.json"))
	if os.IsNotExist(err) {
		return d
	}
	if err != nil {
		e.t.Fatal(err)
	}
	if err := json.Unmarshal(b, &d); err != nil {
		e.t.Fatalf("disks.json: %v: %s", err, b)
	}
	return d
}

// rootLower is the lower directory of the overlay at / in a container.
func (e *env) rootLower(ctr string) string {
	e.t.Helper()
	for _, line := range strings.Split(e.execOK(ctr, "cat", "/proc/self/mounts"), "\n") {
		f := strings.Fields(line)
		if len(f) < 4 || f[1] != "/" || f[2] != "overlay" {
			continue
		}
		for _, o := range strings.Split(f[3], ",") {
			if v, ok := strings.CutPrefix(o, "lowerdir="); ok {
				return v
			}
		}
	}
	e.t.Fatalf("container %s: no overlay at /", ctr)
	return ""
}

// TestKVMImageDisk: a VM pod's containers read their image from a
// read-only erofs disk plugged into the VM, one per image, shared by the
// containers of that image and unplugged after the last is removed; the
// image's files read back as the host has them, and writes stay in the
// guest. A restarted daemon knows the disks.
func TestKVMImageDisk(t *testing.T) {
	e := newKVMEnv(t)
	other := e.reg.Push(t, "e2e/other", "v1", testregistry.WithConfig(testregistry.BusyboxImage(t), nil, []string{"sleep", "1000"}, ""))
	e.pull(other)
	cfg := e.netPodConfig("disk", kvmStage1)
	pod := e.runStage1Pod(cfg, kvmStage1)
	a := e.createAndStart(pod, cfg, e.netContainer(kvmStage1, "a", "sleep", "1000"))
	b := e.createAndStart(pod, cfg, e.netContainer(kvmStage1, "b", "sleep", "1000"))

	d := e.vmDisks(pod)
	if len(d.Disks) != 1 || len(d.Disks[0].Users) != 2 {
		t.Fatalf("two containers of one image: disks %+v, want one disk used by both", d.Disks)
	}
	disk := d.Disks[0]
	if disk.ImageID != e.imageStatus(e.image).Id {
		t.Errorf("disk of image %s, want %s", disk.ImageID, e.imageStatus(e.image).Id)
	}
	la, lb := e.rootLower(a), e.rootLower(b)
	if !strings.Contains(la, "/disks/"+strconv.Itoa(disk.Target)+"-") || la != lb {
		t.Errorf("root lower layers %q and %q: want one disk's mount at target %d", la, lb, disk.Target)
	}
	// The disk file is the image store's, with the SHA-256 recorded.
	f, err := os.ReadFile(disk.Path)
	if err != nil {
		t.Fatal(err)
	}
	if sum := sha256.Sum256(f); hex.EncodeToString(sum[:]) != disk.SHA256 {
		t.Errorf("disk %s has SHA-256 %x, recorded %s", disk.Path, sum, disk.SHA256)
	}
	// The image's files read back as the host's layer has them.
	hostBusybox, err := filepath.Glob(filepath.Join(e.d.StateDir, "images", "layers", "*", "bin", "busybox"))
	if err != nil || len(hostBusybox) == 0 {
		t.Fatalf("busybox in the store's layers: %v %v", hostBusybox, err)
	}
	hb, err := os.ReadFile(hostBusybox[0])
	if err != nil {
		t.Fatal(err)
	}
	want := sha256.Sum256(hb)
	if got := strings.Fields(e.execOK(a, "sha256sum", "/bin/busybox")); len(got) == 0 || got[0] != hex.EncodeToString(want[:]) {
		t.Errorf("/bin/busybox in the container: %v, want %x", got, want)
	}
	checkGuestWritableLayer(t, e, a)
	// b does not see a's writes: its layer is its own over the shared disk.
	if r := e.execSync(b, "test", "-e", "/written"); r.ExitCode == 0 {
		t.Error("a write of one container shows in another of the same image")
	}

	c := e.createAndStart(pod, cfg, e.netContainer(kvmStage1, "c", "sleep", "1000"))
	cOther := e.netContainer(kvmStage1, "c2", "sleep", "1000")
	cOther.Image = &runtimeapi.ImageSpec{Image: other}
	c2 := e.createAndStart(pod, cfg, cOther)
	if d := e.vmDisks(pod); len(d.Disks) != 2 {
		t.Fatalf("containers of two images: disks %+v, want two", d.Disks)
	}
	scsi := "0:0:" + strconv.Itoa(disk.Target) + ":0"
	devices := func() string { return e.execOK(c2, "ls", "/sys/bus/scsi/devices") }
	if !strings.Contains(devices(), scsi) {
		t.Errorf("the guest shows no SCSI device %s: %s", scsi, devices())
	}
	// A restarted daemon knows the plugged disks from the VM's record.
	ctx, cancel := context.WithTimeout(e.ctx(), 2*time.Minute)
	defer cancel()
	if err := e.d.Kill9(ctx); err != nil {
		t.Fatal(err)
	}
	if err := e.d.Restart(ctx); err != nil {
		t.Fatal(err)
	}
	d2 := e.createAndStart(pod, cfg, e.netContainer(kvmStage1, "d", "sleep", "1000"))
	if d := e.vmDisks(pod); len(d.Disks) != 2 {
		t.Fatalf("after a restart, another container of a plugged image: disks %+v, want the two", d.Disks)
	}
	for _, id := range []string{a, b, c, d2} {
		if _, err := e.rt().StopContainer(e.ctx(), &runtimeapi.StopContainerRequest{ContainerId: id, Timeout: 1}); err != nil {
			t.Fatal(err)
		}
		if _, err := e.rt().RemoveContainer(e.ctx(), &runtimeapi.RemoveContainerRequest{ContainerId: id}); err != nil {
			t.Fatal(err)
		}
		if id == a && len(e.vmDisks(pod).Disks) != 2 {
			t.Errorf("after removing one of three containers of the image: disks %+v", e.vmDisks(pod).Disks)
		}
	}
	// The broker undoes a removed container's sharing off the reply path.
	testutil.WaitFor(t, 30*time.Second, "the disk of the image whose containers are gone to be unplugged", func() (bool, string) {
		left := e.vmDisks(pod)
		return len(left.Disks) == 1 && left.Disks[0].ImageID != disk.ImageID, fmt.Sprintf("%+v", left.Disks)
	})
	testutil.WaitFor(t, 30*time.Second, "the guest to let go of the unplugged disk", func() (bool, string) {
		out := devices()
		return !strings.Contains(out, scsi), out
	})
}
