package host

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/cgroups"
)

// ErrProcessGone says a recorded host process no longer runs: it exited, or
// its PID now belongs to another process.
var ErrProcessGone = errors.New("process is gone")

// Process is a host process a backend started for a pod (the fly agent, an
// nspawn or qemu process). PID and StartTime together name it across PID
// reuse; both are persisted in the backend's state.
type Process struct {
	PID int `json:"pid"`
	// StartTime is field 22 of /proc/PID/stat (clock ticks since boot).
	StartTime uint64 `json:"startTime"`
	// Unit is the systemd unit running the process, when it was started as
	// a transient unit.
	Unit string `json:"unit,omitempty"`
	// Cgroup is where Launch put the process when LaunchSpec.Cgroup was
	// set: that cgroup for the plain launcher, the unit's for systemd
	// (nil when systemd placed it in no managed hierarchy). Set by Launch
	// only; the backend records it in its own state.
	Cgroup *cgroups.Cgroup `json:"-"`

	// exited is closed once the process has been reaped, when this daemon
	// is its parent; nil for a process found again after a restart.
	exited chan struct{}
}

// ProcessStartTime returns field 22 (starttime) of /proc/pid/stat. An
// error wrapping ErrProcessGone means no such process.
func ProcessStartTime(pid int) (uint64, error) {
	st, _, err := procStat(pid)
	return st, err
}

// procStat returns a process's start time and state letter.
func procStat(pid int) (uint64, byte, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		if errors.Is(err, os.ErrNotExist) || errors.Is(err, syscall.ESRCH) {
			return 0, 0, fmt.Errorf("pid %d: %w", pid, ErrProcessGone)
		}
		return 0, 0, err
	}
	// The command name (field 2) is in parentheses and may hold spaces or
	// parentheses: fields resume after the last ')'.
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0, 0, fmt.Errorf("pid %d: malformed stat", pid)
	}
	f := strings.Fields(s[i+1:])
	// f[0] is field 3 (state); field 22 is f[19].
	if len(f) < 20 {
		return 0, 0, fmt.Errorf("pid %d: short stat", pid)
	}
	st, err := strconv.ParseUint(f[19], 10, 64)
	if err != nil {
		return 0, 0, fmt.Errorf("pid %d: stat starttime: %w", pid, err)
	}
	return st, f[0][0], nil
}

// NewProcess names the running process pid, reading its start time.
func NewProcess(pid int) (*Process, error) {
	st, err := ProcessStartTime(pid)
	if err != nil {
		return nil, err
	}
	return &Process{PID: pid, StartTime: st}, nil
}

// Alive reports whether the process still runs: its PID exists, is not a
// zombie, and has the recorded start time.
func (p *Process) Alive() bool {
	if p == nil || p.PID <= 0 {
		return false
	}
	if p.exited != nil {
		select {
		case <-p.exited:
			return false
		default:
		}
	}
	st, state, err := procStat(p.PID)
	return err == nil && st == p.StartTime && state != 'Z' && state != 'X'
}

// Signal sends sig to the process. It refuses (ErrProcessGone) when the PID
// no longer names the recorded process; the check and the signal go through
// one pidfd, so a PID reused in between is never signalled.
func (p *Process) Signal(sig syscall.Signal) error {
	if p == nil || p.PID <= 0 {
		return fmt.Errorf("no process: %w", ErrProcessGone)
	}
	fd, err := unix.PidfdOpen(p.PID, 0)
	if err != nil {
		if errors.Is(err, unix.ESRCH) {
			return fmt.Errorf("pid %d: %w", p.PID, ErrProcessGone)
		}
		return p.signalRacy(sig) // kernel without pidfd
	}
	defer unix.Close(fd)
	// The pidfd pins this PID: verify it is still our process.
	st, _, err := procStat(p.PID)
	if err != nil {
		return err
	}
	if st != p.StartTime {
		return fmt.Errorf("pid %d was reused: %w", p.PID, ErrProcessGone)
	}
	if err := unix.PidfdSendSignal(fd, sig, nil, 0); err != nil {
		if errors.Is(err, unix.ESRCH) {
			return fmt.Errorf("pid %d: %w", p.PID, ErrProcessGone)
		}
		return fmt.Errorf("signal pid %d: %w", p.PID, err)
	}
	return nil
}

func (p *Process) signalRacy(sig syscall.Signal) error {
	st, _, err := procStat(p.PID)
	if err != nil {
		return err
	}
	if st != p.StartTime {
		return fmt.Errorf("pid %d was reused: %w", p.PID, ErrProcessGone)
	}
	if err := unix.Kill(p.PID, sig); err != nil {
		if errors.Is(err, unix.ESRCH) {
			return fmt.Errorf("pid %d: %w", p.PID, ErrProcessGone)
		}
		return fmt.Errorf("signal pid %d: %w", p.PID, err)
	}
	return nil
}

// Wait returns nil once the process has exited (or its PID names another
// process), or ctx's error. A process this daemon started is waited on
// through its reaper; another one through a pidfd, falling back to
// polling /proc.
func (p *Process) Wait(ctx context.Context) error {
	if p.exited != nil {
		select {
		case <-p.exited:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	fd, perr := unix.PidfdOpen(p.PID, 0)
	havePidfd := perr == nil
	if havePidfd {
		defer unix.Close(fd)
	}
	delay := 5 * time.Millisecond
	for {
		if !p.Alive() {
			return nil
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		if havePidfd {
			// Readable once the process exits; wake up now and then to
			// look at ctx.
			fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
			_, _ = unix.Poll(fds, 100)
			continue
		}
		time.Sleep(delay)
		if delay < 100*time.Millisecond {
			delay *= 2
		}
	}
}
