package main

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// stateLockName is the file in the state directory that the daemon, and an
// operator tool changing what the daemon owns (gc), hold locked while they
// run: one of them at a time.
const stateLockName = "stagelet.lock"

// errStateBusy: another process holds the state directory's lock.
var errStateBusy = errors.New("the state directory is in use")

// staleLockWait bounds the wait for a lock whose holder is gone: a child
// it was forking when it died holds the lock's open file until its exec
// closes it (a daemon killed while it starts a pod's process, then
// restarted at once). A variable for tests.
var staleLockWait = 5 * time.Second

// lockState takes the state directory's lock and writes the holder's PID
// in it. It does not wait for a live holder; while the PID in the file
// names no process it waits at most staleLockWait. Closing the file
// releases the lock, as does the holder's exit (the lock goes with the
// process, not the file).
func lockState(state string) (*os.File, error) {
	path := filepath.Join(state, stateLockName)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, err
	}
	deadline := time.Now().Add(staleLockWait)
	for {
		err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			break
		}
		if !errors.Is(err, unix.EWOULDBLOCK) {
			f.Close()
			return nil, fmt.Errorf("lock %s: %w", path, err)
		}
		if holderAlive(path) || time.Now().After(deadline) {
			f.Close()
			return nil, fmt.Errorf("%w: %s is held by %s", errStateBusy, path, stateHolder(path))
		}
		time.Sleep(10 * time.Millisecond) // polling the lock: flock has no timeout
	}
	if err := f.Truncate(0); err == nil {
		f.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
	}
	return f, nil
}

// holderAlive tells whether the PID the lock file at path records names a
// running process; a file that names none is taken as alive (a holder
// that has the lock and has not yet written its PID).
func holderAlive(path string) bool {
	b, err := os.ReadFile(path)
	if err != nil {
		return true
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || pid <= 0 {
		return true
	}
	return unix.Kill(pid, 0) != unix.ESRCH
}

// stateHolder names the process holding the lock at path, as well as the
// file says.
func stateHolder(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return "another process"
	}
	pid := strings.TrimSpace(string(b))
	if comm, err := os.ReadFile("/proc/" + pid + "/cmdline"); err == nil && pid != "" {
		return fmt.Sprintf("pid %s (%s)", pid, strings.Join(strings.Fields(strings.ReplaceAll(string(comm), "\x00", " ")), " "))
	}
	return "another process"
}
