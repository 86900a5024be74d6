// Package e2e drives the real `stagelet serve` binary through the CRI, the
// way the kubelet does: images come from a registry on 127.0.0.1 built from
// busybox-static, pods and containers run for real, and the daemon is
// killed and restarted with pods running. The tests need root and skip
// without it.
package e2e

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"flag"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/internal/testutil"
	"github.com/stagelet/stagelet/test/e2e/harness"
	"github.com/stagelet/stagelet/test/testregistry"
)

// stageletBin is the binary built once by TestMain.
var stageletBin string

// Timeouts. They bound waits on conditions; none is slept.
const (
	callTimeout  = 60 * time.Second // one CRI call
	startTimeout = 60 * time.Second // daemon answers after start or restart
	stateTimeout = 30 * time.Second // a container reaches a state
)

func TestMain(m *testing.M) {
	flag.Parse()
	if os.Geteuid() != 0 || testing.Short() {
		// Every test skips, saying why.
		os.Exit(m.Run())
	}
	dir, err := os.MkdirTemp("", "se2e-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, "e2e:", err)
		os.Exit(1)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	stageletBin, err = harness.Build(ctx, dir)
	cancel()
	if err != nil {
		fmt.Fprintln(os.Stderr, "e2e: build stagelet:", err)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

func requireRoot(t *testing.T) {
	t.Helper()
	testutil.NeedRoot(t, "starts the real daemon, which mounts, pivots into root filesystems and creates cgroups")
}

// env is one test's world: a registry, a daemon and the busybox image.
type env struct {
	t     *testing.T
	reg   *testregistry.Registry
	d     *harness.Daemon
	image string // busybox reference, pulled unless newEnvNoPull
}

// newEnv starts a registry holding busybox, a daemon that trusts it, and
// pulls busybox through CRI.
func newEnv(t *testing.T) *env {
	e := newEnvNoPull(t)
	e.pull(e.image)
	return e
}

// newEnvNoPull is newEnv without the pull.
func newEnvNoPull(t *testing.T) *env {
	return newEnvOpts(t, harness.Options{}, false)
}

// newEnvOpts is newEnv with daemon options (a policy, a default stage1);
// Bin and InsecureRegistries are filled in. It pulls busybox when pull is
// set.
func newEnvOpts(t *testing.T, opts harness.Options, pull bool) *env {
	t.Helper()
	requireRoot(t)
	reg := testregistry.Start(t)
	e := &env{t: t, reg: reg}
	e.image = reg.PushBusybox(t, "e2e/busybox", "latest")
	e.d = startDaemonOpts(t, reg, opts)
	if pull {
		e.pull(e.image)
	}
	return e
}

// startDaemonOpts starts `stagelet serve` on fresh directories, with
// options; Bin, InsecureRegistries and Logger are filled in. Its cleanup
// prints the daemon's log on failure and tears everything down; anything
// left over once every pod was removed through CRI and the daemon stopped
// fails the test.
func startDaemonOpts(t *testing.T, reg *testregistry.Registry, opts harness.Options) *harness.Daemon {
	t.Helper()
	opts.Bin = stageletBin
	opts.InsecureRegistries = []string{reg.Host}
	opts.Logger = slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelWarn}))
	d, err := harness.New(opts)
	if err != nil {
		t.Fatalf("prepare daemon: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		left, err := d.Teardown(ctx)
		if err != nil {
			t.Errorf("teardown: %v", err)
		}
		if !left.Empty() {
			t.Errorf("left over after every pod was removed and the daemon stopped:\n%s", left)
		}
		if t.Failed() {
			t.Logf("daemon log (%s), last lines:\n%s", d.LogPath, d.LogTail(150))
		}
	})
	ctx, cancel := context.WithTimeout(t.Context(), startTimeout)
	defer cancel()
	if err := d.Start(ctx); err != nil {
		t.Fatalf("start daemon: %v", err)
	}
	return d
}

func (e *env) rt() runtimeapi.RuntimeServiceClient { return e.d.Runtime() }
func (e *env) is() runtimeapi.ImageServiceClient   { return e.d.Image() }

// ctx is a context for one CRI call.
func (e *env) ctx() context.Context {
	ctx, cancel := context.WithTimeout(e.t.Context(), callTimeout)
	e.t.Cleanup(cancel)
	return ctx
}

// pollCtx is a context for one call inside a polling loop; cancel it right
// after the call.
func (e *env) pollCtx() (context.Context, context.CancelFunc) {
	return context.WithTimeout(e.t.Context(), callTimeout)
}

func (e *env) pull(ref string) string {
	e.t.Helper()
	resp, err := e.is().PullImage(e.ctx(), &runtimeapi.PullImageRequest{Image: &runtimeapi.ImageSpec{Image: ref}})
	if err != nil {
		e.t.Fatalf("PullImage %s: %v", ref, err)
	}
	if resp.ImageRef == "" {
		e.t.Fatalf("PullImage %s: empty image_ref", ref)
	}
	return resp.ImageRef
}

func randHex(n int) string {
	b := make([]byte, n)
	rand.Read(b)
	return hex.EncodeToString(b)
}

var nonLabel = regexp.MustCompile(`[^A-Za-z0-9_.-]`)

// testLabel is the value of the "e2e-test" label every pod carries.
func testLabel(t *testing.T) string {
	s := nonLabel.ReplaceAllString(t.Name(), "_")
	if len(s) > 63 {
		s = s[:63]
	}
	return s
}

// hostNS is what fly pods share with the host.
func hostNS() *runtimeapi.NamespaceOption {
	return &runtimeapi.NamespaceOption{
		Network: runtimeapi.NamespaceMode_NODE,
		Pid:     runtimeapi.NamespaceMode_NODE,
		Ipc:     runtimeapi.NamespaceMode_NODE,
	}
}

// podConfig is a pod config as the kubelet would send it for a host-network,
// host-PID pod, with its own log directory.
func (e *env) podConfig(name string) *runtimeapi.PodSandboxConfig {
	e.t.Helper()
	logDir := filepath.Join(e.d.LogsDir, name+"-"+randHex(4))
	if err := os.MkdirAll(logDir, 0o755); err != nil {
		e.t.Fatal(err)
	}
	return &runtimeapi.PodSandboxConfig{
		Metadata: &runtimeapi.PodSandboxMetadata{
			Name:      name,
			Uid:       randHex(16),
			Namespace: "e2e",
		},
		Hostname:     name,
		LogDirectory: logDir,
		Labels:       map[string]string{"e2e-test": testLabel(e.t)},
		Annotations:  map[string]string{},
		Linux: &runtimeapi.LinuxPodSandboxConfig{
			SecurityContext: &runtimeapi.LinuxSandboxSecurityContext{NamespaceOptions: hostNS()},
		},
	}
}

// runPod runs a pod and registers its stop and removal through CRI.
func (e *env) runPod(cfg *runtimeapi.PodSandboxConfig) string {
	e.t.Helper()
	return e.runPodHandler(cfg, "")
}

// runPodHandler is runPod with a runtime handler (RuntimeClass).
func (e *env) runPodHandler(cfg *runtimeapi.PodSandboxConfig, handler string) string {
	e.t.Helper()
	resp, err := e.rt().RunPodSandbox(e.ctx(), &runtimeapi.RunPodSandboxRequest{Config: cfg, RuntimeHandler: handler})
	if err != nil {
		e.t.Fatalf("RunPodSandbox %s: %v", cfg.GetMetadata().GetName(), err)
	}
	if resp.PodSandboxId == "" {
		e.t.Fatalf("RunPodSandbox %s: empty pod_sandbox_id", cfg.GetMetadata().GetName())
	}
	e.cleanupPod(resp.PodSandboxId)
	return resp.PodSandboxId
}

// cleanupPod stops and removes a pod through CRI when the test ends. Both
// calls must succeed even if the test removed the pod already.
func (e *env) cleanupPod(id string) {
	t := e.t
	t.Cleanup(func() {
		if !e.d.Running() {
			return // the daemon's own teardown reports this
		}
		ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
		defer cancel()
		report := t.Errorf
		if t.Failed() {
			report = t.Logf
		}
		if _, err := e.rt().StopPodSandbox(ctx, &runtimeapi.StopPodSandboxRequest{PodSandboxId: id}); err != nil {
			report("cleanup: StopPodSandbox %s: %v", id, err)
		}
		if _, err := e.rt().RemovePodSandbox(ctx, &runtimeapi.RemovePodSandboxRequest{PodSandboxId: id}); err != nil {
			report("cleanup: RemovePodSandbox %s: %v", id, err)
		}
	})
}

// containerConfig is a container of the busybox image running cmd, logging
// to NAME.log in the pod's log directory.
func (e *env) containerConfig(name string, cmd ...string) *runtimeapi.ContainerConfig {
	return &runtimeapi.ContainerConfig{
		Metadata: &runtimeapi.ContainerMetadata{Name: name},
		Image:    &runtimeapi.ImageSpec{Image: e.image},
		Command:  cmd,
		LogPath:  name + ".log",
		Labels:   map[string]string{"e2e-container": name},
		Linux: &runtimeapi.LinuxContainerConfig{
			Resources:       &runtimeapi.LinuxContainerResources{},
			SecurityContext: &runtimeapi.LinuxContainerSecurityContext{NamespaceOptions: hostNS()},
		},
	}
}

func (e *env) createContainer(podID string, podCfg *runtimeapi.PodSandboxConfig, cfg *runtimeapi.ContainerConfig) string {
	e.t.Helper()
	resp, err := e.rt().CreateContainer(e.ctx(), &runtimeapi.CreateContainerRequest{
		PodSandboxId: podID, Config: cfg, SandboxConfig: podCfg,
	})
	if err != nil {
		e.t.Fatalf("CreateContainer %s: %v", cfg.GetMetadata().GetName(), err)
	}
	if resp.ContainerId == "" {
		e.t.Fatalf("CreateContainer %s: empty container_id", cfg.GetMetadata().GetName())
	}
	return resp.ContainerId
}

func (e *env) startContainer(id string) {
	e.t.Helper()
	if _, err := e.rt().StartContainer(e.ctx(), &runtimeapi.StartContainerRequest{ContainerId: id}); err != nil {
		e.t.Fatalf("StartContainer %s: %v", id, err)
	}
}

// createAndStart creates and starts a container and returns its ID.
func (e *env) createAndStart(podID string, podCfg *runtimeapi.PodSandboxConfig, cfg *runtimeapi.ContainerConfig) string {
	e.t.Helper()
	id := e.createContainer(podID, podCfg, cfg)
	e.startContainer(id)
	return id
}

// runOne runs a pod with one started container and returns both IDs and
// the pod's config.
func (e *env) runOne(name string, cfg *runtimeapi.ContainerConfig) (podID, ctrID string, podCfg *runtimeapi.PodSandboxConfig) {
	e.t.Helper()
	podCfg = e.podConfig(name)
	podID = e.runPod(podCfg)
	ctrID = e.createAndStart(podID, podCfg, cfg)
	return podID, ctrID, podCfg
}

func (e *env) containerStatus(id string) *runtimeapi.ContainerStatus {
	e.t.Helper()
	resp, err := e.rt().ContainerStatus(e.ctx(), &runtimeapi.ContainerStatusRequest{ContainerId: id})
	if err != nil {
		e.t.Fatalf("ContainerStatus %s: %v", id, err)
	}
	if resp.Status == nil {
		e.t.Fatalf("ContainerStatus %s: no status", id)
	}
	return resp.Status
}

func (e *env) podStatus(id string) *runtimeapi.PodSandboxStatus {
	e.t.Helper()
	resp, err := e.rt().PodSandboxStatus(e.ctx(), &runtimeapi.PodSandboxStatusRequest{PodSandboxId: id})
	if err != nil {
		e.t.Fatalf("PodSandboxStatus %s: %v", id, err)
	}
	if resp.Status == nil {
		e.t.Fatalf("PodSandboxStatus %s: no status", id)
	}
	return resp.Status
}

// waitContainerState polls until the container is in state and returns its
// status; the test fails at the deadline.
func (e *env) waitContainerState(id string, state runtimeapi.ContainerState, timeout time.Duration) *runtimeapi.ContainerStatus {
	e.t.Helper()
	var last *runtimeapi.ContainerStatus
	var lastErr error
	deadline := time.Now().Add(timeout)
	for {
		ctx, cancel := e.pollCtx()
		resp, err := e.rt().ContainerStatus(ctx, &runtimeapi.ContainerStatusRequest{ContainerId: id})
		cancel()
		lastErr = err
		if err == nil && resp.Status != nil {
			last = resp.Status
			if last.State == state {
				return last
			}
			if state == runtimeapi.ContainerState_CONTAINER_RUNNING && last.State == runtimeapi.ContainerState_CONTAINER_EXITED {
				e.t.Fatalf("container %s exited (code %d, reason %q, message %q) while waiting for RUNNING; log:\n%s",
					id, last.ExitCode, last.Reason, last.Message, e.logText(last.LogPath))
			}
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("container %s not %s after %s: last status %v, last error %v", id, state, timeout, last, lastErr)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// execSync runs cmd in a container and fails the test if the call fails
// (a non-zero exit code is not a failure of the call).
func (e *env) execSync(id string, cmd ...string) *runtimeapi.ExecSyncResponse {
	e.t.Helper()
	resp, err := e.rt().ExecSync(e.ctx(), &runtimeapi.ExecSyncRequest{ContainerId: id, Cmd: cmd, Timeout: 30})
	if err != nil {
		e.t.Fatalf("ExecSync %q in %s: %v", cmd, id, err)
	}
	return resp
}

// execOK runs cmd and requires exit code 0; it returns stdout.
func (e *env) execOK(id string, cmd ...string) string {
	e.t.Helper()
	r := e.execSync(id, cmd...)
	if r.ExitCode != 0 {
		e.t.Fatalf("ExecSync %q in %s: exit code %d, stdout %q, stderr %q", cmd, id, r.ExitCode, r.Stdout, r.Stderr)
	}
	return string(r.Stdout)
}

// logPath is where a container's CRI log is, from its pod's and its own
// config.
func logPath(podCfg *runtimeapi.PodSandboxConfig, cfg *runtimeapi.ContainerConfig) string {
	return filepath.Join(podCfg.LogDirectory, cfg.LogPath)
}

// readCRILog reads and parses a CRI log file; a malformed line fails the
// test. A missing file reads as no lines.
func (e *env) readCRILog(path string) []harness.LogLine {
	e.t.Helper()
	b, err := os.ReadFile(path)
	if os.IsNotExist(err) {
		return nil
	}
	if err != nil {
		e.t.Fatalf("read CRI log: %v", err)
	}
	lines, err := harness.ParseCRILog(b)
	if err != nil {
		e.t.Fatalf("CRI log %s is malformed: %v\n%s", path, err, b)
	}
	return lines
}

// logText is a log file's raw text for failure messages.
func (e *env) logText(path string) string {
	if path == "" {
		return "(no log path)"
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return fmt.Sprintf("(%v)", err)
	}
	return string(b)
}

// waitLogLine waits until the log holds a full line on stream equal to want.
func (e *env) waitLogLine(path, stream, want string) {
	e.t.Helper()
	testutil.WaitFor(e.t, stateTimeout, fmt.Sprintf("%s line %q in %s", stream, want, path), func() (bool, string) {
		b, err := os.ReadFile(path)
		if err != nil {
			return false, err.Error()
		}
		lines, err := harness.ParseCRILog(b)
		if err != nil {
			return false, err.Error()
		}
		for _, l := range harness.JoinPartial(lines, stream) {
			if l == want {
				return true, ""
			}
		}
		return false, fmt.Sprintf("log so far:\n%s", b)
	})
}

// requireCode fails the test unless err carries gRPC code c.
func requireCode(t *testing.T, err error, c codes.Code, what string) {
	t.Helper()
	if err == nil {
		t.Fatalf("%s: succeeded, want gRPC %s", what, c)
	}
	if s, _ := status.FromError(err); s.Code() != c {
		t.Fatalf("%s: got %v, want gRPC %s", what, err, c)
	}
}

// sameMap compares maps treating nil and empty as equal.
func sameMap(a, b map[string]string) bool {
	if len(a) == 0 && len(b) == 0 {
		return true
	}
	return maps.Equal(a, b)
}

func lower(s string) string { return strings.ToLower(s) }
