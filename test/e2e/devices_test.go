package e2e

import (
	"fmt"
	"os"
	"path/filepath"
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

		privCfg := e.netPodConfig("dev-priv", s)
		privCfg.Linux.SecurityContext.Privileged = true
		privPod := e.runStage1Pod(privCfg, s)
		pc := e.netContainer(s, "priv", "sleep", "3600")
		pc.Linux.SecurityContext.Privileged = true
		priv := e.createAndStart(privPod, privCfg, pc)
		e.waitContainerState(priv, running, stateTimeout)
		// fly: the host's devices, as containerd gives them; nspawn: the
		// pod's (systemd-nspawn's /dev), which holds /dev/net/tun.
		node := map[podStage1]string{flyStage1: "/dev/kmsg", nspawnStage1: "/dev/net/tun"}[s]
		if r := e.execSync(priv, "test", "-c", node); r.ExitCode != 0 {
			t.Errorf("a privileged container has no %s:\n%s", node, e.execOK(priv, "ls", "-lR", "/dev"))
		}
		if r := e.execSync(priv, "head", "-c", "1", "/dev/zero"); r.ExitCode != 0 {
			t.Errorf("a privileged container reading /dev/zero: %d %s", r.ExitCode, r.Stderr)
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

// TestCDIDevices: CDI devices named in CDI_devices or by a cdi.k8s.io/*
// annotation are resolved through the daemon's spec directory, read when
// the container is created: device nodes, bind mounts and environment
// reach the container on fly and nspawn; an unknown device is
// InvalidArgument naming it. Status says CDI is on and where its specs are.
func TestCDIDevices(t *testing.T) {
	forEachStage1(t, func(t *testing.T, e *env, s podStage1) {
		st, err := e.rt().Status(e.ctx(), &runtimeapi.StatusRequest{Verbose: true})
		if err != nil {
			t.Fatal(err)
		}
		if st.Info["cdi.enabled"] != "true" || st.Info["cdi.specDirs"] != e.d.CDIDir {
			t.Errorf("Status info cdi.enabled %q, cdi.specDirs %q", st.Info["cdi.enabled"], st.Info["cdi.specDirs"])
		}
		share := filepath.Join(e.d.LogsDir, "cdi-share-"+randHex(3))
		if err := os.MkdirAll(share, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(share, "lib.txt"), []byte("from the driver\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		spec := fmt.Sprintf(`{"cdiVersion": "0.7.0", "kind": "example.com/dev",
  "devices": [
    {"name": "a", "containerEdits": {"deviceNodes": [{"path": "/dev/cdi-a", "hostPath": "/dev/zero", "permissions": "rw"}], "env": ["CDI_DEVICE=a"]}},
    {"name": "b", "containerEdits": {"deviceNodes": [{"path": "/dev/cdi-b", "hostPath": "/dev/kmsg", "permissions": "r"}]}}
  ],
  "containerEdits": {"mounts": [{"hostPath": %q, "containerPath": "/opt/driver", "options": ["ro", "nosuid", "nodev", "bind"]}]}}`, share)
		if err := os.WriteFile(filepath.Join(e.d.CDIDir, "example.json"), []byte(spec), 0o644); err != nil {
			t.Fatal(err)
		}
		cfg := e.netPodConfig("cdi", s)
		podID := e.runStage1Pod(cfg, s)
		c := e.netContainer(s, "app", "sleep", "3600")
		c.CDIDevices = []*runtimeapi.CDIDevice{{Name: "example.com/dev=a"}}
		c.Annotations = map[string]string{"cdi.k8s.io/plugin": "example.com/dev=b"}
		c.Linux.SecurityContext.Capabilities = &runtimeapi.Capability{AddCapabilities: []string{"SYSLOG"}}
		ctr := e.createAndStart(podID, cfg, c)
		e.waitContainerState(ctr, running, stateTimeout)
		if got := strings.TrimSpace(e.execOK(ctr, "stat", "-c", "%t:%T", "/dev/cdi-a", "/dev/cdi-b")); got != "1:5\n1:b" {
			t.Errorf("the CDI device nodes: %q, want 1:5 and 1:b", got)
		}
		e.execOK(ctr, "head", "-c", "1", "/dev/cdi-a")
		e.execOK(ctr, "dd", "if=/dev/cdi-b", "of=/dev/null", "bs=8192", "count=1")
		if r := e.execSync(ctr, "sh", "-c", "echo x > /dev/cdi-b"); !strings.Contains(string(r.Stderr), "Operation not permitted") {
			t.Errorf("writing a CDI device given read-only: exit %d, %q: want EPERM", r.ExitCode, r.Stderr)
		}
		if got := e.execOK(ctr, "cat", "/opt/driver/lib.txt"); got != "from the driver\n" {
			t.Errorf("the CDI mount: %q", got)
		}
		if got := e.execOK(ctr, "grep", " /opt/driver ", "/proc/self/mounts"); !strings.Contains(got, "ro,nosuid,nodev") {
			t.Errorf("the CDI mount's flags: %q, want ro,nosuid,nodev", got)
		}
		if got := strings.TrimSpace(e.execOK(ctr, "sh", "-c", "echo $CDI_DEVICE")); got != "a" {
			t.Errorf("CDI_DEVICE=%q, want a", got)
		}

		unknown := e.netContainer(s, "unknown", "sleep", "3600")
		unknown.CDIDevices = []*runtimeapi.CDIDevice{{Name: "example.com/dev=missing"}}
		_, err = e.rt().CreateContainer(e.ctx(), &runtimeapi.CreateContainerRequest{PodSandboxId: podID, Config: unknown, SandboxConfig: cfg})
		requireCode(t, err, codes.InvalidArgument, "CreateContainer with an unknown CDI device")
		if !strings.Contains(err.Error(), "example.com/dev=missing") {
			t.Errorf("the refusal does not name the device: %v", err)
		}
	})
}

// TestImageVolume: a CRI image mount (KEP-4639) gives the container an
// image's root filesystem, read-only, or the part image_sub_path names, on
// fly and nspawn (kvm: TestKVMPodBesideNspawnPod); an image the node does
// not have is NotFound, a sub path the image lacks InvalidArgument.
func TestImageVolume(t *testing.T) {
	forEachStage1(t, func(t *testing.T, e *env, s podStage1) {
		cfg := e.netPodConfig("ivol", s)
		podID := e.runStage1Pod(cfg, s)
		c := e.netContainer(s, "app", "sleep", "3600")
		c.Mounts = []*runtimeapi.Mount{
			{ContainerPath: "/image", Image: &runtimeapi.ImageSpec{Image: e.image}},
			{ContainerPath: "/image-bin", Image: &runtimeapi.ImageSpec{Image: e.image}, ImageSubPath: "bin"},
		}
		ctr := e.createAndStart(podID, cfg, c)
		e.waitContainerState(ctr, running, stateTimeout)
		checkImageVolume(t, e, ctr)

		for _, tc := range []struct {
			m    *runtimeapi.Mount
			code codes.Code
		}{
			{&runtimeapi.Mount{ContainerPath: "/x", Image: &runtimeapi.ImageSpec{Image: "127.0.0.1:1/not/pulled:1"}}, codes.NotFound},
			{&runtimeapi.Mount{ContainerPath: "/x", Image: &runtimeapi.ImageSpec{Image: e.image}, ImageSubPath: "no/such/dir"}, codes.InvalidArgument},
		} {
			bad := e.netContainer(s, "bad", "sleep", "3600")
			bad.Mounts = []*runtimeapi.Mount{tc.m}
			_, err := e.rt().CreateContainer(e.ctx(), &runtimeapi.CreateContainerRequest{PodSandboxId: podID, Config: bad, SandboxConfig: cfg})
			requireCode(t, err, tc.code, fmt.Sprintf("CreateContainer with image volume %v", tc.m))
		}
	})
}

// checkImageVolume checks the container of TestImageVolume's mounts.
func checkImageVolume(t *testing.T, e *env, ctr string) {
	t.Helper()
	e.execOK(ctr, "test", "-x", "/image/bin/busybox")
	e.execOK(ctr, "test", "-x", "/image-bin/busybox")
	if r := e.execSync(ctr, "touch", "/image/new"); r.ExitCode == 0 || !strings.Contains(string(r.Stderr), "Read-only file system") {
		t.Errorf("writing into an image volume: exit %d, %q: want EROFS", r.ExitCode, r.Stderr)
	}
}
