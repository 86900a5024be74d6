package kvm

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
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

	"github.com/stagelet/stagelet/internal/mountsafe"
	"github.com/stagelet/stagelet/stage1/host"

	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/stage1"
	"github.com/stagelet/stagelet/stage1/podconn"
	"github.com/stagelet/stagelet/stage1/stage1test"
)

// The VM tests need root, qemu-system-x86_64 and the guest
// assets. TestMain builds the stagelet binary and the assets with it
// (guest/build.sh; the kernel package is cached in
// $STAGELET_GUEST_CACHE, default /var/tmp/stagelet-guest-test), unless
// $STAGELET_GUEST_ASSETS names assets built already (`make guest`).
var (
	agentBinary string
	assetsDir   string
	// templateDir holds the templates of the tests' backends.
	templateDir string
	setupErr    error  // building failed: the tests fail
	skipReason  string // the tests cannot run here: they skip
)

func TestMain(m *testing.M) {
	flag.Parse()
	if spec := os.Getenv(daemonEnv); spec != "" {
		os.Exit(daemonMain(spec))
	}
	os.Exit(func() int {
		switch {
		case testing.Short():
			skipReason = "integration test: boots VMs (skipped with -short)"
		case os.Geteuid() != 0:
			skipReason = "needs root: VMs, cgroups, mounts, taps"
		}
		if _, err := exec.LookPath("qemu-system-x86_64"); skipReason == "" && err != nil {
			skipReason = "needs qemu-system-x86_64 (Debian: qemu-system-x86)"
		}
		if skipReason != "" {
			return m.Run()
		}
		dir, err := os.MkdirTemp("", "stagelet-kvm-test")
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		defer os.RemoveAll(dir)
		templateDir = filepath.Join(dir, "templates")
		agentBinary, setupErr = stage1test.BuildAgent(dir)
		if assetsDir = os.Getenv("STAGELET_GUEST_ASSETS"); assetsDir == "" && setupErr == nil {
			// Without a Debian archive to fetch the kernel from, the
			// tests cannot run here: they skip, saying why.
			var err error
			if assetsDir, err = buildAssets(agentBinary); err != nil {
				skipReason = "no guest assets: " + err.Error()
			}
		}
		return m.Run()
	}())
}

// buildAssets runs guest/build.sh with the freshly built binary.
func buildAssets(binary string) (string, error) {
	cache := os.Getenv("STAGELET_GUEST_CACHE")
	if cache == "" {
		cache = "/var/tmp/stagelet-guest-test"
	}
	script, err := filepath.Abs("../../guest/build.sh")
	if err != nil {
		return "", err
	}
	cmd := exec.Command(script, binary, cache)
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("guest/build.sh: %v\n%s", err, out)
	}
	return cache, nil
}

func needVM(tb testing.TB) {
	tb.Helper()
	if skipReason != "" {
		tb.Skip(skipReason)
	}
	if setupErr != nil {
		tb.Fatal(setupErr)
	}
}

func testLogger(tb testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(tWriter{tb}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

type tWriter struct{ tb testing.TB }

func (w tWriter) Write(b []byte) (int, error) {
	w.tb.Helper()
	w.tb.Log(strings.TrimRight(string(b), "\n"))
	return len(b), nil
}

// sharedBackend is one Backend for the package's tests, as one daemon run
// has: the accelerator is probed once. Its pods' VMs are restored from
// templates, as the daemon's are; coldBackend's boot their kernel.
var (
	backendOnce sync.Once
	backend     *Backend
	coldOnce    sync.Once
	cold        *Backend
)

func testBackend(t *testing.T) *Backend {
	needVM(t)
	backendOnce.Do(func() {
		backend = New(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo})), Config{AssetsDir: assetsDir, TemplateDir: templateDir})
	})
	return backend
}

func coldBackend(t *testing.T) *Backend {
	needVM(t)
	coldOnce.Do(func() {
		cold = New(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo})), Config{AssetsDir: assetsDir})
	})
	return cold
}

func TestConformance(t *testing.T) {
	conformance(t, testBackend(t))
}

// TestConformanceColdBoot runs the stage1 conformance suite on VMs that
// boot their kernel (no templates).
func TestConformanceColdBoot(t *testing.T) {
	conformance(t, coldBackend(t))
}

func conformance(t *testing.T, b *Backend) {
	stage1test.Run(t, b, stage1test.Env{
		AgentBinary:  agentBinary,
		Rootfs:       stage1test.BusyboxRootfs,
		CgroupParent: stage1test.CgroupParent,
		RunDir:       stage1test.ShortRunDir,
		KillPod:      killQemu,
		Timeout:      90 * time.Second,
	})
}

// killQemu kills the recorded qemu process, as a crash would, and waits
// until it is dead.
func killQemu(t *testing.T, b []byte) {
	t.Helper()
	st, err := parseState(b)
	if err != nil {
		t.Fatal(err)
	}
	if st.qemu() == nil {
		t.Fatal("no qemu in state")
	}
	if err := st.qemu().Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := st.qemu().Wait(ctx); err != nil {
		t.Fatal(err)
	}
}

// vmPod is a started pod for the tests below; cleanup destroys it.
type vmPod struct {
	spec *stage1.PodSpec
	pod  *podconn.Pod

	mu    sync.Mutex
	state []byte
}

func (p *vmPod) last() []byte {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]byte(nil), p.state...)
}

var seq int

func startVM(t *testing.T, b *Backend, netns string, opts map[string]string) *vmPod {
	t.Helper()
	seq++
	id := fmt.Sprintf("kvm%d%d", os.Getpid(), seq)
	vp := &vmPod{spec: &stage1.PodSpec{
		ID: id, Name: "kvm", Namespace: "default", UID: id + "-uid", Hostname: "kvm-" + fmt.Sprint(seq),
		RunDir:       stage1test.ShortRunDir(t),
		CgroupParent: stage1test.CgroupParent(t),
		NetNSPath:    netns,
		Options:      opts,
	}}
	persist := func(st []byte) error {
		vp.mu.Lock()
		defer vp.mu.Unlock()
		vp.state = append([]byte(nil), st...)
		return nil
	}
	t.Cleanup(func() {
		if t.Failed() {
			for _, f := range []string{"console.log", "qemu.log"} {
				out, _ := os.ReadFile(filepath.Join(vp.spec.RunDir, "vm", f))
				t.Logf("%s:\n%s", f, out)
			}
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := b.DestroyPod(ctx, vp.spec, vp.last()); err != nil {
			t.Errorf("cleanup: DestroyPod: %v", err)
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pod, err := stage1test.Opened(b.StartPod(ctx, vp.spec, persist))
	if err != nil {
		t.Fatalf("StartPod: %v", err)
	}
	vp.pod = pod
	persist(pod.State())
	return vp
}

// run creates and starts a busybox container running args.
func (vp *vmPod) run(t *testing.T, id string, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	logPath := filepath.Join(t.TempDir(), id+".log")
	spec := &stage1.ContainerSpec{AppSpec: api.AppSpec{
		ID: id, Name: id, Rootfs: stage1test.BusyboxRootfs(t), Args: args,
		Env: []string{"PATH=/bin"}, LogPath: logPath,
	}}
	if _, err := vp.pod.CreateContainer(ctx, spec); err != nil {
		t.Fatalf("CreateContainer: %v", err)
	}
	if _, err := vp.pod.StartContainer(ctx, id); err != nil {
		t.Fatalf("StartContainer: %v", err)
	}
	return logPath
}

func (vp *vmPod) exec(t *testing.T, id string, cmd ...string) (string, int32) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	res, err := vp.pod.ExecSync(ctx, id, cmd, 30*time.Second)
	if err != nil {
		t.Fatalf("ExecSync %v: %v", cmd, err)
	}
	return string(res.Stdout) + string(res.Stderr), res.ExitCode
}

// TestGuestKernel: an app in a kvm pod sees the guest's kernel, not the
// host's, and Details name the accelerator.
func TestGuestKernel(t *testing.T) {
	b := testBackend(t)
	vp := startVM(t, b, "", nil)
	vp.run(t, "main", "/bin/sleep", "1000")
	out, code := vp.exec(t, "main", "uname", "-r")
	guest := strings.TrimSpace(out)
	var u unix.Utsname
	unix.Uname(&u)
	host := unix.ByteSliceToString(u.Release[:])
	if code != 0 || guest == "" || guest == host {
		t.Fatalf("uname -r in the pod = %q (exit %d), host %q: want the guest's kernel", guest, code, host)
	}
	if want := manifestKernel(assetsDir); want != "" && guest != want {
		t.Errorf("uname -r = %q, want the guest kernel %q", guest, want)
	}
	d := vp.pod.Details()
	if d["accelerator"] != "kvm" && d["accelerator"] != "tcg" {
		t.Errorf("Details = %v: no accelerator", d)
	}
	t.Logf("guest kernel %s (host %s), details %v", guest, host, d)
}

// TestTemplate: pods' VMs are restored from one template, built once per
// VM shape, and each gets its own identity: hostname, network, clock, and
// a random number generator that no longer repeats the template's.
func TestTemplate(t *testing.T) {
	b := testBackend(t)
	var outs []string
	for i := range 2 {
		vp := startVM(t, b, "", nil)
		vp.run(t, "main", "/bin/sleep", "1000")
		d := vp.pod.Details()
		if d["template"] == "" {
			t.Fatalf("pod %d: Details %v: not restored from a template", i, d)
		}
		out, code := vp.exec(t, "main", "sh", "-c", "hostname; date +%s; od -An -tx1 -N16 /dev/urandom | tr -d ' \n'")
		f := strings.Fields(out)
		if code != 0 || len(f) != 3 {
			t.Fatalf("pod %d: %q (exit %d)", i, out, code)
		}
		if f[0] != vp.spec.Hostname {
			t.Errorf("pod %d: hostname %q, want %q", i, f[0], vp.spec.Hostname)
		}
		var guestNow int64
		fmt.Sscan(f[1], &guestNow)
		if d := time.Now().Unix() - guestNow; d < -5 || d > 5 {
			t.Errorf("pod %d: guest clock %d, host %d", i, guestNow, time.Now().Unix())
		}
		outs = append(outs, f[2])
	}
	if outs[0] == outs[1] {
		t.Errorf("two restored guests read the same bytes from /dev/urandom: %s", outs[0])
	}
	if got := b.NodeInfo(context.Background())["templates"]; got != templateDir {
		t.Errorf("NodeInfo templates = %q, want %q", got, templateDir)
	}
	if got := coldBackend(t).NodeInfo(context.Background())["templates"]; !strings.HasPrefix(got, "off") {
		t.Errorf("NodeInfo templates of a backend without = %q, want off", got)
	}
	ents, err := os.ReadDir(templateDir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	// One template for every pod of the default shape (TestOptions may
	// have made one of its own); no build left behind.
	for _, n := range names {
		if strings.HasPrefix(n, buildPrefix) {
			t.Errorf("templates %v: a build left behind", names)
		}
	}
}

// TestTemplateStale: a template of other guest assets and an unfinished
// build are removed, an incomplete template of the key wanted is
// replaced, and the template built is found again, by a restarted daemon
// too.
func TestTemplateStale(t *testing.T) {
	needVM(t)
	dir := t.TempDir()
	stale := filepath.Join(dir, "0123456789abcdef")
	if err := os.MkdirAll(filepath.Join(stale, templateShare), 0o700); err != nil {
		t.Fatal(err)
	}
	info, _ := json.Marshal(templateInfo{Key: "0123456789abcdef", Assets: "other"})
	for f, b := range map[string][]byte{templateInfoFile: info, templateMemory: nil, templateState: nil} {
		if err := os.WriteFile(filepath.Join(stale, f), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	build := filepath.Join(dir, buildPrefix+"fedcba9876543210-1")
	if err := os.Mkdir(build, 0o700); err != nil {
		t.Fatal(err)
	}
	// An incomplete template of the very key wanted (no state file).
	vm := vmInfo{Accelerator: "tcg", Machine: "microvm", MemoryMiB: 128, VCPUs: 1}
	b := New(testLogger(t), Config{AssetsDir: assetsDir, TemplateDir: dir})
	tools, err := b.resolveTools()
	if err != nil {
		t.Fatal(err)
	}
	assets, err := assetsFingerprint(tools)
	if err != nil {
		t.Fatal(err)
	}
	incomplete := filepath.Join(dir, templateKey(assets, vm))
	if err := os.MkdirAll(filepath.Join(incomplete, templateShare), 0o700); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	tpl, err := b.template(ctx, tools, vm)
	if err != nil {
		t.Fatal(err)
	}
	b.releaseTemplate(tpl)
	for _, gone := range []string{stale, build} {
		if _, err := os.Stat(gone); !os.IsNotExist(err) {
			t.Errorf("%s: not removed (%v)", gone, err)
		}
	}
	if tpl.dir != incomplete {
		t.Errorf("template in %s, want %s (replacing the incomplete one)", tpl.dir, incomplete)
	}
	again, err := b.template(ctx, tools, vm)
	if err != nil || again.dir != tpl.dir || !again.info.Created.Equal(tpl.info.Created) {
		t.Errorf("second template(): %+v, %v; want the first, %+v", again, err, tpl)
	}
	b.releaseTemplate(again)
	if got, want := b.VMStats(), (stage1.VMStats{TemplateHits: 1, TemplateMisses: 1, TemplateBuilds: 1}); got != want {
		t.Errorf("VMStats after a build and a reuse: %+v, want %+v", got, want)
	}
	// A restarted daemon (a new Backend) finds it too.
	nb := New(testLogger(t), Config{AssetsDir: assetsDir, TemplateDir: dir})
	again, err = nb.template(ctx, tools, vm)
	if err != nil || again.dir != tpl.dir || !again.info.Created.Equal(tpl.info.Created) {
		t.Errorf("template() after a restart: %+v, %v; want the first, %+v", again, err, tpl)
	}
	nb.releaseTemplate(again)
	if got, want := nb.VMStats(), (stage1.VMStats{TemplateHits: 1}); got != want {
		t.Errorf("VMStats of a restarted daemon that found the template: %+v, want %+v", got, want)
	}
}

// TestOptions: the policy's memory and vcpus options size the VM.
func TestOptions(t *testing.T) {
	b := testBackend(t)
	vp := startVM(t, b, "", map[string]string{OptionMemory: "384Mi", OptionVCPUs: "2"})
	vp.run(t, "main", "/bin/sleep", "1000")
	out, _ := vp.exec(t, "main", "sh", "-c", "grep -c ^processor /proc/cpuinfo; grep MemTotal /proc/meminfo")
	f := strings.Fields(out)
	if len(f) < 3 || f[0] != "2" {
		t.Fatalf("in the guest: %q, want 2 CPUs", out)
	}
	var kb int
	fmt.Sscan(f[2], &kb)
	if kb < 300*1024 || kb > 384*1024 {
		t.Errorf("guest MemTotal %d kB, want about 384 MiB", kb)
	}
	if d := vp.pod.Details(); d["memoryMiB"] != "384" || d["vcpus"] != "2" {
		t.Errorf("Details = %v", d)
	}
}

// TestReconnect: a new daemon (a new Backend, the old one's sessions gone
// as with kill -9) recovers a running VM over a new serial session, twice.
func TestReconnect(t *testing.T) {
	b := testBackend(t)
	vp := startVM(t, b, "", nil)
	vp.run(t, "long", "/bin/sleep", "1000")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	before, err := vp.pod.ContainerStatus(ctx, "long")
	if err != nil {
		t.Fatal(err)
	}
	state := vp.pod.State()
	for i := range 2 {
		b.CloseSessions() // the old daemon's connection dies with it
		nb := New(testLogger(t), Config{AssetsDir: assetsDir, Accelerator: vp.pod.Details()["accelerator"]})
		pod, err := stage1test.Opened(nb.RecoverPod(ctx, vp.spec, state))
		if err != nil {
			t.Fatalf("RecoverPod #%d: %v", i+1, err)
		}
		st, err := pod.ContainerStatus(ctx, "long")
		if err != nil || st.State != api.StateRunning || st.PID != before.PID {
			t.Fatalf("after reconnect #%d: %+v, %v; before %+v", i+1, st, err, before)
		}
		if out, _ := (&vmPod{pod: pod}).exec(t, "long", "echo", "again"); out != "again\n" {
			t.Errorf("exec after reconnect #%d: %q", i+1, out)
		}
		nb.CloseSessions()
	}
}

func TestCapabilities(t *testing.T) {
	c := New(nil, Config{}).Capabilities()
	want := stage1.Capabilities{Isolation: stage1.IsolationKernel, KernelIsolated: true, PodNetwork: true, Privileged: "guest", NetworkBeforeStart: true, LocalLayers: true, UserNamespaces: true, HostLogs: true, WholePodCheckpoint: true}
	opts := c.Options
	if c.Options = nil; !reflect.DeepEqual(c, want) {
		t.Errorf("Capabilities = %+v, want %+v", c, want)
	}
	var names []string
	for _, o := range opts {
		names = append(names, o.Name)
		if o.Doc == "" || o.Check == nil {
			t.Errorf("option %q: no Doc or no Check", o.Name)
		}
	}
	if !reflect.DeepEqual(names, []string{OptionMemory, OptionVCPUs}) {
		t.Errorf("Options = %v, want the two vmConfig reads", names)
	}
}

// TestDeclaredOptions: each declared option's Check accepts exactly the
// values vmConfig accepts, so that the policy refuses at load what a
// pod's start would refuse.
func TestDeclaredOptions(t *testing.T) {
	b := New(nil, Config{})
	c := b.Capabilities()
	for _, tt := range []struct {
		name, value string
		ok          bool
	}{
		{OptionMemory, "512", true},
		{OptionMemory, "512Mi", true},
		{OptionMemory, "1G", true},
		{OptionMemory, "64Gi", true},
		{OptionMemory, "128M", true},
		{OptionMemory, "127", false},
		{OptionMemory, "65Gi", false},
		{OptionMemory, "lots", false},
		{OptionMemory, "1T", false},
		{OptionMemory, "", false},
		{OptionMemory, "2048MB", false},
		{OptionVCPUs, "1", true},
		{OptionVCPUs, "64", true},
		{OptionVCPUs, "0", false},
		{OptionVCPUs, "65", false},
		{OptionVCPUs, "two", false},
		{OptionVCPUs, "", false},
	} {
		o, ok := c.Option(tt.name)
		if !ok {
			t.Fatalf("option %q not declared", tt.name)
		}
		err := o.Check(tt.value)
		if (err == nil) != tt.ok {
			t.Errorf("%s=%q: Check says %v, want ok %v", tt.name, tt.value, err, tt.ok)
		}
		if _, verr := b.vmConfig(map[string]string{tt.name: tt.value}, stage1.PodResources{}); (verr == nil) != (err == nil) {
			t.Errorf("%s=%q: Check says %v, vmConfig %v", tt.name, tt.value, err, verr)
		}
	}
	if _, ok := c.Option("memroy"); ok {
		t.Error("a misspelt option is declared")
	}
}

func TestValidate(t *testing.T) {
	ok := stage1.PodSpec{ID: "p", RunDir: "/run/p"}
	if err := validate(&ok); err != nil {
		t.Errorf("valid spec refused: %v", err)
	}
	userns := ok
	userns.UserNS = &stage1.IDMapping{HostID: 1 << 30, Size: 65536}
	if err := validate(&userns); err != nil {
		t.Errorf("a pod with a user namespace refused: %v", err)
	}
	// qemu gets its sockets' names relative to the VM directory, so a run
	// directory longer than a socket address fits.
	long := ok
	long.RunDir = "/" + strings.Repeat("x", 200) + "/pods/p"
	if err := validate(&long); err != nil {
		t.Errorf("long run dir refused: %v", err)
	}
	// The names are relative to the pods directory and carry the pod's
	// ID.
	st := layout(&long, false)
	if st.sockDir() != "/"+strings.Repeat("x", 200)+"/pods" || st.sockName(qmpSocketName) != "p/vm/qmp.sock" {
		t.Errorf("socket dir %q name %q", st.sockDir(), st.sockName(qmpSocketName))
	}
	if filepath.Join(st.sockDir(), st.sockName(ctlSocketName)) != st.ctlSocket() {
		t.Errorf("relative name %q does not lead to %q", st.sockName(ctlSocketName), st.ctlSocket())
	}
	longID := ok
	longID.ID = strings.Repeat("i", 100)
	longID.RunDir = "/run/pods/" + longID.ID
	if err := validate(&longID); err == nil {
		t.Error("a pod id too long for a socket name accepted")
	}
	for name, mut := range map[string]func(*stage1.PodSpec){
		"hostNetwork":           func(s *stage1.PodSpec) { s.HostNetwork = true },
		"hostPID":               func(s *stage1.PodSpec) { s.HostPID = true },
		"hostIPC":               func(s *stage1.PodSpec) { s.HostIPC = true },
		"relative":              func(s *stage1.PodSpec) { s.RunDir = "run/p" },
		"comma":                 func(s *stage1.PodSpec) { s.RunDir = "/run/a,b" },
		"no id":                 func(s *stage1.PodSpec) { s.ID = "" },
		"userns from host ID 0": func(s *stage1.PodSpec) { s.UserNS = &stage1.IDMapping{HostID: 0, Size: 65536} },
		"userns too small":      func(s *stage1.PodSpec) { s.UserNS = &stage1.IDMapping{HostID: 65536, Size: 1000} },
		"userns past 32 bits":   func(s *stage1.PodSpec) { s.UserNS = &stage1.IDMapping{HostID: 1<<32 - 1000, Size: 65536} },
	} {
		s := ok
		mut(&s)
		if err := validate(&s); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

func TestVMConfig(t *testing.T) {
	b := New(nil, Config{})
	pod := stage1.PodResources{MemoryLimit: 300 << 20, CPUQuota: 150000, CPUPeriod: 100000}
	for _, tt := range []struct {
		opts     map[string]string
		res      stage1.PodResources
		mem, cpu int
		ok       bool
	}{
		{nil, stage1.PodResources{}, DefaultMemoryMiB, DefaultVCPUs, true},
		// Sized from the pod: its limit plus the guest's own base; the
		// quota rounded up to whole vCPUs.
		{nil, pod, 300 + GuestBaseMiB, 2, true},
		// The policy's options win over the pod's resources.
		{map[string]string{"memory": "1Gi", "vcpus": "4"}, pod, 1024, 4, true},
		{map[string]string{"memory": "512"}, stage1.PodResources{}, 512, 1, true},
		{map[string]string{"memory": "1Gi", "vcpus": "2"}, stage1.PodResources{}, 1024, 2, true},
		{map[string]string{"memory": "2G"}, stage1.PodResources{}, 2048, 1, true},
		{map[string]string{"memory": "300Mi"}, stage1.PodResources{}, 300, 1, true},
		{map[string]string{"memory": "10"}, stage1.PodResources{}, 0, 0, false},
		{map[string]string{"memory": "lots"}, stage1.PodResources{}, 0, 0, false},
		{map[string]string{"vcpus": "0"}, stage1.PodResources{}, 0, 0, false},
		{map[string]string{"vcpus": "x"}, stage1.PodResources{}, 0, 0, false},
	} {
		vm, err := b.vmConfig(tt.opts, tt.res)
		if (err == nil) != tt.ok || tt.ok && (vm.MemoryMiB != tt.mem || vm.VCPUs != tt.cpu) {
			t.Errorf("vmConfig(%v) = %+v, %v", tt.opts, vm, err)
		}
	}
}

// The kubelet's pod cgroup holds qemu: a VM is kept inside its limit.
func TestFitVM(t *testing.T) {
	const mib = 1 << 20
	containers := stage1.PodResources{MemoryLimit: 35 * mib}
	for _, tt := range []struct {
		name     string
		vm       vmInfo
		limit    uint64
		explicit bool
		want     int // MiB; 0: refused
	}{
		{"no limit", vmInfo{MemoryMiB: 300}, 0, false, 300},
		{"fits", vmInfo{MemoryMiB: 163, TBSizeMiB: 32}, 227 * mib, false, 163},
		{"shrunk to fit", vmInfo{MemoryMiB: 1152, TBSizeMiB: 32}, 1024 * mib, false, 960},
		{"kvm: no translation cache", vmInfo{MemoryMiB: 1152}, 1024 * mib, false, 992},
		{"below the minimum", vmInfo{MemoryMiB: 163, TBSizeMiB: 32}, 35 * mib, false, 0},
		{"just the minimum", vmInfo{MemoryMiB: 163, TBSizeMiB: 32}, (minMemoryMiB + 64) * mib, false, minMemoryMiB},
		{"the policy's size does not fit", vmInfo{MemoryMiB: 512, TBSizeMiB: 32}, 512 * mib, true, 0},
		{"the policy's size fits", vmInfo{MemoryMiB: 512, TBSizeMiB: 32}, 576 * mib, true, 512},
	} {
		vm := tt.vm
		err := fitVM(&vm, tt.limit, tt.explicit, containers)
		switch {
		case tt.want == 0 && !errors.Is(err, errdefs.ErrFailedPrecondition):
			t.Errorf("%s: %+v, %v; want FailedPrecondition", tt.name, vm, err)
		case tt.want != 0 && (err != nil || vm.MemoryMiB != tt.want):
			t.Errorf("%s: %d MiB, %v; want %d MiB", tt.name, vm.MemoryMiB, err, tt.want)
		}
	}
	vm := vmInfo{MemoryMiB: 163, TBSizeMiB: DefaultTBSizeMiB} // qemu's own: 32 + 32 MiB
	err := fitVM(&vm, 35*mib, false, containers)
	if err == nil || !strings.Contains(err.Error(), "overhead.podFixed.memory of at least 192Mi") {
		t.Errorf("refusal does not name the overhead needed: %v", err)
	}
}

func TestParseState(t *testing.T) {
	if st, err := parseState(nil); err != nil || st.qemu() != nil {
		t.Errorf("empty state = %+v, %v", st, err)
	}
	if _, err := parseState([]byte(`{"version":99}`)); err == nil {
		t.Error("unknown version accepted")
	}
	in := &state{Version: stateVersion, VM: vmInfo{Accelerator: "tcg"}}
	in.Record(host.Resource{Kind: host.KindDir, Role: roleDir, Path: "/r/vm"})
	in.Record(host.Resource{Kind: kindTap, Role: roleTap, Name: "tap0", NetNS: "/n"})
	in.Record(host.Resource{Kind: host.KindProcess, Role: roleQemu, Process: &host.Process{PID: 4, StartTime: 2}})
	out, err := parseState(in.marshal())
	if tap, netns := out.tap(); err != nil || out.ctlSocket() != "/r/vm/ctl.sock" || out.qemu().PID != 4 || out.VM.Accelerator != "tcg" || tap != "tap0" || netns != "/n" {
		t.Errorf("round trip = %+v, %v", out, err)
	}
	// A version 1 state (a field each; the tap in two) is read into the
	// ledger in the order its resources were taken.
	v1 := `{"version":1,"dir":"/r/vm","mounts":"/r/mounts","cgroup":{"paths":{"pids":"/sys/fs/cgroup/pids/p"}},"netns":"/n","tap":"tap0","virtiofsd":{"pid":3,"startTime":1},"qemu":{"pid":4,"startTime":2},"vm":{"accelerator":"tcg"}}`
	out, err = parseState([]byte(v1))
	if err != nil {
		t.Fatal(err)
	}
	var roles []string
	for _, r := range out.Resources {
		roles = append(roles, r.Role)
	}
	want := []string{rolePodCgroup, roleDir, roleMounts, roleTap, roleVirtiofsd, roleQemu}
	if tap, netns := out.tap(); !slices.Equal(roles, want) || tap != "tap0" || netns != "/n" || out.qemu().PID != 4 ||
		out.Process(roleVirtiofsd).PID != 3 || out.dir() != "/r/vm" || out.mounts() != "/r/mounts" || out.VM.Accelerator != "tcg" {
		t.Errorf("version 1 state read as %+v (roles %v, want %v)", out, roles, want)
	}
}

// TestStopAndTeardown: Stop stops the apps and the guest powers itself
// off (qemu exits without being killed); DestroyPod leaves no process,
// mount, socket or directory behind. Pod stats are the VM's host cost.
func TestStopAndTeardown(t *testing.T) {
	b := testBackend(t)
	vp := startVM(t, b, "", nil)
	vp.run(t, "main", "/bin/sh", "-c", "trap 'exit 0' TERM; while true; do sleep 1; done")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	ps, err := vp.pod.Stats(ctx, "")
	if err != nil || ps.MemoryUsageBytes == 0 || ps.CPUUsageNanos == 0 {
		t.Errorf("pod stats = %+v, %v: want the VM's host usage", ps, err)
	}
	cs, err := vp.pod.Stats(ctx, "main")
	if err != nil || cs.Pids == 0 {
		t.Errorf("container stats = %+v, %v", cs, err)
	}
	st, _ := parseState(vp.pod.State())
	start := time.Now()
	if err := vp.pod.Stop(ctx, 10*time.Second); err != nil {
		t.Fatalf("Stop: %v", err)
	}
	took := time.Since(start)
	if st.qemu().Alive() {
		t.Fatal("qemu still runs after Stop")
	}
	console, _ := os.ReadFile(filepath.Join(st.dir(), "console.log"))
	if !strings.Contains(string(console), "powering off") {
		t.Errorf("the guest did not power itself off; console:\n%s", console)
	}
	if took > 8*time.Second {
		t.Errorf("Stop took %v for an app that exits on SIGTERM", took)
	}
	t.Logf("Stop took %v", took)
	if err := b.DestroyPod(ctx, vp.spec, vp.pod.State()); err != nil {
		t.Fatalf("DestroyPod: %v", err)
	}
	for _, p := range []string{st.dir(), st.mounts()} {
		if _, err := os.Stat(p); !os.IsNotExist(err) {
			t.Errorf("%s left after DestroyPod (%v)", p, err)
		}
	}
	if ms, err := mountsafe.MountsUnder(vp.spec.RunDir); err != nil || len(ms) != 0 {
		t.Errorf("mounts left beneath the run dir: %v, %v", ms, err)
	}
	if err := st.cgroup().Delete(); err != nil {
		t.Errorf("pod cgroup: %v", err)
	}
	for _, d := range st.cgroup().Paths {
		if _, err := os.Stat(d); !os.IsNotExist(err) {
			t.Errorf("pod cgroup %s left", d)
		}
	}
}

// daemonEnv makes the test binary act as a daemon that starts one pod
// with a container, writes the pod's state to a file and waits to be
// killed (TestDaemonKill9).
const daemonEnv = "STAGELET_KVM_TEST_DAEMON"

type daemonArgs struct {
	Spec      stage1.PodSpec
	Assets    string
	Rootfs    string
	StateFile string
}

func daemonMain(arg string) int {
	var da daemonArgs
	if err := json.Unmarshal([]byte(arg), &da); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	b := New(slog.New(slog.NewTextHandler(os.Stderr, nil)), Config{AssetsDir: da.Assets})
	ctx := context.Background()
	persist := func(st []byte) error { return os.WriteFile(da.StateFile, st, 0o600) }
	pod, err := stage1test.Opened(b.StartPod(ctx, &da.Spec, persist))
	if err != nil {
		fmt.Fprintln(os.Stderr, "StartPod:", err)
		return 1
	}
	spec := &stage1.ContainerSpec{AppSpec: api.AppSpec{ID: "long", Name: "long", Rootfs: da.Rootfs,
		Args: []string{"/bin/sleep", "1000"}, Env: []string{"PATH=/bin"}}}
	if _, err := pod.CreateContainer(ctx, spec); err != nil {
		fmt.Fprintln(os.Stderr, "CreateContainer:", err)
		return 1
	}
	if _, err := pod.StartContainer(ctx, "long"); err != nil {
		fmt.Fprintln(os.Stderr, "StartContainer:", err)
		return 1
	}
	// A call in flight when the daemon dies.
	go pod.ExecSync(ctx, "long", []string{"sleep", "1000"}, 0)
	fmt.Println("READY")
	select {}
}

// TestDaemonKill9: the daemon that started a VM is killed with SIGKILL
// while a call is in flight; the VM keeps running and a new daemon
// recovers it over a new serial session.
func TestDaemonKill9(t *testing.T) {
	b := testBackend(t)
	seq++
	id := fmt.Sprintf("kill%d%d", os.Getpid(), seq)
	da := daemonArgs{
		Spec: stage1.PodSpec{ID: id, Name: "kill9", Namespace: "default", UID: id,
			RunDir: stage1test.ShortRunDir(t), CgroupParent: stage1test.CgroupParent(t)},
		Assets:    assetsDir,
		Rootfs:    stage1test.BusyboxRootfs(t),
		StateFile: filepath.Join(t.TempDir(), "state"),
	}
	t.Cleanup(func() {
		st, _ := os.ReadFile(da.StateFile)
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := b.DestroyPod(ctx, &da.Spec, st); err != nil {
			t.Errorf("cleanup: DestroyPod: %v", err)
		}
	})
	arg, _ := json.Marshal(da)
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), daemonEnv+"="+string(arg))
	cmd.Stderr = tWriter{t}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	line := make([]byte, 6)
	if _, err := io.ReadFull(out, line); err != nil || string(line) != "READY\n" {
		cmd.Process.Kill()
		cmd.Wait()
		t.Fatalf("daemon: %q, %v", line, err)
	}
	cmd.Process.Signal(syscall.SIGKILL)
	cmd.Wait()

	state, err := os.ReadFile(da.StateFile)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pod, err := stage1test.Opened(b.RecoverPod(ctx, &da.Spec, state))
	if err != nil {
		t.Fatalf("RecoverPod after kill -9: %v", err)
	}
	st, err := pod.ContainerStatus(ctx, "long")
	if err != nil || st.State != api.StateRunning {
		t.Fatalf("container after kill -9: %+v, %v", st, err)
	}
	res, err := pod.ExecSync(ctx, "long", []string{"echo", "back"}, 30*time.Second)
	if err != nil || string(res.Stdout) != "back\n" {
		t.Fatalf("ExecSync after kill -9: %+v, %v", res, err)
	}
}

// TestTemplateUnloadable: a template qemu cannot load fails the pod that
// tried it and is removed, and the next pod builds it again.
func TestTemplateUnloadable(t *testing.T) {
	needVM(t)
	dir := t.TempDir()
	b := New(testLogger(t), Config{AssetsDir: assetsDir, TemplateDir: dir})
	first := startVM(t, b, "", nil)
	first.run(t, "main", "/bin/sleep", "1000")
	tpl := first.pod.Details()["template"]
	if tpl == "" {
		t.Fatal("not restored from a template")
	}
	// A state file cut short, as a broken save would leave.
	if err := os.Truncate(filepath.Join(tpl, templateState), 1000); err != nil {
		t.Fatal(err)
	}
	spec := &stage1.PodSpec{ID: fmt.Sprintf("bad%d", os.Getpid()), Name: "bad", Namespace: "default", UID: "bad",
		RunDir: stage1test.ShortRunDir(t), CgroupParent: stage1test.CgroupParent(t)}
	var last []byte
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if _, err := b.StartPod(ctx, spec, func(st []byte) error { last = st; return nil }); err == nil {
		t.Fatal("StartPod restored a VM from a broken template")
	} else {
		t.Logf("StartPod: %v", err)
	}
	if err := b.DestroyPod(ctx, spec, last); err != nil {
		t.Errorf("DestroyPod: %v", err)
	}
	if _, err := os.Stat(tpl); !os.IsNotExist(err) {
		t.Errorf("the broken template %s is still there (%v)", tpl, err)
	}
	// The first pod's VM runs on, on its private mapping.
	if out, code := first.exec(t, "main", "true"); code != 0 {
		t.Errorf("the first pod after its template went: %q (exit %d)", out, code)
	}
	again := startVM(t, b, "", nil)
	if again.pod.Details()["template"] != tpl {
		t.Errorf("next pod: Details %v, want the template %s built again", again.pod.Details(), tpl)
	}
}

// A running pod's VM cannot be migrated while its guest has the 9p share
// mounted: moveBlocker says so. When qemu or the transport
// changes, this test says the refusal is to be revisited.
func TestMigrationRefusedWith9p(t *testing.T) {
	b := testBackend(t)
	vp := startVM(t, b, "", nil)
	vp.run(t, "c", "/bin/sleep", "1000")
	st, err := parseState(vp.last())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	q, err := dialQMP(ctx, filepath.Join(st.dir(), qmpSocketName), func() bool { return true })
	if err != nil {
		t.Fatal(err)
	}
	defer q.Close()
	_, err = q.run(ctx, "migrate", map[string]any{"uri": "exec:cat >/dev/null"})
	if err == nil || !strings.Contains(err.Error(), "VirtFS") {
		t.Fatalf("migrating a pod's VM: %v; want qemu's refusal naming the VirtFS share", err)
	}
	if err := vp.pod.Pod.(*Pod).moveBlocker(); err == nil {
		t.Error("moveBlocker with the share mounted: nil")
	}
	// The pod goes on running.
	if out, code := vp.exec(t, "c", "echo", "alive"); code != 0 || strings.TrimSpace(out) != "alive" {
		t.Errorf("exec after the refused migration: %q, %d", out, code)
	}
}

// The guest keeps the TSC as its clocksource: where the host's TSC is
// invariant the guest is told it is reliable, so that its watchdog does
// not drop it for a jiffies clock when the host is busy.
func TestGuestClocksource(t *testing.T) {
	b := testBackend(t)
	vp := startVM(t, b, "", nil)
	vp.run(t, "c", "/bin/sleep", "1000")
	cmdline, _ := vp.exec(t, "c", "cat", "/proc/cmdline")
	if reliable := strings.Contains(cmdline, "tsc=reliable"); reliable != hostTSC().invariant {
		t.Errorf("guest command line %q: tsc=reliable %v, host TSC invariant %v", cmdline, reliable, hostTSC().invariant)
	}
	cs, _ := vp.exec(t, "c", "cat", "/sys/devices/system/clocksource/clocksource0/current_clocksource")
	if strings.TrimSpace(cs) != "tsc" {
		t.Errorf("guest clocksource %q, want tsc", cs)
	}
}

func TestParseTSC(t *testing.T) {
	for _, tc := range []struct {
		cpuinfo string
		want    tscFacts
	}{
		{"processor\t: 0\ncpu MHz\t\t: 2299.998\nflags\t\t: fpu tsc constant_tsc nonstop_tsc rdtscp\n\nprocessor\t: 1\ncpu MHz\t\t: 1200.000\nflags\t\t: fpu\n", tscFacts{kHz: 2299998, invariant: true}},
		{"cpu MHz\t\t: 3000.000\nflags\t\t: fpu tsc constant_tsc\n", tscFacts{kHz: 3000000}},
		{"flags\t\t: nonstop_tsc constant_tsc\n", tscFacts{invariant: true}},
		{"", tscFacts{}},
	} {
		if got := parseTSC(tc.cpuinfo); got != tc.want {
			t.Errorf("parseTSC(%q) = %+v, want %+v", tc.cpuinfo, got, tc.want)
		}
	}
}
