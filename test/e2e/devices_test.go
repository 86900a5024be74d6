package e2e

import (
	"fmt"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// TestDevices: on fly and nspawn a container given a host device (CRI
// devices) sees the host's node at its path, with the host's numbers, mode
// and owner, and may use it as far as its permissions say; any container
// may make a device node (CAP_MKNOD, as with runc) but open none it was not
// given beyond the default ones: not a block device (a loop device here)
// nor another character device. Device access is fenced by the cgroup
// (v1 devices lists, v2 a device program), which is what answers EPERM.
func TestDevices(t *testing.T) {
	var kmsg unix.Stat_t
	if err := unix.Stat("/dev/kmsg", &kmsg); err != nil {
		t.Skipf("no /dev/kmsg to give: %v", err)
	}
	forEachStage1(t, func(t *testing.T, e *env, s podStage1) {
		cfg := e.netPodConfig("dev", s)
		podID := e.runStage1Pod(cfg, s)
		given := e.netContainer(s, "given", "sleep", "3600")
		given.Devices = []*runtimeapi.Device{{HostPath: "/dev/kmsg", ContainerPath: "/dev/given", Permissions: "r"}}
		given.Linux.SecurityContext.Capabilities = &runtimeapi.Capability{AddCapabilities: []string{"SYSLOG"}}
		ctr := e.createAndStart(podID, cfg, given)
		e.waitContainerState(ctr, running, stateTimeout)
		got := strings.TrimSpace(e.execOK(ctr, "stat", "-c", "%F %t:%T %a %u:%g", "/dev/given"))
		want := fmt.Sprintf("character special file %x:%x %o %d:%d", unix.Major(kmsg.Rdev), unix.Minor(kmsg.Rdev), kmsg.Mode&0o7777, kmsg.Uid, kmsg.Gid)
		if got != want {
			t.Errorf("/dev/given in the container: %q, want the host's /dev/kmsg: %q", got, want)
		}
		if r := e.execSync(ctr, "dd", "if=/dev/given", "of=/dev/null", "bs=8192", "count=1"); r.ExitCode != 0 {
			t.Errorf("reading the device it was given: exit %d, %s", r.ExitCode, r.Stderr)
		}
		if r := e.execSync(ctr, "sh", "-c", "echo x > /dev/given"); !strings.Contains(string(r.Stderr), "Operation not permitted") {
			t.Errorf("writing a device given read-only: exit %d, %q: want EPERM", r.ExitCode, r.Stderr)
		}

		def := e.createAndStart(podID, cfg, e.netContainer(s, "default", "sleep", "3600"))
		e.waitContainerState(def, running, stateTimeout)
		for _, c := range []struct{ what, script string }{
			{"a loop device", "mknod /tmp/d b 7 0 && head -c 512 /tmp/d"},
			{"cpu_dma_latency", "mknod /tmp/c c 10 259 && head -c 4 /tmp/c"},
		} {
			r := e.execSync(def, "sh", "-c", c.script)
			if r.ExitCode == 0 || !strings.Contains(string(r.Stderr), "Operation not permitted") {
				t.Errorf("a default container opening %s it made: exit %d, %q: want mknod to work and the open to fail with EPERM", c.what, r.ExitCode, r.Stderr)
			}
		}
		if r := e.execSync(def, "head", "-c", "1", "/dev/zero"); r.ExitCode != 0 {
			t.Errorf("a default container reading /dev/zero: exit %d, %s", r.ExitCode, r.Stderr)
		}

		bad := e.netContainer(s, "bad", "sleep", "3600")
		bad.Devices = []*runtimeapi.Device{{HostPath: "/dev/no-such-device", ContainerPath: "/dev/x", Permissions: "rw"}}
		_, err := e.rt().CreateContainer(e.ctx(), &runtimeapi.CreateContainerRequest{PodSandboxId: podID, Config: bad, SandboxConfig: cfg})
		requireCode(t, err, codes.InvalidArgument, "CreateContainer with a device the host does not have")
		if !strings.Contains(err.Error(), "config.devices[0].host_path") {
			t.Errorf("the refusal does not name the field: %v", err)
		}
	})
}
