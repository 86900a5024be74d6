package stage1test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stagelet/stagelet/stage1/host"

	sddbus "github.com/coreos/go-systemd/v22/dbus"
	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/cgroups"
)

// DefaultSystemdTestbed is where scripts/systemd-testbed.sh builds the
// Debian tree that SystemdBed boots, unless STAGELET_TEST_SYSTEMD_ROOT
// names another.
const DefaultSystemdTestbed = "/var/tmp/stagelet-systemd-testbed"

// systemdShared is a directory bound into every booted testbed at the
// same path: each SystemdBed's Shared directory is beneath it. The tree
// holds its mount point (the container's root is read-only, so nspawn
// could not create it), made by the testbed script or by BootSystemd.
const systemdShared = "/var/tmp/stagelet-systemd-shared"

// SystemdBootTimeout bounds how long BootSystemd waits for the booted
// systemd to reach "running" (or "degraded").
var SystemdBootTimeout = 90 * time.Second

// SystemdBed is a systemd booted with `systemd-nspawn -b` on the testbed
// tree, so that the systemd launcher can be tested on a host whose PID 1 is
// not systemd. Its system bus is reached through the container's root as
// the host sees it (/proc/<leader>/root/run/dbus/system_bus_socket). Paths
// the launcher hands systemd are the container's; Shared is a host
// directory bound into the container at the same path, for files both
// sides use (logs, sockets, binaries).
type SystemdBed struct {
	Tree string
	// Leader is the container's PID 1 (its systemd), as the host sees it.
	Leader int
	// Bus is the D-Bus address of the container's system bus.
	Bus string
	// Shared is the same path on the host and in the container (beneath
	// systemdShared).
	Shared string
	// BootTime is how long the boot took, up to a running system.
	BootTime time.Duration

	dir     string
	nspawn  *exec.Cmd
	exited  chan struct{}
	cgroups *cgroups.Cgroup
	pidNS   string
}

// SystemdTestbed returns the testbed tree, or skips t saying why there is
// none: not root, no systemd-nspawn, -short, or no tree built.
func SystemdTestbed(t testing.TB) string {
	t.Helper()
	if testing.Short() {
		t.Skip("-short: not booting a systemd container")
	}
	if os.Geteuid() != 0 {
		t.Skip("booting a systemd container needs root")
	}
	if _, err := exec.LookPath("systemd-nspawn"); err != nil {
		t.Skip("systemd-nspawn is not installed (apt-get install systemd-container)")
	}
	tree := os.Getenv("STAGELET_TEST_SYSTEMD_ROOT")
	if tree == "" {
		tree = DefaultSystemdTestbed
	}
	if _, err := os.Stat(filepath.Join(tree, ".stagelet-testbed")); err != nil {
		t.Skipf("no systemd testbed at %s: build it with `make systemd-testbed` (scripts/systemd-testbed.sh; needs debootstrap and a Debian mirror), or set STAGELET_TEST_SYSTEMD_ROOT", tree)
	}
	return tree
}

// BootSystemd boots the testbed with systemd-nspawn -b (read-only root,
// private network, not registered with machined) and waits until its
// systemd runs. The container is powered off and everything is removed
// when t ends. It skips t as SystemdTestbed does.
func BootSystemd(t testing.TB) *SystemdBed {
	t.Helper()
	tree := SystemdTestbed(t)
	for _, d := range []string{systemdShared, filepath.Join(tree, systemdShared)} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	dir, err := os.MkdirTemp(systemdShared, "test-")
	if err != nil {
		t.Fatal(err)
	}
	b := &SystemdBed{Tree: tree, dir: dir, Shared: filepath.Join(dir, "shared"), exited: make(chan struct{})}
	t.Cleanup(func() { b.teardown(t) })
	if err := os.Mkdir(b.Shared, 0o755); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if err := b.start(); err != nil {
		t.Fatalf("boot %s: %v", tree, err)
	}
	if err := b.waitRunning(); err != nil {
		log, _ := os.ReadFile(filepath.Join(dir, "boot.log"))
		t.Fatalf("boot %s: %v\nsystemd-nspawn log:\n%s", tree, err, log)
	}
	b.BootTime = time.Since(start)
	return b
}

// start launches systemd-nspawn in cgroups of its own in the hierarchies
// nspawn uses (name=systemd and the hybrid or pure cgroup2), through a
// shell that joins them and execs nspawn.
func (b *SystemdBed) start() error {
	cg, err := bedCgroup("stagelet-systemd-test-" + strconv.Itoa(os.Getpid()) + "-" + filepath.Base(b.dir))
	if err != nil {
		return err
	}
	b.cgroups = cg
	if err := cg.Create(); err != nil {
		return err
	}
	logf, err := os.Create(filepath.Join(b.dir, "boot.log"))
	if err != nil {
		return err
	}
	defer logf.Close()
	const script = `while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"`
	args := []string{"-c", script, "sh"}
	for _, d := range cg.Paths {
		args = append(args, filepath.Join(d, "cgroup.procs"))
	}
	nspawn, err := exec.LookPath("systemd-nspawn")
	if err != nil {
		return err
	}
	args = append(args, "--", nspawn,
		"--quiet", "--boot",
		"--directory="+b.Tree,
		"--read-only",
		"--register=no", "--keep-unit",
		"--settings=no",
		"--machine="+b.machine(),
		"--private-network",
		"--console=pipe",
		"--link-journal=no",
		"--bind="+systemdShared,
	)
	cmd := exec.Command("/bin/sh", args...)
	cmd.Stdout = logf
	cmd.Stderr = logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return err
	}
	b.nspawn = cmd
	go func() {
		cmd.Wait()
		close(b.exited)
	}()
	return nil
}

func (b *SystemdBed) machine() string { return "stagelet-systemd-" + filepath.Base(b.dir) }

// bedCgroup is a cgroup named name beneath the caller's own in the
// name=systemd hierarchy and the cgroup2 one (hybrid or pure).
func bedCgroup(name string) (*cgroups.Cgroup, error) {
	own, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return nil, err
	}
	cg := &cgroups.Cgroup{Paths: map[string]string{}}
	var st unix.Statfs_t
	pureV2 := unix.Statfs("/sys/fs/cgroup", &st) == nil && st.Type == unix.CGROUP2_SUPER_MAGIC
	for _, line := range strings.Split(string(own), "\n") {
		f := strings.SplitN(line, ":", 3)
		if len(f) != 3 {
			continue
		}
		var mnt string
		switch {
		case f[1] == "" && pureV2:
			mnt = "/sys/fs/cgroup"
		case f[1] == "":
			mnt = "/sys/fs/cgroup/unified"
		case f[1] == "name=systemd":
			mnt = "/sys/fs/cgroup/systemd"
		default:
			continue
		}
		if _, err := os.Stat(mnt); err != nil {
			continue
		}
		cg.Paths["bed"+strconv.Itoa(len(cg.Paths))] = filepath.Join(mnt, f[2], name)
	}
	if len(cg.Paths) == 0 {
		return nil, errors.New("no name=systemd or cgroup2 hierarchy")
	}
	return cg, nil
}

// waitRunning finds the container's PID 1 and waits until its system bus
// answers and systemd's SystemState is running or degraded.
func (b *SystemdBed) waitRunning() error {
	deadline := time.Now().Add(SystemdBootTimeout)
	pid := b.nspawn.Process.Pid
	for b.Leader == 0 {
		select {
		case <-b.exited:
			return errors.New("systemd-nspawn exited")
		default:
		}
		if time.Now().After(deadline) {
			return errors.New("no container leader")
		}
		// The shell execs nspawn, whose children are first a helper and
		// then the container's PID 1: the one that is PID 1 in its own
		// PID namespace (NSpid "<host pid> 1").
		c, _ := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", pid, pid))
		for _, f := range strings.Fields(string(c)) {
			child, err := strconv.Atoi(f)
			if err != nil {
				continue
			}
			if ns := nsPIDs(child); len(ns) == 2 && ns[1] == "1" {
				b.Leader = child
			}
		}
		if b.Leader == 0 {
			time.Sleep(20 * time.Millisecond) // polling /proc: no event for a fork
		}
	}
	b.Bus = "unix:path=" + fmt.Sprintf("/proc/%d/root/run/dbus/system_bus_socket", b.Leader)
	ns, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/pid", b.Leader))
	if err != nil {
		return err
	}
	b.pidNS = ns
	var last error
	for {
		select {
		case <-b.exited:
			return fmt.Errorf("systemd-nspawn exited (last: %v)", last)
		default:
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("systemd did not reach running: %v", last)
		}
		state, err := b.systemState()
		if err == nil && (state == "running" || state == "degraded") {
			return nil
		}
		if err == nil {
			err = fmt.Errorf("system state %q", state)
		}
		last = err
		time.Sleep(50 * time.Millisecond) // polling: the bus appears during boot
	}
}

func (b *SystemdBed) systemState() (string, error) {
	c, err := b.Conn()
	if err != nil {
		return "", err
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	p, err := c.SystemStateContext(ctx)
	if err != nil {
		return "", err
	}
	s, _ := p.Value.Value().(string)
	return s, nil
}

// Conn opens a go-systemd connection to the container's systemd; the
// caller closes it.
func (b *SystemdBed) Conn() (*sddbus.Conn, error) {
	return sddbus.NewConnection(host.DialBus(b.Bus))
}

// Launcher returns a SystemdLauncher talking to the container's systemd,
// with PIDs mapped to the host's.
func (b *SystemdBed) Launcher(log *slog.Logger) *host.SystemdLauncher {
	return &host.SystemdLauncher{Log: log, Dial: host.DialBus(b.Bus), HostPID: b.HostPID}
}

// HostPID maps a PID of the container's PID namespace to the host's: the
// process in that namespace whose NSpid ends with pid.
func (b *SystemdBed) HostPID(pid int) (int, error) {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return 0, err
	}
	want := strconv.Itoa(pid)
	for _, e := range ents {
		hp, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if ns, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/pid", hp)); err != nil || ns != b.pidNS {
			continue
		}
		if f := nsPIDs(hp); len(f) > 0 && f[len(f)-1] == want {
			return hp, nil
		}
	}
	return 0, fmt.Errorf("pid %d of the container: no such process: %w", pid, host.ErrProcessGone)
}

// nsPIDs is the NSpid line of /proc/PID/status.
func nsPIDs(pid int) []string {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return nil
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), "NSpid:"); ok {
			return strings.Fields(rest)
		}
	}
	return nil
}

// teardown powers the container off through its bus, waits for
// systemd-nspawn to exit, kills (by PID) what it started if it does not,
// and removes the cgroups and directories.
func (b *SystemdBed) teardown(t testing.TB) {
	if b.nspawn != nil {
		start := time.Now()
		if b.Bus != "" {
			if c, err := b.Conn(); err == nil {
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				_, err = c.StartUnitContext(ctx, "poweroff.target", "replace-irreversibly", nil)
				cancel()
				c.Close()
				if err != nil {
					t.Logf("systemd testbed: poweroff: %v", err)
				}
			}
		}
		select {
		case <-b.exited:
			t.Logf("systemd testbed: powered off in %v", time.Since(start).Round(time.Millisecond))
		case <-time.After(30 * time.Second):
			t.Errorf("systemd testbed: no poweroff after 30s; killing systemd-nspawn (pid %d) and the container", b.nspawn.Process.Pid)
			_ = b.nspawn.Process.Kill()
			if b.Leader != 0 {
				_ = unix.Kill(b.Leader, unix.SIGKILL)
			}
			<-b.exited
		}
	}
	// Left behind by a killed systemd-nspawn.
	_ = os.Remove(filepath.Join("/run/systemd/nspawn/propagate", b.machine()))
	if b.cgroups != nil {
		if err := b.cgroups.Kill(); err != nil {
			t.Errorf("systemd testbed: %v", err)
		}
		if err := b.cgroups.Delete(); err != nil {
			t.Errorf("systemd testbed: %v", err)
		}
	}
	if err := os.RemoveAll(b.dir); err != nil {
		t.Errorf("systemd testbed: %v", err)
	}
}
