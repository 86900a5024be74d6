package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	nriapi "github.com/containerd/nri/pkg/api"
	"github.com/containerd/nri/pkg/stub"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/internal/testutil"
	"github.com/stagelet/stagelet/test/e2e/harness"
)

// nriPluginsDir is where containerd/nri's own sample plugins are built
// (../shared/nri/build.sh, which caches them): $STAGELET_NRI_PLUGINS, or
// what the kit's build prints.
var nriPluginsDir = sync.OnceValues(func() (string, error) {
	if d := os.Getenv("STAGELET_NRI_PLUGINS"); d != "" {
		return d, nil
	}
	root, err := harness.ModuleRoot()
	if err != nil {
		return "", err
	}
	out, err := exec.Command(filepath.Join(root, "..", "shared", "nri", "build.sh"), nriTestPlugins...).Output()
	if err != nil {
		return "", fmt.Errorf("../shared/nri/build.sh: %w", err)
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	return lines[len(lines)-1], nil
})

// nriTestPlugins are the plugins the tests run (scripts/install-test-deps.sh
// builds the same).
var nriTestPlugins = []string{"ulimit-adjuster", "device-injector", "hook-injector", "logger", "template"}

func nriPlugin(t *testing.T, name string) string {
	t.Helper()
	dir, err := nriPluginsDir()
	if err != nil {
		t.Fatalf("containerd/nri's plugins (../shared/nri/build.sh): %v", err)
	}
	p := filepath.Join(dir, name)
	if _, err := os.Stat(p); err != nil {
		t.Fatal(err)
	}
	return p
}

// startNRIPlugin runs plugin (a binary of nriPlugin) with args, as a
// DaemonSet's plugin runs: on its own, connecting to the daemon's socket.
// Its output goes to a file whose path it returns; the test's end kills
// it.
func startNRIPlugin(t *testing.T, bin string, args ...string) (*exec.Cmd, string) {
	t.Helper()
	out := filepath.Join(t.TempDir(), filepath.Base(bin)+".log")
	f, err := os.Create(out)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = f, f
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	t.Cleanup(func() {
		cmd.Process.Kill()
		<-done
	})
	return cmd, out
}

// nriConnected waits until the daemon's verbose Status lists each of
// plugins ("NN-name") as connected.
func (e *env) nriConnected(plugins ...string) {
	e.t.Helper()
	testutil.WaitFor(e.t, time.Minute, "NRI plugins "+strings.Join(plugins, ", ")+" connected", func() (bool, string) {
		info := e.verboseStatus()["nri"]
		var st struct {
			Plugins []struct{ Name string }
		}
		if err := json.Unmarshal([]byte(info), &st); err != nil {
			return false, info
		}
		have := map[string]bool{}
		for _, p := range st.Plugins {
			have[p.Name] = true
		}
		for _, p := range plugins {
			if !have[p] {
				return false, info
			}
		}
		return true, ""
	})
}

// TestNRIPlugins runs containerd/nri's own plugins, unmodified, against
// the daemon on fly, nspawn and kvm: ulimit-adjuster (started by the
// daemon from its plugin directory) sets a container's RLIMIT_NOFILE
// from its pod's annotation; logger, connecting on its own after a pod
// already runs, is synchronized with it, sees every event and adds an
// environment variable; device-injector gives a container a device node
// and a mount (refused in a VM, naming the plugin); hook-injector's OCI
// hooks run at prestart and poststop.
func TestNRIPlugins(t *testing.T) {
	for _, s := range []podStage1{flyStage1, nspawnStage1, kvmStage1} {
		t.Run(s.handler, func(t *testing.T) {
			opts := harness.Options{Policy: allStage1sPolicy, NRIPlugins: map[string]string{"10-ulimit-adjuster": nriPlugin(t, "ulimit-adjuster")}}
			var e *env
			if s == kvmStage1 {
				e = newKVMEnvOpts(t, opts)
			} else {
				e = newEnvOpts(t, opts, true)
			}
			testNRIPlugins(t, e, s)
		})
	}
}

func testNRIPlugins(t *testing.T, e *env, s podStage1) {
	e.nriConnected("10-ulimit-adjuster")
	// A pod that runs before logger connects: logger's synchronization
	// gets it.
	early := e.netPodConfig("early", s)
	earlyID := e.runStage1Pod(early, s)

	logFile := filepath.Join(t.TempDir(), "logger.log")
	startNRIPlugin(t, nriPlugin(t, "logger"), "-idx", "20", "-socket-path", e.d.NRISocket, "-log-file", logFile, "-add-env", "NRI_LOGGER")
	startNRIPlugin(t, nriPlugin(t, "device-injector"), "-idx", "30", "-socket-path", e.d.NRISocket)
	e.nriConnected("10-ulimit-adjuster", "20-logger", "30-device-injector")
	// stagelet doctor asks the serving daemon.
	out, _ := exec.Command(stageletBin, "doctor", "-config", e.d.ConfigPath, "-socket", e.d.Socket, "-state-dir", e.d.StateDir, "-run-dir", e.d.RunDir).CombinedOutput()
	if !strings.Contains(string(out), "connected: 10-ulimit-adjuster, 20-logger, 30-device-injector") {
		t.Errorf("stagelet doctor does not list the connected plugins:\n%s", out)
	}
	testutil.WaitFor(t, time.Minute, "logger's synchronization with the running pod", func() (bool, string) {
		b, _ := os.ReadFile(logFile)
		return strings.Contains(string(b), "Synchronize") && strings.Contains(string(b), earlyID), string(b)
	})

	cfg := e.netPodConfig("nri", s)
	cfg.Annotations["ulimits.noderesource.dev/container.limits"] = `[{"type": "RLIMIT_NOFILE", "soft": 1234, "hard": 4321}]`
	pod := e.runStage1Pod(cfg, s)
	ctr := e.netContainer(s, "limits", "sh", "-c", `echo "$(ulimit -Sn) $(ulimit -Hn) $NRI_LOGGER"; sleep 3600`)
	id := e.createAndStart(pod, cfg, ctr)
	got := strings.Fields(e.execOK(id, "sh", "-c", `echo "$(ulimit -Sn) $(ulimit -Hn) $NRI_LOGGER"`))
	if len(got) != 3 || got[0] != "1234" || got[1] != "4321" || !strings.HasPrefix(got[2], "logger-pid-") {
		t.Errorf("the container's open files limits and logger's variable: %q, want 1234 4321 logger-pid-N", got)
	}
	if _, err := e.rt().UpdateContainerResources(e.ctx(), &runtimeapi.UpdateContainerResourcesRequest{ContainerId: id, Linux: &runtimeapi.LinuxContainerResources{CpuShares: 512}}); err != nil {
		t.Errorf("UpdateContainerResources: %v", err)
	}
	if _, err := e.rt().StopContainer(e.ctx(), &runtimeapi.StopContainerRequest{ContainerId: id, Timeout: 1}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.rt().RemoveContainer(e.ctx(), &runtimeapi.RemoveContainerRequest{ContainerId: id}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.rt().StopPodSandbox(e.ctx(), &runtimeapi.StopPodSandboxRequest{PodSandboxId: pod}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.rt().RemovePodSandbox(e.ctx(), &runtimeapi.RemovePodSandboxRequest{PodSandboxId: pod}); err != nil {
		t.Fatal(err)
	}
	// Every event the library defines for a pod and a container of it.
	testutil.WaitFor(t, time.Minute, "logger seeing every event", func() (bool, string) {
		b, _ := os.ReadFile(logFile)
		for _, ev := range []string{"RunPodSandbox", "CreateContainer", "PostCreateContainer", "StartContainer", "PostStartContainer",
			"UpdateContainer", "PostUpdateContainer", "StopContainer", "RemoveContainer", "StopPodSandbox", "RemovePodSandbox"} {
			if !strings.Contains(string(b), ev) {
				return false, "no " + ev + " in:\n" + string(b)
			}
		}
		return true, ""
	})

	testDeviceInjector(t, e, s)
	if s != kvmStage1 {
		testHookInjector(t, e, s)
	}
}

// testDeviceInjector: device-injector's device node and mount reach the
// container, as runc gives them; a VM refuses the device, naming the
// plugin.
func testDeviceInjector(t *testing.T, e *env, s podStage1) {
	shared := t.TempDir()
	if err := os.WriteFile(filepath.Join(shared, "file"), []byte("from the host\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg := e.netPodConfig("devices", s)
	cfg.Annotations["devices.noderesource.dev/container.dev"] = "- path: /dev/nri-null\n  type: c\n  major: 1\n  minor: 3\n  file_mode: 0666\n"
	cfg.Annotations["mounts.noderesource.dev/container.dev"] = fmt.Sprintf("- source: %s\n  destination: /nri-mount\n  type: bind\n  options: [rbind, ro]\n", shared)
	pod := e.runStage1Pod(cfg, s)
	ctr := e.netContainer(s, "dev", "sh", "-c", "test -c /dev/nri-null && echo x >/dev/nri-null && cat /nri-mount/file && ! touch /nri-mount/x")
	if s == kvmStage1 {
		_, err := e.rt().CreateContainer(e.ctx(), &runtimeapi.CreateContainerRequest{PodSandboxId: pod, Config: ctr, SandboxConfig: cfg})
		if err == nil || !strings.Contains(err.Error(), "device-injector") || !strings.Contains(err.Error(), "/dev/nri-null") {
			t.Errorf("a device injected in a VM: %v, want a refusal naming device-injector and the device", err)
		}
		// The mount alone reaches the guest, shared as CRI mounts are.
		mcfg := e.netPodConfig("mounts", s)
		mcfg.Annotations["mounts.noderesource.dev/container.mnt"] = cfg.Annotations["mounts.noderesource.dev/container.dev"]
		cfg = mcfg
		pod = e.runStage1Pod(cfg, s)
		ctr = e.netContainer(s, "mnt", "sh", "-c", "cat /nri-mount/file && ! touch /nri-mount/x")
		id := e.createAndStart(pod, cfg, ctr)
		if st := e.waitContainerState(id, runtimeapi.ContainerState_CONTAINER_EXITED, callTimeout); st.ExitCode != 0 {
			b, _ := os.ReadFile(filepath.Join(cfg.LogDirectory, "mnt.log"))
			t.Errorf("device-injector's mount in a VM: exit %d\n%s", st.ExitCode, b)
		}
		return
	}
	id := e.createAndStart(pod, cfg, ctr)
	st := e.waitContainerState(id, runtimeapi.ContainerState_CONTAINER_EXITED, callTimeout)
	if st.ExitCode != 0 {
		b, _ := os.ReadFile(filepath.Join(cfg.LogDirectory, "dev.log"))
		t.Errorf("device-injector's device and mount: exit %d\n%s", st.ExitCode, b)
	}
}

// testHookInjector: hook-injector finds hooks in the node's hook directory
// (written for this test's containers only, by annotation) and injects
// them; the daemon runs prestart, poststart and poststop hooks as runc
// would, with the container's state on their stdin, and refuses a
// createContainer hook, naming the plugin.
func testHookInjector(t *testing.T, e *env, s podStage1) {
	hooksDir := "/etc/containers/oci/hooks.d"
	if _, err := os.Stat(hooksDir); os.IsNotExist(err) {
		if err := os.MkdirAll(hooksDir, 0o755); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.Remove(hooksDir); os.Remove(filepath.Dir(hooksDir)) })
	}
	tag := randHex(8)
	dir := t.TempDir()
	out := filepath.Join(dir, "hook.out")
	script := filepath.Join(dir, "hook.sh")
	if err := os.WriteFile(script, []byte("#!/bin/sh\n{ echo \"$1\"; cat; echo; } >>"+out+"\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	for stage, who := range map[string]string{"prestart": tag, "poststart": tag, "poststop": tag, "createContainer": tag + "-cc"} {
		spec := fmt.Sprintf(`{"version": "1.0.0", "hook": {"path": %q, "args": ["hook.sh", %q]}, "when": {"annotations": {"stagelet-e2e-hook": %q}}, "stages": [%q]}`, script, stage, who, stage)
		p := filepath.Join(hooksDir, "stagelet-e2e-"+tag+"-"+stage+".json")
		if err := os.WriteFile(p, []byte(spec), 0o644); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.Remove(p) })
	}
	startNRIPlugin(t, nriPlugin(t, "hook-injector"), "-idx", "40", "-socket-path", e.d.NRISocket)
	e.nriConnected("40-hook-injector")

	cfg := e.netPodConfig("hooks", s)
	pod := e.runStage1Pod(cfg, s)
	ctr := e.netContainer(s, "hooked", "sleep", "3600")
	ctr.Annotations = map[string]string{"stagelet-e2e-hook": tag}
	id := e.createContainer(pod, cfg, ctr)
	b, _ := os.ReadFile(out)
	if !strings.HasPrefix(string(b), "prestart\n") || !strings.Contains(string(b), `"id":"`+id+`"`) || !strings.Contains(string(b), `"status":"created"`) {
		t.Errorf("the prestart hook's record: %q", b)
	}
	e.startContainer(id)
	// The poststart hook's pid is the host's, of the container's process
	// (in a pod with a PID namespace of its own too).
	b, _ = os.ReadFile(out)
	_, after, ok := strings.Cut(string(b), "poststart\n")
	var state struct{ Pid int }
	if !ok || json.Unmarshal([]byte(strings.SplitN(after, "\n", 2)[0]), &state) != nil {
		t.Errorf("no poststart record with a state: %q", b)
	} else if cg, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", state.Pid)); err != nil || !strings.Contains(string(cg), "/app-"+id) {
		t.Errorf("the poststart hook's pid %d is not the container's process on the host: %q, %v", state.Pid, cg, err)
	}
	if _, err := e.rt().StopContainer(e.ctx(), &runtimeapi.StopContainerRequest{ContainerId: id, Timeout: 1}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.rt().RemoveContainer(e.ctx(), &runtimeapi.RemoveContainerRequest{ContainerId: id}); err != nil {
		t.Fatal(err)
	}
	b, _ = os.ReadFile(out)
	if !strings.Contains(string(b), "poststop\n") {
		t.Errorf("no poststop hook ran: %q", b)
	}
	// A createContainer hook would run in the namespaces of a process
	// that does not exist before StartContainer here: refused, named.
	cc := e.netContainer(s, "cc", "true")
	cc.Annotations = map[string]string{"stagelet-e2e-hook": tag + "-cc"}
	_, err := e.rt().CreateContainer(e.ctx(), &runtimeapi.CreateContainerRequest{PodSandboxId: pod, Config: cc, SandboxConfig: cfg})
	if err == nil || !strings.Contains(err.Error(), "hook-injector") || !strings.Contains(err.Error(), "createContainer") {
		t.Errorf("a createContainer hook: %v, want a refusal naming hook-injector", err)
	}
}

// TestNRIPluginFailures: a plugin that hangs past the request timeout
// delays a container's creation by that timeout at most, once: it is
// disconnected and the container is created as without it; a plugin
// that dies while pods start takes nothing with it.
func TestNRIPluginFailures(t *testing.T) {
	e := newEnvOpts(t, harness.Options{Policy: bothStage1sPolicy, NRIRequestTimeout: "1s"}, true)
	s := flyStage1
	hang := startStubPlugin(t, e.d.NRISocket, "50", "hang")
	crash, _ := startNRIPlugin(t, nriPlugin(t, "template"), "-idx", "60", "-name", "crash", "-socket", e.d.NRISocket)
	e.nriConnected("50-hang", "60-crash")

	cfg := e.netPodConfig("hung", s)
	pod := e.runStage1Pod(cfg, s)
	start := time.Now()
	id := e.createAndStart(pod, cfg, e.netContainer(s, "c", "true"))
	took := time.Since(start)
	e.waitContainerState(id, runtimeapi.ContainerState_CONTAINER_EXITED, callTimeout)
	if took > 30*time.Second {
		t.Errorf("CreateContainer and StartContainer took %v with a plugin hanging: more than its timeout allows", took)
	}
	select {
	case <-hang.asked:
	default:
		t.Error("the hanging plugin was never asked")
	}
	testutil.WaitFor(t, time.Minute, "the hanging plugin disconnected", func() (bool, string) {
		info := e.verboseStatus()["nri"]
		return !strings.Contains(info, "50-hang"), info
	})

	// The other plugin dies, as a crash kills it, with pods starting.
	var wg sync.WaitGroup
	cfgs := make([]*runtimeapi.PodSandboxConfig, 3)
	ids := make([]string, len(cfgs))
	for i := range cfgs {
		cfgs[i] = e.netPodConfig(fmt.Sprintf("after-%d", i), s)
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, err := e.rt().RunPodSandbox(e.ctx(), &runtimeapi.RunPodSandboxRequest{Config: cfgs[i], RuntimeHandler: s.handler})
			if err != nil {
				t.Errorf("RunPodSandbox while a plugin crashes: %v", err)
				return
			}
			e.cleanupPod(resp.PodSandboxId)
			ids[i] = resp.PodSandboxId
		}()
	}
	crash.Process.Signal(syscall.SIGKILL)
	wg.Wait()
	for i, p := range ids {
		if p == "" {
			continue
		}
		id := e.createAndStart(p, cfgs[i], e.netContainer(s, "c", "true"))
		e.waitContainerState(id, runtimeapi.ContainerState_CONTAINER_EXITED, callTimeout)
	}
}

// stubPlugin is a plugin of this test: it hangs in CreateContainer until
// its connection ends (its first call closes asked).
type stubPlugin struct {
	asked chan struct{}
	once  sync.Once
}

func (p *stubPlugin) CreateContainer(ctx context.Context, _ *nriapi.PodSandbox, _ *nriapi.Container) (*nriapi.ContainerAdjustment, []*nriapi.ContainerUpdate, error) {
	p.once.Do(func() { close(p.asked) })
	<-ctx.Done()
	return nil, nil, ctx.Err()
}

// startStubPlugin connects a stubPlugin named idx-name to the daemon's
// socket; the test's end disconnects it.
func startStubPlugin(t *testing.T, socket, idx, name string) *stubPlugin {
	t.Helper()
	p := &stubPlugin{asked: make(chan struct{})}
	st, err := stub.New(p, stub.WithSocketPath(socket), stub.WithPluginIdx(idx), stub.WithPluginName(name))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	if err := st.Start(ctx); err != nil {
		cancel()
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Stop(); cancel() })
	return p
}

// syncPlugin is a plugin of this test that handles only a container's
// start (the stub wants one event at least) and asks for updates on its
// own (stub.UpdateContainers).
type syncPlugin struct{}

func (syncPlugin) StartContainer(context.Context, *nriapi.PodSandbox, *nriapi.Container) error {
	return nil
}

// TestNRIPluginUpdatesARunningContainer: a plugin's own update of a
// running container's limits (as a resource policy rebalances) reaches
// the container's cgroup and its status, as the kubelet's
// UpdateContainerResources does.
func TestNRIPluginUpdatesARunningContainer(t *testing.T) {
	e := newEnvOpts(t, harness.Options{Policy: bothStage1sPolicy}, true)
	s := flyStage1
	st, err := stub.New(syncPlugin{}, stub.WithSocketPath(e.d.NRISocket), stub.WithPluginIdx("70"), stub.WithPluginName("updater"))
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(st.Stop)
	e.nriConnected("70-updater")

	cfg := e.netPodConfig("updated", s)
	pod := e.runStage1Pod(cfg, s)
	id := e.createAndStart(pod, cfg, e.netContainer(s, "c", "sleep", "3600"))
	failed, err := st.UpdateContainers([]*nriapi.ContainerUpdate{{
		ContainerId: id,
		Linux: &nriapi.LinuxContainerUpdate{Resources: &nriapi.LinuxResources{
			Memory: &nriapi.LinuxMemory{Limit: nriapi.Int64(64 << 20)},
			Cpu:    &nriapi.LinuxCPU{Shares: nriapi.UInt64(333)},
		}},
	}})
	if err != nil || len(failed) > 0 {
		t.Fatalf("UpdateContainers: failed %v, %v", failed, err)
	}
	got := e.containerStatus(id).GetResources().GetLinux()
	if got.GetMemoryLimitInBytes() != 64<<20 || got.GetCpuShares() != 333 {
		t.Errorf("the container's status after the plugin's update: %v", got)
	}
	limit := strings.TrimSpace(e.execOK(id, "sh", "-c", "cat /sys/fs/cgroup/memory.max 2>/dev/null || cat /sys/fs/cgroup/memory/memory.limit_in_bytes"))
	if limit != fmt.Sprint(64<<20) {
		t.Errorf("the container's cgroup memory limit after the plugin's update: %s", limit)
	}
}
