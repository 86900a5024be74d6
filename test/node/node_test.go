// Package node tests stagelet where Kubernetes nodes run it: on a host with
// systemd as PID 1 and a pure cgroup v2 hierarchy, as the systemd service
// of contrib/systemd/stagelet.service, under both cgroup drivers. It runs
// inside the node VM that `make test-node` boots (scripts/test-node.sh);
// elsewhere it skips. It changes the host it runs on (a systemd unit, a CNI
// configuration, /etc/stagelet), which is why it runs only in that VM.
package node

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/internal/testutil"
	"github.com/stagelet/stagelet/test/testregistry"
)

const (
	socket    = "/run/stagelet/stagelet.sock"
	unitName  = "stagelet.service"
	unitPath  = "/etc/systemd/system/stagelet.service"
	dropInDir = "/etc/systemd/system/stagelet.service.d"
	configDir = "/etc/stagelet"
	cgroupFS  = "/sys/fs/cgroup"
)

// env is what the run script hands the test.
type env struct {
	bin  string // the stagelet binary to install
	unit string // contrib/systemd/stagelet.service
}

func nodeEnv(t *testing.T) env {
	t.Helper()
	if os.Getenv("STAGELET_NODE_TEST") == "" {
		t.Skip("runs only inside the node VM (make test-node), where it may change the host")
	}
	e := env{bin: os.Getenv("STAGELET_BIN"), unit: os.Getenv("STAGELET_UNIT")}
	if e.bin == "" || e.unit == "" {
		t.Fatal("STAGELET_BIN and STAGELET_UNIT must name the binary and the unit file")
	}
	return e
}

func run(t *testing.T, name string, args ...string) string {
	t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return strings.TrimSpace(string(out))
}

// unitProp reads one property of a systemd unit.
func unitProp(t *testing.T, unit, prop string) string {
	t.Helper()
	return run(t, "systemctl", "show", "--value", "-p", prop, unit)
}

// install puts the binary where the unit expects it and the unit, with a
// drop-in that adds extraArgs to stagelet serve, and (re)starts it.
func (e env) install(t *testing.T, extraArgs string) {
	t.Helper()
	if err := copyFile(e.bin, "/usr/local/bin/stagelet", 0o755); err != nil {
		t.Fatal(err)
	}
	if err := copyFile(e.unit, unitPath, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.RemoveAll(dropInDir); err != nil {
		t.Fatal(err)
	}
	if extraArgs != "" {
		if err := os.MkdirAll(dropInDir, 0o755); err != nil {
			t.Fatal(err)
		}
		body := "[Service]\nExecStart=\nExecStart=/usr/local/bin/stagelet serve " + extraArgs + "\n"
		if err := os.WriteFile(filepath.Join(dropInDir, "test.conf"), []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	run(t, "systemctl", "daemon-reload")
	run(t, "systemctl", "restart", unitName)
}

// installSystemdDriver installs and starts the service with a node
// configuration (configDir/name) choosing the systemd cgroup driver; the
// test's end stops it and drops the configuration's drop-in.
func (e env) installSystemdDriver(t *testing.T, name string) {
	t.Helper()
	if err := os.MkdirAll(configDir, 0o755); err != nil {
		t.Fatal(err)
	}
	cfg := filepath.Join(configDir, name)
	if err := os.WriteFile(cfg, []byte("version: 1\ncgroup_driver: systemd\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	e.install(t, "--config "+cfg)
	t.Cleanup(func() {
		stopService(t)
		os.RemoveAll(dropInDir)
		run(t, "systemctl", "daemon-reload")
	})
}

func copyFile(from, to string, mode os.FileMode) error {
	b, err := os.ReadFile(from)
	if err != nil {
		return err
	}
	tmp := to + ".new"
	if err := os.WriteFile(tmp, b, mode); err != nil {
		return err
	}
	return os.Rename(tmp, to)
}

// client connects to the service's CRI socket and waits until it answers
// (it answers Unavailable while it recovers its pods after a start).
func client(t *testing.T) (runtimeapi.RuntimeServiceClient, runtimeapi.ImageServiceClient) {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	rt := runtimeapi.NewRuntimeServiceClient(conn)
	testutil.WaitFor(t, 60*time.Second, "the daemon answers ListPodSandbox", func() (bool, string) {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_, err := rt.ListPodSandbox(ctx, &runtimeapi.ListPodSandboxRequest{})
		if err != nil {
			return false, err.Error() + "\n" + journal(t)
		}
		return true, ""
	})
	return rt, runtimeapi.NewImageServiceClient(conn)
}

func journal(t *testing.T) string {
	out, _ := exec.Command("journalctl", "-u", unitName, "--no-pager", "-n", "60").CombinedOutput()
	return string(out)
}

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	t.Cleanup(cancel)
	return c
}

// pod is one pod the test runs, with one container.
type pod struct {
	id, ctr string
	cfg     *runtimeapi.PodSandboxConfig
	logDir  string
	handler string
	removed bool
}

// startPod runs a pod (startSandbox) with one container, app, started:
// it logs a greeting, then sleeps.
func startPod(t *testing.T, rt runtimeapi.RuntimeServiceClient, img, name, namespace, handler, cgroupParent string) *pod {
	t.Helper()
	c := ctx(t)
	p := startSandbox(t, rt, name, namespace, handler, cgroupParent)
	cr, err := rt.CreateContainer(c, &runtimeapi.CreateContainerRequest{
		PodSandboxId:  p.id,
		SandboxConfig: p.cfg,
		Config: &runtimeapi.ContainerConfig{
			Metadata: &runtimeapi.ContainerMetadata{Name: "app"},
			Image:    &runtimeapi.ImageSpec{Image: img},
			Command:  []string{"sh", "-c", "echo hello from " + name + "; exec sleep 100000"},
			LogPath:  "app.log",
			Linux: &runtimeapi.LinuxContainerConfig{Resources: &runtimeapi.LinuxContainerResources{
				MemoryLimitInBytes: 96 << 20,
			}},
		},
	})
	if err != nil {
		t.Fatalf("CreateContainer in %s: %v", name, err)
	}
	p.ctr = cr.ContainerId
	if _, err := rt.StartContainer(c, &runtimeapi.StartContainerRequest{ContainerId: p.ctr}); err != nil {
		t.Fatalf("StartContainer in %s: %v", name, err)
	}
	return p
}

// startSandbox runs a pod with no container on the runtime handler; the
// test's end removes it if the test did not.
func startSandbox(t *testing.T, rt runtimeapi.RuntimeServiceClient, name, namespace, handler, cgroupParent string) *pod {
	t.Helper()
	uid := fmt.Sprintf("%s-%d", name, time.Now().UnixNano())
	p := &pod{logDir: t.TempDir(), handler: handler}
	p.cfg = &runtimeapi.PodSandboxConfig{
		Metadata:     &runtimeapi.PodSandboxMetadata{Name: name, Namespace: namespace, Uid: uid},
		Hostname:     name,
		LogDirectory: p.logDir,
		Linux:        &runtimeapi.LinuxPodSandboxConfig{CgroupParent: cgroupParent},
	}
	r, err := rt.RunPodSandbox(ctx(t), &runtimeapi.RunPodSandboxRequest{Config: p.cfg, RuntimeHandler: handler})
	if err != nil {
		t.Fatalf("RunPodSandbox %s: %v\n%s", name, err, journal(t))
	}
	p.id = r.PodSandboxId
	// A test that fails half way must not leave its pods to the next.
	t.Cleanup(func() { p.removeQuietly(t) })
	return p
}

// check asserts that the pod is ready, its container runs, answers exec,
// and has logged its greeting; it returns the pod's verbose info.
func (p *pod) check(t *testing.T, rt runtimeapi.RuntimeServiceClient, name string) map[string]string {
	t.Helper()
	c := ctx(t)
	st, err := rt.PodSandboxStatus(c, &runtimeapi.PodSandboxStatusRequest{PodSandboxId: p.id, Verbose: true})
	if err != nil {
		t.Fatal(err)
	}
	if st.Status.State != runtimeapi.PodSandboxState_SANDBOX_READY {
		t.Fatalf("pod %s is %v", name, st.Status.State)
	}
	if ip := st.Status.GetNetwork().GetIp(); net.ParseIP(ip) == nil {
		t.Errorf("pod %s has no IP from CNI (%q)", name, ip)
	}
	testutil.WaitFor(t, 30*time.Second, "the container of "+name+" to run", func() (bool, string) {
		cs, err := rt.ContainerStatus(c, &runtimeapi.ContainerStatusRequest{ContainerId: p.ctr})
		if err != nil {
			return false, err.Error()
		}
		return cs.Status.State == runtimeapi.ContainerState_CONTAINER_RUNNING, cs.Status.State.String()
	})
	ex, err := rt.ExecSync(c, &runtimeapi.ExecSyncRequest{ContainerId: p.ctr, Cmd: []string{"sh", "-c", "echo exec in $0", name}, Timeout: 30})
	if err != nil || ex.ExitCode != 0 || strings.TrimSpace(string(ex.Stdout)) != "exec in "+name {
		t.Errorf("ExecSync in %s = %+v, %v", name, ex, err)
	}
	testutil.WaitFor(t, 30*time.Second, "the greeting in the log of "+name, func() (bool, string) {
		b, _ := os.ReadFile(filepath.Join(p.logDir, "app.log"))
		return bytes.Contains(b, []byte("hello from "+name)), string(b)
	})
	return st.Info
}

// removeQuietly removes the pod if a test left it, on a connection of its
// own; it reports failures without failing the test.
func (p *pod) removeQuietly(t *testing.T) {
	if p.removed {
		return
	}
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Log(err)
		return
	}
	defer conn.Close()
	rt := runtimeapi.NewRuntimeServiceClient(conn)
	c, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := rt.StopPodSandbox(c, &runtimeapi.StopPodSandboxRequest{PodSandboxId: p.id}); err != nil {
		t.Logf("cleanup: stop pod %s: %v", p.id, err)
	}
	if _, err := rt.RemovePodSandbox(c, &runtimeapi.RemovePodSandboxRequest{PodSandboxId: p.id}); err != nil {
		t.Logf("cleanup: remove pod %s: %v", p.id, err)
	}
}

func (p *pod) remove(t *testing.T, rt runtimeapi.RuntimeServiceClient) {
	t.Helper()
	c := ctx(t)
	if _, err := rt.StopPodSandbox(c, &runtimeapi.StopPodSandboxRequest{PodSandboxId: p.id}); err != nil {
		t.Fatalf("StopPodSandbox: %v", err)
	}
	if _, err := rt.RemovePodSandbox(c, &runtimeapi.RemovePodSandboxRequest{PodSandboxId: p.id}); err != nil {
		t.Fatalf("RemovePodSandbox: %v", err)
	}
	p.removed = true
}

// mainPID is the service's main process.
func mainPID(t *testing.T) int {
	t.Helper()
	pid, err := strconv.Atoi(unitProp(t, unitName, "MainPID"))
	if err != nil || pid == 0 {
		t.Fatalf("stagelet.service has no main process: %q %v", unitProp(t, unitName, "MainPID"), err)
	}
	return pid
}

// cgroupOf is a process's cgroup2 path.
func cgroupOf(t *testing.T, pid int) string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		if p, ok := strings.CutPrefix(line, "0::"); ok {
			return p
		}
	}
	t.Fatalf("pid %d has no cgroup2 line: %s", pid, b)
	return ""
}

// noThreadedCgroups fails when any cgroup of the host is threaded or
// domain invalid: stagelet must never cause either.
func noThreadedCgroups(t *testing.T) {
	t.Helper()
	err := filepath.WalkDir(cgroupFS, func(p string, d fs.DirEntry, err error) error {
		if err != nil || !d.IsDir() {
			return nil
		}
		b, err := os.ReadFile(filepath.Join(p, "cgroup.type"))
		if err != nil {
			return nil
		}
		if typ := strings.TrimSpace(string(b)); typ != "domain" && p != cgroupFS {
			return fmt.Errorf("%s is %q", p, typ)
		}
		return nil
	})
	if err != nil {
		t.Error(err)
	}
}

// appCgroup finds the cgroup directory of a container (named app-<id>)
// beneath dir, in the host's hierarchy.
func appCgroup(t *testing.T, dir, ctr string) string {
	t.Helper()
	var found string
	filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err == nil && d.IsDir() && d.Name() == "app-"+ctr {
			found = p
			return fs.SkipAll
		}
		return nil
	})
	if found == "" {
		logs, _ := filepath.Glob("/run/stagelet/pods/*/nspawn.log")
		var tails string
		for _, l := range logs {
			b, _ := os.ReadFile(l)
			tails += l + ":\n" + string(b[max(0, len(b)-3000):]) + "\n"
		}
		t.Fatalf("no cgroup app-%s beneath %s:\n%s\n%s\n%s", ctr, dir, cgroupTree(dir), journal(t), tails)
	}
	return found
}

// cgroupTree lists the cgroups beneath dir with their processes and
// controllers, for a failure's message.
func cgroupTree(dir string) string {
	var b strings.Builder
	filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || !d.IsDir() {
			return nil
		}
		procs, _ := os.ReadFile(filepath.Join(p, "cgroup.procs"))
		ctl, _ := os.ReadFile(filepath.Join(p, "cgroup.subtree_control"))
		typ, _ := os.ReadFile(filepath.Join(p, "cgroup.type"))
		var cmds []string
		for _, pid := range strings.Fields(string(procs)) {
			c, _ := os.ReadFile("/proc/" + pid + "/comm")
			cmds = append(cmds, pid+":"+strings.TrimSpace(string(c)))
		}
		fmt.Fprintf(&b, "  %s [%s] subtree_control=%q procs=%v\n", strings.TrimPrefix(p, dir), strings.TrimSpace(string(typ)), strings.TrimSpace(string(ctl)), cmds)
		return nil
	})
	return b.String()
}

// checkMemoryLimit asserts that the container of p, whose cgroup is
// beneath dir, has the memory limit startPod gave it.
func checkMemoryLimit(t *testing.T, dir string, p *pod) {
	t.Helper()
	app := appCgroup(t, dir, p.ctr)
	if got := readTrim(t, filepath.Join(app, "memory.max")); got != strconv.Itoa(96<<20) {
		t.Errorf("container of %s: memory.max = %s, want %d", p.cfg.Metadata.Name, got, 96<<20)
	}
}

func readTrim(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}

func pullBusybox(t *testing.T, img runtimeapi.ImageServiceClient) string {
	t.Helper()
	reg := testregistry.Start(t)
	ref := reg.PushBusybox(t, "node/busybox", "1")
	if _, err := img.PullImage(ctx(t), &runtimeapi.PullImageRequest{Image: &runtimeapi.ImageSpec{Image: ref}}); err != nil {
		t.Fatalf("PullImage %s: %v", ref, err)
	}
	return ref
}

func restart(t *testing.T) {
	t.Helper()
	before := mainPID(t)
	run(t, "systemctl", "restart", unitName)
	if after := mainPID(t); after == before {
		t.Fatalf("the daemon's PID did not change across a restart (%d)", before)
	}
}

// stopService stops the service and forgets a failed state, so that the
// next test starts from a clean unit.
func stopService(t *testing.T) {
	t.Helper()
	run(t, "systemctl", "stop", unitName)
	exec.Command("systemctl", "reset-failed", unitName).Run()
}

// TestCgroupfsDriver: the service as shipped (embedded defaults, the
// cgroupfs driver, Delegate=yes) on a pure cgroup v2 host. Where systemd
// starts the daemon in the supervisor leaf of its service's cgroup
// (DelegateSubgroup=, systemd 254) pods go beside that leaf; where it
// starts it in the service's root (older systemd, such as Debian 12's),
// pods with no parent go beneath the cgroup root, since systemd could not
// restart a service whose cgroup delegates controllers. Either way pods
// survive a restart of the service, and a pod the kubelet gives an
// absolute parent goes there.
func TestCgroupfsDriver(t *testing.T) {
	e := nodeEnv(t)
	e.install(t, "")
	t.Cleanup(func() { stopService(t) })
	rt, img := client(t)
	svc := unitProp(t, unitName, "ControlGroup")
	var pods string
	switch got := cgroupOf(t, mainPID(t)); got {
	case svc + "/supervisor":
		pods = filepath.Join(svc, "stagelet")
	case svc:
		pods = "/stagelet"
	default:
		t.Fatalf("the daemon runs in %s, want its service's cgroup %s or its leaf", got, svc)
	}
	if _, err := os.Stat(filepath.Join(cgroupFS, pods)); err != nil {
		t.Fatalf("no pod cgroup parent %s: %v", pods, err)
	}
	rc, err := rt.RuntimeConfig(ctx(t), &runtimeapi.RuntimeConfigRequest{})
	if err != nil || rc.GetLinux().GetCgroupDriver() != runtimeapi.CgroupDriver_CGROUPFS {
		t.Errorf("RuntimeConfig = %v, %v; want the cgroupfs driver", rc, err)
	}
	ref := pullBusybox(t, img)

	// The kubelet's cgroupfs driver names absolute parents.
	kubelet := "/kubepods/burstable/podnode-fly-1"
	ns := startPod(t, rt, ref, "nspawn-pod", "default", "", "")
	fly := startPod(t, rt, ref, "fly-pod", "kube-system", "fly", kubelet)
	podDir := func(p *pod) string {
		parent := pods
		if p == fly {
			parent = kubelet
		}
		return filepath.Join(cgroupFS, parent, "stagelet-pod-"+p.id)
	}
	for _, p := range []*pod{ns, fly} {
		name := p.cfg.Metadata.Name
		info := p.check(t, rt, name)
		if want := strings.TrimSuffix(name, "-pod"); info["stage1"] != want {
			t.Errorf("pod %s runs on stage1 %q, want %s", name, info["stage1"], want)
		}
		dir := podDir(p)
		if _, err := os.Stat(dir); err != nil {
			t.Errorf("pod %s has no cgroup %s: %v", name, dir, err)
			continue
		}
		checkMemoryLimit(t, dir, p)
	}
	noThreadedCgroups(t)

	restart(t)
	rt, _ = client(t)
	for _, p := range []*pod{ns, fly} {
		p.check(t, rt, p.cfg.Metadata.Name)
	}
	for _, p := range []*pod{ns, fly} {
		p.remove(t, rt)
		if _, err := os.Stat(podDir(p)); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("pod %s's cgroup is left after RemovePodSandbox: %v", p.cfg.Metadata.Name, err)
		}
	}
	noThreadedCgroups(t)
}

// TestSystemdDriver: with cgroup_driver systemd, each pod's host process
// is a transient unit in the slice the kubelet names, for nspawn and fly.
func TestSystemdDriver(t *testing.T) {
	e := nodeEnv(t)
	e.installSystemdDriver(t, "systemd-driver.yaml")
	rt, img := client(t)
	rc, err := rt.RuntimeConfig(ctx(t), &runtimeapi.RuntimeConfigRequest{})
	if err != nil || rc.GetLinux().GetCgroupDriver() != runtimeapi.CgroupDriver_SYSTEMD {
		t.Errorf("RuntimeConfig = %v, %v; want the systemd driver", rc, err)
	}
	ref := pullBusybox(t, img)

	// The kubelet names the pod's slice after its QoS class and UID
	// (dashes escaped as underscores).
	slice := func(uid string) string {
		return "kubepods-burstable-pod" + strings.ReplaceAll(uid, "-", "_") + ".slice"
	}
	nsSlice, flySlice := slice("node-ns-1"), slice("node-fly-1")
	ns := startPod(t, rt, ref, "nspawn-pod", "default", "", nsSlice)
	fly := startPod(t, rt, ref, "fly-pod", "kube-system", "fly", flySlice)
	for _, c := range []struct {
		p     *pod
		slice string
	}{{ns, nsSlice}, {fly, flySlice}} {
		name := c.p.cfg.Metadata.Name
		c.p.check(t, rt, name)
		unit := "stagelet-pod-" + c.p.id + ".service"
		if got := unitProp(t, unit, "Slice"); got != c.slice {
			t.Errorf("%s: unit %s is in slice %q, want %q", name, unit, got, c.slice)
		}
		if got := unitProp(t, unit, "ActiveState"); got != "active" {
			t.Errorf("%s: unit %s is %s", name, unit, got)
		}
		cg := unitProp(t, unit, "ControlGroup")
		if want := "/kubepods.slice/kubepods-burstable.slice/" + c.slice + "/" + unit; cg != want {
			t.Errorf("%s: unit cgroup %s, want %s", name, cg, want)
		}
		checkMemoryLimit(t, filepath.Join(cgroupFS, cg), c.p)
	}
	noThreadedCgroups(t)

	restart(t)
	rt, _ = client(t)
	for _, p := range []*pod{ns, fly} {
		p.check(t, rt, p.cfg.Metadata.Name)
	}
	for _, p := range []*pod{ns, fly} {
		p.remove(t, rt)
		unit := "stagelet-pod-" + p.id + ".service"
		if got := unitProp(t, unit, "LoadState"); got != "not-found" {
			t.Errorf("unit %s is %s after RemovePodSandbox, want gone", unit, got)
		}
	}
	noThreadedCgroups(t)
}

// rootDisk is the node's first disk (/dev/vda in the node VM), which the
// host's root can read.
func rootDisk(t *testing.T) string {
	t.Helper()
	ents, err := os.ReadDir("/sys/block")
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		n := e.Name()
		if strings.HasPrefix(n, "loop") || strings.HasPrefix(n, "ram") || strings.HasPrefix(n, "zram") {
			continue
		}
		dev := "/dev/" + n
		if f, err := os.Open(dev); err == nil {
			f.Close()
			return dev
		}
	}
	t.Fatal("no disk the host's root can open")
	return ""
}

// TestDeviceFilter: on a pure cgroup v2 node (no devices controller: a
// BPF device program per container) a default container of nspawn and of
// fly can make a node for the host's disk but not open it, and a container
// given the disk through CRI devices reads it.
func TestDeviceFilter(t *testing.T) {
	e := nodeEnv(t)
	e.install(t, "")
	t.Cleanup(func() { stopService(t) })
	rt, img := client(t)
	ref := pullBusybox(t, img)
	disk := rootDisk(t)
	var st unix.Stat_t
	if err := unix.Stat(disk, &st); err != nil {
		t.Fatal(err)
	}
	mknod := fmt.Sprintf("mknod /tmp/d b %d %d && head -c 512 /tmp/d | wc -c", unix.Major(st.Rdev), unix.Minor(st.Rdev))
	for _, tc := range []struct{ name, namespace, handler string }{
		{"dev-nspawn", "default", ""},
		{"dev-fly", "kube-system", "fly"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := startPod(t, rt, ref, tc.name, tc.namespace, tc.handler, "")
			p.check(t, rt, tc.name)
			c := ctx(t)
			ex, err := rt.ExecSync(c, &runtimeapi.ExecSyncRequest{ContainerId: p.ctr, Cmd: []string{"sh", "-c", mknod}, Timeout: 30})
			if err != nil {
				t.Fatal(err)
			}
			if !strings.Contains(string(ex.Stderr), "Operation not permitted") || strings.TrimSpace(string(ex.Stdout)) == "512" {
				t.Errorf("a default container reading %s through a node it made: stdout %q stderr %q, want EPERM", disk, ex.Stdout, ex.Stderr)
			}
			cr, err := rt.CreateContainer(c, &runtimeapi.CreateContainerRequest{
				PodSandboxId: p.id, SandboxConfig: p.cfg,
				Config: &runtimeapi.ContainerConfig{
					Metadata: &runtimeapi.ContainerMetadata{Name: "given"},
					Image:    &runtimeapi.ImageSpec{Image: ref},
					Command:  []string{"sleep", "100000"},
					Devices:  []*runtimeapi.Device{{HostPath: disk, ContainerPath: "/dev/xdisk", Permissions: "r"}},
				},
			})
			if err != nil {
				t.Fatalf("CreateContainer given %s: %v", disk, err)
			}
			if _, err := rt.StartContainer(c, &runtimeapi.StartContainerRequest{ContainerId: cr.ContainerId}); err != nil {
				t.Fatal(err)
			}
			ex, err = rt.ExecSync(c, &runtimeapi.ExecSyncRequest{ContainerId: cr.ContainerId, Cmd: []string{"sh", "-c", "head -c 512 /dev/xdisk | wc -c"}, Timeout: 30})
			if err != nil || strings.TrimSpace(string(ex.Stdout)) != "512" {
				t.Errorf("a container given %s reading it: %+v %v", disk, ex, err)
			}
			p.remove(t, rt)
		})
	}
}
