package host

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/cgroups"
	"github.com/stagelet/stagelet/internal/testutil"
)

// In the helper mode the test binary plays a daemon that launches a
// process and exits at once.
func TestMain(m *testing.M) {
	if os.Getenv("STAGELET_TEST_LAUNCHER") != "" {
		p, err := (&PlainLauncher{}).Launch(context.Background(), LaunchSpec{
			Name: "helper", Path: "/bin/sleep", Args: []string{"1000"},
			LogPath: os.Getenv("STAGELET_TEST_LAUNCHER"),
		})
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		fmt.Printf("%d %d\n", p.PID, p.StartTime)
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func TestProcessStartTime(t *testing.T) {
	st, err := ProcessStartTime(os.Getpid())
	if err != nil || st == 0 {
		t.Fatalf("ProcessStartTime(self) = %d, %v", st, err)
	}
	p, err := NewProcess(os.Getpid())
	if err != nil || !p.Alive() {
		t.Fatalf("NewProcess(self) = %+v, %v", p, err)
	}
	reused := &Process{PID: os.Getpid(), StartTime: st + 1}
	if reused.Alive() {
		t.Error("a process with another start time is alive")
	}
	if err := reused.Signal(0); !errors.Is(err, ErrProcessGone) {
		t.Errorf("Signal to a reused PID: %v, want ErrProcessGone", err)
	}
	if _, err := ProcessStartTime(1 << 30); !errors.Is(err, ErrProcessGone) {
		t.Errorf("ProcessStartTime(no such pid) = %v", err)
	}
}

func TestLaunchDetached(t *testing.T) {
	logPath := filepath.Join(t.TempDir(), "out.log")
	p, err := (&PlainLauncher{}).Launch(context.Background(), LaunchSpec{
		Name: "t", Path: "/bin/sh", Args: []string{"-c", "echo started; echo err >&2; exec sleep 1000"},
		LogPath: logPath,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Signal(syscall.SIGKILL); p.Wait(context.Background()) })
	if !p.Alive() {
		t.Fatal("not alive after Launch")
	}
	sid, err := unix.Getsid(p.PID)
	if err != nil || sid != p.PID {
		t.Errorf("session %d (%v), want its own (%d)", sid, err, p.PID)
	}
	waitFor(t, func() bool {
		b, _ := os.ReadFile(logPath)
		return strings.Contains(string(b), "started\n") && strings.Contains(string(b), "err\n")
	})
	if err := p.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := p.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if p.Alive() {
		t.Error("alive after Wait")
	}
	if err := p.Signal(syscall.SIGKILL); !errors.Is(err, ErrProcessGone) {
		t.Errorf("Signal after exit: %v, want ErrProcessGone", err)
	}
}

// TestLaunchOutlivesLauncher: the process a daemon launched keeps running
// after the daemon exits, and a Process rebuilt from PID and start time
// (as after a restart) sees, signals and waits for it.
func TestLaunchOutlivesLauncher(t *testing.T) {
	// Orphans come to this process, which reaps the one it kills.
	if err := unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); err != nil {
		t.Skipf("cannot become a child subreaper: %v", err)
	}
	t.Cleanup(func() { unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0) })
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "STAGELET_TEST_LAUNCHER="+filepath.Join(t.TempDir(), "log"))
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("launcher: %v", err)
	}
	f := strings.Fields(string(out))
	if len(f) != 2 {
		t.Fatalf("launcher said %q", out)
	}
	pid, _ := strconv.Atoi(f[0])
	st, _ := strconv.ParseUint(f[1], 10, 64)
	p := &Process{PID: pid, StartTime: st}
	reaped := make(chan struct{})
	t.Cleanup(func() {
		p.Signal(syscall.SIGKILL)
		<-reaped
	})
	go func() {
		var ws unix.WaitStatus
		unix.Wait4(pid, &ws, 0, nil)
		close(reaped)
	}()
	if !p.Alive() {
		t.Fatal("launched process died with its launcher")
	}
	if err := p.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := p.Wait(ctx); err != nil {
		t.Fatal(err)
	}
}

// sleepInCgroup launches a sleep with the plain launcher into a cgroup
// of its own beneath the test's (name-<pid>), both gone at the test's end.
func sleepInCgroup(t *testing.T, name string) (*cgroups.Cgroup, *Process) {
	t.Helper()
	testutil.NeedRoot(t, "creates cgroups")
	self, err := cgroups.Self()
	if err != nil {
		t.Skipf("no cgroups: %v", err)
	}
	cg := self.Child(fmt.Sprintf("%s-%d", name, os.Getpid()))
	if err := cg.Create(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := cg.Kill(); err != nil {
			t.Error(err)
		}
		if err := cg.Delete(); err != nil {
			t.Error(err)
		}
	})
	p, err := (&PlainLauncher{}).Launch(context.Background(), LaunchSpec{
		Name: "t", Path: "/bin/sleep", Args: []string{"1000"},
		LogPath: filepath.Join(t.TempDir(), "log"), Cgroup: cg,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Signal(syscall.SIGKILL); p.Wait(context.Background()) })
	return cg, p
}

func TestLaunchIntoCgroup(t *testing.T) {
	cg, p := sleepInCgroup(t, "stagelet-launch-test")
	pids, err := cg.Procs()
	if err != nil {
		t.Fatal(err)
	}
	if len(pids) != 1 || pids[0] != p.PID {
		t.Errorf("cgroup holds %v, want only %d (the launcher must not be left in it)", pids, p.PID)
	}
	if err := cg.Kill(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := p.Wait(ctx); err != nil {
		t.Fatal(err)
	}
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	testutil.WaitFor(t, 10*time.Second, "the condition", testutil.Holds(cond))
}
