package fly

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stagelet/stagelet/stage1/host"

	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/internal/mountsafe"
	"github.com/stagelet/stagelet/internal/testutil"
	"github.com/stagelet/stagelet/network"
	"github.com/stagelet/stagelet/stage1"
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
		dir, err := os.MkdirTemp("", "stagelet-fly-test")
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

func needRoot(t *testing.T) {
	t.Helper()
	testutil.NeedRoot(t, "runs real agents: cgroups, pivot_root")
	if buildErr != nil {
		t.Fatal(buildErr)
	}
}

func testLogger(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(tWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

type tWriter struct{ t *testing.T }

func (w tWriter) Write(b []byte) (int, error) {
	w.t.Helper()
	w.t.Log(string(b))
	return len(b), nil
}

func TestConformance(t *testing.T) {
	needRoot(t)
	stage1test.Run(t, New(testLogger(t)), stage1test.Env{
		AgentBinary:  agentBinary,
		Rootfs:       stage1test.BusyboxRootfs,
		CgroupParent: stage1test.CgroupParent,
		RunDir:       stage1test.ShortRunDir,
		KillPod:      killAgent,
	})
}

// killAgent kills the recorded agent process and waits until it is dead.
func killAgent(t *testing.T, b []byte) {
	t.Helper()
	st, err := parseState(b)
	if err != nil {
		t.Fatal(err)
	}
	if st.agent() == nil {
		t.Fatal("no agent in state")
	}
	if err := st.agent().Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := st.agent().Wait(ctx); err != nil {
		t.Fatal(err)
	}
}

func TestCapabilities(t *testing.T) {
	c := New(nil).Capabilities()
	want := stage1.Capabilities{Isolation: stage1.IsolationHost, HostNetwork: true, PodNetwork: true, HostPID: true, HostIPC: true, Privileged: "host"}
	if len(c.Options) != 0 {
		t.Errorf("Options = %+v: it reads none", c.Options)
	}
	if c.Options = nil; !reflect.DeepEqual(c, want) {
		t.Errorf("Capabilities = %+v, want %+v", c, want)
	}
}

func TestParseState(t *testing.T) {
	if st, err := parseState(nil); err != nil || st.agent() != nil || st.cgroup() != nil {
		t.Errorf("empty state = %+v, %v", st, err)
	}
	if _, err := parseState([]byte(`{"version":99}`)); err == nil {
		t.Error("unknown version accepted")
	}
	if _, err := parseState([]byte(`{`)); err == nil {
		t.Error("garbage accepted")
	}
	in := &state{Version: stateVersion}
	in.Record(host.Resource{Kind: host.KindFile, Role: roleSocket, Path: "/run/x/agent.sock"})
	in.Record(host.Resource{Kind: host.KindProcess, Role: roleAgent, Process: &host.Process{PID: 42, StartTime: 7}})
	out, err := parseState(in.marshal())
	if err != nil || out.socket() != in.socket() || out.agent().PID != 42 || out.agent().StartTime != 7 {
		t.Errorf("round trip = %+v, %v", out, err)
	}
	// A version 1 state (a field each) is read into the ledger, in the
	// order its resources were taken.
	v1 := `{"version":1,"cgroup":{"paths":{"memory":"/sys/fs/cgroup/memory/p"}},"socket":"/run/x/agent.sock","agent":{"pid":42,"startTime":7}}`
	out, err = parseState([]byte(v1))
	if err != nil {
		t.Fatal(err)
	}
	var roles []string
	for _, r := range out.Resources {
		roles = append(roles, r.Role)
	}
	if strings.Join(roles, ",") != rolePodCgroup+","+roleSocket+","+roleAgent ||
		out.cgroup().Paths["memory"] != "/sys/fs/cgroup/memory/p" || out.socket() != "/run/x/agent.sock" || out.agent().PID != 42 {
		t.Errorf("version 1 state read as %+v (roles %v)", out, roles)
	}
}

func TestStartPodRejectsNetNSWithHostNetwork(t *testing.T) {
	_, err := New(nil).StartPod(context.Background(), &stage1.PodSpec{
		ID: "p", RunDir: t.TempDir(), AgentBinary: "/bin/true", HostNetwork: true, NetNSPath: "/run/netns/x",
	}, func([]byte) error { return nil })
	if err == nil {
		t.Fatal("accepted a network namespace for a pod in the host network")
	}
}

// TestPodNetNS: with a pod network namespace, the agent and its apps run
// in it, not in the host's.
func TestPodNetNS(t *testing.T) {
	needRoot(t)
	netRun := stage1test.ShortRunDir(t)
	nets, err := network.New(network.Config{ConfDir: t.TempDir(), RunDir: netRun}, testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	// The netns directory is a shared bind of itself while pods may use
	// it (as /run/netns is); the test owns it and releases it.
	t.Cleanup(func() { mountsafe.UnmountAll(filepath.Join(netRun, "netns")) })
	nsPath, err := nets.NewNetNS(context.Background(), "flyns")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { nets.RemoveNetNS(context.Background(), nsPath) })
	var want unix.Stat_t
	if err := unix.Stat(nsPath, &want); err != nil {
		t.Fatal(err)
	}
	spec := &stage1.PodSpec{
		ID: "flyns", RunDir: stage1test.ShortRunDir(t), CgroupParent: stage1test.CgroupParent(t),
		NetNSPath: nsPath, AgentBinary: agentBinary,
	}
	var last []byte
	b := New(testLogger(t))
	t.Cleanup(func() {
		if err := b.DestroyPod(context.Background(), spec, last); err != nil {
			t.Error(err)
		}
	})
	ctx := context.Background()
	pod, err := stage1test.Opened(b.StartPod(ctx, spec, func(s []byte) error { last = s; return nil }))
	if err != nil {
		t.Fatal(err)
	}
	rootfs := stage1test.BusyboxRootfs(t)
	app := &stage1.ContainerSpec{AppSpec: api.AppSpec{ID: "a", Name: "a", Rootfs: rootfs, Args: []string{"sleep", "1000"},
		Env: []string{"PATH=/bin"}, Capabilities: []string{"CAP_KILL"}}}
	if _, err := pod.CreateContainer(ctx, app); err != nil {
		t.Fatal(err)
	}
	if _, err := pod.StartContainer(ctx, "a"); err != nil {
		t.Fatal(err)
	}
	res, err := pod.ExecSync(ctx, "a", []string{"readlink", "/proc/self/ns/net"}, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if got, wantLink := strings.TrimSpace(string(res.Stdout)), fmt.Sprintf("net:[%d]", want.Ino); got != wantLink {
		t.Fatalf("app's netns %q, want the pod's %q", got, wantLink)
	}
	if err := pod.Stop(ctx, time.Second); err != nil {
		t.Fatal(err)
	}
}

// TestStartPodAgentFails: an agent that exits at once is reported, and
// everything taken is released.
func TestStartPodAgentFails(t *testing.T) {
	needRoot(t)
	parent := stage1test.CgroupParent(t)
	spec := &stage1.PodSpec{
		ID: "failing", RunDir: stage1test.ShortRunDir(t), CgroupParent: parent,
		HostNetwork: true, AgentBinary: "/bin/false",
	}
	var last []byte
	_, err := New(testLogger(t)).StartPod(context.Background(), spec, func(b []byte) error { last = b; return nil })
	if err == nil {
		t.Fatal("StartPod with a failing agent succeeded")
	}
	st, perr := parseState(last)
	if perr != nil || st.cgroup() == nil || st.agent() == nil {
		t.Fatalf("persisted state %s (%v) does not record cgroup and agent", last, perr)
	}
	for _, d := range st.cgroup().Paths {
		if _, err := os.Stat(d); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("pod cgroup %s left behind: %v", d, err)
		}
	}
}

// TestAgentInPodCgroup: the agent runs in the recorded pod cgroup, which
// holds nothing else of the test's.
func TestAgentInPodCgroup(t *testing.T) {
	needRoot(t)
	spec := &stage1.PodSpec{
		ID: "incg", RunDir: stage1test.ShortRunDir(t), CgroupParent: stage1test.CgroupParent(t),
		HostNetwork: true, AgentBinary: agentBinary,
	}
	var last []byte
	b := New(testLogger(t))
	t.Cleanup(func() {
		if err := b.DestroyPod(context.Background(), spec, last); err != nil {
			t.Error(err)
		}
	})
	pod, err := stage1test.Opened(b.StartPod(context.Background(), spec, func(s []byte) error { last = s; return nil }))
	if err != nil {
		t.Fatal(err)
	}
	st, err := parseState(pod.State())
	if err != nil {
		t.Fatal(err)
	}
	pids, err := st.cgroup().Procs()
	if err != nil {
		t.Fatal(err)
	}
	if len(pids) != 1 || pids[0] != st.agent().PID {
		t.Errorf("pod cgroup holds %v, want the agent %d alone", pids, st.agent().PID)
	}
	info, err := pod.Info(context.Background())
	if err != nil || info.PID != st.agent().PID {
		t.Errorf("Info = %+v, %v; agent pid %d", info, err, st.agent().PID)
	}
}
