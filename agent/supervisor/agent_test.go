package supervisor_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/moby/sys/capability"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/agent/client"
	"github.com/stagelet/stagelet/agent/supervisor"
	"github.com/stagelet/stagelet/cgroups"
	"github.com/stagelet/stagelet/devices"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/testutil"
)

// The root tests run a real stagelet binary as the agent. It is built once
// by TestMain (or taken from $STAGELET_TEST_BINARY).
var (
	stageletBin string
	buildErr    error
	// escapeBin is a static program that tries the classic chroot
	// escape and lists the root it reached.
	escapeBin string
)

const escapeSrc = `package main

import (
	"fmt"
	"os"
	"syscall"
)

func main() {
	os.MkdirAll("/tmp/escape", 0o755)
	if err := syscall.Chroot("/tmp/escape"); err != nil {
		fmt.Println("chroot:", err)
		os.Exit(1)
	}
	for i := 0; i < 64; i++ {
		syscall.Chdir("..")
	}
	if err := syscall.Chroot("."); err != nil {
		fmt.Println("chroot:", err)
		os.Exit(1)
	}
	ents, _ := os.ReadDir("/")
	for _, e := range ents {
		fmt.Println(e.Name())
	}
}
`

// trampolineEnv makes the test binary wait for one byte on fd 3 and then
// exec the agent: the test moves it into a fresh cgroup in between, so the
// agent finds that cgroup as its own from its first instruction.
const trampolineEnv = "STAGELET_TEST_TRAMPOLINE"

// pid1Env makes the trampoline prepare to run the agent as PID 1 of a new
// PID namespace.
const pid1Env = "STAGELET_TEST_PID1"

// inheritableEnv makes the trampoline start the agent with its
// capabilities in its inheritable set too.
const inheritableEnv = "STAGELET_TEST_INHERITABLE"

func TestMain(m *testing.M) {
	if bin := os.Getenv(trampolineEnv); bin != "" {
		trampoline(bin)
	}
	os.Exit(testMain(m))
}

func trampoline(bin string) {
	gate := os.NewFile(3, "gate")
	var b [1]byte
	if _, err := gate.Read(b[:]); err != nil {
		fmt.Fprintln(os.Stderr, "trampoline:", err)
		os.Exit(1)
	}
	gate.Close()
	if os.Getenv(pid1Env) != "" {
		// PID 1 of a new PID and mount namespace: mount the namespace's
		// own /proc, as a container manager would.
		if err := syscall.Mount("", "/", "", syscall.MS_SLAVE|syscall.MS_REC, ""); err != nil {
			fmt.Fprintln(os.Stderr, "trampoline:", err)
			os.Exit(1)
		}
		if err := syscall.Mount("proc", "/proc", "proc", syscall.MS_NOSUID|syscall.MS_NODEV|syscall.MS_NOEXEC, ""); err != nil {
			fmt.Fprintln(os.Stderr, "trampoline:", err)
			os.Exit(1)
		}
	}
	if os.Getenv(inheritableEnv) != "" {
		// The agent starts with every capability it holds also in its
		// inheritable set, as systemd-nspawn starts it: the thread that
		// executes the agent carries the set through execve.
		runtime.LockOSThread()
		if err := inheritAll(); err != nil {
			fmt.Fprintln(os.Stderr, "trampoline:", err)
			os.Exit(1)
		}
	}
	env := []string{}
	for _, e := range os.Environ() {
		if !strings.HasPrefix(e, trampolineEnv+"=") && !strings.HasPrefix(e, pid1Env+"=") && !strings.HasPrefix(e, inheritableEnv+"=") {
			env = append(env, e)
		}
	}
	err := syscall.Exec(bin, append([]string{"stagelet"}, os.Args[1:]...), env)
	fmt.Fprintln(os.Stderr, "trampoline: exec:", err)
	os.Exit(1)
}

// inheritAll puts the calling thread's permitted capabilities into its
// inheritable set.
func inheritAll() error {
	c, err := capability.NewPid2(0)
	if err == nil {
		err = c.Load()
	}
	if err != nil {
		return err
	}
	for _, cp := range capability.ListKnown() {
		if c.Get(capability.PERMITTED, cp) {
			c.Set(capability.INHERITABLE, cp)
		}
	}
	return c.Apply(capability.CAPS)
}

func testMain(m *testing.M) int {
	flag.Parse()
	if os.Geteuid() != 0 || testing.Short() {
		return m.Run()
	}
	dir, err := os.MkdirTemp("", "stagelet-agent-test-")
	if err != nil {
		buildErr = err
		return m.Run()
	}
	defer os.RemoveAll(dir)
	stageletBin = os.Getenv("STAGELET_TEST_BINARY")
	if stageletBin == "" {
		stageletBin = filepath.Join(dir, "stagelet")
		buildErr = goBuild("../..", stageletBin, "./cmd/stagelet")
	}
	if buildErr == nil {
		src := filepath.Join(dir, "escape-src")
		os.Mkdir(src, 0o755)
		os.WriteFile(filepath.Join(src, "go.mod"), []byte("module escape\n\ngo 1.22\n"), 0o644)
		os.WriteFile(filepath.Join(src, "main.go"), []byte(escapeSrc), 0o644)
		escapeBin = filepath.Join(dir, "escape")
		buildErr = goBuild(src, escapeBin, ".")
	}
	return m.Run()
}

// goBuild builds a static binary of pkg, from dir, at out.
func goBuild(dir, out, pkg string) error {
	cmd := exec.Command("go", "build", "-o", out, pkg)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go build %s: %v\n%s", pkg, err, b)
	}
	return nil
}

// needRoot skips tests that need root, busybox and a built binary.
func needRoot(t testing.TB) {
	t.Helper()
	testutil.NeedRoot(t, "runs a real agent: mount namespaces, pivot_root, cgroups, setuid")
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	if _, err := os.Stat("/bin/busybox"); err != nil {
		t.Skip("needs a static busybox at /bin/busybox for the test rootfs")
	}
}

// makeRootfs builds a rootfs of busybox and its applets.
func makeRootfs(t testing.TB) string {
	t.Helper()
	root := filepath.Join(t.TempDir(), "rootfs")
	for _, d := range []string{"bin", "etc", "tmp", "proc", "sys", "dev", "root"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	os.Chmod(filepath.Join(root, "tmp"), 0o1777)
	src, err := os.Open("/bin/busybox")
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	dst, err := os.OpenFile(filepath.Join(root, "bin", "busybox"), os.O_CREATE|os.O_WRONLY, 0o755)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(dst, src); err != nil {
		t.Fatal(err)
	}
	dst.Close()
	out, err := exec.Command("/bin/busybox", "--list").Output()
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range strings.Fields(string(out)) {
		if name == "busybox" {
			continue
		}
		if err := os.Symlink("busybox", filepath.Join(root, "bin", name)); err != nil {
			t.Fatal(err)
		}
	}
	os.WriteFile(filepath.Join(root, "etc", "passwd"), []byte("root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000::/tmp:/bin/sh\n"), 0o644)
	os.WriteFile(filepath.Join(root, "etc", "group"), []byte("root:x:0:\nuser:x:1000:\n"), 0o644)
	return root
}

// testAgent is a running agent process inside its own cgroup.
type testAgent struct {
	t      testing.TB
	c      *client.Client
	cmd    *exec.Cmd
	cg     *cgroups.Cgroup
	state  string
	logs   *lockedBuffer
	exited chan struct{}
}

type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

func randomName(prefix string) string {
	b := make([]byte, 6)
	rand.Read(b)
	return prefix + hex.EncodeToString(b)
}

func startAgent(t testing.TB) *testAgent {
	t.Helper()
	return startAgentAs(t, false)
}

// startAgentAs starts an agent; with pid1 it is PID 1 of a new PID and
// mount namespace.
func startAgentAs(t testing.TB, pid1 bool, extraArgs ...string) *testAgent {
	t.Helper()
	needRoot(t)
	dir := t.TempDir()
	self, err := cgroups.Self()
	if err != nil {
		t.Fatalf("cgroups: %v", err)
	}
	cg := self.Child(randomName("stagelet-agent-test-"))
	if err := cg.Create(); err != nil {
		t.Fatal(err)
	}
	ta := &testAgent{t: t, cg: cg, state: filepath.Join(dir, "state"), logs: &lockedBuffer{}, exited: make(chan struct{})}
	t.Cleanup(func() {
		if err := cg.Kill(); err != nil {
			t.Errorf("kill test cgroup: %v", err)
		}
		if err := cg.Delete(); err != nil {
			t.Errorf("delete test cgroup: %v", err)
		}
	})
	sock := filepath.Join(dir, "agent.sock")
	ta.cmd = exec.Command(os.Args[0], append([]string{"agent", "--socket", sock, "--state-dir", ta.state, "--log-level", "debug"}, extraArgs...)...)
	ta.cmd.Env = append(os.Environ(), trampolineEnv+"="+stageletBin)
	ta.cmd.Stdout, ta.cmd.Stderr = ta.logs, ta.logs
	ta.cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if pid1 {
		ta.cmd.Env = append(ta.cmd.Env, pid1Env+"=1")
		ta.cmd.SysProcAttr.Cloneflags = syscall.CLONE_NEWPID | syscall.CLONE_NEWNS
	}
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	ta.cmd.ExtraFiles = []*os.File{r}
	if err := ta.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	r.Close()
	go func() {
		ta.cmd.Wait()
		close(ta.exited)
	}()
	t.Cleanup(func() {
		select {
		case <-ta.exited:
		default:
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			if err := ta.c.Shutdown(ctx, 0); err != nil {
				t.Errorf("shutdown: %v", err)
			}
			select {
			case <-ta.exited:
			case <-ctx.Done():
				t.Errorf("agent did not exit after shutdown")
				ta.cmd.Process.Kill()
				<-ta.exited
			}
		}
		if strings.Contains(ta.logs.String(), "DATA RACE") {
			t.Error("the race detector found a data race in the agent")
		}
		if t.Failed() {
			t.Logf("agent log:\n%s", ta.logs.String())
		}
	})
	if err := cg.Add(ta.cmd.Process.Pid); err != nil {
		w.Close()
		t.Fatal(err)
	}
	w.Write([]byte{1})
	w.Close()

	ta.c = client.NewClient(client.UnixDialer(sock))
	testutil.WaitFor(t, 10*time.Second, "the agent answers", func() (bool, string) {
		select {
		case <-ta.exited:
			t.Fatalf("agent exited: %v\n%s", ta.cmd.ProcessState, ta.logs.String())
		default:
		}
		_, err := ta.c.Info(context.Background())
		return err == nil, fmt.Sprint(err)
	})
	return ta
}

func ctx(t testing.TB) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return c
}

// run creates and starts an app.
func (ta *testAgent) run(spec *api.AppSpec) *api.AppStatus {
	ta.t.Helper()
	if _, err := ta.c.Create(ctx(ta.t), spec); err != nil {
		ta.t.Fatalf("create %s: %v", spec.ID, err)
	}
	st, err := ta.c.Start(ctx(ta.t), spec.ID)
	if err != nil {
		ta.t.Fatalf("start %s: %v", spec.ID, err)
	}
	return st
}

func (ta *testAgent) waitExited(id string) *api.AppStatus {
	ta.t.Helper()
	var st *api.AppStatus
	testutil.WaitFor(ta.t, 20*time.Second, id+" exited", func() (bool, string) {
		var err error
		st, err = ta.c.Status(ctx(ta.t), id)
		if err != nil {
			ta.t.Fatal(err)
		}
		return st.State == api.StateExited, st.State
	})
	return st
}

func (ta *testAgent) appPID(id string) int {
	ta.t.Helper()
	st, err := ta.c.Status(ctx(ta.t), id)
	if err != nil || st.State != api.StateRunning || st.PID <= 0 {
		ta.t.Fatalf("status of %s: %+v %v", id, st, err)
	}
	return st.PID
}

func (ta *testAgent) exec(id string, cmd ...string) *api.ExecResult {
	ta.t.Helper()
	res, err := ta.c.Exec(ctx(ta.t), id, cmd, 0)
	if err != nil {
		ta.t.Fatalf("exec %q: %v", cmd, err)
	}
	return res
}

func sh(script string) []string { return []string{"sh", "-c", script} }

func TestInfo(t *testing.T) {
	ta := startAgent(t)
	info, err := ta.c.Info(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	var u syscall.Utsname
	syscall.Uname(&u)
	if info.Version != api.Version || info.PID != ta.cmd.Process.Pid || info.Kernel == "" || info.StartedAt.IsZero() {
		t.Errorf("info = %+v (agent pid %d)", info, ta.cmd.Process.Pid)
	}
	st, err := os.Stat(filepath.Join(filepath.Dir(ta.state), "agent.sock"))
	if err != nil || st.Mode().Perm() != 0o600 {
		t.Errorf("socket mode: %v %v", st.Mode(), err)
	}
}

func TestAppLogs(t *testing.T) {
	ta := startAgent(t)
	rootfs := makeRootfs(t)
	logPath := filepath.Join(t.TempDir(), "pods", "c", "0.log")
	before := time.Now()
	ta.run(&api.AppSpec{
		ID: "logs", Rootfs: rootfs, LogPath: logPath,
		Args: sh(`echo out1; echo err1 >&2; head -c 20000 /dev/zero | tr '\0' a; echo; echo out2; printf tail`),
	})
	st := ta.waitExited("logs")
	if st.ExitCode != 0 || st.Reason != api.ReasonCompleted {
		t.Errorf("status = %+v", st)
	}
	if st.CreatedAt.Before(before) || st.StartedAt.Before(st.CreatedAt) || st.FinishedAt.Before(st.StartedAt) {
		t.Errorf("times out of order: %+v", st)
	}
	b, err := os.ReadFile(logPath)
	if err != nil {
		t.Fatal(err)
	}
	var stdout []string
	var stderr []string
	for _, line := range strings.Split(strings.TrimSuffix(string(b), "\n"), "\n") {
		f := strings.SplitN(line, " ", 4)
		if len(f) != 4 {
			t.Fatalf("bad line %q", line)
		}
		if _, err := time.Parse(time.RFC3339Nano, f[0]); err != nil {
			t.Errorf("bad time in %q: %v", line, err)
		}
		entry := f[2] + " " + f[3]
		switch f[1] {
		case "stdout":
			stdout = append(stdout, entry)
		case "stderr":
			stderr = append(stderr, entry)
		default:
			t.Errorf("bad stream in %q", line)
		}
	}
	a := strings.Repeat("a", 20000)
	want := []string{"F out1", "P " + a[:16384], "F " + a[16384:], "F out2", "P tail"}
	if strings.Join(stdout, "\n") != strings.Join(want, "\n") {
		t.Errorf("stdout lines:\n%.200q\nwant\n%.200q", stdout, want)
	}
	if len(stderr) != 1 || stderr[0] != "F err1" {
		t.Errorf("stderr lines: %q", stderr)
	}
}

func TestExitCodes(t *testing.T) {
	ta := startAgent(t)
	rootfs := makeRootfs(t)
	tests := []struct {
		id     string
		script string
		code   int32
		reason string
	}{
		{"zero", "exit 0", 0, api.ReasonCompleted},
		{"three", "exit 3", 3, api.ReasonError},
		{"killed", "kill -9 $$", 137, api.ReasonError},
	}
	for _, tt := range tests {
		ta.run(&api.AppSpec{ID: tt.id, Rootfs: rootfs, Args: sh(tt.script)})
	}
	for _, tt := range tests {
		st := ta.waitExited(tt.id)
		if st.ExitCode != tt.code || st.Reason != tt.reason || st.FinishedAt.IsZero() {
			t.Errorf("%s: status %+v, want code %d reason %s", tt.id, st, tt.code, tt.reason)
		}
		// The record on disk says the same.
		b, err := os.ReadFile(filepath.Join(ta.state, tt.id+".json"))
		if err != nil {
			t.Errorf("%s: record: %v", tt.id, err)
		} else if !strings.Contains(string(b), `"exitCode":`+strconv.Itoa(int(tt.code))) || !strings.Contains(string(b), `"state":"exited"`) {
			t.Errorf("%s: record %s", tt.id, b)
		}
	}
}

func TestStartFailure(t *testing.T) {
	ta := startAgent(t)
	rootfs := makeRootfs(t)
	if _, err := ta.c.Create(ctx(t), &api.AppSpec{ID: "nosuch", Rootfs: rootfs, Args: []string{"nosuch"}}); err != nil {
		t.Fatal(err)
	}
	_, err := ta.c.Start(ctx(t), "nosuch")
	if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), `exec: "nosuch": executable file not found in $PATH`) {
		t.Fatalf("start error = %v", err)
	}
	st, err := ta.c.Status(ctx(t), "nosuch")
	if err != nil {
		t.Fatal(err)
	}
	if st.State != api.StateExited || st.ExitCode != 128 || st.Reason != api.ReasonError || !strings.Contains(st.Message, "not found in $PATH") {
		t.Errorf("status = %+v", st)
	}
	if _, err := ta.c.Start(ctx(t), "nosuch"); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Errorf("second start: %v", err)
	}
}

func TestCreateErrors(t *testing.T) {
	ta := startAgent(t)
	rootfs := makeRootfs(t)
	ok := &api.AppSpec{ID: "a", Rootfs: rootfs, Args: []string{"true"}}
	if _, err := ta.c.Create(ctx(t), ok); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		spec  *api.AppSpec
		class error
	}{
		{ok, errdefs.ErrAlreadyExists},
		{&api.AppSpec{ID: "b", Args: []string{"true"}}, errdefs.ErrInvalidArgument},
		{&api.AppSpec{ID: "b", Rootfs: rootfs + "/nosuch", Args: []string{"true"}}, errdefs.ErrInvalidArgument},
		{&api.AppSpec{ID: "b", Rootfs: rootfs}, errdefs.ErrInvalidArgument},
		{&api.AppSpec{ID: "b/c", Rootfs: rootfs, Args: []string{"true"}}, errdefs.ErrInvalidArgument},
		{&api.AppSpec{ID: "b", Rootfs: rootfs, Args: []string{"true"}, Capabilities: []string{"CAP_NOPE"}}, errdefs.ErrInvalidArgument},
		{&api.AppSpec{ID: "b", Rootfs: rootfs, Args: []string{"true"}, Mounts: []api.Mount{{Source: "rel", Destination: "/x"}}}, errdefs.ErrInvalidArgument},
	}
	for i, tt := range tests {
		if _, err := ta.c.Create(ctx(t), tt.spec); !errors.Is(err, tt.class) {
			t.Errorf("%d: create error = %v, want %v", i, err, tt.class)
		}
	}
	if _, err := ta.c.Status(ctx(t), "nosuch"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("status of unknown app: %v", err)
	}
	if _, err := ta.c.Start(ctx(t), "nosuch"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("start of unknown app: %v", err)
	}
	if _, err := ta.c.Exec(ctx(t), "a", []string{"true"}, 0); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Errorf("exec in a created app: %v", err)
	}
	// Stop of a created app does nothing; remove is idempotent.
	if st, err := ta.c.Stop(ctx(t), "a", time.Second); err != nil || st.State != api.StateCreated {
		t.Errorf("stop created app: %+v %v", st, err)
	}
	for i := 0; i < 2; i++ {
		if err := ta.c.Remove(ctx(t), "a"); err != nil {
			t.Errorf("remove %d: %v", i, err)
		}
	}
	if _, err := ta.c.Status(ctx(t), "a"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("status after remove: %v", err)
	}
	if _, err := os.Stat(filepath.Join(ta.state, "a.json")); !os.IsNotExist(err) {
		t.Errorf("record left after remove: %v", err)
	}
	apps, err := ta.c.List(ctx(t))
	if err != nil || len(apps) != 0 {
		t.Errorf("list = %v, %v", apps, err)
	}
}

func TestStop(t *testing.T) {
	ta := startAgent(t)
	rootfs := makeRootfs(t)
	ta.run(&api.AppSpec{ID: "stubborn", Rootfs: rootfs, Args: sh(`trap "" TERM; while true; do sleep 1; done`)})
	ta.run(&api.AppSpec{ID: "polite", Rootfs: rootfs, Args: []string{"sleep", "1000"}})

	const timeout = 500 * time.Millisecond
	start := time.Now()
	st, err := ta.c.Stop(ctx(t), "stubborn", timeout)
	if err != nil {
		t.Fatal(err)
	}
	if took := time.Since(start); took < timeout {
		t.Errorf("stop returned after %v, before the %v timeout", took, timeout)
	}
	if st.State != api.StateExited || st.ExitCode != 137 || st.Reason != api.ReasonError {
		t.Errorf("stubborn: %+v", st)
	}
	st, err = ta.c.Stop(ctx(t), "polite", 30*time.Second)
	if err != nil || st.ExitCode != 128+int32(syscall.SIGTERM) {
		t.Errorf("polite: %+v, %v", st, err)
	}
	// Idempotent on exited apps.
	if st2, err := ta.c.Stop(ctx(t), "stubborn", timeout); err != nil || st2.ExitCode != 137 {
		t.Errorf("second stop: %+v %v", st2, err)
	}
	// Nothing is left in the app cgroups.
	for _, id := range []string{"stubborn", "polite"} {
		pids, err := ta.cg.Child("app-" + id).Procs()
		if err != nil || len(pids) != 0 {
			t.Errorf("%s cgroup: %v %v", id, pids, err)
		}
	}
	if err := ta.c.Signal(ctx(t), "polite", int(syscall.SIGTERM)); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Errorf("signal to exited app: %v", err)
	}
}

func TestSignalAndRemoveRunning(t *testing.T) {
	ta := startAgent(t)
	rootfs := makeRootfs(t)
	ta.run(&api.AppSpec{ID: "s", Rootfs: rootfs, Args: []string{"sleep", "1000"}})
	if err := ta.c.Signal(ctx(t), "s", int(syscall.SIGKILL)); err != nil {
		t.Fatal(err)
	}
	if st := ta.waitExited("s"); st.ExitCode != 137 {
		t.Errorf("status %+v", st)
	}
	ta.run(&api.AppSpec{ID: "r", Rootfs: rootfs, Args: sh("sleep 1000 & sleep 1000")})
	if err := ta.c.Remove(ctx(t), "r"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(ta.cg.Child("app-r").Paths["pids"]); !os.IsNotExist(err) {
		t.Errorf("app cgroup left after remove: %v", err)
	}
}

func TestExec(t *testing.T) {
	ta := startAgent(t)
	rootfs := makeRootfs(t)
	hostFile := filepath.Join(t.TempDir(), "hostname")
	os.WriteFile(hostFile, []byte("pod-a\n"), 0o644)
	ta.run(&api.AppSpec{
		ID: "user", Rootfs: rootfs, Args: []string{"sleep", "1000"},
		UID: 1000, GID: 1000, AdditionalGIDs: []uint32{2000},
		Capabilities: []string{"CAP_CHOWN", "CAP_NET_BIND_SERVICE"},
		NoNewPrivs:   true, Hostname: "pod-a", Cwd: "/tmp",
		Env:    []string{"FOO=bar", "PATH=/bin"},
		Mounts: []api.Mount{{Source: hostFile, Destination: "/etc/hostname", Readonly: true}},
	})
	appPID := ta.appPID("user")
	ta.run(&api.AppSpec{
		ID: "root", Rootfs: rootfs, Args: []string{"sleep", "1000"},
		Capabilities: []string{"CAP_CHOWN", "CAP_NET_BIND_SERVICE"},
	})

	if res := ta.exec("user", "id"); strings.TrimSpace(string(res.Stdout)) != "uid=1000(user) gid=1000(user) groups=2000" || res.ExitCode != 0 {
		t.Errorf("id: %q %q %d", res.Stdout, res.Stderr, res.ExitCode)
	}
	res := ta.exec("user", "sh", "-c", "cat /etc/hostname; hostname; pwd; echo $FOO; grep -E '^(CapEff|CapPrm|CapBnd|CapAmb|NoNewPrivs)' /proc/self/status")
	want := "pod-a\npod-a\n/tmp\nbar\nCapPrm:\t0000000000000000\nCapEff:\t0000000000000000\nCapBnd:\t0000000000000401\nCapAmb:\t0000000000000000\nNoNewPrivs:\t1\n"
	if string(res.Stdout) != want {
		t.Errorf("user exec:\n%s\nwant\n%s\nstderr %s", res.Stdout, want, res.Stderr)
	}
	// The app itself has the same credentials as its exec.
	res = ta.exec("user", "grep", "-E", "^(Uid|CapEff|CapBnd|NoNewPrivs)", fmt.Sprintf("/proc/%d/status", appPID))
	for _, w := range []string{"Uid:\t1000\t1000\t1000\t1000", "CapEff:\t0000000000000000", "CapBnd:\t0000000000000401", "NoNewPrivs:\t1"} {
		if !strings.Contains(string(res.Stdout), w) {
			t.Errorf("app status lacks %q:\n%s", w, res.Stdout)
		}
	}
	res = ta.exec("root", "sh", "-c", "grep -E '^(CapEff|CapBnd|NoNewPrivs)' /proc/self/status; id -u")
	if want := "CapEff:\t0000000000000401\nCapBnd:\t0000000000000401\nNoNewPrivs:\t0\n0\n"; string(res.Stdout) != want {
		t.Errorf("root exec:\n%s\nwant\n%s", res.Stdout, want)
	}
	// Nothing of the agent's leaks into the app or the exec: only stdio
	// (and ls's own directory) are open.
	if res := ta.exec("user", "ls", fmt.Sprintf("/proc/%d/fd", appPID)); string(res.Stdout) != "0\n1\n2\n" {
		t.Errorf("app's open files: %q %q", res.Stdout, res.Stderr)
	}
	if res := ta.exec("user", "ls", "/proc/self/fd"); string(res.Stdout) != "0\n1\n2\n3\n" {
		t.Errorf("exec's open files: %q %q", res.Stdout, res.Stderr)
	}
	if res := ta.exec("user", "sh", "-c", "echo oops >&2; exit 5"); res.ExitCode != 5 || string(res.Stderr) != "oops\n" {
		t.Errorf("exit 5: %+v", res)
	}
	if _, err := ta.c.Exec(ctx(t), "user", []string{"nosuch"}, 0); !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "not found in $PATH") {
		t.Errorf("exec nosuch: %v", err)
	}

	start := time.Now()
	res, err := ta.c.Exec(ctx(t), "user", []string{"sleep", "1000"}, 300*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	if !res.TimedOut || time.Since(start) > 20*time.Second {
		t.Errorf("exec timeout: %+v after %v", res, time.Since(start))
	}
	// The exec'd process ran in the app's cgroup and is gone.
	testutil.WaitFor(t, 10*time.Second, "only the app left in its cgroup", func() (bool, string) {
		pids, err := ta.cg.Child("app-user").Procs()
		return err == nil && len(pids) == 1, fmt.Sprint(pids, err)
	})

	if _, err := ta.c.Stop(ctx(t), "user", 0); err != nil {
		t.Fatal(err)
	}
	if _, err := ta.c.Exec(ctx(t), "user", []string{"true"}, 0); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Errorf("exec in stopped app: %v", err)
	}
}

func TestExecOutputLimit(t *testing.T) {
	ta := startAgent(t)
	rootfs := makeRootfs(t)
	ta.run(&api.AppSpec{ID: "a", Rootfs: rootfs, Args: []string{"sleep", "1000"}})
	// stdout and stderr share the limit: what stdout leaves, stderr gets.
	res := ta.exec("a", "sh", "-c", "head -c 10000000 /dev/zero; head -c 10000000 /dev/zero >&2")
	if len(res.Stdout) != 10000000 || len(res.Stderr) != supervisor.ExecOutputLimit-10000000 || res.ExitCode != 0 {
		t.Errorf("captured %d bytes of stdout and %d of stderr, code %d; want %d together", len(res.Stdout), len(res.Stderr), res.ExitCode, supervisor.ExecOutputLimit)
	}
}

func TestReadonly(t *testing.T) {
	ta := startAgent(t)
	rootfs := makeRootfs(t)
	ro, rw := t.TempDir(), t.TempDir()
	os.WriteFile(filepath.Join(ro, "f"), []byte("data\n"), 0o644)
	ta.run(&api.AppSpec{
		ID: "ro", Rootfs: rootfs, Args: []string{"sleep", "1000"}, ReadonlyRootfs: true,
		Mounts: []api.Mount{
			{Source: ro, Destination: "/ro", Readonly: true},
			{Source: rw, Destination: "/data/rw"},
		},
	})
	for _, p := range []string{"/newfile", "/ro/newfile"} {
		res := ta.exec("ro", "touch", p)
		if res.ExitCode == 0 || !strings.Contains(string(res.Stderr), "Read-only file system") {
			t.Errorf("touch %s: code %d, %s", p, res.ExitCode, res.Stderr)
		}
	}
	if res := ta.exec("ro", "cat", "/ro/f"); string(res.Stdout) != "data\n" {
		t.Errorf("cat /ro/f: %+v", res)
	}
	for _, p := range []string{"/data/rw/x", "/dev/shm/x", "/tmp/x"} {
		res := ta.exec("ro", "touch", p)
		wantOK := p != "/tmp/x" // /tmp is part of the read-only rootfs
		if (res.ExitCode == 0) != wantOK {
			t.Errorf("touch %s: code %d %s", p, res.ExitCode, res.Stderr)
		}
	}
	if _, err := os.Stat(filepath.Join(rw, "x")); err != nil {
		t.Errorf("write through the rw mount not seen on the host: %v", err)
	}
	// The app's mounts did not leak into the host.
	b, _ := os.ReadFile("/proc/self/mountinfo")
	if strings.Contains(string(b), rootfs) {
		t.Errorf("app mounts visible on the host:\n%s", b)
	}
	// /sys is read-only, /proc/sys too.
	if res := ta.exec("ro", "sh", "-c", "touch /sys/x || echo no"); !strings.Contains(string(res.Stdout), "no") {
		t.Errorf("/sys writable: %+v", res)
	}
}

func TestOrphanReaping(t *testing.T) {
	ta := startAgent(t)
	rootfs := makeRootfs(t)
	// The inner shell starts a background sleep and exits: the sleep is
	// re-parented to the agent, which must reap it when it exits.
	ta.run(&api.AppSpec{ID: "orphans", Rootfs: rootfs, Args: sh(`sh -c 'sleep 0.5 & echo $! > /tmp/gc'; exec sleep 1000`)})
	var pid int
	testutil.WaitFor(t, 10*time.Second, "the grandchild's pid", func() (bool, string) {
		b, err := os.ReadFile(filepath.Join(rootfs, "tmp", "gc"))
		if err != nil || !strings.HasSuffix(string(b), "\n") {
			return false, fmt.Sprint(err)
		}
		pid, err = strconv.Atoi(strings.TrimSpace(string(b)))
		return err == nil, fmt.Sprint(err)
	})
	testutil.WaitFor(t, 10*time.Second, "the orphan to be reaped", func() (bool, string) {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if errors.Is(err, os.ErrNotExist) {
			return true, ""
		}
		return false, string(b)
	})
	if st, _ := ta.c.Status(ctx(t), "orphans"); st.State != api.StateRunning {
		t.Errorf("app state %+v", st)
	}
}

func TestReopenLog(t *testing.T) {
	ta := startAgent(t)
	rootfs := makeRootfs(t)
	logPath := filepath.Join(t.TempDir(), "c.log")
	ta.run(&api.AppSpec{ID: "ticker", Rootfs: rootfs, LogPath: logPath, Args: sh(`while true; do echo tick; sleep 0.05; done`)})
	hasTick := func(p string) func() (bool, string) {
		return func() (bool, string) {
			b, err := os.ReadFile(p)
			return err == nil && strings.Contains(string(b), " stdout F tick\n"), fmt.Sprint(err)
		}
	}
	testutil.WaitFor(t, 10*time.Second, "a line in the log", hasTick(logPath))
	if err := os.Rename(logPath, logPath+".1"); err != nil {
		t.Fatal(err)
	}
	if err := ta.c.ReopenLog(ctx(t), "ticker"); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 10*time.Second, "a line in the new log", hasTick(logPath))
	if _, err := ta.c.Stop(ctx(t), "ticker", 0); err != nil {
		t.Fatal(err)
	}
	if err := ta.c.ReopenLog(ctx(t), "ticker"); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Errorf("reopen of exited app: %v", err)
	}
}

func TestStats(t *testing.T) {
	ta := startAgent(t)
	rootfs := makeRootfs(t)
	ta.run(&api.AppSpec{ID: "a", Rootfs: rootfs, Args: sh("sleep 1000 & sleep 1000"),
		Resources: api.Resources{MemoryLimit: 64 << 20, PidsLimit: 50, CPUShares: 512}})
	testutil.WaitFor(t, 10*time.Second, "two processes in the app", func() (bool, string) {
		s, err := ta.c.Stats(ctx(t), "a")
		return err == nil && s.Pids >= 2, fmt.Sprint(s, err)
	})
	s, err := ta.c.Stats(ctx(t), "a")
	if err != nil || s.MemoryUsageBytes == 0 || s.CPUUsageNanos == 0 || s.Timestamp.IsZero() {
		t.Errorf("app stats %+v %v", s, err)
	}
	pod, err := ta.c.Stats(ctx(t), "")
	if err != nil || pod.Pids < s.Pids+1 {
		t.Errorf("pod stats %+v %v", pod, err)
	}
	b, err := os.ReadFile(filepath.Join(ta.cg.Child("app-a").Paths["memory"], "memory.limit_in_bytes"))
	if err == nil && strings.TrimSpace(string(b)) != strconv.Itoa(64<<20) {
		t.Errorf("memory limit %s", b)
	}
	if _, err := ta.c.Stats(ctx(t), "nosuch"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("stats of unknown app: %v", err)
	}
}

func TestShutdown(t *testing.T) {
	ta := startAgent(t)
	rootfs := makeRootfs(t)
	ta.run(&api.AppSpec{ID: "a", Rootfs: rootfs, Args: sh(`trap "" TERM; while true; do sleep 1; done`)})
	ta.run(&api.AppSpec{ID: "b", Rootfs: rootfs, Args: []string{"sleep", "1000"}})
	if err := ta.c.Shutdown(ctx(t), 200*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	select {
	case <-ta.exited:
	case <-time.After(20 * time.Second):
		t.Fatal("agent still runs after shutdown")
	}
	if code := ta.cmd.ProcessState.ExitCode(); code != 0 {
		t.Errorf("agent exit code %d", code)
	}
	for id, code := range map[string]string{"a": `"exitCode":137`, "b": `"exitCode":143`} {
		b, err := os.ReadFile(filepath.Join(ta.state, id+".json"))
		if err != nil || !strings.Contains(string(b), code) || !strings.Contains(string(b), `"state":"exited"`) {
			t.Errorf("record %s: %s %v", id, b, err)
		}
	}
}

func TestSIGTERMStopsApps(t *testing.T) {
	ta := startAgent(t)
	rootfs := makeRootfs(t)
	ta.run(&api.AppSpec{ID: "a", Rootfs: rootfs, Args: []string{"sleep", "1000"}})
	if err := ta.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case <-ta.exited:
	case <-time.After(30 * time.Second):
		t.Fatal("agent still runs after SIGTERM")
	}
	if code := ta.cmd.ProcessState.ExitCode(); code != 0 {
		t.Errorf("agent exit code %d", code)
	}
	b, err := os.ReadFile(filepath.Join(ta.state, "a.json"))
	if err != nil || !strings.Contains(string(b), `"exitCode":143`) {
		t.Errorf("record: %s %v", b, err)
	}
}

func TestOOMKilled(t *testing.T) {
	ta := startAgent(t)
	rootfs := makeRootfs(t)
	ta.run(&api.AppSpec{ID: "oom", Rootfs: rootfs, Args: sh("exec dd if=/dev/zero of=/dev/null bs=64M count=1"),
		Resources: api.Resources{MemoryLimit: 16 << 20}})
	st := ta.waitExited("oom")
	if st.ExitCode != 137 || st.Reason != api.ReasonOOMKilled {
		t.Errorf("status %+v", st)
	}
}

// An OOM group (the kubelet's memory.oom.group): an OOM kill of one of
// the app's processes takes all of them, on cgroup v2 by the kernel, on
// v1 by the agent. Without one, the app lives on without the process
// killed.
func TestOOMGroup(t *testing.T) {
	ta := startAgent(t)
	rootfs := makeRootfs(t)
	// tail keeps what it reads of a file without newlines: it is the
	// OOM killer's pick, and the shell waits on for its sleep.
	script := sh("sleep 1000 & tail /dev/zero; wait")
	ta.run(&api.AppSpec{ID: "single", Rootfs: rootfs, Args: script, Resources: api.Resources{MemoryLimit: 16 << 20}})
	ta.run(&api.AppSpec{ID: "group", Rootfs: rootfs, Args: script, Resources: api.Resources{MemoryLimit: 16 << 20, OOMGroup: true}})
	if st := ta.waitExited("group"); st.Reason != api.ReasonOOMKilled {
		t.Errorf("app with an OOM group: %+v", st)
	}
	memory, file := "memory", "memory.oom_control"
	if ta.cg.IsV2() {
		memory, file = cgroups.Unified, "memory.events"
	}
	testutil.WaitFor(t, time.Minute, "an OOM kill in the app without a group", func() (bool, string) {
		v := ta.cgroupValue("single", memory, file)
		return !strings.Contains(v, "oom_kill 0"), v
	})
	if st, err := ta.c.Status(ctx(t), "single"); err != nil || st.State != api.StateRunning {
		t.Errorf("app without an OOM group after an OOM kill: %+v %v", st, err)
	}
}

func TestLiveSocketNotReplaced(t *testing.T) {
	ta := startAgent(t)
	sock := filepath.Join(filepath.Dir(ta.state), "agent.sock")
	out, err := exec.Command(stageletBin, "agent", "--socket", sock, "--state-dir", t.TempDir()).CombinedOutput()
	if err == nil || !strings.Contains(string(out), "another process serves this socket") {
		t.Errorf("second agent on a live socket: %v\n%s", err, out)
	}
	if _, err := ta.c.Info(ctx(t)); err != nil {
		t.Errorf("first agent lost its socket: %v", err)
	}
}

func TestAgentAsPID1(t *testing.T) {
	ta := startAgentAs(t, true)
	info, err := ta.c.Info(ctx(t))
	if err != nil || info.PID != 1 {
		t.Fatalf("info %+v %v", info, err)
	}
	rootfs := makeRootfs(t)
	ta.run(&api.AppSpec{ID: "orphans", Rootfs: rootfs, Args: sh(`sh -c 'sleep 0.5 & echo $! > /tmp/gc'; exec sleep 1000`)})
	var pid string
	testutil.WaitFor(t, 10*time.Second, "the grandchild's pid", func() (bool, string) {
		b, err := os.ReadFile(filepath.Join(rootfs, "tmp", "gc"))
		pid = strings.TrimSpace(string(b))
		return err == nil && strings.HasSuffix(string(b), "\n"), fmt.Sprint(err)
	})
	// The pid is one of the pod's namespace: look from inside.
	testutil.WaitFor(t, 10*time.Second, "the orphan to be reaped by PID 1", func() (bool, string) {
		res := ta.exec("orphans", "sh", "-c", "cat /proc/"+pid+"/stat 2>/dev/null || echo gone")
		return string(res.Stdout) == "gone\n", string(res.Stdout)
	})
	ta.run(&api.AppSpec{ID: "exits", Rootfs: rootfs, Args: sh("exit 7")})
	if st := ta.waitExited("exits"); st.ExitCode != 7 {
		t.Errorf("exit code as PID 1: %+v", st)
	}
	if err := ta.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case <-ta.exited:
	case <-time.After(30 * time.Second):
		t.Fatal("PID 1 agent still runs after SIGTERM")
	}
	if code := ta.cmd.ProcessState.ExitCode(); code != 0 {
		t.Errorf("agent exit code %d", code)
	}
	b, err := os.ReadFile(filepath.Join(ta.state, "orphans.json"))
	if err != nil || !strings.Contains(string(b), `"exitCode":143`) {
		t.Errorf("record: %s %v", b, err)
	}
}

// BenchmarkAppLifecycle measures create, start, exit and remove of an app
// that exits at once: the agent's share of a container's start latency.
func BenchmarkAppLifecycle(b *testing.B) {
	needRoot(b)
	ta := startAgent(b)
	rootfs := makeRootfs(b)
	c := context.Background()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		id := "b" + strconv.Itoa(i)
		if _, err := ta.c.Create(c, &api.AppSpec{ID: id, Rootfs: rootfs, Args: []string{"true"}}); err != nil {
			b.Fatal(err)
		}
		if _, err := ta.c.Start(c, id); err != nil {
			b.Fatal(err)
		}
		if _, err := ta.c.Stop(c, id, time.Minute); err != nil {
			b.Fatal(err)
		}
		if err := ta.c.Remove(c, id); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkExec measures one exec of `true` in a running app.
func BenchmarkExec(b *testing.B) {
	needRoot(b)
	ta := startAgent(b)
	rootfs := makeRootfs(b)
	c := context.Background()
	if _, err := ta.c.Create(c, &api.AppSpec{ID: "a", Rootfs: rootfs, Args: []string{"sleep", "1000"}}); err != nil {
		b.Fatal(err)
	}
	if _, err := ta.c.Start(c, "a"); err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		res, err := ta.c.Exec(c, "a", []string{"true"}, 0)
		if err != nil || res.ExitCode != 0 {
			b.Fatal(res, err)
		}
	}
}

func TestPrivileged(t *testing.T) {
	ta := startAgent(t)
	rootfs := makeRootfs(t)
	hostDevices, err := devices.Host("/dev")
	if err != nil {
		t.Fatal(err)
	}
	ta.run(&api.AppSpec{ID: "p", Rootfs: rootfs, Args: []string{"sleep", "1000"}, Privileged: true,
		Devices: hostDevices, DeviceCgroup: devices.AllowAll()})
	own, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	var ownEff string
	for _, l := range strings.Split(string(own), "\n") {
		if strings.HasPrefix(l, "CapEff:") {
			ownEff = l
		}
	}
	res := ta.exec("p", "grep", "^CapEff:", "/proc/self/status")
	if strings.TrimSpace(string(res.Stdout)) != ownEff {
		t.Errorf("privileged CapEff %q, the agent's %q", res.Stdout, ownEff)
	}
	// The host's devices it was given, with their numbers, and /sys
	// writable.
	for _, d := range hostDevices {
		res = ta.exec("p", "stat", "-c", "%t:%T", d.Path)
		if want := fmt.Sprintf("%x:%x", d.Major, d.Minor); strings.TrimSpace(string(res.Stdout)) != want {
			t.Errorf("%s in the privileged container: %q, want %s", d.Path, res.Stdout, want)
		}
	}
	res = ta.exec("p", "grep", " /sys ", "/proc/self/mounts")
	if !strings.Contains(string(res.Stdout), " rw,") {
		t.Errorf("privileged /sys: %q", res.Stdout)
	}
}

func TestMountPropagation(t *testing.T) {
	ta := startAgent(t)
	rootfs := makeRootfs(t)
	// A shared mount on the host, the source of the app's mounts.
	src := t.TempDir()
	os.Mkdir(filepath.Join(src, "sub"), 0o755)
	if err := syscall.Mount(src, src, "", syscall.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Unmount(src, syscall.MNT_DETACH) })
	if err := syscall.Mount("", src, "", syscall.MS_SHARED, ""); err != nil {
		t.Fatal(err)
	}
	ta.run(&api.AppSpec{ID: "prop", Rootfs: rootfs, Args: []string{"sleep", "1000"}, Mounts: []api.Mount{
		{Source: src, Destination: "/slave", Propagation: "rslave"},
		{Source: src, Destination: "/private"},
		{Source: src, Destination: "/shared", Propagation: "rshared"},
	}})
	sub := filepath.Join(src, "sub")
	if err := syscall.Mount("tmpfs", sub, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Unmount(sub, syscall.MNT_DETACH) })
	res := ta.exec("prop", "cat", fmt.Sprintf("/proc/%d/mountinfo", ta.appPID("prop")))
	mi := string(res.Stdout)
	for dest, want := range map[string]bool{"/slave/sub": true, "/shared/sub": true, "/private/sub": false} {
		if got := strings.Contains(mi, " "+dest+" "); got != want {
			t.Errorf("host mount seen at %s: %v, want %v", dest, got, want)
		}
	}
	// Nothing the app mounts comes back to the host.
	res = ta.exec("prop", "mount", "-t", "tmpfs", "tmpfs", "/tmp")
	if res.ExitCode == 0 {
		t.Errorf("an unprivileged app could mount: %+v", res)
	}
}

func TestExecCannotEscapeChroot(t *testing.T) {
	ta := startAgent(t)
	rootfs := makeRootfs(t)
	b, err := os.ReadFile(escapeBin)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(rootfs, "bin", "escape"), b, 0o755); err != nil {
		t.Fatal(err)
	}
	ta.run(&api.AppSpec{ID: "e", Rootfs: rootfs, Args: []string{"sleep", "1000"}, Capabilities: []string{"CAP_SYS_CHROOT"}})
	// An exec runs in the app's mount namespace, whose root is the app's
	// (pivot_root), with CAP_SYS_CHROOT: breaking out must end at the
	// app's root all the same.
	res := ta.exec("e", "escape")
	if res.ExitCode != 0 {
		t.Fatalf("escape: %+v", res)
	}
	for _, name := range strings.Fields(string(res.Stdout)) {
		if _, err := os.Lstat(filepath.Join(rootfs, name)); err != nil {
			t.Errorf("an exec broke out of the app's root: it sees %q:\n%s", name, res.Stdout)
		}
	}
}

// watcher collects what one Watch subscription delivers.
type watcher struct {
	snapshot chan []*api.AppStatus
	events   chan *api.Event
	end      chan error
}

func (ta *testAgent) watch(ctx context.Context) *watcher {
	w := &watcher{snapshot: make(chan []*api.AppStatus, 1), events: make(chan *api.Event, 100), end: make(chan error, 1)}
	go func() {
		w.end <- ta.c.Watch(ctx, func(s []*api.AppStatus) { w.snapshot <- s }, func(ev *api.Event) { w.events <- ev })
	}()
	return w
}

func (w *watcher) next(t *testing.T) *api.Event {
	t.Helper()
	select {
	case ev := <-w.events:
		return ev
	case err := <-w.end:
		t.Fatalf("the subscription ended: %v", err)
	case <-time.After(20 * time.Second):
		t.Fatal("no event in 20s")
	}
	return nil
}

// TestEvents: a subscriber gets every app at once, then each change after
// it as it happens, exit code and reason included; several subscribe at
// once; the subscription ends, ErrUnavailable, when the agent dies.
func TestEvents(t *testing.T) {
	ta := startAgent(t)
	rootfs := makeRootfs(t)
	ta.run(&api.AppSpec{ID: "before", Rootfs: rootfs, Args: []string{"sleep", "1000"}})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ws := []*watcher{ta.watch(ctx), ta.watch(ctx)}
	for _, w := range ws {
		select {
		case s := <-w.snapshot:
			if len(s) != 1 || s[0].ID != "before" || s[0].State != api.StateRunning {
				t.Fatalf("snapshot %+v", s)
			}
		case err := <-w.end:
			t.Fatalf("subscribe: %v", err)
		}
	}
	ta.run(&api.AppSpec{ID: "b", Rootfs: rootfs, Args: sh("read x; exit 3"), Stdin: true, StdinOnce: true})
	if _, err := ta.c.Stop(ctx, "b", time.Second); err != nil {
		t.Fatal(err)
	}
	if err := ta.c.Remove(ctx, "b"); err != nil {
		t.Fatal(err)
	}
	for i, w := range ws {
		var types []string
		for _, want := range []string{api.EventCreated, api.EventStarted, api.EventExited, api.EventRemoved} {
			ev := w.next(t)
			types = append(types, ev.Type)
			if ev.Type != want || ev.App.ID != "b" || ev.Time.IsZero() {
				t.Fatalf("subscriber %d: events %v, then %+v; want %s for b", i, types, ev.App, want)
			}
			switch ev.Type {
			case api.EventStarted:
				if ev.App.State != api.StateRunning || ev.App.PID == 0 {
					t.Errorf("started event %+v", ev.App)
				}
			case api.EventExited:
				if ev.App.State != api.StateExited || ev.App.ExitCode != 143 || ev.App.Reason != api.ReasonError || ev.App.FinishedAt.IsZero() {
					t.Errorf("exited event %+v", ev.App)
				}
			}
		}
	}
	if err := ta.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	<-ta.exited
	for i, w := range ws {
		select {
		case err := <-w.end:
			if !errors.Is(err, errdefs.ErrUnavailable) {
				t.Errorf("subscriber %d ended with %v, want ErrUnavailable", i, err)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("subscriber %d still waits after the agent died", i)
		}
	}
}

// TestWatchEndsWithContext: ending the context ends a subscription
// without an error.
func TestWatchEndsWithContext(t *testing.T) {
	ta := startAgent(t)
	ctx, cancel := context.WithCancel(context.Background())
	w := ta.watch(ctx)
	<-w.snapshot
	cancel()
	select {
	case err := <-w.end:
		if err != nil {
			t.Errorf("Watch returned %v after its context ended", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Watch still runs after its context ended")
	}
}

// cgroupValue reads a cgroup v1 file of an app's controller.
func (ta *testAgent) cgroupValue(id, controller, file string) string {
	ta.t.Helper()
	b, err := os.ReadFile(filepath.Join(ta.cg.Child("app-" + id).Paths[controller], file))
	if err != nil {
		ta.t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}

// TestUpdate: a running app's limits change in place; zero fields stay;
// an exited app, an OOM score and an unknown app are refused.
func TestUpdate(t *testing.T) {
	ta := startAgent(t)
	if ta.cg.Paths["memory"] == "" || ta.cg.Paths["cpu"] == "" {
		t.Skip("needs the cgroup v1 memory and cpu controllers")
	}
	rootfs := makeRootfs(t)
	ta.run(&api.AppSpec{ID: "a", Rootfs: rootfs, Args: []string{"sleep", "1000"},
		Resources: api.Resources{MemoryLimit: 64 << 20, CPUShares: 512, CPUQuota: 50000, CPUPeriod: 100000}})
	if _, err := ta.c.Update(ctx(t), "a", api.Resources{MemoryLimit: 128 << 20, CPUQuota: 200000}); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ ctl, file, want string }{
		{"memory", "memory.limit_in_bytes", strconv.Itoa(128 << 20)},
		{"cpu", "cpu.cfs_quota_us", "200000"},
		{"cpu", "cpu.cfs_period_us", "100000"},
		{"cpu", "cpu.shares", "512"},
	} {
		if got := ta.cgroupValue("a", c.ctl, c.file); got != c.want {
			t.Errorf("%s = %s, want %s", c.file, got, c.want)
		}
	}
	if _, err := ta.c.Update(ctx(t), "a", api.Resources{OOMScoreAdj: 100}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("changing the OOM score: %v, want InvalidArgument", err)
	}
	if _, err := ta.c.Update(ctx(t), "nosuch", api.Resources{MemoryLimit: 1 << 30}); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("update of an unknown app: %v", err)
	}
	if _, err := ta.c.Stop(ctx(t), "a", 0); err != nil {
		t.Fatal(err)
	}
	if _, err := ta.c.Update(ctx(t), "a", api.Resources{MemoryLimit: 1 << 30}); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Errorf("update of an exited app: %v, want FailedPrecondition", err)
	}
}

// TestOOMScoreNotBelowAgent: an app scores as it asked (0, runc's, when
// it names none), but never below its agent, so that the OOM killer never
// prefers the agent; an exec'd command scores as its app.
func TestOOMScoreNotBelowAgent(t *testing.T) {
	ta := startAgent(t)
	score := func(pid int) int {
		t.Helper()
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/oom_score_adj", pid))
		if err != nil {
			t.Fatal(err)
		}
		n, err := strconv.Atoi(strings.TrimSpace(string(b)))
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	agent := score(ta.cmd.Process.Pid)
	if agent >= 500 {
		t.Skipf("the agent's own score is %d", agent)
	}
	rootfs := makeRootfs(t)
	for _, c := range []struct {
		id          string
		asked, want int
	}{
		{"asked", 500, 500},
		{"none", 0, max(0, agent)},
		{"below", agent - 1, agent},
	} {
		ta.run(&api.AppSpec{ID: c.id, Rootfs: rootfs, Args: []string{"sleep", "1000"}, Resources: api.Resources{OOMScoreAdj: c.asked}})
		if got := score(ta.appPID(c.id)); got != c.want {
			t.Errorf("app %s asking %d scores %d, want %d (the agent: %d)", c.id, c.asked, got, c.want, agent)
		}
	}
	// A command started straight from the agent gets its score just after
	// it started (execdirect_linux.go): it reads its score once its stdin,
	// which the agent pumps once the start returned, brings a line.
	var out syncBuffer
	code, err := ta.c.ExecStream(ctx(t), "asked", sh("read x; cat /proc/self/oom_score_adj"),
		client.StreamIO{Stdin: strings.NewReader("go\n"), Stdout: &out})
	if err != nil || code != 0 || strings.TrimSpace(out.String()) != "500" {
		t.Errorf("an exec in app asked scores %q (code %d, err %v), want 500", out.String(), code, err)
	}
}

// TestPodDevices: a privileged app of a stage1 whose privileged does not
// mean the host's devices gets the agent's own /dev nodes.
func TestPodDevices(t *testing.T) {
	ta := startAgent(t)
	rootfs := makeRootfs(t)
	ta.run(&api.AppSpec{ID: "p", Rootfs: rootfs, Args: []string{"sleep", "1000"}, Privileged: true, PodDevices: true, DeviceCgroup: devices.AllowAll()})
	own, err := devices.Host("/dev")
	if err != nil || len(own) == 0 {
		t.Fatalf("the agent's devices: %v %v", own, err)
	}
	for _, d := range own {
		res := ta.exec("p", "stat", "-c", "%t:%T", d.Path)
		if want := fmt.Sprintf("%x:%x", d.Major, d.Minor); strings.TrimSpace(string(res.Stdout)) != want {
			t.Errorf("%s in the app: %q, want %s", d.Path, res.Stdout, want)
		}
	}
}

// TestDevices: an app gets the device nodes it is given (numbers, mode,
// owner) and may open those and the default ones only: it can make any
// node, but not open one it was not given.
func TestDevices(t *testing.T) {
	ta := startAgent(t)
	rootfs := makeRootfs(t)
	// kmsg (1:11): not among the default devices.
	given, err := devices.Resolve([]devices.Request{{Host: "/dev/kmsg", Container: "/dev/given", Permissions: "r"}}, "devices")
	if err != nil {
		t.Fatal(err)
	}
	ta.run(&api.AppSpec{ID: "d", Rootfs: rootfs, Args: []string{"sleep", "1000"},
		Capabilities: []string{"CAP_MKNOD", "CAP_DAC_OVERRIDE", "CAP_SYSLOG"},
		Devices:      given.Nodes, DeviceCgroup: append(devices.DefaultRules(), given.Rules...)})
	res := ta.exec("d", "stat", "-c", "%F %t:%T %a %u:%g", "/dev/given")
	if got, want := strings.TrimSpace(string(res.Stdout)), "character special file 1:b 644 0:0"; got != want {
		t.Errorf("/dev/given: %q, want %q", got, want)
	}
	if res := ta.exec("d", "dd", "if=/dev/given", "of=/dev/null", "bs=8192", "count=1"); res.ExitCode != 0 {
		t.Errorf("reading the device it was given: %d %s", res.ExitCode, res.Stderr)
	}
	if res := ta.exec("d", "sh", "-c", "echo x > /dev/given"); !strings.Contains(string(res.Stderr), "Operation not permitted") {
		t.Errorf("writing a device given read-only: %d %q, want EPERM", res.ExitCode, res.Stderr)
	}
	// cpu_dma_latency (10:259): made, then refused.
	res = ta.exec("d", "sh", "-c", "mknod /tmp/k c 10 259 && head -c 4 /tmp/k")
	if !strings.Contains(string(res.Stderr), "Operation not permitted") {
		t.Errorf("opening a device not given: %d %q %q, want EPERM", res.ExitCode, res.Stdout, res.Stderr)
	}
}

// TestMountOptions: a bind mount's nosuid, nodev and noexec flags, beside
// read-only.
func TestMountOptions(t *testing.T) {
	ta := startAgent(t)
	rootfs := makeRootfs(t)
	src := t.TempDir()
	ta.run(&api.AppSpec{ID: "m", Rootfs: rootfs, Args: []string{"sleep", "1000"}, Mounts: []api.Mount{
		{Source: src, Destination: "/flags", NoSuid: true, NoDev: true, NoExec: true},
		{Source: src, Destination: "/ro-noexec", Readonly: true, NoExec: true},
		{Source: src, Destination: "/plain"},
	}})
	res := ta.exec("m", "cat", "/proc/self/mounts")
	opts := map[string][]string{}
	for _, l := range strings.Split(string(res.Stdout), "\n") {
		if f := strings.Fields(l); len(f) > 3 {
			opts[f[1]] = strings.Split(f[3], ",")
		}
	}
	for dest, want := range map[string][]string{
		"/flags":     {"rw", "nosuid", "nodev", "noexec"},
		"/ro-noexec": {"ro", "noexec"},
	} {
		for _, w := range want {
			if !slices.Contains(opts[dest], w) {
				t.Errorf("%s mounted %v, want %s", dest, opts[dest], w)
			}
		}
	}
	if slices.Contains(opts["/plain"], "noexec") {
		t.Errorf("/plain mounted %v: noexec it was not asked for", opts["/plain"])
	}
}
