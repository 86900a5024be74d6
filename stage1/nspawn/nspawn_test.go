package nspawn

import (
	"strconv"

	"golang.org/x/sys/unix"

	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stagelet/stagelet/stage1/host"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/cgroups"
	"github.com/stagelet/stagelet/internal/mountsafe"
	"github.com/stagelet/stagelet/internal/testutil"
	"github.com/stagelet/stagelet/stage1"
	"github.com/stagelet/stagelet/stage1/podconn"
	"github.com/stagelet/stagelet/stage1/stage1test"
)

var (
	agentBinary string
	buildErr    error
)

func TestMain(m *testing.M) {
	flag.Parse()
	code := func() int {
		if os.Geteuid() != 0 || testing.Short() {
			return m.Run() // root-only tests skip; no binary needed
		}
		if _, err := exec.LookPath("systemd-nspawn"); err != nil {
			return m.Run() // they skip as well
		}
		if a := os.Getenv("NSPAWN_HELPER_AGENT"); a != "" {
			// TestSurvivesDaemonKill's helper process, killed with
			// SIGKILL: it uses its parent's agent binary and makes
			// nothing it would leave behind.
			agentBinary = a
			return m.Run()
		}
		dir, err := os.MkdirTemp("", "stagelet-nspawn-test")
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		defer os.RemoveAll(dir)
		agentBinary, buildErr = stage1test.BuildAgent(dir)
		return m.Run()
	}()
	os.Exit(code)
}

func needRoot(tb testing.TB) {
	tb.Helper()
	testutil.NeedRoot(tb, "runs real systemd-nspawn containers: cgroups, mounts")
	if _, err := exec.LookPath("systemd-nspawn"); err != nil {
		tb.Skip("needs systemd-nspawn (Debian: systemd-container)")
	}
	if buildErr != nil {
		tb.Fatal(buildErr)
	}
}

func testLogger(tb testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(tWriter{tb}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

type tWriter struct{ tb testing.TB }

func (w tWriter) Write(b []byte) (int, error) {
	w.tb.Helper()
	w.tb.Log(string(b))
	return len(b), nil
}

func TestConformance(t *testing.T) {
	needRoot(t)
	stage1test.Run(t, New(testLogger(t)), stage1test.Env{
		AgentBinary:  agentBinary,
		Rootfs:       stage1test.BusyboxRootfs,
		CgroupParent: stage1test.CgroupParent,
		RunDir:       stage1test.ShortRunDir,
		KillPod:      killNSpawn,
	})
}

// killNSpawn kills the recorded systemd-nspawn process, as a crash would,
// and waits until it is dead. The container's init outlives it; DestroyPod
// is what ends it.
func killNSpawn(t *testing.T, b []byte) {
	t.Helper()
	st, err := parseState(b)
	if err != nil {
		t.Fatal(err)
	}
	if st.nspawn() == nil {
		t.Fatal("no nspawn in state")
	}
	if err := st.nspawn().Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := st.nspawn().Wait(ctx); err != nil {
		t.Fatal(err)
	}
}

func TestCapabilities(t *testing.T) {
	c := New(nil).Capabilities()
	want := stage1.Capabilities{Isolation: stage1.IsolationNamespaces, HostNetwork: true, PodNetwork: true, Privileged: "pod", UserNamespaces: true}
	if len(c.Options) != 0 {
		t.Errorf("Options = %+v: it reads none", c.Options)
	}
	if c.Options = nil; !reflect.DeepEqual(c, want) {
		t.Errorf("Capabilities = %+v, want %+v", c, want)
	}
}

func TestParseState(t *testing.T) {
	if st, err := parseState(nil); err != nil || st.nspawn() != nil || st.cgroup() != nil {
		t.Errorf("empty state = %+v, %v", st, err)
	}
	if _, err := parseState([]byte(`{"version":99}`)); err == nil {
		t.Error("unknown version accepted")
	}
	if _, err := parseState([]byte(`{`)); err == nil {
		t.Error("garbage accepted")
	}
	in := &state{Version: stateVersion, Machine: "m"}
	in.Record(host.Resource{Kind: host.KindDir, Role: roleAgentDir, Path: "/run/x/agent"})
	in.Record(host.Resource{Kind: host.KindProcess, Role: roleNSpawn, Process: &host.Process{PID: 42, StartTime: 7}})
	out, err := parseState(in.marshal())
	if err != nil || out.socket() != "/run/x/agent/agent.sock" || out.nspawn().PID != 42 || out.nspawn().StartTime != 7 || out.Machine != "m" {
		t.Errorf("round trip = %+v, %v", out, err)
	}
	// A version 1 state (a field each) is read into the ledger in the
	// order its resources were taken; a field it lacked stays absent.
	v1 := `{"version":1,"machine":"m","tree":"/r/stage1","mounts":"/r/mounts","agentDir":"/r/agent","cgroup":{"paths":{"pids":"/sys/fs/cgroup/pids/p"}},"nspawn":{"pid":42,"startTime":7},"network":"private"}`
	out, err = parseState([]byte(v1))
	if err != nil {
		t.Fatal(err)
	}
	var roles []string
	for _, r := range out.Resources {
		roles = append(roles, r.Role)
	}
	want := []string{rolePodCgroup, roleTree, roleAgentDir, roleMounts, roleNSpawn}
	if !slices.Equal(roles, want) || out.tree() != "/r/stage1" || out.mounts() != "/r/mounts" || out.nspawn().PID != 42 ||
		out.cgroup().Paths["pids"] != "/sys/fs/cgroup/pids/p" || out.Machine != "m" || out.Network != "private" || out.leader() != nil {
		t.Errorf("version 1 state read as %+v (roles %v, want %v)", out, roles, want)
	}
}

func TestMachineName(t *testing.T) {
	long := strings.Repeat("ab12", 16)
	for _, tt := range []struct{ id, want string }{
		{"conf1", "stagelet-conf1"},
		{"Pod-1", "stagelet-Pod-1"},
	} {
		if got := machineName(tt.id); got != tt.want {
			t.Errorf("machineName(%q) = %q, want %q", tt.id, got, tt.want)
		}
	}
	for _, id := range []string{long, "a_b.c", "x/y"} {
		got := machineName(id)
		if len(got) > 64 || strings.ContainsAny(got, "_./") || got != machineName(id) {
			t.Errorf("machineName(%q) = %q: not a stable valid host name", id, got)
		}
	}
	if machineName(long) == machineName(long+"0") {
		t.Error("different ids share a machine name")
	}
}

func TestNetworkArgs(t *testing.T) {
	st := layout(&stage1.PodSpec{ID: "p", RunDir: "/r"})
	for _, tt := range []struct {
		spec stage1.PodSpec
		want string // the network flag, "" for none
	}{
		{stage1.PodSpec{HostNetwork: true}, ""},
		{stage1.PodSpec{NetNSPath: "/run/netns/p"}, "--network-namespace-path=/run/netns/p"},
		{stage1.PodSpec{}, "--private-network"},
	} {
		args := nspawnArgs(&tt.spec, st)
		var got string
		for _, a := range args {
			if strings.HasPrefix(a, "--network") || strings.HasPrefix(a, "--private-network") {
				got = a
			}
		}
		if got != tt.want {
			t.Errorf("%+v: network flag %q, want %q (args %v)", tt.spec, got, tt.want, args)
		}
		if slices.Contains(args, "--as-pid2") || !slices.Contains(args, "--register=no") || !slices.Contains(args, "--keep-unit") {
			t.Errorf("args %v", args)
		}
	}
}

func TestValidate(t *testing.T) {
	ok := stage1.PodSpec{ID: "p", RunDir: "/run/p", AgentBinary: "/bin/stagelet"}
	if err := validate(&ok); err != nil {
		t.Errorf("valid spec refused: %v", err)
	}
	for name, mut := range map[string]func(*stage1.PodSpec){
		"hostPID":        func(s *stage1.PodSpec) { s.HostPID = true },
		"hostIPC":        func(s *stage1.PodSpec) { s.HostIPC = true },
		"host and netns": func(s *stage1.PodSpec) { s.HostNetwork = true; s.NetNSPath = "/run/netns/x" },
		"colon":          func(s *stage1.PodSpec) { s.RunDir = "/run/a:b" },
		"relative":       func(s *stage1.PodSpec) { s.AgentBinary = "stagelet" },
		"no id":          func(s *stage1.PodSpec) { s.ID = "" },
	} {
		s := ok
		mut(&s)
		if err := validate(&s); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

// pod is a started pod for the nspawn-specific tests.
type pod struct {
	t    testing.TB
	b    stage1.Backend
	spec *stage1.PodSpec
	pod  *podconn.Pod

	mu    sync.Mutex
	state []byte
}

func (p *pod) last() []byte {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]byte(nil), p.state...)
}

// startPod starts a pod; cleanup destroys it with the last persisted state.
func startPod(tb testing.TB, b stage1.Backend, mut func(*stage1.PodSpec)) *pod {
	tb.Helper()
	t, _ := tb.(*testing.T)
	var runDir, cgParent string
	if t != nil {
		runDir, cgParent = stage1test.ShortRunDir(t), stage1test.CgroupParent(t)
	} else {
		runDir, cgParent = benchRunDir(tb), benchCgroupParent(tb)
	}
	id := fmt.Sprintf("ns%d%d", os.Getpid(), seq())
	p := &pod{t: tb, b: b, spec: &stage1.PodSpec{
		ID: id, Name: "nspawn", Namespace: "default", UID: id, Hostname: "nspawn-pod",
		RunDir: runDir, CgroupParent: cgParent, HostNetwork: true, AgentBinary: agentBinary,
	}}
	if mut != nil {
		mut(p.spec)
	}
	persist := func(s []byte) error {
		p.mu.Lock()
		defer p.mu.Unlock()
		p.state = append([]byte(nil), s...)
		return nil
	}
	tb.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := b.DestroyPod(ctx, p.spec, p.last()); err != nil {
			tb.Errorf("cleanup: DestroyPod: %v", err)
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	sp, err := stage1test.Opened(b.StartPod(ctx, p.spec, persist))
	if err != nil {
		tb.Fatalf("StartPod: %v", err)
	}
	p.pod = sp
	persist(sp.State())
	return p
}

var (
	seqMu sync.Mutex
	seqN  int
)

func seq() int {
	seqMu.Lock()
	defer seqMu.Unlock()
	seqN++
	return seqN
}

// run creates and starts a container and waits until it runs.
func (p *pod) run(id string, rootfs string, mounts []api.Mount, args ...string) {
	p.t.Helper()
	p.runSpec(api.AppSpec{ID: id, Name: id, Rootfs: rootfs, Args: args, Env: []string{"PATH=/bin"}, Mounts: mounts})
}

// runSpec creates and starts a container and waits until it runs.
func (p *pod) runSpec(spec api.AppSpec) {
	p.t.Helper()
	id := spec.ID
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, err := p.pod.CreateContainer(ctx, &stage1.ContainerSpec{AppSpec: spec})
	if err != nil {
		p.t.Fatalf("CreateContainer %s: %v", id, err)
	}
	if _, err := p.pod.StartContainer(ctx, id); err != nil {
		p.t.Fatalf("StartContainer %s: %v", id, err)
	}
	waitFor(p.t, "container "+id+" running", func() (bool, error) {
		st, err := p.pod.ContainerStatus(ctx, id)
		return err == nil && st.State == api.StateRunning, err
	})
}

func (p *pod) exec(id string, cmd ...string) string {
	p.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	res, err := p.pod.ExecSync(ctx, id, cmd, 10*time.Second)
	if err != nil {
		p.t.Fatalf("ExecSync %v: %v", cmd, err)
	}
	if res.ExitCode != 0 {
		p.t.Fatalf("ExecSync %v: exit %d, stderr %q", cmd, res.ExitCode, res.Stderr)
	}
	return string(res.Stdout)
}

func waitFor(tb testing.TB, what string, cond func() (bool, error)) {
	tb.Helper()
	testutil.WaitFor(tb, 30*time.Second, what, testutil.NoError(cond))
}

// TestPodNamespaces: the app runs in the pod's PID namespace, whose init is
// the agent; the hostname is the pod's; a pod with neither host network nor
// a network namespace has loopback only; an exec sees the pod's
// namespaces, not the host's.
func TestPodNamespaces(t *testing.T) {
	needRoot(t)
	// The kubelet's FQDN when the cluster domain is empty: a name the
	// kernel takes and systemd-nspawn's --hostname refuses.
	const fqdn = "nspawn-pod.sub.default.svc."
	p := startPod(t, New(testLogger(t)), func(s *stage1.PodSpec) { s.HostNetwork = false; s.Hostname = fqdn })
	p.run("app", stage1test.BusyboxRootfs(t), nil, "/bin/sleep", "1000")

	cmdline := p.exec("app", "cat", "/proc/1/cmdline")
	if !strings.HasPrefix(cmdline, podAgent+"\x00agent\x00") {
		t.Errorf("PID 1 in the pod is %q, want the agent", cmdline)
	}
	if h := strings.TrimSpace(p.exec("app", "hostname")); h != fqdn {
		t.Errorf("hostname %q, want %s", h, fqdn)
	}
	ps := p.exec("app", "ps", "-o", "pid,args")
	if strings.Contains(ps, "systemd-nspawn") || !strings.Contains(ps, "sleep 1000") {
		t.Errorf("ps in the pod:\n%s", ps)
	}
	for _, ns := range []string{"pid", "ipc", "uts", "net", "mnt"} {
		in := strings.TrimSpace(p.exec("app", "readlink", "/proc/self/ns/"+ns))
		host, err := os.Readlink("/proc/self/ns/" + ns)
		if err != nil {
			t.Fatal(err)
		}
		if in == host {
			t.Errorf("exec shares the host's %s namespace (%s)", ns, in)
		}
	}
	devs := p.exec("app", "cat", "/proc/net/dev")
	var ifaces []string
	for _, line := range strings.Split(devs, "\n")[2:] {
		if name, _, ok := strings.Cut(strings.TrimSpace(line), ":"); ok {
			ifaces = append(ifaces, name)
		}
	}
	if !slices.Equal(ifaces, []string{"lo"}) {
		t.Errorf("private network has interfaces %v, want [lo]", ifaces)
	}
	if d := p.pod.Details(); d["network"] != "private" || d["machine"] == "" {
		t.Errorf("Details = %v", d)
	}
	// The app runs in its own cgroup beneath the pod's, made by the agent
	// from inside the container.
	st, _ := parseState(p.pod.State())
	appPID := 0
	if s, err := p.pod.ContainerStatus(context.Background(), "app"); err == nil {
		appPID = s.PID // as the pod sees it
	}
	for ctl, dir := range st.cgroup().Child("app-app").Paths {
		b, err := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
		if err != nil || len(strings.Fields(string(b))) != 1 {
			t.Errorf("app cgroup %s (%s): %q, %v", ctl, dir, b, err)
		}
	}
	if appPID == 0 {
		t.Error("no app pid")
	}
	if _, err := p.pod.Stats(context.Background(), "app"); err != nil {
		t.Errorf("app Stats: %v", err)
	}
}

// TestSurvivesDaemonKill: a pod started by a process that is then killed
// with SIGKILL (the daemon crashing) keeps running and is recovered from
// its persisted state by another process.
func TestSurvivesDaemonKill(t *testing.T) {
	needRoot(t)
	runDir, cgParent := stage1test.ShortRunDir(t), stage1test.CgroupParent(t)
	stateFile := filepath.Join(t.TempDir(), "state.json")
	spec := &stage1.PodSpec{
		ID: fmt.Sprintf("ns%dsurv", os.Getpid()), Hostname: "survivor", RunDir: runDir,
		CgroupParent: cgParent, HostNetwork: true, AgentBinary: agentBinary,
	}
	b := New(testLogger(t))
	t.Cleanup(func() {
		st, _ := os.ReadFile(stateFile)
		if err := b.DestroyPod(context.Background(), spec, st); err != nil {
			t.Errorf("cleanup: DestroyPod: %v", err)
		}
	})
	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperDaemon$", "-test.v")
	cmd.Env = append(os.Environ(), "NSPAWN_HELPER_STATE="+stateFile, "NSPAWN_HELPER_RUNDIR="+runDir,
		"NSPAWN_HELPER_CGROUP="+cgParent, "NSPAWN_HELPER_AGENT="+agentBinary, "NSPAWN_HELPER_ID="+spec.ID,
		"NSPAWN_HELPER_ROOTFS="+stage1test.BusyboxRootfs(t))
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = cmd.Stdout
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 64*1024)
	var got []byte
	for !bytes.Contains(got, []byte("HELPER READY")) {
		n, err := out.Read(buf)
		got = append(got, buf[:n]...)
		if err != nil {
			cmd.Process.Kill()
			cmd.Wait()
			t.Fatalf("helper ended before its pod ran: %v\n%s", err, got)
		}
	}
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	cmd.Wait()

	state, err := os.ReadFile(stateFile)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	pod, err := stage1test.Opened(b.RecoverPod(ctx, spec, state))
	if err != nil {
		t.Fatalf("RecoverPod after the daemon's SIGKILL: %v", err)
	}
	st, err := pod.ContainerStatus(ctx, "app")
	if err != nil || st.State != api.StateRunning {
		t.Fatalf("container after the daemon's SIGKILL: %+v, %v", st, err)
	}
	res, err := pod.ExecSync(ctx, "app", []string{"hostname"}, 10*time.Second)
	if err != nil || string(res.Stdout) != "survivor\n" {
		t.Errorf("ExecSync after recovery: %+v, %v", res, err)
	}
	if err := pod.Stop(ctx, time.Second); err != nil {
		t.Errorf("Stop of a recovered pod: %v", err)
	}
}

// TestHelperDaemon is the daemon TestSurvivesDaemonKill kills: it starts a
// pod with one running container, writes the state, says so and blocks.
func TestHelperDaemon(t *testing.T) {
	stateFile := os.Getenv("NSPAWN_HELPER_STATE")
	if stateFile == "" {
		t.Skip("helper process of TestSurvivesDaemonKill")
	}
	spec := &stage1.PodSpec{
		ID: os.Getenv("NSPAWN_HELPER_ID"), Hostname: "survivor", RunDir: os.Getenv("NSPAWN_HELPER_RUNDIR"),
		CgroupParent: os.Getenv("NSPAWN_HELPER_CGROUP"), HostNetwork: true, AgentBinary: os.Getenv("NSPAWN_HELPER_AGENT"),
	}
	persist := func(s []byte) error { return os.WriteFile(stateFile, s, 0o600) }
	ctx := context.Background()
	pod, err := stage1test.Opened(New(nil).StartPod(ctx, spec, persist))
	if err != nil {
		t.Fatal(err)
	}
	persist(pod.State())
	if _, err := pod.CreateContainer(ctx, &stage1.ContainerSpec{AppSpec: api.AppSpec{
		ID: "app", Rootfs: os.Getenv("NSPAWN_HELPER_ROOTFS"), Args: []string{"/bin/sleep", "1000"},
	}}); err != nil {
		t.Fatal(err)
	}
	if _, err := pod.StartContainer(ctx, "app"); err != nil {
		t.Fatal(err)
	}
	fmt.Println("HELPER READY")
	select {} // until killed
}

// TestHostNetwork: a host-network pod sees the host's network namespace.
func TestHostNetwork(t *testing.T) {
	needRoot(t)
	p := startPod(t, New(testLogger(t)), nil)
	p.run("app", stage1test.BusyboxRootfs(t), nil, "/bin/sleep", "1000")
	in := strings.TrimSpace(p.exec("app", "readlink", "/proc/self/ns/net"))
	host, _ := os.Readlink("/proc/self/ns/net")
	if in != host {
		t.Errorf("host-network pod is in %s, host in %s", in, host)
	}
}

// TestLateMounts: a container whose rootfs and mount sources are made on
// the host after the pod started reaches the running pod: its rootfs runs,
// a bind of an arbitrary host directory and of a single file are visible,
// read-only where asked, and writes through a writable one reach the host.
// Removing the container undoes its binds.
func TestLateMounts(t *testing.T) {
	needRoot(t)
	p := startPod(t, New(testLogger(t)), nil)
	// Everything below is created after the pod runs.
	rootfs := stage1test.BusyboxRootfs(t)
	src := t.TempDir()
	if err := os.WriteFile(filepath.Join(src, "hello"), []byte("from the host\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(t.TempDir(), "single")
	if err := os.WriteFile(file, []byte("one file\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	ro := t.TempDir()
	p.run("late", rootfs, []api.Mount{
		{Source: src, Destination: "/data"},
		{Source: file, Destination: "/etc/single"},
		{Source: ro, Destination: "/ro", Readonly: true},
	}, "/bin/sleep", "1000")

	if got := p.exec("late", "cat", "/data/hello"); got != "from the host\n" {
		t.Errorf("/data/hello = %q", got)
	}
	if got := p.exec("late", "cat", "/etc/single"); got != "one file\n" {
		t.Errorf("/etc/single = %q", got)
	}
	p.exec("late", "sh", "-c", "echo back > /data/written")
	if b, err := os.ReadFile(filepath.Join(src, "written")); err != nil || string(b) != "back\n" {
		t.Errorf("write through the bind: %q, %v", b, err)
	}
	ctx := context.Background()
	res, err := p.pod.ExecSync(ctx, "late", []string{"touch", "/ro/x"}, 10*time.Second)
	if err != nil || res.ExitCode == 0 {
		t.Errorf("write to a read-only mount: %+v, %v", res, err)
	}

	// Once the container runs, the host keeps only the rootfs bind: the
	// app holds its own mounts of the sources.
	st, _ := parseState(p.pod.State())
	dir := filepath.Join(st.mounts(), "late")
	if ms, _ := mountsafe.MountsUnder(dir); len(ms) != 1 || ms[0] != filepath.Join(dir, "rootfs") {
		t.Errorf("host mounts of the running container: %v, want the rootfs only", ms)
	}
	if _, err := p.pod.StopContainer(ctx, "late", time.Second); err != nil {
		t.Fatal(err)
	}
	if err := p.pod.RemoveContainer(ctx, "late"); err != nil {
		t.Fatal(err)
	}
	if ms, _ := mountsafe.MountsUnder(dir); len(ms) != 0 {
		t.Errorf("mounts left after RemoveContainer: %v", ms)
	}
	if _, err := os.Stat(filepath.Join(src, "hello")); err != nil {
		t.Errorf("mount source damaged by RemoveContainer: %v", err)
	}
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("container dir left: %v", err)
	}
}

// TestCreateContainerErrors: a missing mount source is refused and leaves
// no bind behind; a duplicate id is AlreadyExists and keeps the first.
func TestCreateContainerErrors(t *testing.T) {
	needRoot(t)
	p := startPod(t, New(testLogger(t)), nil)
	ctx := context.Background()
	rootfs := stage1test.BusyboxRootfs(t)
	_, err := p.pod.CreateContainer(ctx, &stage1.ContainerSpec{AppSpec: api.AppSpec{
		ID: "bad", Rootfs: rootfs, Args: []string{"/bin/true"},
		Mounts: []api.Mount{{Source: "/nonexistent/source", Destination: "/x"}},
	}})
	if err == nil {
		t.Fatal("create with a missing mount source succeeded")
	}
	st, _ := parseState(p.pod.State())
	if ms, _ := mountsafe.MountsUnder(filepath.Join(st.mounts(), "bad")); len(ms) != 0 {
		t.Errorf("binds left after a failed create: %v", ms)
	}
	p.run("dup", rootfs, nil, "/bin/sleep", "1000")
	_, err = p.pod.CreateContainer(ctx, &stage1.ContainerSpec{AppSpec: api.AppSpec{ID: "dup", Rootfs: rootfs, Args: []string{"/bin/true"}}})
	if err == nil {
		t.Fatal("duplicate create succeeded")
	}
	if got := p.exec("dup", "echo", "still"); got != "still\n" {
		t.Errorf("first container after a duplicate create: %q", got)
	}
}

// TestStopReleases: Stop ends the container and nspawn; DestroyPod leaves
// no process, mount, cgroup, tree or nspawn leftovers.
func TestStopReleases(t *testing.T) {
	needRoot(t)
	b := New(testLogger(t))
	p := startPod(t, b, nil)
	p.run("app", stage1test.BusyboxRootfs(t), []api.Mount{{Source: t.TempDir(), Destination: "/data"}}, "/bin/sh", "-c", "trap '' TERM; sleep 1000 & wait")
	st, err := parseState(p.pod.State())
	if err != nil {
		t.Fatal(err)
	}
	if st.leader() == nil || !st.leader().Alive() {
		t.Fatalf("leader not recorded or not alive: %+v", st.leader())
	}
	ctx := context.Background()
	start := time.Now()
	if err := p.pod.Stop(ctx, time.Second); err != nil {
		t.Fatalf("Stop: %v", err)
	}
	t.Logf("pod stop took %v", time.Since(start))
	if b, err := os.ReadFile(filepath.Join(p.spec.RunDir, "nspawn.log")); err == nil {
		t.Logf("nspawn.log:\n%s", b)
	}
	if st.nspawn().Alive() || st.leader().Alive() {
		t.Errorf("after Stop: nspawn alive %v, leader alive %v", st.nspawn().Alive(), st.leader().Alive())
	}
	for _, cg := range []string{"", "sys"} {
		c := st.cgroup()
		if cg == "sys" {
			c = st.systemdCgroup()
		}
		if c == nil {
			continue
		}
		if pids, err := c.Procs(); err != nil || len(pids) != 0 {
			t.Errorf("processes left after Stop: %v, %v", pids, err)
		}
	}
	if err := b.DestroyPod(ctx, p.spec, p.pod.State()); err != nil {
		t.Fatalf("DestroyPod: %v", err)
	}
	if ms, _ := mountsafe.MountsUnder(p.spec.RunDir); len(ms) != 0 {
		t.Errorf("mounts left under the run dir: %v", ms)
	}
	for _, c := range []map[string]string{st.cgroup().Paths, sysPaths(st)} {
		for k, d := range c {
			if _, err := os.Stat(d); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("cgroup %s left: %s (%v)", k, d, err)
			}
		}
	}
	for _, d := range []string{st.tree(), st.mounts(), st.agentDir(), "/run/systemd/nspawn/propagate/" + st.Machine} {
		if _, err := os.Stat(d); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s left: %v", d, err)
		}
	}
}

func sysPaths(st *state) map[string]string {
	if st.systemdCgroup() == nil {
		return nil
	}
	return st.systemdCgroup().Paths
}

// TestStartPodNSpawnFails: a container whose init cannot run (a dynamic
// binary in a tree without libraries) ends nspawn; StartPod reports it, and
// everything taken is released.
func TestStartPodNSpawnFails(t *testing.T) {
	needRoot(t)
	b := New(testLogger(t))
	spec := &stage1.PodSpec{
		ID: "failing", RunDir: stage1test.ShortRunDir(t), CgroupParent: stage1test.CgroupParent(t),
		HostNetwork: true, AgentBinary: "/bin/false", FailedLogDir: t.TempDir(),
	}
	var last []byte
	_, err := b.StartPod(context.Background(), spec, func(s []byte) error { last = s; return nil })
	if err == nil {
		t.Fatal("StartPod with a failing agent succeeded")
	}
	// nspawn's log outlives the pod's run directory, and the error says
	// where it is and how it ends.
	kept := filepath.Join(spec.FailedLogDir, "failing-nspawn.log")
	log, rerr := os.ReadFile(kept)
	if rerr != nil || len(log) == 0 {
		t.Errorf("nspawn's log not kept at %s: %q %v", kept, log, rerr)
	}
	if !strings.Contains(err.Error(), "kept at "+kept) || !strings.Contains(err.Error(), lastLine(log)) {
		t.Errorf("error %q names neither %s nor the log's end %q", err, kept, lastLine(log))
	}
	st, perr := parseState(last)
	if perr != nil || st.cgroup() == nil || st.nspawn() == nil {
		t.Fatalf("persisted state %s (%v) does not record cgroup and nspawn", last, perr)
	}
	for _, d := range st.cgroup().Paths {
		if _, err := os.Stat(d); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("pod cgroup %s left behind: %v", d, err)
		}
	}
	if ms, _ := mountsafe.MountsUnder(spec.RunDir); len(ms) != 0 {
		t.Errorf("mounts left: %v", ms)
	}
}

// BenchmarkPodStart measures StartPod plus creating and starting one
// container until it runs; stop and destroy are outside the timing.
// Run with -benchtime=20x for the median the issue asks for (logged).
func BenchmarkPodStart(b *testing.B) {
	needRoot(b)
	be := New(slog.New(slog.NewTextHandler(&bytes.Buffer{}, nil)))
	var times []time.Duration
	for i := 0; b.Loop(); i++ {
		b.StopTimer()
		rootfs := benchRootfs(b)
		b.StartTimer()
		start := time.Now()
		p := startPod(b, be, nil)
		p.run("bench", rootfs, nil, "/bin/sleep", "1000")
		times = append(times, time.Since(start))
		b.StopTimer()
		ctx := context.Background()
		if err := p.pod.Stop(ctx, time.Second); err != nil {
			b.Fatal(err)
		}
		if err := be.DestroyPod(ctx, p.spec, p.pod.State()); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
	}
	if len(times) > 0 {
		slices.Sort(times)
		b.ReportMetric(float64(times[len(times)/2].Microseconds())/1000, "median-ms")
		b.Logf("pod+container start over %d runs: median %v, min %v, max %v", len(times), times[len(times)/2], times[0], times[len(times)-1])
	}
}

// BenchmarkExecSync measures ExecSync of `true` in a running nspawn pod.
func BenchmarkExecSync(b *testing.B) {
	needRoot(b)
	be := New(slog.New(slog.NewTextHandler(&bytes.Buffer{}, nil)))
	p := startPod(b, be, nil)
	p.run("bench", benchRootfs(b), nil, "/bin/sleep", "1000")
	ctx := context.Background()
	var times []time.Duration
	for b.Loop() {
		start := time.Now()
		res, err := p.pod.ExecSync(ctx, "bench", []string{"/bin/true"}, 10*time.Second)
		if err != nil || res.ExitCode != 0 {
			b.Fatalf("ExecSync: %+v, %v", res, err)
		}
		times = append(times, time.Since(start))
	}
	slices.Sort(times)
	b.ReportMetric(float64(times[len(times)/2].Microseconds())/1000, "median-ms")
}

// Benchmarks get the same fixtures as tests, built with testing.TB.

func benchRunDir(tb testing.TB) string {
	d, err := os.MkdirTemp("", "sl")
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { os.RemoveAll(d) })
	return d
}

func benchCgroupParent(tb testing.TB) string {
	name := fmt.Sprintf("stagelet-bench-%d-%d", os.Getpid(), seq())
	cg, err := cgroups.Resolve(name)
	if err != nil {
		tb.Skipf("no usable cgroups: %v", err)
	}
	tb.Cleanup(func() {
		if err := cg.Kill(); err != nil {
			tb.Error(err)
		}
		if err := cg.Delete(); err != nil {
			tb.Error(err)
		}
	})
	return name
}

// benchRootfs is a busybox root: /bin/busybox and one symlink per applet.
func benchRootfs(tb testing.TB) string {
	const bb = "/bin/busybox"
	if _, err := os.Stat(bb); err != nil {
		tb.Skipf("needs a static busybox at %s", bb)
	}
	dir, err := os.MkdirTemp("", "slroot")
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { os.RemoveAll(dir) })
	for _, d := range []string{"bin", "etc", "tmp", "proc", "sys", "dev"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			tb.Fatal(err)
		}
	}
	data, err := os.ReadFile(bb)
	if err != nil {
		tb.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "bin", "busybox"), data, 0o755); err != nil {
		tb.Fatal(err)
	}
	for _, name := range []string{"sh", "sleep", "true"} {
		if err := os.Symlink("busybox", filepath.Join(dir, "bin", name)); err != nil {
			tb.Fatal(err)
		}
	}
	return dir
}

// TestNoMountsLeakAcrossPods: a pod started after another holds no copy of
// the first pod's container binds, neither while they exist nor after the
// container is removed.
func TestNoMountsLeakAcrossPods(t *testing.T) {
	needRoot(t)
	b := New(testLogger(t))
	a := startPod(t, b, nil)
	a.run("app", stage1test.BusyboxRootfs(t), []api.Mount{{Source: t.TempDir(), Destination: "/data"}}, "/bin/sleep", "1000")
	other := startPod(t, b, nil)
	ost, err := parseState(other.pod.State())
	if err != nil || ost.leader() == nil {
		t.Fatalf("second pod's leader: %+v, %v", ost, err)
	}
	ast, _ := parseState(a.pod.State())
	dir := filepath.Join(ast.mounts(), "app")
	inOther := func() []string {
		var out []string
		for _, pid := range []int{ost.leader().PID} {
			b, err := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", pid))
			if err != nil {
				t.Fatal(err)
			}
			for _, line := range strings.Split(string(b), "\n") {
				if strings.Contains(line, dir) {
					out = append(out, fmt.Sprintf("pid %d: %s", pid, line))
				}
			}
		}
		return out
	}
	if left := inOther(); len(left) != 0 {
		t.Errorf("the first pod's binds are visible in the second pod:\n%s", strings.Join(left, "\n"))
	}
	ctx := context.Background()
	if _, err := a.pod.StopContainer(ctx, "app", time.Second); err != nil {
		t.Fatal(err)
	}
	if err := a.pod.RemoveContainer(ctx, "app"); err != nil {
		t.Fatal(err)
	}
	if left := inOther(); len(left) != 0 {
		t.Errorf("the first pod's binds remain in the second pod's namespaces:\n%s", strings.Join(left, "\n"))
	}
}

func lastLine(b []byte) string {
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	return lines[len(lines)-1]
}

// TestSeccompUnconfined: nspawn installs no filter of its own, so an app
// without a seccomp profile is unconfined, as the CRI defines it.
func TestSeccompUnconfined(t *testing.T) {
	needRoot(t)
	p := startPod(t, New(testLogger(t)), nil)
	p.run("u", stage1test.BusyboxRootfs(t), nil, "/bin/sleep", "1000")
	if got := p.exec("u", "grep", "^Seccomp:", "/proc/self/status"); strings.Fields(got)[1] != "0" {
		t.Errorf("an app without a profile: %q, want Seccomp: 0", got)
	}
}

// sharedSource is a directory that is a shared mount on the host, as a
// kubelet volume with mount propagation is.
func sharedSource(t *testing.T) string {
	t.Helper()
	src := t.TempDir()
	if err := syscall.Mount(src, src, "", syscall.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Unmount(src, syscall.MNT_DETACH) })
	if err := syscall.Mount("", src, "", syscall.MS_SHARED, ""); err != nil {
		t.Fatal(err)
	}
	return src
}

func hostMounted(t *testing.T, path string) bool {
	t.Helper()
	ms, err := mountsafe.MountsUnder(path)
	if err != nil {
		t.Fatal(err)
	}
	return slices.Contains(ms, path)
}

// TestMountPropagationThroughNSpawn: host → container (rslave and
// rshared) and container → host (rshared only) across nspawn's namespace,
// which makes every mount it inherits a slave.
func TestMountPropagationThroughNSpawn(t *testing.T) {
	needRoot(t)
	p := startPod(t, New(testLogger(t)), nil)
	src := sharedSource(t)
	for _, d := range []string{"late", "from-shared", "from-slave"} {
		os.Mkdir(filepath.Join(src, d), 0o755)
		t.Cleanup(func() { syscall.Unmount(filepath.Join(src, d), syscall.MNT_DETACH) })
	}
	p.runSpec(api.AppSpec{ID: "prop", Rootfs: stage1test.BusyboxRootfs(t), Args: []string{"/bin/sleep", "1000"},
		Env: []string{"PATH=/bin"}, Privileged: true, Mounts: []api.Mount{
			{Source: src, Destination: "/shared", Propagation: "rshared"},
			{Source: src, Destination: "/slave", Propagation: "rslave"},
			{Source: src, Destination: "/private"},
		}})
	// Host → container.
	if err := syscall.Mount("tmpfs", filepath.Join(src, "late"), "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	mi := p.exec("prop", "cat", "/proc/self/mountinfo")
	for dest, want := range map[string]bool{"/shared/late": true, "/slave/late": true, "/private/late": false} {
		if got := strings.Contains(mi, " "+dest+" "); got != want {
			t.Errorf("a host mount seen at %s: %v, want %v", dest, got, want)
		}
	}
	// Container → host.
	p.exec("prop", "mount", "-t", "tmpfs", "tmpfs", "/shared/from-shared")
	p.exec("prop", "mount", "-t", "tmpfs", "tmpfs", "/slave/from-slave")
	if !hostMounted(t, filepath.Join(src, "from-shared")) {
		t.Error("a mount beneath the rshared mount did not reach the host")
	}
	if hostMounted(t, filepath.Join(src, "from-slave")) {
		t.Error("a mount beneath the rslave mount reached the host")
	}
}

// TestHostRemovesVolumeMountPoint: while a container runs, the host can
// unmount and remove a mount point inside a volume the container mounts
// (as with runc, where the container's copies are in other namespaces
// only): no bind of the daemon's in the host's namespace holds it busy.
func TestHostRemovesVolumeMountPoint(t *testing.T) {
	needRoot(t)
	p := startPod(t, New(testLogger(t)), nil)
	src := t.TempDir()
	sub := filepath.Join(src, "tmpfs")
	os.Mkdir(sub, 0o755)
	if err := syscall.Mount("tmpfs", sub, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Unmount(sub, syscall.MNT_DETACH) })
	p.run("v", stage1test.BusyboxRootfs(t), []api.Mount{{Source: src, Destination: "/mnt", Readonly: true}}, "/bin/sleep", "1000")
	// Read-only at the top only: the tmpfs beneath stays writable.
	p.exec("v", "touch", "/mnt/tmpfs/file")
	if err := syscall.Unmount(sub, syscall.MNT_DETACH); err != nil {
		t.Fatal(err)
	}
	if err := os.RemoveAll(src); err != nil {
		t.Errorf("removing the volume while the container runs: %v", err)
	}
}

// TestCollect: a pod cgroup in nspawn's own hierarchies that no record
// names (its record lost) is removed once empty; one that still holds a
// process (another daemon's pod) or that a record names is left.
func TestCollect(t *testing.T) {
	needRoot(t)
	parent, err := systemdParent()
	if err != nil {
		t.Skipf("no name=systemd or hybrid cgroup2 hierarchy: %v", err)
	}
	lost, kept := fmt.Sprintf("%064x", os.Getpid()), fmt.Sprintf("%063xf", os.Getpid())
	var cgs []*cgroups.Cgroup
	for _, id := range []string{lost, kept} {
		cg := parent.Child(host.LaunchName(id))
		if err := cg.Create(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = cg.Kill(); _ = cg.Delete() })
		cgs = append(cgs, cg)
	}
	// What nspawn makes beneath it, and a process in the lost one.
	payload := cgs[0].Child("payload")
	if err := payload.Create(); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("sleep", "1000")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	if err := payload.Add(cmd.Process.Pid); err != nil {
		t.Fatal(err)
	}
	mine := func(id string) bool { return id == lost || id == kept }
	keep := func(id string) bool { return !mine(id) || id == kept }
	got, err := New(testLogger(t)).Collect(context.Background(), keep)
	if err != nil || len(got) != 0 {
		t.Fatalf("Collect with a process in the cgroup = %v, %v; want nothing collected", got, err)
	}
	cmd.Process.Kill()
	cmd.Wait()
	got, err = New(testLogger(t)).Collect(context.Background(), keep)
	if err != nil || !slices.Equal(got, []string{lost}) {
		t.Fatalf("Collect = %v, %v; want [%s]", got, err, lost)
	}
	for _, d := range cgs[0].Paths {
		if _, err := os.Stat(d); !os.IsNotExist(err) {
			t.Errorf("collected cgroup %s still there: %v", d, err)
		}
	}
	for _, d := range cgs[1].Paths {
		if _, err := os.Stat(d); err != nil {
			t.Errorf("kept cgroup %s: %v", d, err)
		}
	}
}

// TestUserNS: a pod in a user namespace of its own. Its containers run
// as its root, which the host sees as the mapping's first ID; they own
// their root filesystem (idmapped: what the pod's root writes is the
// host's root's on disk) and write their log; limits apply in the app's
// cgroup; the pod is released as any other.
func TestUserNS(t *testing.T) {
	needRoot(t)
	const base, size = 1 << 30, 65536
	p := startPod(t, New(testLogger(t)), func(s *stage1.PodSpec) {
		s.UserNS = &stage1.IDMapping{HostID: base, Size: size}
	})
	rootfs := stage1test.BusyboxRootfs(t)
	logPath := filepath.Join(t.TempDir(), "app.log")
	p.runSpec(api.AppSpec{ID: "app", Name: "app", Rootfs: rootfs, Args: []string{"/bin/sh", "-c", "echo started; sleep 1000"},
		Env: []string{"PATH=/bin"}, LogPath: logPath, Resources: api.Resources{MemoryLimit: 64 << 20}})
	if got := strings.Fields(p.exec("app", "cat", "/proc/self/uid_map")); len(got) != 3 || got[0] != "0" || got[1] != strconv.Itoa(base) || got[2] != strconv.Itoa(size) {
		t.Errorf("uid_map inside = %v, want 0 %d %d", got, base, size)
	}
	if got := strings.TrimSpace(p.exec("app", "id", "-u")); got != "0" {
		t.Errorf("id -u inside = %s, want 0", got)
	}
	// Every process of the pod but systemd-nspawn itself (the agent, the
	// app) is, to the host, the mapping's first ID.
	lst, _ := parseState(p.pod.State())
	pids, err := lst.cgroup().Procs()
	if err != nil || len(pids) < 3 {
		t.Fatalf("the pod cgroup's processes: %v, %v", pids, err)
	}
	for _, pid := range pids {
		if pid == lst.nspawn().PID {
			continue
		}
		status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
		if err != nil {
			continue // gone meanwhile (an exec)
		}
		for _, line := range strings.Split(string(status), "\n") {
			if f := strings.Fields(line); len(f) > 1 && f[0] == "Uid:" && f[1] != strconv.Itoa(base) {
				t.Errorf("the host sees pid %d of the pod as uid %s, want %d", pid, f[1], base)
			}
		}
	}
	p.exec("app", "touch", "/made-inside")
	var fi unix.Stat_t
	if err := unix.Stat(filepath.Join(rootfs, "made-inside"), &fi); err != nil || fi.Uid != 0 {
		t.Errorf("a file the pod's root made: uid %d (%v), want the host's root through the idmapped rootfs", fi.Uid, err)
	}
	waitFor(t, "the log line", func() (bool, error) {
		b, err := os.ReadFile(logPath)
		return strings.Contains(string(b), " stdout F started\n"), err
	})
	if lst.UserNS == nil || lst.UserNS.HostID != base {
		t.Errorf("state's user namespace: %+v", lst.UserNS)
	}
}

// TestSELinuxArgs: a pod's agent runs unconfined at the pod's level and
// nspawn's file systems get its mount label; a pod without a level (no
// mount label) gets neither flag.
func TestSELinuxArgs(t *testing.T) {
	st := layout(&stage1.PodSpec{ID: "p", RunDir: "/r"})
	const proc, mount = "system_u:system_r:container_t:s0:c1,c2", "system_u:object_r:container_file_t:s0:c1,c2"
	args := nspawnArgs(&stage1.PodSpec{SELinuxProcessLabel: proc, SELinuxMountLabel: mount}, st)
	for _, want := range []string{"--selinux-context=system_u:system_r:spc_t:s0:c1,c2", "--selinux-apifs-context=" + mount} {
		if !slices.Contains(args, want) {
			t.Errorf("args %v lack %s", args, want)
		}
	}
	for _, spec := range []stage1.PodSpec{{}, {SELinuxProcessLabel: "system_u:system_r:spc_t:s0"}} {
		for _, a := range nspawnArgs(&spec, st) {
			if strings.HasPrefix(a, "--selinux") {
				t.Errorf("%+v: %s", spec, a)
			}
		}
	}
}
