// Package stage1test is the conformance suite every stage1 backend runs:
// one body of tests (pod and container lifecycle, exit codes, idempotent
// stop and remove, status after remove, forget-and-recover, a pod whose
// agent died) run against a real backend, a real agent binary and real
// cgroups. Backends call Run from their own tests with an Env, and may use
// the helpers here (BuildAgent, BusyboxRootfs, CgroupParent, ShortRunDir)
// to build one, and Opened to drive a pod they started as the broker
// does.
package stage1test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/cgroups"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/stage1"
	"github.com/stagelet/stagelet/stage1/podconn"
)

// Env is what the suite needs from the backend's test.
type Env struct {
	// AgentBinary is a built stagelet binary (see BuildAgent).
	AgentBinary string
	// Rootfs returns a fresh container root filesystem holding busybox
	// and its applets in /bin (see BusyboxRootfs); it skips the test when
	// it cannot.
	Rootfs func(t *testing.T) string
	// CgroupParent returns a fresh cgroup parent beneath the test's own
	// cgroup, removed when the test ends (see CgroupParent).
	CgroupParent func(t *testing.T) string
	// RunDir returns a fresh pod run directory, short enough for a unix
	// socket path (see ShortRunDir).
	RunDir func(t *testing.T) string
	// KillPod kills the pod's host process(es) from outside (as a crash
	// would), given the pod's last persisted state, and returns once they
	// are dead.
	KillPod func(t *testing.T, state []byte)
	// Timeout bounds each wait of the suite; zero means 30s.
	Timeout time.Duration
	// Procs lists the processes of a pod still running on the host;
	// nil means every process beneath the pod's cgroup parent.
	Procs func(t *testing.T, spec *stage1.PodSpec) []string
	// Leftovers lists what a destroyed pod left on the host besides
	// processes; nil means the cgroups beneath the pod's cgroup parent.
	Leftovers func(t *testing.T, spec *stage1.PodSpec) []string
}

// Run runs the conformance suite against b.
func Run(t *testing.T, b stage1.Backend, env Env) {
	if env.Timeout == 0 {
		env.Timeout = 30 * time.Second
	}
	s := &suite{b: b, env: env}
	t.Run("Capabilities", s.testCapabilities)
	t.Run("Lifecycle", s.testLifecycle)
	t.Run("ExitCodes", s.testExitCodes)
	t.Run("Idempotent", s.testIdempotent)
	t.Run("ForgetAndRecover", s.testForgetAndRecover)
	t.Run("PodGone", s.testPodGone)
	t.Run("DestroyTwice", s.testDestroyTwice)
}

type suite struct {
	b   stage1.Backend
	env Env
}

var podSeq atomic.Int64

// testPod is a started pod and what is needed to destroy it.
type testPod struct {
	spec *stage1.PodSpec
	pod  stage1.Pod
	conn *podconn.Conn // the broker's side of the pod's agent
	cg   string        // cgroup parent

	mu    sync.Mutex
	state []byte // last persisted
}

// set makes pod the test's pod, with a connection to its agent.
func (p *testPod) set(pod stage1.Pod) {
	p.pod, p.conn = pod, podconn.Connect(pod, nil)
}

// stop stops the pod, its agent shut down through the connection.
func (p *testPod) stop(ctx context.Context, timeout time.Duration) error {
	return p.pod.Stop(ctx, timeout, p.conn.Shutdown)
}

func (p *testPod) lastState() []byte {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]byte(nil), p.state...)
}

func (s *suite) ctx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), s.env.Timeout)
	t.Cleanup(cancel)
	return ctx
}

// startPod starts a pod; the test's cleanup destroys it with the last
// persisted state, whatever happened.
func (s *suite) startPod(t *testing.T) *testPod {
	t.Helper()
	id := fmt.Sprintf("conf%d%d", os.Getpid(), podSeq.Add(1))
	tp := &testPod{
		spec: &stage1.PodSpec{
			ID:           id,
			Name:         "conformance",
			Namespace:    "default",
			UID:          id + "-uid",
			Hostname:     "conformance",
			RunDir:       s.env.RunDir(t),
			CgroupParent: s.env.CgroupParent(t),
			// The host's network where the backend offers it (no
			// namespace to make); else a pod with no network at all.
			HostNetwork: s.b.Capabilities().HostNetwork,
			AgentBinary: s.env.AgentBinary,
		},
	}
	tp.cg = tp.spec.CgroupParent
	persist := func(st []byte) error {
		tp.mu.Lock()
		defer tp.mu.Unlock()
		tp.state = append([]byte(nil), st...)
		return nil
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), s.env.Timeout)
		defer cancel()
		if err := s.b.DestroyPod(ctx, tp.spec, tp.lastState()); err != nil {
			t.Errorf("cleanup: DestroyPod: %v", err)
		}
	})
	pod, err := s.b.StartPod(s.ctx(t), tp.spec, persist)
	if err != nil {
		t.Fatalf("StartPod: %v", err)
	}
	tp.set(pod)
	if st := pod.State(); len(st) > 0 {
		persist(st)
	}
	return tp
}

// container creates and starts a container running args.
func (s *suite) container(t *testing.T, tp *testPod, id string, args ...string) (logPath string) {
	t.Helper()
	ctx := s.ctx(t)
	logPath = filepath.Join(t.TempDir(), id+".log")
	spec := &stage1.ContainerSpec{AppSpec: api.AppSpec{
		ID:      id,
		Name:    id,
		Rootfs:  s.env.Rootfs(t),
		Args:    args,
		Env:     []string{"PATH=/bin"},
		LogPath: logPath,
		// As the broker sets it: the daemon writes the log where the
		// backend says so.
		HostLog: s.b.Capabilities().HostLogs,
	}}
	st, err := tp.conn.CreateContainer(ctx, spec)
	if err != nil {
		t.Fatalf("CreateContainer %s: %v", id, err)
	}
	if st.ID != id || st.State != api.StateCreated {
		t.Fatalf("CreateContainer %s: status %+v, want created", id, st)
	}
	if _, err := tp.conn.StartContainer(ctx, id); err != nil {
		t.Fatalf("StartContainer %s: %v", id, err)
	}
	return logPath
}

// waitFor polls cond until it holds or the suite's timeout passes.
func (s *suite) waitFor(t *testing.T, what string, cond func() (bool, error)) {
	t.Helper()
	deadline := time.Now().Add(s.env.Timeout)
	delay := 5 * time.Millisecond
	var lastErr error
	for {
		ok, err := cond()
		if ok {
			return
		}
		lastErr = err
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s (last error: %v)", what, lastErr)
		}
		time.Sleep(delay) // polling a condition; nothing to block on
		if delay < 100*time.Millisecond {
			delay *= 2
		}
	}
}

func (s *suite) waitState(t *testing.T, pod *podconn.Conn, id, state string) *api.AppStatus {
	t.Helper()
	var st *api.AppStatus
	s.waitFor(t, fmt.Sprintf("container %s %s", id, state), func() (bool, error) {
		var err error
		st, err = pod.ContainerStatus(s.ctx(t), id)
		return err == nil && st.State == state, err
	})
	return st
}

func (s *suite) testCapabilities(t *testing.T) {
	c := s.b.Capabilities()
	if c.Isolation < stage1.IsolationHost || c.Isolation > stage1.IsolationKernel {
		t.Errorf("Isolation %d out of range", c.Isolation)
	}
	if c.KernelIsolated != (c.Isolation == stage1.IsolationKernel) {
		t.Errorf("KernelIsolated %v disagrees with Isolation %d", c.KernelIsolated, c.Isolation)
	}
	if !c.HostNetwork && !c.PodNetwork {
		t.Error("backend supports no network at all")
	}
	switch c.Privileged {
	case "host", "pod", "guest":
	default:
		t.Errorf("Privileged %q", c.Privileged)
	}
	if s.b.Name() == "" {
		t.Error("empty name")
	}
	// The policy refuses option keys a backend does not declare, and
	// cites each declared one by name.
	seen := map[string]bool{}
	for _, o := range c.Options {
		if o.Name == "" || o.Doc == "" || seen[o.Name] {
			t.Errorf("option %+v: want a name of its own and a Doc", o)
		}
		seen[o.Name] = true
	}
}

func (s *suite) testLifecycle(t *testing.T) {
	tp := s.startPod(t)
	ctx := s.ctx(t)
	info, err := tp.conn.Info(ctx)
	if err != nil {
		t.Fatalf("Info: %v", err)
	}
	if info.Version != api.Version {
		t.Errorf("agent protocol version %d, want %d", info.Version, api.Version)
	}
	if d := tp.pod.Details(); d["stage1"] != s.b.Name() {
		t.Errorf("Details = %v, want stage1=%s", d, s.b.Name())
	}

	logPath := s.container(t, tp, "main", "/bin/sh", "-c", "echo hi; sleep 1000")
	st := s.waitState(t, tp.conn, "main", api.StateRunning)
	if st.StartedAt.IsZero() {
		t.Errorf("running without StartedAt: %+v", st)
	}
	s.waitFor(t, "the log line", func() (bool, error) {
		b, err := os.ReadFile(logPath)
		return strings.Contains(string(b), " stdout F hi\n"), err
	})

	list, err := tp.conn.ListContainers(ctx)
	if err != nil || len(list) != 1 || list[0].ID != "main" {
		t.Errorf("ListContainers = %v, %v", list, err)
	}
	res, err := tp.conn.ExecSync(ctx, "main", []string{"echo", "x"}, 10*time.Second)
	if err != nil {
		t.Fatalf("ExecSync: %v", err)
	}
	if string(res.Stdout) != "x\n" || res.ExitCode != 0 {
		t.Errorf("ExecSync = %q exit %d (stderr %q), want \"x\\n\" 0", res.Stdout, res.ExitCode, res.Stderr)
	}
	if _, err := tp.conn.PodStats(ctx, tp.pod); err != nil {
		t.Errorf("pod Stats: %v", err)
	}
	if _, err := tp.conn.Stats(ctx, "main"); err != nil {
		t.Errorf("container Stats: %v", err)
	}
	if err := tp.conn.ReopenLog(ctx, "main"); err != nil {
		t.Errorf("ReopenLog: %v", err)
	}

	st, err = tp.conn.StopContainer(ctx, "main", 2*time.Second)
	if err != nil {
		t.Fatalf("StopContainer: %v", err)
	}
	if st.State != api.StateExited {
		st = s.waitState(t, tp.conn, "main", api.StateExited)
	}
	if st.ExitCode != 137 && st.ExitCode != 143 {
		t.Errorf("stopped exit code %d, want 137 or 143", st.ExitCode)
	}
	st, err = tp.conn.ContainerStatus(ctx, "main")
	if err != nil {
		t.Fatal(err)
	}
	if st.State != api.StateExited || st.FinishedAt.IsZero() || (st.ExitCode != 137 && st.ExitCode != 143) {
		t.Errorf("status after stop = %+v", st)
	}

	if err := tp.conn.RemoveContainer(ctx, "main"); err != nil {
		t.Fatalf("RemoveContainer: %v", err)
	}
	if _, err := tp.conn.ContainerStatus(ctx, "main"); !errdefs.IsNotFound(err) {
		t.Errorf("status after remove: %v, want NotFound", err)
	}
	if _, err := tp.conn.StartContainer(ctx, "main"); !errdefs.IsNotFound(err) {
		t.Errorf("start after remove: %v, want NotFound", err)
	}
	if err := tp.stop(ctx, 5*time.Second); err != nil {
		t.Errorf("pod Stop: %v", err)
	}
	if err := s.b.DestroyPod(ctx, tp.spec, tp.pod.State()); err != nil {
		t.Errorf("DestroyPod: %v", err)
	}
	s.checkReleased(t, tp)
}

func (s *suite) testExitCodes(t *testing.T) {
	tp := s.startPod(t)
	for _, tt := range []struct {
		id     string
		args   []string
		code   int32
		reason string
	}{
		{"three", []string{"/bin/sh", "-c", "exit 3"}, 3, api.ReasonError},
		{"true", []string{"/bin/true"}, 0, api.ReasonCompleted},
	} {
		s.container(t, tp, tt.id, tt.args...)
		st := s.waitState(t, tp.conn, tt.id, api.StateExited)
		if st.ExitCode != tt.code || st.Reason != tt.reason {
			t.Errorf("%s: exit %d reason %q, want %d %q", tt.id, st.ExitCode, st.Reason, tt.code, tt.reason)
		}
		if st.FinishedAt.IsZero() || st.FinishedAt.Before(st.StartedAt) {
			t.Errorf("%s: StartedAt %v FinishedAt %v", tt.id, st.StartedAt, st.FinishedAt)
		}
	}
}

func (s *suite) testIdempotent(t *testing.T) {
	tp := s.startPod(t)
	ctx := s.ctx(t)
	s.container(t, tp, "c", "/bin/sleep", "1000")
	s.waitState(t, tp.conn, "c", api.StateRunning)
	for i := range 2 {
		st, err := tp.conn.StopContainer(ctx, "c", time.Second)
		if err != nil {
			t.Fatalf("StopContainer #%d: %v", i+1, err)
		}
		if st != nil && st.State != api.StateExited {
			t.Errorf("StopContainer #%d: state %s", i+1, st.State)
		}
	}
	for i := range 2 {
		if err := tp.conn.RemoveContainer(ctx, "c"); err != nil {
			t.Fatalf("RemoveContainer #%d: %v", i+1, err)
		}
	}
	if err := tp.conn.RemoveContainer(ctx, "never-created"); err != nil {
		t.Errorf("RemoveContainer of an unknown container: %v", err)
	}
	if _, err := tp.conn.ContainerStatus(ctx, "never-created"); !errdefs.IsNotFound(err) {
		t.Errorf("status of an unknown container: %v, want NotFound", err)
	}

	s.container(t, tp, "d", "/bin/sleep", "1000")
	s.waitState(t, tp.conn, "d", api.StateRunning)
	for i := range 2 {
		if err := tp.stop(ctx, time.Second); err != nil {
			t.Fatalf("pod Stop #%d: %v", i+1, err)
		}
	}
	if _, err := tp.conn.Info(ctx); err == nil {
		t.Error("agent still answers after pod Stop")
	}
	if pids := s.procs(t, tp); len(pids) != 0 {
		t.Errorf("processes left in the pod's cgroups after Stop: %v", pids)
	}
}

func (s *suite) testForgetAndRecover(t *testing.T) {
	tp := s.startPod(t)
	ctx := s.ctx(t)
	s.container(t, tp, "long", "/bin/sleep", "1000")
	before := s.waitState(t, tp.conn, "long", api.StateRunning)
	state := tp.pod.State()
	tp.pod, tp.conn = nil, nil // forget

	pod, err := s.b.RecoverPod(ctx, tp.spec, state)
	if err != nil {
		t.Fatalf("RecoverPod: %v", err)
	}
	tp.set(pod)
	st, err := tp.conn.ContainerStatus(ctx, "long")
	if err != nil {
		t.Fatalf("status after recovery: %v", err)
	}
	if st.State != api.StateRunning || st.PID != before.PID || !st.StartedAt.Equal(before.StartedAt) {
		t.Errorf("after recovery %+v, before %+v", st, before)
	}
	res, err := tp.conn.ExecSync(ctx, "long", []string{"echo", "x"}, 10*time.Second)
	if err != nil || string(res.Stdout) != "x\n" {
		t.Errorf("ExecSync after recovery = %+v, %v", res, err)
	}
	// Recovering again (a second restart) works as well.
	if _, err := s.b.RecoverPod(ctx, tp.spec, pod.State()); err != nil {
		t.Errorf("second RecoverPod: %v", err)
	}
}

func (s *suite) testPodGone(t *testing.T) {
	tp := s.startPod(t)
	ctx := s.ctx(t)
	s.container(t, tp, "orphan", "/bin/sh", "-c", "sleep 1000 & sleep 1000")
	s.waitState(t, tp.conn, "orphan", api.StateRunning)
	state := tp.pod.State()
	s.env.KillPod(t, state)

	_, err := s.b.RecoverPod(ctx, tp.spec, state)
	if !errors.Is(err, stage1.ErrPodGone) {
		t.Fatalf("RecoverPod of a killed pod: %v, want ErrPodGone", err)
	}
	if err := s.b.DestroyPod(ctx, tp.spec, state); err != nil {
		t.Fatalf("DestroyPod: %v", err)
	}
	s.checkReleased(t, tp)
}

func (s *suite) testDestroyTwice(t *testing.T) {
	tp := s.startPod(t)
	ctx := s.ctx(t)
	s.container(t, tp, "c", "/bin/sleep", "1000")
	s.waitState(t, tp.conn, "c", api.StateRunning)
	state := tp.pod.State()
	for i := range 2 {
		if err := s.b.DestroyPod(ctx, tp.spec, state); err != nil {
			t.Fatalf("DestroyPod #%d: %v", i+1, err)
		}
	}
	s.checkReleased(t, tp)
	if _, err := s.b.RecoverPod(ctx, tp.spec, state); !errors.Is(err, stage1.ErrPodGone) {
		t.Errorf("RecoverPod after DestroyPod: %v, want ErrPodGone", err)
	}
	// Stop on the old value of a destroyed pod is still fine.
	if err := tp.stop(ctx, time.Second); err != nil {
		t.Errorf("Stop after DestroyPod: %v", err)
	}
}

// procs lists the pod's processes still running (Env.Procs).
func (s *suite) procs(t *testing.T, tp *testPod) []string {
	t.Helper()
	if s.env.Procs != nil {
		return s.env.Procs(t, tp.spec)
	}
	cg, err := cgroups.Resolve(tp.cg)
	if err != nil {
		t.Fatal(err)
	}
	pids, err := cg.Procs()
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, pid := range pids {
		out = append(out, "pid "+strconv.Itoa(pid))
	}
	return out
}

// leftovers lists what the destroyed pod left besides processes
// (Env.Leftovers).
func (s *suite) leftovers(t *testing.T, tp *testPod) []string {
	t.Helper()
	if s.env.Leftovers != nil {
		return s.env.Leftovers(t, tp.spec)
	}
	cg, err := cgroups.Resolve(tp.cg)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for ctl, dir := range cg.Paths {
		ents, err := os.ReadDir(dir)
		if err != nil {
			continue
		}
		for _, e := range ents {
			if e.IsDir() {
				out = append(out, fmt.Sprintf("cgroup (%s) %s", ctl, filepath.Join(dir, e.Name())))
			}
		}
	}
	return out
}

// checkReleased asserts that nothing of a destroyed pod is left: no
// process, no cgroup beneath its cgroup parent.
func (s *suite) checkReleased(t *testing.T, tp *testPod) {
	t.Helper()
	if procs := s.procs(t, tp); len(procs) != 0 {
		t.Errorf("processes left after DestroyPod: %v", procs)
	}
	for _, l := range s.leftovers(t, tp) {
		t.Errorf("left after DestroyPod: %s", l)
	}
}

// Opened is podconn.Open of what a backend's StartPod or RecoverPod
// returned, for a test to drive the pod as the broker does: the error as
// it is when there is one.
func Opened(pod stage1.Pod, err error) (*podconn.Pod, error) {
	if err != nil {
		return nil, err
	}
	return podconn.Open(pod, nil), nil
}

// BuildAgent builds the stagelet binary (CGO off) from the module holding
// the current directory into dir and returns its path.
func BuildAgent(dir string) (string, error) {
	gomod, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		return "", fmt.Errorf("go env GOMOD: %w", err)
	}
	root := filepath.Dir(strings.TrimSpace(string(gomod)))
	out := filepath.Join(dir, "stagelet")
	cmd := exec.Command("go", "build", "-trimpath", "-ldflags", "-s -w", "-o", out, "./cmd/stagelet")
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build ./cmd/stagelet: %v\n%s", err, b)
	}
	return out, nil
}

// BusyboxRootfs returns a fresh root filesystem holding /bin/busybox and a
// symlink per applet, plus /etc/passwd and /etc/group. It skips the test
// when /bin/busybox is missing.
func BusyboxRootfs(t *testing.T) string {
	t.Helper()
	const bb = "/bin/busybox"
	if _, err := os.Stat(bb); err != nil {
		t.Skipf("needs a static busybox at %s for the test rootfs", bb)
	}
	root := filepath.Join(t.TempDir(), "rootfs")
	for _, d := range []string{"bin", "etc", "tmp", "proc", "sys", "dev", "root"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Chmod(filepath.Join(root, "tmp"), 0o1777); err != nil {
		t.Fatal(err)
	}
	if err := copyFile(bb, filepath.Join(root, "bin", "busybox"), 0o755); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(bb, "--list").Output()
	if err != nil {
		t.Fatalf("busybox --list: %v", err)
	}
	for _, name := range strings.Fields(string(out)) {
		if name == "busybox" {
			continue
		}
		if err := os.Symlink("busybox", filepath.Join(root, "bin", name)); err != nil {
			t.Fatal(err)
		}
	}
	files := map[string]string{
		"etc/passwd": "root:x:0:0:root:/root:/bin/sh\n",
		"etc/group":  "root:x:0:\n",
	}
	for name, content := range files {
		if err := os.WriteFile(filepath.Join(root, name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return root
}

func copyFile(src, dst string, mode os.FileMode) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, mode)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

// CgroupParent returns a relative cgroup parent, unique to the test,
// beneath the test process's own cgroup. When the test ends it kills what
// is left in it and removes it.
func CgroupParent(t *testing.T) string {
	t.Helper()
	name := fmt.Sprintf("stagelet-test-%d-%d", os.Getpid(), podSeq.Add(1))
	cg, err := cgroups.Resolve(name)
	if err != nil {
		t.Skipf("no usable cgroups: %v", err)
	}
	t.Cleanup(func() {
		if err := cg.Kill(); err != nil {
			t.Errorf("cleanup: %v", err)
		}
		if err := cg.Delete(); err != nil {
			t.Errorf("cleanup: %v", err)
		}
	})
	return name
}

// ShortRunDir returns a fresh directory under the system's temporary
// directory with a short name (a unix socket path is limited to 107
// bytes), removed when the test ends.
func ShortRunDir(t *testing.T) string {
	t.Helper()
	d, err := os.MkdirTemp("", "sl")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(d) })
	return d
}
