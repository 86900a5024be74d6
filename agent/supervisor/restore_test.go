package supervisor_test

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/testutil"
)

// A restore as the daemon does it, with an orphan the agent inherits
// standing in for the process criu restores: OpRestore gives pipes the
// restorer opens through /proc, OpAdopt makes the process the app's, its
// output in the app's log and its exit the app's; a process that exited
// before its adoption still gives its status, and a restore that failed
// or names a stranger exits the app with why.
func TestRestoreAdopt(t *testing.T) {
	ta := startAgent(t)
	rootfs := makeRootfs(t)
	logs := t.TempDir()
	// orphan leaves a sleep to the agent (a child subreaper) and returns
	// its PID.
	donors := 0
	orphan := func() int {
		t.Helper()
		donors++
		id := fmt.Sprintf("donor%d", donors)
		file := filepath.Join(rootfs, "tmp", id)
		ta.run(&api.AppSpec{ID: id, Rootfs: rootfs, Args: sh(`(sleep 1000 </dev/null >/dev/null 2>&1 & echo $! > /tmp/` + id + `); exec sleep 1000`)})
		var pid int
		testutil.WaitFor(t, 10*time.Second, "the orphan's pid", func() (bool, string) {
			b, err := os.ReadFile(file)
			if err != nil || !strings.HasSuffix(string(b), "\n") {
				return false, fmt.Sprint(err)
			}
			pid, err = strconv.Atoi(strings.TrimSpace(string(b)))
			return err == nil, fmt.Sprint(err)
		})
		testutil.WaitFor(t, 10*time.Second, "the orphan to be the agent's", func() (bool, string) {
			b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
			want := fmt.Sprintf("\nPPid:\t%d\n", ta.cmd.Process.Pid)
			return strings.Contains(string(b), want), fmt.Sprint(err)
		})
		return pid
	}
	create := func(id string) {
		t.Helper()
		if _, err := ta.c.Create(ctx(t), &api.AppSpec{ID: id, Rootfs: rootfs, Args: []string{"true"}, LogPath: filepath.Join(logs, id+".log")}); err != nil {
			t.Fatal(err)
		}
	}
	prepare := func(id string) *api.RestoreIO {
		t.Helper()
		r, err := ta.c.Call(ctx(t), &api.Request{Op: api.OpRestore, ID: id})
		if err != nil || r.Restore == nil {
			t.Fatalf("restore %s: %+v %v", id, r, err)
		}
		return r.Restore
	}
	adopt := func(id string, pid int, why string) (*api.AppStatus, error) {
		r, err := ta.c.Call(ctx(t), &api.Request{Op: api.OpAdopt, ID: id, PID: pid, Message: why})
		if r == nil {
			return nil, err
		}
		return r.App, err
	}

	create("r")
	rio := prepare("r")
	if rio.PID != ta.cmd.Process.Pid {
		t.Errorf("restore names the agent %d, want %d", rio.PID, ta.cmd.Process.Pid)
	}
	if _, err := ta.c.Start(ctx(t), "r"); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Errorf("start during the restore: %v", err)
	}
	// The restorer's end of the app's stdout, as the daemon opens it.
	out, err := os.OpenFile(fmt.Sprintf("/proc/%d/fd/%d", rio.PID, rio.Stdout), os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintln(out, "hello from the restored process")
	out.Close()
	pid := orphan()
	st, err := adopt("r", pid, "")
	if err != nil || st.State != api.StateRunning || st.PID != pid {
		t.Fatalf("adopt: %+v %v", st, err)
	}
	if err := syscall.Kill(pid, syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if st := ta.waitExited("r"); st.ExitCode != 128+int32(syscall.SIGTERM) {
		t.Errorf("adopted process killed: %+v", st)
	}
	if b, _ := os.ReadFile(filepath.Join(logs, "r.log")); !strings.Contains(string(b), "stdout F hello from the restored process") {
		t.Errorf("log: %q", b)
	}

	// Exited before its adoption: its status is kept for it.
	create("early")
	prepare("early")
	pid = orphan()
	syscall.Kill(pid, syscall.SIGKILL)
	testutil.WaitFor(t, 10*time.Second, "the orphan reaped", func() (bool, string) {
		_, err := os.Stat(fmt.Sprintf("/proc/%d", pid))
		return errors.Is(err, os.ErrNotExist), fmt.Sprint(err)
	})
	if _, err := adopt("early", pid, ""); err != nil {
		t.Fatalf("adopt an exited process: %v", err)
	}
	if st := ta.waitExited("early"); st.ExitCode != 128+int32(syscall.SIGKILL) {
		t.Errorf("adopted after its exit: %+v", st)
	}

	// A failed restore, and a process that is not the agent's.
	create("failed")
	prepare("failed")
	if st, err := adopt("failed", 0, "criu said no"); err != nil || st.State != api.StateExited || st.ExitCode != 128 || !strings.Contains(st.Message, "criu said no") {
		t.Errorf("failed restore: %+v %v", st, err)
	}
	if _, err := adopt("failed", 0, "again"); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Errorf("adopt with no restore under way: %v", err)
	}
	create("stranger")
	prepare("stranger")
	if _, err := adopt("stranger", os.Getpid(), ""); !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "not the agent's child") {
		t.Errorf("adopt a stranger: %v", err)
	}
	if st := ta.waitExited("stranger"); st.ExitCode != 128 {
		t.Errorf("after adopting a stranger: %+v", st)
	}

	// A restorer the agent runs (OpRestoreRun): the app's output pipes
	// and the agent's network namespace as fds 3 to 5, the app's cgroup,
	// and what it leaves behind re-parented to the agent, to adopt.
	create("run")
	prepare("run")
	dir := t.TempDir()
	script := `echo restored by the agent child >&3; readlink /proc/self/fd/5 > ` + dir + `/netns; cat /proc/self/cgroup > ` + dir + `/cgroup; ` +
		`sleep 1000 </dev/null >/dev/null 2>&1 & echo $! > ` + dir + `/pid`
	if _, err := ta.c.Call(ctx(t), &api.Request{Op: api.OpRestoreRun, ID: "run", Cmd: []string{"/bin/sh", "-c", script}}); err != nil {
		t.Fatalf("restorer: %v", err)
	}
	if b, _ := os.ReadFile(filepath.Join(dir, "netns")); !strings.HasPrefix(string(b), "net:[") {
		t.Errorf("the restorer's fd 5: %q", b)
	}
	if b, _ := os.ReadFile(filepath.Join(dir, "cgroup")); !strings.Contains(string(b), api.AppCgroup("run")) {
		t.Errorf("the restorer ran in cgroup %q", b)
	}
	b, _ := os.ReadFile(filepath.Join(dir, "pid"))
	pid, _ = strconv.Atoi(strings.TrimSpace(string(b)))
	if st, err := adopt("run", pid, ""); err != nil || st.State != api.StateRunning {
		t.Fatalf("adopt what the restorer left: %+v %v", st, err)
	}
	if _, err := ta.c.Stop(ctx(t), "run", time.Second); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(filepath.Join(logs, "run.log")); !strings.Contains(string(b), "stdout F restored by the agent child") {
		t.Errorf("log: %q", b)
	}
	create("broken")
	prepare("broken")
	_, err = ta.c.Call(ctx(t), &api.Request{Op: api.OpRestoreRun, ID: "broken", Cmd: []string{"/bin/sh", "-c", "echo criu said no; exit 3"}})
	if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "criu said no") || !strings.Contains(err.Error(), "exited with 3") {
		t.Errorf("a failing restorer: %v", err)
	}

	// A terminal's app is not restored; a removed restore ends.
	if _, err := ta.c.Create(ctx(t), &api.AppSpec{ID: "tty", Rootfs: rootfs, Args: []string{"true"}, TTY: true}); err != nil {
		t.Fatal(err)
	}
	if _, err := ta.c.Call(ctx(t), &api.Request{Op: api.OpRestore, ID: "tty"}); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Errorf("restore of an app with a terminal: %v", err)
	}
	create("gone")
	prepare("gone")
	if err := ta.c.Remove(ctx(t), "gone"); err != nil {
		t.Errorf("remove during a restore: %v", err)
	}
}
