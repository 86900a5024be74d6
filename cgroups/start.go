package cgroups

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"syscall"

	"golang.org/x/sys/unix"
)

// Start starts cmd so that the new process is in c from its first
// instruction: there is no window in which it runs (or forks) outside c.
//
// In v2 mode the process is cloned straight into c (CLONE_INTO_CGROUP,
// through SysProcAttr.UseCgroupFD). In v1 mode the calling goroutine is
// locked to its OS thread, that one thread is moved into c (the v1 "tasks"
// files), the process is forked from it (a child inherits its parent
// thread's cgroups), and the thread is moved back to where it was. If the
// thread cannot be moved back it is left locked to a goroutine that exits,
// so the Go runtime retires it. While the fork runs, c's cgroup.procs lists the caller's PID: do not
// Kill c concurrently with Start.
//
// c must exist (Create). cmd is started as by cmd.Start; the caller waits
// for it.
func (c *Cgroup) Start(cmd *exec.Cmd) error {
	if p, ok := c.Paths[Unified]; ok {
		return startV2(p, cmd)
	}
	return c.startV1(cmd)
}

func startV2(dir string, cmd *exec.Cmd) error {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("cgroups: start: open %s: %w", dir, err)
	}
	defer unix.Close(fd)
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.UseCgroupFD = true
	cmd.SysProcAttr.CgroupFD = fd
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("cgroups: start in %s: %w", dir, err)
	}
	return nil
}

func (c *Cgroup) startV1(cmd *exec.Cmd) error {
	e, err := loadEnv()
	if err != nil {
		return err
	}
	tc, err := os.Open("/proc/thread-self/cgroup")
	if err != nil {
		return fmt.Errorf("cgroups: start: %w", err)
	}
	procs, err := parseProcCgroup(tc)
	tc.Close()
	if err != nil {
		return err
	}
	e.procs = procs
	home, err := e.self() // this thread's own cgroups
	if err != nil {
		return err
	}

	// A fresh goroutine, so that a thread that cannot be moved back is
	// retired by the runtime when the goroutine exits still locked.
	done := make(chan error, 1)
	go func() { done <- c.forkFromThread(home, cmd) }()
	return <-done
}

func (c *Cgroup) forkFromThread(home *Cgroup, cmd *exec.Cmd) error {
	runtime.LockOSThread()
	tid := strconv.Itoa(unix.Gettid())
	moveTo := func(to *Cgroup) error {
		for _, k := range v1Controllers {
			d, ok := to.Paths[k]
			if !ok {
				continue
			}
			if _, ok := c.Paths[k]; !ok {
				continue // a hierarchy c does not use: the thread never left
			}
			if err := writeFile(d, "tasks", tid); err != nil {
				return err
			}
		}
		return nil
	}
	moveErr := moveTo(c)
	var startErr error
	if moveErr == nil {
		startErr = cmd.Start()
	}
	if err := moveTo(home); err != nil {
		// Stay locked: this thread ends with the goroutine.
		if moveErr == nil && startErr == nil {
			return nil
		}
		return fmt.Errorf("cgroups: start in %s: %w", c, errors.Join(moveErr, startErr))
	}
	runtime.UnlockOSThread()
	if moveErr != nil {
		return fmt.Errorf("cgroups: start: move thread into %s: %w", c, moveErr)
	}
	if startErr != nil {
		return fmt.Errorf("cgroups: start: %w", startErr)
	}
	return nil
}
