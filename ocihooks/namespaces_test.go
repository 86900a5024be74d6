package ocihooks

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/testutil"
)

// container starts, with unshare(1), a process in new mount, UTS and PID
// namespaces (its own /proc) that stands for a container's init: hostname
// "ocihooks-ctr", a tmpfs on dir/m, dir/shadowed replaced by dir/image's
// file. It returns the init's pid as the runtime sees it; the cleanup
// kills it by that pid.
func container(t *testing.T, dir string) int {
	t.Helper()
	testutil.NeedRoot(t, "creates namespaces and mounts in them")
	unshare, err := exec.LookPath("unshare")
	if err != nil {
		t.Skipf("needs unshare (util-linux): %v", err)
	}
	if err := os.Mkdir(filepath.Join(dir, "m"), 0o755); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"image", "shadowed"} {
		if _, err := os.Stat(filepath.Join(dir, f)); os.IsNotExist(err) {
			script(t, dir, f, "exit 0")
		}
	}
	setup := `hostname ocihooks-ctr && mount -t tmpfs none ` + dir + `/m && mount --bind ` + dir + `/image ` + dir + `/shadowed && exec sleep 600`
	cmd := exec.Command(unshare, "--mount", "--uts", "--pid", "--fork", "--kill-child", "--mount-proc", "/bin/sh", "-c", setup)
	var stderr tail
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var init int
	t.Cleanup(func() {
		if init > 0 {
			_ = killPid(init)
		}
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	testutil.WaitFor(t, 10*time.Second, "the container's init to run sleep", func() (bool, string) {
		b, _ := os.ReadFile("/proc/" + strconv.Itoa(cmd.Process.Pid) + "/task/" + strconv.Itoa(cmd.Process.Pid) + "/children")
		init, _ = strconv.Atoi(strings.TrimSpace(string(b)))
		comm, _ := os.ReadFile("/proc/" + strconv.Itoa(init) + "/comm")
		return init > 0 && string(comm) == "sleep\n", string(comm) + stderr.String()
	})
	return init
}

func killPid(pid int) error {
	p, err := os.FindProcess(pid)
	if err != nil {
		return err
	}
	return p.Kill()
}

func TestRunInNamespaces(t *testing.T) {
	dir := t.TempDir()
	out := filepath.Join(dir, "out")
	hook := script(t, dir, "hook", `echo $$ > `+out+`.pid
cat /proc/sys/kernel/hostname > `+out+`.hostname
stat -f -c %T `+dir+`/m > `+out+`.fs
pwd > `+out+`.pwd
cat > `+out+`.stdin`)
	script(t, dir, "shadowed", `echo ran > `+out+`.shadowed`)
	script(t, dir, "image", `echo ran > `+out+`.image`)
	init := container(t, dir)

	st := testState()
	st.Pid = init
	err := RunInNamespaces(context.Background(), CreateContainer, []Hook{{Path: hook, Args: []string{"hook"}}}, st, init)
	if err != nil {
		t.Fatal(err)
	}
	for file, want := range map[string]string{"hostname": "ocihooks-ctr", "fs": "tmpfs", "pwd": "/"} {
		if got := strings.TrimSpace(readFile(t, out+"."+file)); got != want {
			t.Errorf("the hook's %s: %q, want %q", file, got, want)
		}
	}
	if pid, _ := strconv.Atoi(strings.TrimSpace(readFile(t, out+".pid"))); pid <= 1 || pid == init {
		t.Errorf("the hook's pid %d is not one of the container's PID namespace", pid)
	}
	var got State
	if err := json.Unmarshal([]byte(readFile(t, out+".stdin")), &got); err != nil {
		t.Fatal(err)
	}
	if got.Pid != 1 || got.ID != st.ID {
		t.Errorf("state %+v: want the init's pid as the container sees it, 1", got)
	}

	// dir/shadowed is, in the container, another file (the image's): it
	// is refused, and neither file runs.
	err = RunInNamespaces(context.Background(), StartContainer, []Hook{{Path: filepath.Join(dir, "shadowed")}}, st, init)
	if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "not the runtime's file") {
		t.Fatalf("RunInNamespaces of a path the image shadows = %v, want FailedPrecondition", err)
	}
	for _, f := range []string{".shadowed", ".image"} {
		if _, err := os.Stat(out + f); err == nil {
			t.Errorf("%s ran", f)
		}
	}
}

func TestRunInNamespacesTimeout(t *testing.T) {
	dir := t.TempDir()
	hook, _ := sleeper(t, dir)
	init := container(t, dir)
	err := RunInNamespaces(context.Background(), StartContainer, []Hook{{Path: hook, Timeout: intp(1)}}, testState(), init)
	if !errors.Is(err, errdefs.ErrDeadlineExceeded) {
		t.Fatalf("RunInNamespaces = %v, want DeadlineExceeded", err)
	}
	// The pids the hook wrote are its container's: it is gone when
	// nothing but the init runs in the container's PID namespace.
	testutil.WaitFor(t, 10*time.Second, "the hook's processes to end", func() (bool, string) {
		running := runningIn(t, init)
		return len(running) == 0, strings.Join(running, " ")
	})
}

// runningIn lists the processes, zombies aside, of init's PID namespace
// but init.
func runningIn(t *testing.T, init int) []string {
	t.Helper()
	ns, err := os.Readlink("/proc/" + strconv.Itoa(init) + "/ns/pid")
	if err != nil {
		t.Fatal(err)
	}
	entries, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	var running []string
	for _, e := range entries {
		if _, err := strconv.Atoi(e.Name()); err != nil || e.Name() == strconv.Itoa(init) {
			continue
		}
		link, _ := os.Readlink("/proc/" + e.Name() + "/ns/pid")
		stat, _ := os.ReadFile("/proc/" + e.Name() + "/stat")
		_, state, _ := strings.Cut(string(stat), ") ")
		if link == ns && !strings.HasPrefix(state, "Z") {
			running = append(running, e.Name())
		}
	}
	return running
}

func TestRunInNamespacesStages(t *testing.T) {
	for _, s := range []Stage{Prestart, CreateRuntime, Poststart, Poststop, "bogus"} {
		if err := RunInNamespaces(context.Background(), s, nil, testState(), os.Getpid()); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("RunInNamespaces(%s) = %v, want InvalidArgument", s, err)
		}
	}
	err := RunInNamespaces(context.Background(), CreateContainer, []Hook{{Path: "/bin/true"}}, testState(), 1<<30)
	if !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("RunInNamespaces with no such init = %v, want NotFound", err)
	}
}
