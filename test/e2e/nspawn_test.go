package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/broker"
	"github.com/stagelet/stagelet/internal/testutil"
	"github.com/stagelet/stagelet/test/e2e/harness"
)

// newNspawnEnv is a daemon whose policy maps the handler "nspawn" (and
// "fly"), with busybox pulled.
func newNspawnEnv(t *testing.T) *env {
	return newEnvOpts(t, harness.Options{Policy: bothStage1sPolicy}, true)
}

// nspawnPod runs a pod on nspawn in its own network, PID and IPC
// namespaces and returns its ID and config.
func (e *env) nspawnPod(name string) (string, *runtimeapi.PodSandboxConfig) {
	e.t.Helper()
	cfg := e.netPodConfig(name, nspawnStage1)
	return e.runStage1Pod(cfg, nspawnStage1), cfg
}

// nspawnContainer is a container of a pod nspawnPod made.
func (e *env) nspawnContainer(name string, cmd ...string) *runtimeapi.ContainerConfig {
	return e.netContainer(nspawnStage1, name, cmd...)
}

// hostNSLink is the test process's own namespace of kind ("pid", "net").
func hostNSLink(t *testing.T, kind string) string {
	t.Helper()
	l, err := os.Readlink("/proc/self/ns/" + kind)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// stdoutLines are a container's complete stdout lines so far.
func (e *env) stdoutLines(path string) []string {
	e.t.Helper()
	return harness.JoinPartial(e.readCRILog(path), "stdout")
}

// waitStdoutPrefix waits until the container's log holds a stdout line
// beginning with prefix and returns the lines so far.
func (e *env) waitStdoutPrefix(path, prefix string) []string {
	e.t.Helper()
	var lines []string
	testutil.WaitFor(e.t, stateTimeout, fmt.Sprintf("a stdout line %q... in %s", prefix, path), func() (bool, string) {
		lines = e.stdoutLines(path)
		return slices.ContainsFunc(lines, func(l string) bool { return strings.HasPrefix(l, prefix) }), e.logText(path)
	})
	return lines
}

// The containers of an nspawn pod share its network: B reaches A's server
// on 127.0.0.1. With the pod's PID namespace shared (POD), B sees A's
// processes and none of the host's, and both are in one PID namespace that
// is not the host's.
func TestNspawnMultiContainerPod(t *testing.T) {
	e := newNspawnEnv(t)
	podID, podCfg := e.nspawnPod("multi")
	cfgA := e.nspawnContainer("server", "sh", "-c",
		"mkdir -p /www && echo from-a > /www/index.html && exec httpd -f -p 127.0.0.1:8080 -h /www")
	a := e.createAndStart(podID, podCfg, cfgA)
	b := e.createAndStart(podID, podCfg, e.nspawnContainer("client", "sleep", "3600"))
	e.waitContainerState(a, running, stateTimeout)
	e.waitContainerState(b, running, stateTimeout)

	testutil.WaitFor(t, stateTimeout, "B to fetch A's page on 127.0.0.1:8080", func() (bool, string) {
		r := e.execSync(b, wget("http://127.0.0.1:8080/")...)
		return r.ExitCode == 0 && string(r.Stdout) == "from-a\n", fmt.Sprintf("exit %d stdout %q stderr %q", r.ExitCode, r.Stdout, r.Stderr)
	})
	netA := strings.TrimSpace(e.execOK(a, "readlink", "/proc/self/ns/net"))
	netB := strings.TrimSpace(e.execOK(b, "readlink", "/proc/self/ns/net"))
	if netA != netB || netA == hostNSLink(t, "net") {
		t.Errorf("network namespaces: A %s, B %s, host %s; want A = B ≠ host", netA, netB, hostNSLink(t, "net"))
	}

	pidA := strings.TrimSpace(e.execOK(a, "readlink", "/proc/self/ns/pid"))
	pidB := strings.TrimSpace(e.execOK(b, "readlink", "/proc/self/ns/pid"))
	if pidA != pidB || pidA == hostNSLink(t, "pid") {
		t.Errorf("PID namespaces with pid mode POD: A %s, B %s, host %s; want A = B ≠ host", pidA, pidB, hostNSLink(t, "pid"))
	}
	ps := e.execOK(b, "ps", "-o", "pid,args")
	if !strings.Contains(ps, "httpd -f -p 127.0.0.1:8080") {
		t.Errorf("B does not see A's server among the pod's processes:\n%s", ps)
	}
	self := filepath.Base(os.Args[0])
	if strings.Contains(ps, self) {
		t.Errorf("B sees the host's process %s:\n%s", self, ps)
	}
	if n := len(strings.Split(strings.TrimSpace(ps), "\n")) - 1; n > 10 {
		t.Errorf("B sees %d processes; a pod of two containers has a handful:\n%s", n, ps)
	}
}

// With the PID namespace mode CONTAINER (the kubelet's default, when the
// pod does not set shareProcessNamespace) each container has a PID
// namespace of its own: B does not see A's processes. A runtime that
// cannot do that must refuse the pod or the container, not share
// silently.
func TestNspawnContainerPIDNamespace(t *testing.T) {
	e := newNspawnEnv(t)
	ns := &runtimeapi.NamespaceOption{
		Network: runtimeapi.NamespaceMode_POD,
		Pid:     runtimeapi.NamespaceMode_CONTAINER,
		Ipc:     runtimeapi.NamespaceMode_POD,
	}
	podCfg := e.podConfig("pid-container")
	podCfg.Linux.SecurityContext.NamespaceOptions = ns
	resp, err := e.rt().RunPodSandbox(e.ctx(), &runtimeapi.RunPodSandboxRequest{Config: podCfg, RuntimeHandler: "nspawn"})
	if err != nil {
		requireRefusal(t, err, "RunPodSandbox with pid mode CONTAINER")
		return
	}
	e.cleanupPod(resp.PodSandboxId)
	podID := resp.PodSandboxId

	start := func(name string, cmd ...string) (string, bool) {
		cfg := e.containerConfig(name, cmd...)
		cfg.Linux.SecurityContext.NamespaceOptions = ns
		r, err := e.rt().CreateContainer(e.ctx(), &runtimeapi.CreateContainerRequest{PodSandboxId: podID, Config: cfg, SandboxConfig: podCfg})
		if err != nil {
			requireRefusal(t, err, "CreateContainer with pid mode CONTAINER")
			return "", false
		}
		if _, err := e.rt().StartContainer(e.ctx(), &runtimeapi.StartContainerRequest{ContainerId: r.ContainerId}); err != nil {
			requireRefusal(t, err, "StartContainer with pid mode CONTAINER")
			return "", false
		}
		return r.ContainerId, true
	}
	a, ok := start("a", "sh", "-c", "exec sleep 3601")
	if !ok {
		return
	}
	b, ok := start("b", "sleep", "3602")
	if !ok {
		return
	}
	e.waitContainerState(a, running, stateTimeout)
	e.waitContainerState(b, running, stateTimeout)
	pidA := strings.TrimSpace(e.execOK(a, "readlink", "/proc/self/ns/pid"))
	pidB := strings.TrimSpace(e.execOK(b, "readlink", "/proc/self/ns/pid"))
	if pidA == pidB {
		t.Errorf("the pod was accepted with pid mode CONTAINER, but both containers are in PID namespace %s", pidA)
	}
	if ps := e.execOK(b, "ps", "-o", "pid,args"); strings.Contains(ps, "sleep 3601") {
		t.Errorf("the pod was accepted with pid mode CONTAINER, but container b sees container a's process:\n%s", ps)
	}
}

// requireRefusal accepts an explicit refusal: InvalidArgument,
// Unimplemented or FailedPrecondition, whose message speaks of the PID
// namespace.
func requireRefusal(t *testing.T, err error, what string) {
	t.Helper()
	if !harness.IsCode(err, codes.InvalidArgument) && !harness.IsCode(err, codes.Unimplemented) && !harness.IsCode(err, codes.FailedPrecondition) {
		t.Fatalf("%s: %v, want success or an explicit refusal (InvalidArgument, Unimplemented, FailedPrecondition)", what, err)
	}
	if !strings.Contains(lower(err.Error()), "pid") {
		t.Errorf("%s refused without naming the PID namespace: %v", what, err)
	}
	t.Logf("%s refused: %v", what, err)
}

// capBits are the Linux capability numbers by name.
var capBits = map[string]int{
	"CAP_CHOWN": unix.CAP_CHOWN, "CAP_DAC_OVERRIDE": unix.CAP_DAC_OVERRIDE, "CAP_DAC_READ_SEARCH": unix.CAP_DAC_READ_SEARCH,
	"CAP_FOWNER": unix.CAP_FOWNER, "CAP_FSETID": unix.CAP_FSETID, "CAP_KILL": unix.CAP_KILL, "CAP_SETGID": unix.CAP_SETGID,
	"CAP_SETUID": unix.CAP_SETUID, "CAP_SETPCAP": unix.CAP_SETPCAP, "CAP_LINUX_IMMUTABLE": unix.CAP_LINUX_IMMUTABLE,
	"CAP_NET_BIND_SERVICE": unix.CAP_NET_BIND_SERVICE, "CAP_NET_BROADCAST": unix.CAP_NET_BROADCAST,
	"CAP_NET_ADMIN": unix.CAP_NET_ADMIN, "CAP_NET_RAW": unix.CAP_NET_RAW, "CAP_IPC_LOCK": unix.CAP_IPC_LOCK,
	"CAP_IPC_OWNER": unix.CAP_IPC_OWNER, "CAP_SYS_MODULE": unix.CAP_SYS_MODULE, "CAP_SYS_RAWIO": unix.CAP_SYS_RAWIO,
	"CAP_SYS_CHROOT": unix.CAP_SYS_CHROOT, "CAP_SYS_PTRACE": unix.CAP_SYS_PTRACE, "CAP_SYS_PACCT": unix.CAP_SYS_PACCT,
	"CAP_SYS_ADMIN": unix.CAP_SYS_ADMIN, "CAP_SYS_BOOT": unix.CAP_SYS_BOOT, "CAP_SYS_NICE": unix.CAP_SYS_NICE,
	"CAP_SYS_RESOURCE": unix.CAP_SYS_RESOURCE, "CAP_SYS_TIME": unix.CAP_SYS_TIME, "CAP_SYS_TTY_CONFIG": unix.CAP_SYS_TTY_CONFIG,
	"CAP_MKNOD": unix.CAP_MKNOD, "CAP_LEASE": unix.CAP_LEASE, "CAP_AUDIT_WRITE": unix.CAP_AUDIT_WRITE,
	"CAP_AUDIT_CONTROL": unix.CAP_AUDIT_CONTROL, "CAP_SETFCAP": unix.CAP_SETFCAP, "CAP_MAC_OVERRIDE": unix.CAP_MAC_OVERRIDE,
	"CAP_MAC_ADMIN": unix.CAP_MAC_ADMIN, "CAP_SYSLOG": unix.CAP_SYSLOG, "CAP_WAKE_ALARM": unix.CAP_WAKE_ALARM,
	"CAP_BLOCK_SUSPEND": unix.CAP_BLOCK_SUSPEND, "CAP_AUDIT_READ": unix.CAP_AUDIT_READ, "CAP_PERFMON": unix.CAP_PERFMON,
	"CAP_BPF": unix.CAP_BPF, "CAP_CHECKPOINT_RESTORE": unix.CAP_CHECKPOINT_RESTORE,
}

func capMask(t *testing.T, names []string) uint64 {
	t.Helper()
	var m uint64
	for _, n := range names {
		bit, ok := capBits[n]
		if !ok {
			t.Fatalf("unknown capability %q", n)
		}
		m |= 1 << bit
	}
	return m
}

// hostAllCaps is every capability the node grants: the test's own
// bounding set (root, like the daemon). It may lack some the kernel knows
// when the node itself runs in a restricted container.
func hostAllCaps(t *testing.T) uint64 {
	t.Helper()
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	return hexMask(t, procStatus(strings.Split(string(b), "\n"))["CapBnd"])
}

// procStatus parses "Key:\tvalue" lines of /proc/PID/status output.
func procStatus(lines []string) map[string]string {
	m := map[string]string{}
	for _, l := range lines {
		if k, v, ok := strings.Cut(l, ":"); ok {
			m[k] = strings.Join(strings.Fields(v), " ")
		}
	}
	return m
}

func hexMask(t *testing.T, v string) uint64 {
	t.Helper()
	m, err := strconv.ParseUint(v, 16, 64)
	if err != nil {
		t.Fatalf("capability mask %q: %v", v, err)
	}
	return m
}

// Users, capabilities and no_new_privs as each container's process and
// its ExecSync processes see them in /proc/self/status.
func TestNspawnUsersAndCapabilities(t *testing.T) {
	e := newNspawnEnv(t)
	cfg := e.netPodConfig("caps", nspawnStage1)
	// The kubelet marks the sandbox privileged when any container is.
	cfg.Linux.SecurityContext.Privileged = true
	podID := e.runStage1Pod(cfg, nspawnStage1)

	defaults := capMask(t, broker.DefaultCapabilities)
	if defaults != 0xa80425fb {
		t.Logf("stagelet's default capabilities are %#016x; containerd's are 0x00000000a80425fb", defaults)
	}
	all := hostAllCaps(t)
	addNetAdmin := (defaults | 1<<unix.CAP_NET_ADMIN) &^ (1 << unix.CAP_MKNOD)
	uid := func(v int64) *runtimeapi.Int64Value { return &runtimeapi.Int64Value{Value: v} }
	cases := []struct {
		name string
		sec  func(*runtimeapi.LinuxContainerSecurityContext)
		uid  string // the Uid: line, "real effective saved fs"
		eff  uint64 // CapEff
		bnd  uint64 // CapBnd
		nnp  string // NoNewPrivs
	}{
		{"root-default", func(*runtimeapi.LinuxContainerSecurityContext) {}, "0 0 0 0", defaults, defaults, "0"},
		{"uid-1000", func(s *runtimeapi.LinuxContainerSecurityContext) { s.RunAsUser = uid(1000) }, "1000 1000 1000 1000", 0, defaults, "0"},
		{"drop-all", func(s *runtimeapi.LinuxContainerSecurityContext) {
			s.Capabilities = &runtimeapi.Capability{DropCapabilities: []string{"ALL"}}
		}, "0 0 0 0", 0, 0, "0"},
		{"add-net-admin", func(s *runtimeapi.LinuxContainerSecurityContext) {
			s.Capabilities = &runtimeapi.Capability{AddCapabilities: []string{"NET_ADMIN"}, DropCapabilities: []string{"MKNOD"}}
		}, "0 0 0 0", addNetAdmin, addNetAdmin, "0"},
		{"privileged", func(s *runtimeapi.LinuxContainerSecurityContext) { s.Privileged = true }, "0 0 0 0", all, all, "0"},
		{"no-new-privs", func(s *runtimeapi.LinuxContainerSecurityContext) { s.NoNewPrivs = true }, "0 0 0 0", defaults, defaults, "1"},
	}
	const script = `grep -E '^(Uid|Gid|CapEff|CapPrm|CapBnd|NoNewPrivs):' /proc/self/status; echo status-done`
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cc := e.nspawnContainer(tc.name, "sh", "-c", script+"; exec sleep 3600")
			tc.sec(cc.Linux.SecurityContext)
			id := e.createAndStart(podID, cfg, cc)
			e.waitContainerState(id, running, stateTimeout)
			app := procStatus(e.waitStdoutPrefix(logPath(cfg, cc), "status-done"))
			exe := procStatus(strings.Split(e.execOK(id, "sh", "-c", script), "\n"))
			for _, v := range []struct {
				who string
				st  map[string]string
			}{{"the container's process", app}, {"an ExecSync process", exe}} {
				if v.st["Uid"] != tc.uid {
					t.Errorf("%s: Uid %q, want %q", v.who, v.st["Uid"], tc.uid)
				}
				if got := hexMask(t, v.st["CapEff"]); got != tc.eff {
					t.Errorf("%s: CapEff %#016x, want %#016x", v.who, got, tc.eff)
				}
				if got := hexMask(t, v.st["CapBnd"]); got != tc.bnd {
					t.Errorf("%s: CapBnd %#016x, want %#016x", v.who, got, tc.bnd)
				}
				if v.st["NoNewPrivs"] != tc.nnp {
					t.Errorf("%s: NoNewPrivs %q, want %q", v.who, v.st["NoNewPrivs"], tc.nnp)
				}
			}
		})
	}
}

// A read-only rootfs refuses writes, from the app and from ExecSync.
func TestNspawnReadonlyRootfs(t *testing.T) {
	e := newNspawnEnv(t)
	podID, podCfg := e.nspawnPod("readonly")
	cfg := e.nspawnContainer("ro", "sh", "-c", "if touch /from-app 2>/dev/null; then echo app-wrote; else echo app-refused; fi; exec sleep 3600")
	cfg.Linux.SecurityContext.ReadonlyRootfs = true
	id := e.createAndStart(podID, podCfg, cfg)
	e.waitContainerState(id, running, stateTimeout)
	lines := e.waitStdoutPrefix(logPath(podCfg, cfg), "app-")
	if !slices.Contains(lines, "app-refused") {
		t.Errorf("the app could write to its read-only rootfs: %q", lines)
	}
	r := e.execSync(id, "touch", "/newfile")
	if r.ExitCode == 0 {
		t.Fatalf("touch /newfile succeeded on a read-only rootfs")
	}
	if !strings.Contains(string(r.Stderr), "Read-only file system") {
		t.Errorf("touch /newfile failed, but not for a read-only file system: %q", r.Stderr)
	}
	if out := e.execOK(id, "cat", "/etc/group"); !strings.Contains(out, "extra:x:2000") {
		t.Errorf("the read-only rootfs does not hold the image's files")
	}
	// A writable container of the same pod is not affected.
	rw := e.createAndStart(podID, podCfg, e.nspawnContainer("rw", "sleep", "3600"))
	e.waitContainerState(rw, running, stateTimeout)
	e.execOK(rw, "touch", "/newfile")
}

// A container beyond its memory limit is OOM-killed and reported so.
func TestNspawnMemoryLimitOOMKilled(t *testing.T) {
	e := newNspawnEnv(t)
	podID, podCfg := e.nspawnPod("oom")
	cfg := e.nspawnContainer("hog", "sh", "-c", "head -c 64m /dev/zero | tail")
	cfg.Linux.Resources.MemoryLimitInBytes = 16 << 20
	id := e.createAndStart(podID, podCfg, cfg)
	st := e.waitContainerState(id, exited, 60*time.Second)
	if st.Reason != "OOMKilled" {
		t.Errorf("memory hog beyond its 16 MiB limit: reason %q exit code %d message %q, want reason OOMKilled", st.Reason, st.ExitCode, st.Message)
	}
	if st.ExitCode == 0 {
		t.Errorf("memory hog beyond its limit exited 0")
	}
	// A container within its limit in the same pod runs on.
	ok := e.nspawnContainer("modest", "sh", "-c", "head -c 4m /dev/zero | tail | wc -c; exec sleep 3600")
	ok.Linux.Resources.MemoryLimitInBytes = 16 << 20
	okID := e.createAndStart(podID, podCfg, ok)
	e.waitContainerState(okID, running, stateTimeout)
	e.waitLogLine(logPath(podCfg, ok), "stdout", "4194304")
}

// nsScript prints the namespaces and cgroups of the process running it.
const nsScript = `for n in pid net uts ipc mnt; do echo "ns $n $(readlink /proc/self/ns/$n)"; done; sed 's/^/cg /' /proc/self/cgroup; echo ns-done`

// ExecSync runs in the pod's namespaces and the container's cgroups, the
// same as the container's own process, and not in the host's.
func TestNspawnExecSyncSeesPodNamespaces(t *testing.T) {
	e := newNspawnEnv(t)
	podID, podCfg := e.nspawnPod("exec-ns")
	cfg := e.nspawnContainer("app", "sh", "-c", nsScript+"; exec sleep 3600")
	id := e.createAndStart(podID, podCfg, cfg)
	e.waitContainerState(id, running, stateTimeout)
	app := e.waitStdoutPrefix(logPath(podCfg, cfg), "ns-done")
	exe := strings.Split(strings.TrimSpace(e.execOK(id, "sh", "-c", nsScript)), "\n")

	pick := func(lines []string, prefix string) []string {
		var out []string
		for _, l := range lines {
			if strings.HasPrefix(l, prefix) {
				out = append(out, l)
			}
		}
		return out
	}
	for _, kind := range []string{"pid", "net", "uts", "ipc", "mnt"} {
		a, x := pick(app, "ns "+kind+" "), pick(exe, "ns "+kind+" ")
		if len(a) != 1 || len(x) != 1 {
			t.Fatalf("%s namespace not printed: app %q exec %q", kind, app, exe)
		}
		link := strings.TrimPrefix(x[0], "ns "+kind+" ")
		if link == hostNSLink(t, kind) {
			t.Errorf("ExecSync runs in the host's %s namespace %s", kind, link)
		}
		// The agent cannot join the app's mount namespace (it is
		// multithreaded); exec chroots into the app's root mount
		// instead, checked below through a file only that mount holds.
		if kind != "mnt" && a[0] != x[0] {
			t.Errorf("ExecSync's %s namespace differs from the container's: exec %q, app %q", kind, x[0], a[0])
		}
	}
	if a, x := pick(app, "cg "), pick(exe, "cg "); !slices.Equal(a, x) || len(a) == 0 {
		t.Errorf("ExecSync's cgroups differ from the container's:\nexec %q\napp  %q", x, a)
	}
	e.execOK(id, "sh", "-c", "echo from-exec > /exec-marker")
	if out := e.execOK(id, "cat", "/exec-marker"); out != "from-exec\n" {
		t.Errorf("a second ExecSync does not see the file the first wrote in the container's root: %q", out)
	}
	if _, err := os.Stat("/exec-marker"); err == nil {
		t.Errorf("the file ExecSync wrote in the container's root appeared in the host's root")
	}
	if got := strings.TrimSpace(e.execOK(id, "hostname")); got != podCfg.Hostname {
		t.Errorf("hostname seen by ExecSync: %q, want the pod's %q", got, podCfg.Hostname)
	}
	// PID 1 of the pod is its init (the agent), not the host's.
	if comm := strings.TrimSpace(e.execOK(id, "cat", "/proc/1/comm")); comm == "" || comm == hostComm(t, 1) {
		t.Errorf("PID 1 seen by ExecSync is %q, the host's init", comm)
	}
}

func hostComm(t *testing.T, pid int) string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}

// Container logs and exit codes behave on nspawn as on fly: CRI log lines
// per stream, exit 0 → Completed, non-zero → Error, kill → 137.
func TestNspawnLogsAndExitCodes(t *testing.T) {
	e := newNspawnEnv(t)
	podID, podCfg := e.nspawnPod("exits")
	cases := []struct {
		name   string
		cmd    []string
		code   int32
		reason string
	}{
		{"ok", []string{"sh", "-c", "echo out-line; echo err-line >&2; printf 'no-newline'"}, 0, "Completed"},
		{"three", []string{"sh", "-c", "echo failing; exit 3"}, 3, "Error"},
		{"killed", []string{"sh", "-c", "kill -KILL $$"}, 137, "Error"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			before := time.Now()
			cfg := e.nspawnContainer(tc.name, tc.cmd...)
			id := e.createAndStart(podID, podCfg, cfg)
			st := e.waitContainerState(id, exited, stateTimeout)
			if st.ExitCode != tc.code || st.Reason != tc.reason {
				t.Errorf("exit code %d reason %q, want %d %q", st.ExitCode, st.Reason, tc.code, tc.reason)
			}
			if st.StartedAt < before.UnixNano() || st.FinishedAt < st.StartedAt || st.FinishedAt > time.Now().UnixNano() {
				t.Errorf("times: started %d finished %d (test began %d)", st.StartedAt, st.FinishedAt, before.UnixNano())
			}
			if st.LogPath != logPath(podCfg, cfg) {
				t.Errorf("log_path %q, want %q", st.LogPath, logPath(podCfg, cfg))
			}
		})
	}
	// The "ok" container's log: one full line per stream, the unterminated
	// last write as a line of its own.
	path := filepath.Join(podCfg.LogDirectory, "ok.log")
	lines := e.readCRILog(path)
	for _, l := range lines {
		if l.Time.Before(time.Now().Add(-5*time.Minute)) || l.Time.After(time.Now()) {
			t.Errorf("log line time %s is not recent", l.Time)
		}
	}
	out := harness.JoinPartial(lines, "stdout")
	errs := harness.JoinPartial(lines, "stderr")
	if !slices.Equal(out, []string{"out-line", "no-newline"}) {
		t.Errorf("stdout lines %q, want [out-line no-newline]\n%s", out, e.logText(path))
	}
	if !slices.Equal(errs, []string{"err-line"}) {
		t.Errorf("stderr lines %q, want [err-line]\n%s", errs, e.logText(path))
	}
	e.waitLogLine(filepath.Join(podCfg.LogDirectory, "three.log"), "stdout", "failing")
}

// An nspawn pod runs on the host's kernel: namespaces, not a VM.
func TestNspawnSharesHostKernel(t *testing.T) {
	e := newNspawnEnv(t)
	podID, podCfg := e.nspawnPod("kernel")
	id := e.createAndStart(podID, podCfg, e.nspawnContainer("app", "sleep", "3600"))
	e.waitContainerState(id, running, stateTimeout)
	var u unix.Utsname
	if err := unix.Uname(&u); err != nil {
		t.Fatal(err)
	}
	host := unix.ByteSliceToString(u.Release[:])
	if got := strings.TrimSpace(e.execOK(id, "uname", "-r")); got != host {
		t.Errorf("uname -r in the pod: %q, host %q", got, host)
	}
	resp, err := e.rt().PodSandboxStatus(e.ctx(), &runtimeapi.PodSandboxStatusRequest{PodSandboxId: podID, Verbose: true})
	if err != nil {
		t.Fatalf("PodSandboxStatus verbose: %v", err)
	}
	if k, ok := resp.Info["agent.kernel"]; ok && !strings.Contains(k, host) {
		t.Errorf("verbose info agent.kernel %q does not name the host's kernel %q", k, host)
	}
	if got := resp.Info["stage1"]; got != "nspawn" {
		t.Errorf("verbose info stage1 %q, want nspawn", got)
	}
}
