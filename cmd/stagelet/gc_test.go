package main

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestStateLock: one holder at a time; the second is told who holds it;
// closing releases it.
func TestStateLock(t *testing.T) {
	dir := t.TempDir()
	f, err := lockState(dir)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(filepath.Join(dir, stateLockName))
	if strings.TrimSpace(string(b)) != strconv.Itoa(os.Getpid()) {
		t.Errorf("the lock file says %q, want this PID", b)
	}
	if _, err := lockState(dir); !errors.Is(err, errStateBusy) || !strings.Contains(err.Error(), "pid "+strconv.Itoa(os.Getpid())) {
		t.Errorf("second lock: %v", err)
	}
	f.Close()
	g, err := lockState(dir)
	if err != nil {
		t.Fatalf("lock after release: %v", err)
	}
	g.Close()
}

// TestStateLockOfTheDead: a lock still held after its holder died (by a
// child it forked, until that child's exec) is waited for; one whose
// holder lives is not.
func TestStateLockOfTheDead(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, stateLockName)
	// The transient holder: another open file of the lock, locked.
	h, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	if err := unix.Flock(int(h.Fd()), unix.LOCK_EX); err != nil {
		t.Fatal(err)
	}
	// The PID of a process that is gone.
	dead := exec.Command("true")
	if err := dead.Run(); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(strconv.Itoa(dead.Process.Pid)+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	defer func(w time.Duration) { staleLockWait = w }(staleLockWait)
	staleLockWait = 200 * time.Millisecond
	start := time.Now()
	if _, err := lockState(dir); !errors.Is(err, errStateBusy) {
		t.Fatalf("a lock held past the wait: %v", err)
	}
	if waited := time.Since(start); waited < staleLockWait {
		t.Errorf("gave up on a dead holder's lock after %s, want a wait of %s", waited, staleLockWait)
	}
	unix.Flock(int(h.Fd()), unix.LOCK_UN)
	f, err := lockState(dir)
	if err != nil {
		t.Fatalf("the lock of a dead holder, released: %v", err)
	}
	f.Close()

	// A live holder (this process) is not waited for.
	if err := unix.Flock(int(h.Fd()), unix.LOCK_EX); err != nil {
		t.Fatal(err)
	}
	os.WriteFile(path, []byte(strconv.Itoa(os.Getpid())+"\n"), 0o600)
	start = time.Now()
	if _, err := lockState(dir); !errors.Is(err, errStateBusy) {
		t.Errorf("a live holder's lock: %v", err)
	}
	if waited := time.Since(start); waited >= staleLockWait {
		t.Errorf("waited %s for a live holder", waited)
	}
}

// TestGCUsage: gc wants exactly one of --set-aside and --all, and --all
// takes no IDs; doctor wants text or json.
func TestGCUsage(t *testing.T) {
	for _, args := range [][]string{{}, {"--set-aside", "--all"}, {"--all", "abc"}} {
		var out, errb bytes.Buffer
		if rc := gcMain(args, &out, &errb); rc != 2 {
			t.Errorf("gc %v: rc %d, want 2\n%s", args, rc, errb.String())
		}
	}
	var out, errb bytes.Buffer
	if rc := doctorMain([]string{"-o", "yaml"}, &out, &errb); rc != 2 || !strings.Contains(errb.String(), "want text or json") {
		t.Errorf("doctor -o yaml: rc %d\n%s", rc, errb.String())
	}
}

// TestGCRefusedWhileLocked: with the state directory's lock held (a
// running daemon), gc changes nothing and says why.
func TestGCRefusedWhileLocked(t *testing.T) {
	state := t.TempDir()
	f, err := lockState(state)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out, errb bytes.Buffer
	if rc := gcMain([]string{"--set-aside", "--state-dir", state, "--run-dir", t.TempDir()}, &out, &errb); rc != 1 || !strings.Contains(errb.String(), "the daemon runs; stop it first") {
		t.Errorf("gc with the lock held: rc %d\n%s", rc, errb.String())
	}
}

// TestDoctorChangesNothing: doctor on a node whose state and run
// directories do not exist yet reports and creates nothing.
func TestDoctorChangesNothing(t *testing.T) {
	root := t.TempDir()
	state, run := filepath.Join(root, "state"), filepath.Join(root, "run")
	var out, errb bytes.Buffer
	rc := doctorMain([]string{"-o", "json", "--state-dir", state, "--run-dir", run}, &out, &errb)
	if rc == 2 || !strings.Contains(out.String(), `"name": "set-aside"`) {
		t.Fatalf("doctor: rc %d\n%s%s", rc, out.String(), errb.String())
	}
	ents, _ := os.ReadDir(root)
	if len(ents) != 0 {
		t.Errorf("doctor created %v", ents)
	}
}
