package ocihooks

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/opencontainers/runtime-spec/specs-go"

	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/testutil"
)

// script writes an executable shell script with body into dir and
// returns its path.
func script(t *testing.T, dir, name, body string) string {
	t.Helper()
	path := filepath.Join(dir, name)
	if err := os.WriteFile(path, []byte("#!/bin/sh\n"+body+"\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	return path
}

func testState() State {
	return State{Version: specs.Version, ID: "c1", Status: specs.StateCreated, Pid: 42, Bundle: "/run/b", Annotations: map[string]string{"a": "b"}}
}

func readFile(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestRunArgvEnvStdin(t *testing.T) {
	dir := t.TempDir()
	out := filepath.Join(dir, "out")
	// $0 is argv[0]: the script is run by its #! line, so the kernel
	// puts its path there; the arguments follow as given.
	hook := script(t, dir, "hook", `for a in "$@"; do echo "arg=$a"; done > `+out+`.args
cat /proc/$$/environ > `+out+`.env
cat > `+out+`.stdin`)
	h := Hook{Path: hook, Args: []string{"argv0", "one", "two words"}, Env: []string{"A=1", "B=two words"}}
	if err := Run(context.Background(), CreateRuntime, []Hook{h}, testState()); err != nil {
		t.Fatal(err)
	}
	if got, want := readFile(t, out+".args"), "arg=one\narg=two words\n"; got != want {
		t.Errorf("args %q, want %q", got, want)
	}
	// The environment the hook was executed with (its /proc/pid/environ).
	if got, want := readFile(t, out+".env"), "A=1\x00B=two words\x00"; got != want {
		t.Errorf("env %q, want exactly %q", got, want)
	}
	var st State
	if err := json.Unmarshal([]byte(readFile(t, out+".stdin")), &st); err != nil {
		t.Fatalf("stdin: %v", err)
	}
	if want := testState(); st.ID != want.ID || st.Pid != want.Pid || st.Status != want.Status || st.Bundle != want.Bundle || st.Annotations["a"] != "b" || st.Version != want.Version {
		t.Errorf("stdin state %+v, want %+v", st, want)
	}
}

// TestRunArgv0 checks argv[0] itself with a binary that reports it.
func TestRunArgv0(t *testing.T) {
	dir := t.TempDir()
	out := filepath.Join(dir, "out")
	sh := "/bin/sh"
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"Args[0]", []string{"custom-argv0", "-c", `printf %s "$0" > ` + out}, "custom-argv0"},
		{"no Args: Path", nil, sh},
	} {
		t.Run(tc.name, func(t *testing.T) {
			os.Remove(out)
			h := Hook{Path: sh, Args: tc.args}
			if tc.args == nil {
				// sh with no arguments reads its commands from stdin: the
				// state, which is no command; sh's error about it starts
				// with its $0, argv[0].
				err := Run(context.Background(), Prestart, []Hook{h}, testState())
				if err == nil || !strings.Contains(err.Error(), "output: \""+sh+": 1: ") {
					t.Fatalf("Run = %v, want sh's error prefixed by %s", err, sh)
				}
				return
			}
			if err := Run(context.Background(), Prestart, []Hook{h}, testState()); err != nil {
				t.Fatal(err)
			}
			if got := readFile(t, out); got != tc.want {
				t.Errorf("argv[0] %q, want %q", got, tc.want)
			}
		})
	}
}

func TestRunFailure(t *testing.T) {
	dir := t.TempDir()
	ran := filepath.Join(dir, "ran")
	fail := script(t, dir, "fail", `echo to-stdout; echo to-stderr >&2; exit 3`)
	after := script(t, dir, "after", `echo x >> `+ran)
	for _, tc := range []struct {
		stage    Stage
		afterRan bool
	}{{CreateRuntime, false}, {Poststart, false}, {Poststop, true}} {
		t.Run(string(tc.stage), func(t *testing.T) {
			os.Remove(ran)
			err := Run(context.Background(), tc.stage, []Hook{{Path: fail}, {Path: after}}, testState())
			if !errors.Is(err, errdefs.ErrFailedPrecondition) {
				t.Fatalf("Run = %v, want FailedPrecondition", err)
			}
			for _, want := range []string{fail, string(tc.stage), "exit status 3", "to-stdout", "to-stderr"} {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("error %q does not say %q", err, want)
				}
			}
			if _, statErr := os.Stat(ran); (statErr == nil) != tc.afterRan {
				t.Errorf("the hook after the failing one ran: %v, want %v", statErr == nil, tc.afterRan)
			}
		})
	}
}

func TestRunCannotStart(t *testing.T) {
	dir := t.TempDir()
	notExec := filepath.Join(dir, "plain")
	if err := os.WriteFile(notExec, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name  string
		hook  Hook
		class error
		cause error
	}{
		{"missing", Hook{Path: filepath.Join(dir, "missing")}, errdefs.ErrFailedPrecondition, os.ErrNotExist},
		{"not executable", Hook{Path: notExec}, errdefs.ErrFailedPrecondition, os.ErrPermission},
		{"relative", Hook{Path: "sh"}, errdefs.ErrInvalidArgument, nil},
		{"zero timeout", Hook{Path: "/bin/true", Timeout: intp(0)}, errdefs.ErrInvalidArgument, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := Run(context.Background(), CreateRuntime, []Hook{tc.hook}, testState())
			if !errors.Is(err, tc.class) || (tc.cause != nil && !errors.Is(err, tc.cause)) {
				t.Fatalf("Run = %v, want %v caused by %v", err, tc.class, tc.cause)
			}
		})
	}
}

func TestRunRefusesContainerStages(t *testing.T) {
	for _, s := range []Stage{CreateContainer, StartContainer, "bogus"} {
		if err := Run(context.Background(), s, nil, testState()); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("Run(%s) = %v, want InvalidArgument", s, err)
		}
	}
}

// sleeper is a hook that records its pid and its child's, then waits on
// the child, a long sleep.
func sleeper(t *testing.T, dir string) (hook, pids string) {
	pids = filepath.Join(dir, "pids")
	return script(t, dir, "sleeper", `sleep 600 & echo $$ $! > `+pids+`.new; mv `+pids+`.new `+pids+`; wait`), pids
}

// awaitGone waits for the processes whose pids are in file to be gone
// (or zombies, which no longer run).
func awaitGone(t *testing.T, file string) {
	t.Helper()
	for _, f := range strings.Fields(readFile(t, file)) {
		if _, err := strconv.Atoi(f); err != nil {
			t.Fatal(err)
		}
		testutil.WaitFor(t, 10*time.Second, "process "+f+" to end", func() (bool, string) {
			b, err := os.ReadFile("/proc/" + f + "/stat")
			if err != nil {
				return true, ""
			}
			_, after, _ := strings.Cut(string(b), ") ")
			return strings.HasPrefix(after, "Z"), after
		})
	}
}

func TestRunTimeout(t *testing.T) {
	dir := t.TempDir()
	hook, pids := sleeper(t, dir)
	start := time.Now()
	err := Run(context.Background(), CreateRuntime, []Hook{{Path: hook, Timeout: intp(1)}}, testState())
	if !errors.Is(err, errdefs.ErrDeadlineExceeded) || !strings.Contains(err.Error(), "timeout of 1s") {
		t.Fatalf("Run = %v, want DeadlineExceeded", err)
	}
	if d := time.Since(start); d < time.Second || d > time.Second+waitDelay {
		t.Errorf("Run returned after %v, want about 1s", d)
	}
	awaitGone(t, pids)
}

func TestRunContextCanceled(t *testing.T) {
	dir := t.TempDir()
	hook, pids := sleeper(t, dir)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	errc := make(chan error, 1)
	go func() { errc <- Run(ctx, Poststop, []Hook{{Path: hook}, {Path: hook}}, testState()) }()
	testutil.WaitFor(t, 10*time.Second, "the hook to start", func() (bool, string) {
		_, err := os.Stat(pids)
		return err == nil, ""
	})
	cancel()
	err := <-errc
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("Run = %v, want context.Canceled", err)
	}
	awaitGone(t, pids)
}

func TestKillGroupOfGoneProcess(t *testing.T) {
	p, err := os.StartProcess("/bin/true", []string{"true"}, &os.ProcAttr{Sys: &syscall.SysProcAttr{Setpgid: true}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.Wait(); err != nil {
		t.Fatal(err)
	}
	if err := killGroup(p); !errors.Is(err, os.ErrProcessDone) {
		t.Fatalf("killGroup of a reaped group = %v, want ErrProcessDone", err)
	}
}
