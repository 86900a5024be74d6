package host_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	sddbus "github.com/coreos/go-systemd/v22/dbus"

	"github.com/stagelet/stagelet/cgroups"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/stage1/host"
	"github.com/stagelet/stagelet/stage1/stage1test"
)

func testLog(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(tWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

type tWriter struct{ t *testing.T }

func (w tWriter) Write(b []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(b)))
	return len(b), nil
}

// unitProps reads the properties of unit (Unit and Service interfaces);
// a unit systemd does not know has LoadState "not-found".
func unitProps(t *testing.T, c *sddbus.Conn, unit string) map[string]any {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	u, err := c.GetUnitPropertiesContext(ctx, unit)
	if err != nil {
		t.Fatalf("properties of %s: %v", unit, err)
	}
	if u["LoadState"] == "not-found" {
		return u
	}
	s, err := c.GetUnitTypePropertiesContext(ctx, unit, "Service")
	if err != nil {
		t.Fatalf("service properties of %s: %v", unit, err)
	}
	for k, v := range s {
		u[k] = v
	}
	return u
}

// waitGone waits until systemd no longer knows unit (stopped and
// collected).
func waitGone(t *testing.T, c *sddbus.Conn, unit string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		p := unitProps(t, c, unit)
		if p["LoadState"] == "not-found" {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("unit %s still loaded: %v/%v", unit, p["ActiveState"], p["SubState"])
		}
		time.Sleep(20 * time.Millisecond) // polling the unit's state
	}
}

func waitExit(t *testing.T, p *host.Process) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := p.Wait(ctx); err != nil {
		t.Fatalf("pid %d still runs: %v", p.PID, err)
	}
}

// TestSystemdLauncher runs the systemd launcher against a real systemd: one
// booted with systemd-nspawn -b on the testbed tree (make systemd-testbed).
// The units run inside that container, so their paths are the container's
// (its /bin/sleep), and the PIDs systemd reports are mapped to the host's.
func TestSystemdLauncher(t *testing.T) {
	bed := stage1test.BootSystemd(t)
	t.Logf("systemd booted in %v (leader pid %d)", bed.BootTime.Round(time.Millisecond), bed.Leader)
	ctx := context.Background()
	c, err := bed.Conn()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if v, err := c.GetManagerProperty("Version"); err == nil {
		t.Logf("container systemd %s", v)
	}

	l := bed.Launcher(testLog(t))
	defer l.Close()
	if err := l.Ping(ctx); err != nil {
		t.Fatal(err)
	}

	const name = "stagelet-test-sleep"
	unit := host.UnitName(name)
	logPath := filepath.Join(bed.Shared, "logs", "sleep.log")
	start := time.Now()
	p, err := l.Launch(ctx, host.LaunchSpec{
		Name:    name,
		Path:    "/bin/sh",
		Args:    []string{"-c", `echo "hello $GREETING from $(pwd)"; echo oops >&2; exec /bin/sleep 1000`},
		Env:     []string{"GREETING=world", "PATH=/usr/bin:/bin"},
		Dir:     "/tmp",
		LogPath: logPath,
		Cgroup:  &cgroups.Cgroup{}, // ask for the unit's cgroup
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("launched %s in %v: host pid %d", unit, time.Since(start).Round(time.Millisecond), p.PID)
	defer l.Release(ctx, name)

	if p.Unit != unit {
		t.Errorf("Unit = %q, want %q", p.Unit, unit)
	}
	if !p.Alive() {
		t.Fatalf("pid %d is not alive", p.PID)
	}
	// The shell execs sleep: same PID, so the unit's main process is it.
	deadline := time.Now().Add(5 * time.Second)
	for {
		cmdline, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", p.PID))
		if string(cmdline) == "/bin/sleep\x001000\x00" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("host pid %d runs %q, want /bin/sleep 1000", p.PID, cmdline)
		}
		time.Sleep(10 * time.Millisecond) // until the shell has exec'ed
	}

	props := unitProps(t, c, unit)
	for k, want := range map[string]any{
		"ActiveState":  "active",
		"SubState":     "running",
		"Slice":        cgroups.DefaultSlice,
		"Delegate":     true,
		"KillMode":     "mixed",
		"CollectMode":  "inactive-or-failed",
		"Type":         "exec",
		"ControlGroup": "/" + cgroups.DefaultSlice + "/" + unit,
	} {
		if got := props[k]; got != want {
			t.Errorf("%s = %v, want %v", k, got, want)
		}
	}
	mainPID, _ := props["MainPID"].(uint32)
	if hp, err := bed.HostPID(int(mainPID)); err != nil || hp != p.PID {
		t.Errorf("MainPID %d maps to host pid %d (%v), want %d", mainPID, hp, err, p.PID)
	}
	// Within the container the controllers are read-only, so systemd
	// places units in name=systemd (and cgroup2) only: none this project
	// manages, and no cgroup is returned. Where one is, it is the unit's.
	if p.Cgroup != nil {
		for k, d := range p.Cgroup.Paths {
			if !strings.HasSuffix(d, "/"+unit) {
				t.Errorf("cgroup %s: %s is not the unit's", k, d)
			}
		}
	}
	t.Logf("unit cgroup as the daemon sees it: %v", p.Cgroup)

	// Output and environment.
	deadline = time.Now().Add(5 * time.Second)
	for {
		b, _ := os.ReadFile(logPath)
		if strings.Contains(string(b), "hello world from /tmp\n") && strings.Contains(string(b), "oops\n") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("log %s: %q", logPath, b)
		}
		time.Sleep(10 * time.Millisecond)
	}

	// A unit name is taken once.
	if _, err := l.Launch(ctx, host.LaunchSpec{Name: name, Path: "/bin/true", LogPath: logPath}); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Errorf("second launch of %s: %v, want AlreadyExists", name, err)
	}

	// The unit outlives the launcher's connection (the daemon's death).
	l.Close()
	l2 := bed.Launcher(testLog(t))
	defer l2.Close()
	if !p.Alive() {
		t.Fatal("process died with the launcher's connection")
	}

	// Release: everything in the unit is killed, systemd forgets it.
	start = time.Now()
	if err := l2.Release(ctx, name); err != nil {
		t.Fatal(err)
	}
	waitExit(t, p)
	waitGone(t, c, unit)
	t.Logf("released %s in %v", unit, time.Since(start).Round(time.Millisecond))
	if err := l2.Release(ctx, name); err != nil {
		t.Errorf("second release: %v", err)
	}
}

// TestSystemdLauncherStopAndFailures: a unit stopped through systemd
// (SIGTERM to the main process, KillMode=mixed) is collected; a launch whose
// binary cannot be executed fails and leaves no unit; ExtraFiles and a name
// that is not a unit name are refused.
func TestSystemdLauncherStopAndFailures(t *testing.T) {
	bed := stage1test.BootSystemd(t)
	ctx := context.Background()
	c, err := bed.Conn()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	l := bed.Launcher(testLog(t))
	defer l.Close()
	logPath := filepath.Join(bed.Shared, "stop.log")

	p, err := l.Launch(ctx, host.LaunchSpec{Name: "stagelet-test-stop", Path: "/bin/sleep", Args: []string{"1000"}, LogPath: logPath})
	if err != nil {
		t.Fatal(err)
	}
	if p.Cgroup != nil {
		t.Errorf("Cgroup = %v without LaunchSpec.Cgroup, want nil", p.Cgroup)
	}
	done := make(chan string, 1)
	if _, err := c.StopUnitContext(ctx, "stagelet-test-stop.service", "replace", done); err != nil {
		t.Fatal(err)
	}
	if res := <-done; res != "done" {
		t.Errorf("stop job: %s", res)
	}
	waitExit(t, p)
	waitGone(t, c, "stagelet-test-stop.service")
	if err := l.Release(ctx, "stagelet-test-stop"); err != nil {
		t.Errorf("release of a stopped unit: %v", err)
	}

	// A process that dies on its own: the unit is collected too.
	p, err = l.Launch(ctx, host.LaunchSpec{Name: "stagelet-test-crash", Path: "/bin/sleep", Args: []string{"1000"}, LogPath: logPath})
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	waitExit(t, p)
	waitGone(t, c, "stagelet-test-crash.service")

	_, err = l.Launch(ctx, host.LaunchSpec{Name: "stagelet-test-missing", Path: "/nonexistent", LogPath: logPath})
	if err == nil {
		t.Fatal("launch of a missing binary succeeded")
	}
	t.Logf("missing binary: %v", err)
	waitGone(t, c, "stagelet-test-missing.service")

	if _, err := l.Launch(ctx, host.LaunchSpec{Name: "bad/name", Path: "/bin/true", LogPath: logPath}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("bad name: %v, want InvalidArgument", err)
	}
	if _, err := l.Launch(ctx, host.LaunchSpec{Name: "stagelet-test-files", Path: "/bin/true", LogPath: logPath, ExtraFiles: []*os.File{os.Stdin}}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("extra files: %v, want InvalidArgument", err)
	}
}

// TestSystemdCollectUnits: under the systemd driver, the units of a pod
// no record names (its own, and one of its other processes) are released;
// a recorded pod's unit, a unit not named after a pod and another daemon's
// pod's unit stay.
func TestSystemdCollectUnits(t *testing.T) {
	bed := stage1test.BootSystemd(t)
	ctx := context.Background()
	c, err := bed.Conn()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	l := bed.Launcher(testLog(t))
	defer l.Close()
	l.Owner = "/var/lib/stagelet-a"
	other := bed.Launcher(testLog(t)) // another daemon's, on the same systemd
	defer other.Close()
	other.Owner = "/var/lib/stagelet-b"
	lost, kept, others := strings.Repeat("a", 64), strings.Repeat("b", 64), strings.Repeat("c", 64)
	names := []string{host.LaunchName(lost), host.LaunchName(lost) + "-virtiofsd", host.LaunchName(kept), "stagelet-test-other", host.LaunchName(others)}
	procs := map[string]*host.Process{}
	for _, n := range names {
		by := l
		if n == host.LaunchName(others) {
			by = other
		}
		p, err := by.Launch(ctx, host.LaunchSpec{Name: n, Path: "/bin/sleep", Args: []string{"1000"}, LogPath: filepath.Join(bed.Shared, n+".log")})
		if err != nil {
			t.Fatal(err)
		}
		procs[n] = p
		defer l.Release(ctx, n)
	}
	got, err := host.CollectUnits(ctx, l, func(id string) bool { return id == kept })
	if err != nil || fmt.Sprint(got) != fmt.Sprint([]string{lost}) {
		t.Fatalf("CollectUnits = %v, %v; want [%s]", got, err, lost)
	}
	for _, n := range names[:2] {
		waitExit(t, procs[n])
		waitGone(t, c, host.UnitName(n))
	}
	for _, n := range names[2:] {
		if p := unitProps(t, c, host.UnitName(n)); p["ActiveState"] != "active" {
			t.Errorf("%s: %v, want it left running", n, p["ActiveState"])
		}
	}
	// Without a unit launcher there is nothing to collect.
	if got, err := host.CollectUnits(ctx, &host.PlainLauncher{}, func(string) bool { return false }); err != nil || got != nil {
		t.Errorf("plain launcher: %v, %v", got, err)
	}
}

// TestSystemdLauncherLimits: a launch's memory cap and CPU weight are its
// unit's MemoryMax and CPUWeight, in the slice it names; LimitSlice caps
// a slice's units together, and lifts the cap again.
func TestSystemdLauncherLimits(t *testing.T) {
	bed := stage1test.BootSystemd(t)
	ctx := context.Background()
	c, err := bed.Conn()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	l := bed.Launcher(testLog(t))
	defer l.Close()
	const slice = "stagelet-limits.slice"
	if err := l.LimitSlice(ctx, slice, 512<<20); err != nil {
		t.Fatal(err)
	}
	const name = "stagelet-test-limits"
	p, err := l.Launch(ctx, host.LaunchSpec{Name: name, Path: "/bin/sleep", Args: []string{"1000"}, LogPath: filepath.Join(bed.Shared, "limits.log"),
		Slice: slice, MemoryMax: 256 << 20, CPUShares: 2048})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release(ctx, name)
	props := unitProps(t, c, host.UnitName(name))
	for k, want := range map[string]any{"Slice": slice, "MemoryMax": uint64(256 << 20), "CPUWeight": uint64(cgroups.SharesToWeight(2048))} {
		if got := props[k]; got != want {
			t.Errorf("%s = %v, want %v", k, got, want)
		}
	}
	sliceMax := func() any {
		t.Helper()
		v, err := c.GetUnitTypePropertyContext(ctx, slice, "Slice", "MemoryMax")
		if err != nil {
			t.Fatal(err)
		}
		return v.Value.Value()
	}
	if got := sliceMax(); got != uint64(512<<20) {
		t.Errorf("the slice's MemoryMax = %v, want %d", got, 512<<20)
	}
	if err := l.LimitSlice(ctx, slice, 0); err != nil {
		t.Fatal(err)
	}
	if got := sliceMax(); got != uint64(1<<64-1) {
		t.Errorf("the slice's MemoryMax after lifting it = %v, want infinity", got)
	}
	if err := l.LimitSlice(ctx, "not-a-slice", 1); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("LimitSlice of a unit that is no slice: %v", err)
	}
	if err := l.Release(ctx, name); err != nil {
		t.Fatal(err)
	}
	waitExit(t, p)
}
