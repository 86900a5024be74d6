package e2e

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/internal/staticbin"
	"github.com/stagelet/stagelet/policy"
	"github.com/stagelet/stagelet/test/e2e/harness"
)

// What the CRI conformance suite (critest) checks, through the real
// daemon, in the project's own suite.

// IPC sysctls are set in the pod's IPC namespace, on nspawn and on fly
// (whose pods get an IPC namespace of their own unless they ask for the
// host's); the host's values stay, and a host-IPC pod's IPC sysctls are
// refused.
func TestIPCSysctls(t *testing.T) {
	forEachStage1(t, func(t *testing.T, e *env, s podStage1) {
		s.ipc = runtimeapi.NamespaceMode_POD
		const shm, mq = "kernel.shm_rmid_forced", "fs.mqueue.msg_max"
		hostShm, hostMq := readHostSysctl(t, shm), readHostSysctl(t, mq)
		want := map[string]string{shm: "1", mq: "99"}
		if hostShm == "1" {
			want[shm] = "0"
		}
		if hostMq == "99" {
			want[mq] = "98"
		}
		cfg := e.netPodConfig("ipc-sysctl", s)
		cfg.Linux.Sysctls = want
		podID := e.runStage1Pod(cfg, s)
		ctr := e.createAndStart(podID, cfg, e.netContainer(s, "app", "sleep", "3600"))
		e.waitContainerState(ctr, running, stateTimeout)
		for name, v := range want {
			if got := strings.TrimSpace(e.execOK(ctr, "cat", "/proc/sys/"+strings.ReplaceAll(name, ".", "/"))); got != v {
				t.Errorf("%s inside the pod: %q, want %q", name, got, v)
			}
		}
		if got := strings.TrimSpace(e.execOK(ctr, "readlink", "/proc/self/ns/ipc")); got == hostNSLink(t, "ipc") {
			t.Errorf("the pod shares the host's IPC namespace (%s)", got)
		}
		if readHostSysctl(t, shm) != hostShm || readHostSysctl(t, mq) != hostMq {
			t.Errorf("the host's IPC sysctls changed")
		}

		hostIPC := e.netPodConfig("ipc-sysctl-host", s)
		hostIPC.Linux.SecurityContext.NamespaceOptions.Ipc = runtimeapi.NamespaceMode_NODE
		hostIPC.Linux.Sysctls = map[string]string{shm: want[shm]}
		_, err := e.rt().RunPodSandbox(e.ctx(), &runtimeapi.RunPodSandboxRequest{Config: hostIPC, RuntimeHandler: s.handler})
		requireCode(t, err, codes.InvalidArgument, "RunPodSandbox of a host-IPC pod with sysctl "+shm)
		if readHostSysctl(t, shm) != hostShm {
			t.Errorf("the host's %s changed", shm)
		}
	})
}

// With the embedded default policy, a hostPID or hostIPC pod the kubelet
// admitted runs on fly, in the host's namespaces, and the verbose status
// says why; a hostNetwork pod stays on nspawn.
func TestDefaultPolicyRunsHostNamespacePods(t *testing.T) {
	e := newEnvOpts(t, harness.Options{Policy: string(policy.DefaultYAML())}, true)
	pod := runtimeapi.NamespaceMode_POD
	node := runtimeapi.NamespaceMode_NODE
	for _, c := range []struct {
		name   string
		ns     *runtimeapi.NamespaceOption
		stage1 string
		shared string // the namespace the container shares with the host
		reason string
	}{
		{"host-pid", nsOpts(pod, node, pod), "fly", "pid", "conflicts.host_pid"},
		{"host-ipc", nsOpts(pod, pod, node), "fly", "ipc", "conflicts.host_ipc"},
		{"host-net", nsOpts(node, pod, pod), "nspawn", "net", ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg := e.policyPod(c.name, "monitoring", c.ns, nil)
			id := e.runPod(cfg)
			if got := e.podStatus(id).RuntimeHandler; got != c.stage1 {
				t.Fatalf("stage1 %q, want %q", got, c.stage1)
			}
			info := e.verbosePod(id).Info
			if c.reason != "" && !strings.Contains(strings.Join(mapValues(info), "\n"), c.reason) {
				t.Errorf("the verbose status does not give the reason %q: %v", c.reason, info)
			}
			ctr := e.containerConfig("app", "sleep", "3600")
			ctr.Linux.SecurityContext.NamespaceOptions = c.ns
			id = e.createAndStart(id, cfg, ctr)
			e.waitContainerState(id, running, stateTimeout)
			if got := strings.TrimSpace(e.execOK(id, "readlink", "/proc/self/ns/"+c.shared)); got != hostNSLink(t, c.shared) {
				t.Errorf("%s namespace %s, the host's is %s", c.shared, got, hostNSLink(t, c.shared))
			}
		})
	}
}

func mapValues(m map[string]string) []string {
	var out []string
	for _, v := range m {
		out = append(out, v)
	}
	return out
}

// The container security fields critest checks, through CRI on nspawn:
// masked and read-only paths, an absent seccomp profile meaning
// unconfined, run_as_group without a user refused.
func TestContainerSecurityFields(t *testing.T) {
	e := newNspawnEnv(t)
	podID, podCfg := e.nspawnPod("security")

	c := e.nspawnContainer("masked", "sleep", "3600")
	c.Linux.SecurityContext.MaskedPaths = []string{"/etc/passwd", "/proc/kcore"}
	c.Linux.SecurityContext.ReadonlyPaths = []string{"/tmp"}
	masked := e.createAndStart(podID, podCfg, c)
	e.waitContainerState(masked, running, stateTimeout)
	if got := e.execOK(masked, "sh", "-c", "cat /etc/passwd; echo end"); got != "end\n" {
		t.Errorf("masked /etc/passwd reads %q", got)
	}
	if res := e.execSync(masked, "touch", "/tmp/x"); res.ExitCode == 0 || !strings.Contains(string(res.Stderr), "Read-only file system") {
		t.Errorf("touch in a read-only path: %d %q", res.ExitCode, res.Stderr)
	}
	if got := e.execOK(masked, "grep", "^Seccomp:", "/proc/self/status"); strings.Fields(got)[1] != "0" {
		t.Errorf("no seccomp profile: %q, want unconfined (Seccomp: 0)", got)
	}

	g := e.nspawnContainer("group-only", "true")
	gid := &runtimeapi.Int64Value{Value: 1002}
	g.Linux.SecurityContext.RunAsGroup = gid
	_, err := e.rt().CreateContainer(e.ctx(), &runtimeapi.CreateContainerRequest{PodSandboxId: podID, Config: g, SandboxConfig: podCfg})
	requireCode(t, err, codes.InvalidArgument, "CreateContainer with run_as_group and no user")

}

// A container may share the PID namespace of another container of its pod
// (namespace_options.pid TARGET, what kubectl debug --target asks), on
// nspawn and on fly; a target outside the pod is not found.
func TestPIDNamespaceTarget(t *testing.T) {
	forEachStage1(t, func(t *testing.T, e *env, s podStage1) {
		cfg := e.netPodConfig("debug-target", s)
		podID := e.runStage1Pod(cfg, s)
		target := e.netContainer(s, "target", "sleep", "3601")
		target.Linux.SecurityContext.NamespaceOptions.Pid = runtimeapi.NamespaceMode_CONTAINER
		targetID := e.createAndStart(podID, cfg, target)
		e.waitContainerState(targetID, running, stateTimeout)
		debug := e.netContainer(s, "debug", "sleep", "3602")
		debug.Linux.SecurityContext.NamespaceOptions.Pid = runtimeapi.NamespaceMode_TARGET
		debug.Linux.SecurityContext.NamespaceOptions.TargetId = targetID
		debugID := e.createAndStart(podID, cfg, debug)
		e.waitContainerState(debugID, running, stateTimeout)
		if got := e.execOK(debugID, "sh", "-c", "tr '\\0' ' ' </proc/1/cmdline"); got != "sleep 3601 " {
			t.Errorf("PID 1 of the debug container's namespace runs %q, want the target's sleep 3601", got)
		}
		if got := e.execOK(debugID, "readlink", "/proc/self/ns/pid"); got != e.execOK(targetID, "readlink", "/proc/self/ns/pid") {
			t.Errorf("the debug container's PID namespace %s is not the target's", got)
		}

		other := e.netContainer(s, "other-target", "true")
		other.Linux.SecurityContext.NamespaceOptions.Pid = runtimeapi.NamespaceMode_TARGET
		other.Linux.SecurityContext.NamespaceOptions.TargetId = "0123456789abcdef"
		_, err := e.rt().CreateContainer(e.ctx(), &runtimeapi.CreateContainerRequest{PodSandboxId: podID, Config: other, SandboxConfig: cfg})
		requireCode(t, err, codes.NotFound, "CreateContainer targeting a container not in the pod")
	})
}

// Mount propagation through the daemon: what the host mounts beneath an
// rslave or rshared volume reaches the container, what a privileged
// container mounts beneath an rshared volume reaches the host, and the
// host can remove a volume's mount points while the container runs.
func TestMountPropagationThroughCRI(t *testing.T) {
	forEachStage1(t, func(t *testing.T, e *env, s podStage1) {
		src := t.TempDir()
		if err := syscall.Mount(src, src, "", syscall.MS_BIND, ""); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { syscall.Unmount(src, syscall.MNT_DETACH) })
		if err := syscall.Mount("", src, "", syscall.MS_SHARED, ""); err != nil {
			t.Fatal(err)
		}
		for _, d := range []string{"from-host", "from-container"} {
			os.Mkdir(filepath.Join(src, d), 0o755)
			t.Cleanup(func() { syscall.Unmount(filepath.Join(src, d), syscall.MNT_DETACH) })
		}
		cfg := e.netPodConfig("propagation", s)
		cfg.Linux.SecurityContext.Privileged = true
		podID := e.runStage1Pod(cfg, s)
		c := e.netContainer(s, "app", "sleep", "3600")
		c.Linux.SecurityContext.Privileged = true
		c.Mounts = []*runtimeapi.Mount{
			{HostPath: src, ContainerPath: "/shared", Propagation: runtimeapi.MountPropagation_PROPAGATION_BIDIRECTIONAL},
			{HostPath: src, ContainerPath: "/slave", Propagation: runtimeapi.MountPropagation_PROPAGATION_HOST_TO_CONTAINER},
			{HostPath: src, ContainerPath: "/private"},
		}
		ctr := e.createAndStart(podID, cfg, c)
		e.waitContainerState(ctr, running, stateTimeout)
		if err := syscall.Mount("tmpfs", filepath.Join(src, "from-host"), "tmpfs", 0, "size=1m"); err != nil {
			t.Fatal(err)
		}
		mi := e.execOK(ctr, "cat", "/proc/self/mountinfo")
		for dest, want := range map[string]bool{"/shared/from-host": true, "/slave/from-host": true, "/private/from-host": false} {
			if got := strings.Contains(mi, " "+dest+" "); got != want {
				t.Errorf("the host's mount seen at %s: %v, want %v", dest, got, want)
			}
		}
		e.execOK(ctr, "mount", "-t", "tmpfs", "tmpfs", "/shared/from-container")
		b, _ := os.ReadFile("/proc/self/mountinfo")
		if !strings.Contains(string(b), " "+filepath.Join(src, "from-container")+" ") {
			t.Errorf("the container's mount beneath its rshared volume did not reach the host")
		}
		// The host unmounts and removes what it mounted in the volume.
		if err := syscall.Unmount(filepath.Join(src, "from-host"), syscall.MNT_DETACH); err != nil {
			t.Fatal(err)
		}
		if err := os.Remove(filepath.Join(src, "from-host")); err != nil {
			t.Errorf("removing a mount point in a volume of a running container: %v", err)
		}
	})
}

// serve refuses to start from a binary that is not static: it is every
// pod's agent, in roots without a C library.
func TestServeRefusesDynamicBinary(t *testing.T) {
	requireRoot(t)
	if _, err := exec.LookPath("gcc"); err != nil {
		t.Skip("needs a C compiler to build stagelet with cgo")
	}
	root, err := harness.ModuleRoot()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	bin := filepath.Join(dir, "stagelet")
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Minute)
	defer cancel()
	build := exec.CommandContext(ctx, "go", "build", "-o", bin, "./cmd/stagelet")
	build.Dir = root
	build.Env = append(os.Environ(), "CGO_ENABLED=1")
	if b, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build with cgo: %v\n%s", err, b)
	}
	if staticbin.Check(bin) == nil {
		t.Skip("a cgo build of stagelet came out static on this machine")
	}
	serve := exec.CommandContext(ctx, bin, "serve", "--socket", filepath.Join(dir, "cri.sock"),
		"--state-dir", filepath.Join(dir, "state"), "--run-dir", filepath.Join(dir, "run"))
	out, err := serve.CombinedOutput()
	if err == nil || serve.ProcessState == nil || serve.ProcessState.ExitCode() <= 0 {
		t.Fatalf("serve from a dynamic binary: %v, want a non-zero exit\n%s", err, out)
	}
	for _, want := range []string{"dynamically linked", "CGO_ENABLED=0"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("serve's message lacks %q:\n%s", want, out)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "cri.sock")); err == nil {
		t.Error("serve created its socket")
	}
}
