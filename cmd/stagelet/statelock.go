package main

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// stateLockName is the file in the state directory that the daemon, and an
// operator tool changing what the daemon owns (gc), hold locked while they
// run: one of them at a time.
const stateLockName = "stagelet.lock"

// errStateBusy: another process holds the state directory's lock.
var errStateBusy = errors.New("the state directory is in use")

// lockState takes the state directory's lock, without waiting, and writes
// the holder's PID in it. Closing the file releases it, as does the
// holder's exit (the lock goes with the process, not the file).
func lockState(state string) (*os.File, error) {
	path := filepath.Join(state, stateLockName)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, err
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, fmt.Errorf("%w: %s is held by %s", errStateBusy, path, stateHolder(path))
		}
		return nil, fmt.Errorf("lock %s: %w", path, err)
	}
	if err := f.Truncate(0); err == nil {
		f.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
	}
	return f, nil
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
