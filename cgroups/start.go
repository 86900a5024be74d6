package cgroups

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
)

// Start starts cmd so that the new process is in c from its first
// instruction: there is no window in which it runs (or forks) outside c.
//
// In v2 mode the process is cloned straight into c (CLONE_INTO_CGROUP,
// through SysProcAttr.UseCgroupFD). On kernels without CLONE_INTO_CGROUP
// (before 5.7) the child is first the ExecHelper, which waits on a pipe
// until the parent has moved it into c and only then executes the command:
// the command never runs outside c. In v1 mode the calling goroutine is
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
	if !cloneIntoCgroup() {
		return startHelped(dir, cmd)
	}
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
	home, err := threadHome()
	if err != nil {
		return err
	}

	// A fresh goroutine, so that a thread that cannot be moved back is
	// retired by the runtime when the goroutine exits still locked.
	done := make(chan error, 1)
	go func() { done <- c.forkFromThread(home, cmd) }()
	return <-done
}

// ErrNoCloneInto says a v2 cgroup cannot take a process at clone time on
// this kernel (before 5.7), so a thread cannot place its forks in it.
var ErrNoCloneInto = errors.New("cgroups: the kernel cannot clone into a cgroup (CLONE_INTO_CGROUP, Linux 5.7)")

// ThreadPlacement is a thread readied by PlaceThread.
type ThreadPlacement struct {
	// CgroupFD, in v2 mode, is the cgroup's directory to clone into
	// (SysProcAttr.UseCgroupFD and CgroupFD); -1 in v1 mode.
	CgroupFD int
	// home: v1 mode, the "tasks" files of the thread's own cgroups.
	home []*os.File
}

// PlaceThread readies the calling thread so that the next process it forks
// starts in c. The caller must have locked the goroutine to its thread
// and call Release once it forked. In v1 mode the thread itself moves into
// c, and Release moves it back to home, the cgroup the thread is in (nil:
// read from /proc, which costs a parse of the mount table); in v2 mode the
// placement holds c's directory to clone into (ErrNoCloneInto on kernels
// without CLONE_INTO_CGROUP). On failure in v1 mode the thread may be in c
// in some hierarchies: it must be retired (left locked to a goroutine that
// exits).
func (c *Cgroup) PlaceThread(home *Cgroup) (*ThreadPlacement, error) {
	if p, ok := c.Paths[Unified]; ok {
		if !cloneIntoCgroup() {
			return nil, ErrNoCloneInto
		}
		fd, err := unix.Open(p, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			return nil, fmt.Errorf("cgroups: open %s: %w", p, err)
		}
		return &ThreadPlacement{CgroupFD: fd}, nil
	}
	if home == nil {
		var err error
		if home, err = threadHome(); err != nil {
			return nil, err
		}
	}
	tp := &ThreadPlacement{CgroupFD: -1}
	for _, k := range v1Controllers {
		d, ok := home.Paths[k]
		if _, used := c.Paths[k]; !ok || !used {
			continue
		}
		f, err := os.OpenFile(filepath.Join(d, "tasks"), os.O_WRONLY, 0)
		if err != nil {
			tp.close()
			return nil, fmt.Errorf("cgroups: %w", err)
		}
		tp.home = append(tp.home, f)
	}
	if err := c.moveThread(c); err != nil {
		tp.close()
		return nil, fmt.Errorf("cgroups: move thread into %s: %w", c, err)
	}
	return tp, nil
}

// Release moves the thread back to the cgroups it had before PlaceThread
// (v1 mode) and closes what the placement holds. It only writes to files
// PlaceThread opened, so it works after the thread changed its root or
// mount namespace. The placement is unusable afterwards.
func (tp *ThreadPlacement) Release() error {
	var errs []error
	for _, f := range tp.home {
		// "0" is the writing thread itself.
		if _, err := f.Write([]byte("0")); err != nil {
			errs = append(errs, fmt.Errorf("cgroups: move thread back to %s: %w", filepath.Dir(f.Name()), err))
		}
	}
	tp.close()
	return errors.Join(errs...)
}

func (tp *ThreadPlacement) close() {
	for _, f := range tp.home {
		f.Close()
	}
	tp.home = nil
	if tp.CgroupFD >= 0 {
		unix.Close(tp.CgroupFD)
		tp.CgroupFD = -1
	}
}

// threadHome is the calling thread's own cgroups (v1 mode: a thread may
// be in other cgroups than its process).
func threadHome() (*Cgroup, error) {
	e, err := loadEnv()
	if err != nil {
		return nil, err
	}
	tc, err := os.Open("/proc/thread-self/cgroup")
	if err != nil {
		return nil, fmt.Errorf("cgroups: %w", err)
	}
	procs, err := parseProcCgroup(tc)
	tc.Close()
	if err != nil {
		return nil, err
	}
	e.procs = procs
	return e.self()
}

// moveThread moves the calling thread into to's directories of the v1
// hierarchies c uses.
func (c *Cgroup) moveThread(to *Cgroup) error {
	// "0" is the writing thread itself: the kernel then skips the
	// global threadgroup lock a move by TID takes (a tenth of the time).
	const tid = "0"
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

func (c *Cgroup) forkFromThread(home *Cgroup, cmd *exec.Cmd) error {
	runtime.LockOSThread()
	moveTo := c.moveThread
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

// cloneIntoCgroup reports whether the kernel places a new process into a
// cgroup at clone time (CLONE_INTO_CGROUP, Linux 5.7). A variable so tests
// can take the other path.
var cloneIntoCgroup = sync.OnceValue(func() bool {
	var u unix.Utsname
	if err := unix.Uname(&u); err != nil {
		return false
	}
	return kernelAtLeast(unix.ByteSliceToString(u.Release[:]), 5, 7)
})

// CloneIntoCgroup reports whether the kernel places a new process into a
// cgroup at clone time (CLONE_INTO_CGROUP, Linux 5.7).
func CloneIntoCgroup() bool { return cloneIntoCgroup() }

// kernelAtLeast compares a kernel release ("5.4.0-150-generic") with
// major.minor.
func kernelAtLeast(release string, major, minor int) bool {
	var ma, mi int
	if _, err := fmt.Sscanf(release, "%d.%d", &ma, &mi); err != nil {
		return false
	}
	return ma > major || ma == major && mi >= minor
}

// ExecHelper is the command (an executable and its leading arguments) whose
// process runs RunExecHelper: the binary that links this package, with a
// subcommand that calls it. stagelet's main registers "cgroup-exec".
var ExecHelper = []string{"/proc/self/exe", "cgroup-exec"}

// startHelped starts cmd as the ExecHelper, moves that process into dir
// and then lets it execute cmd's program.
func startHelped(dir string, cmd *exec.Cmd) error {
	if cmd.Err != nil {
		return cmd.Err
	}
	r, w, err := os.Pipe()
	if err != nil {
		return fmt.Errorf("cgroups: start: %w", err)
	}
	defer w.Close()
	path, args, extra := cmd.Path, cmd.Args, cmd.ExtraFiles
	cmd.Path = ExecHelper[0]
	cmd.Args = append(append(append([]string(nil), ExecHelper...),
		strconv.Itoa(3+len(extra)), path), args...)
	cmd.ExtraFiles = append(append([]*os.File(nil), extra...), r)
	err = cmd.Start()
	r.Close()
	cmd.ExtraFiles = extra
	if err != nil {
		return fmt.Errorf("cgroups: start: %w", err)
	}
	if err := writeFile(dir, "cgroup.procs", strconv.Itoa(cmd.Process.Pid)); err != nil {
		cmd.Process.Kill()
		cmd.Wait()
		return fmt.Errorf("cgroups: start in %s: %w", dir, err)
	}
	if _, err := w.Write([]byte{1}); err != nil {
		cmd.Process.Kill()
		cmd.Wait()
		return fmt.Errorf("cgroups: start: release the helper: %w", err)
	}
	return nil
}

// RunExecHelper is the body of the ExecHelper: args are FD PATH ARGV...
// It waits until one byte arrives on FD (the parent has moved this process
// into its cgroup), closes FD and executes PATH with ARGV and the
// environment. It returns only on failure, with an exit status.
func RunExecHelper(args []string) int {
	if len(args) < 3 {
		fmt.Fprintln(os.Stderr, "cgroup-exec: usage: cgroup-exec FD PATH ARGV0 [ARG...]")
		return 2
	}
	fd, err := strconv.Atoi(args[0])
	if err != nil || fd < 3 {
		fmt.Fprintf(os.Stderr, "cgroup-exec: bad fd %q\n", args[0])
		return 2
	}
	f := os.NewFile(uintptr(fd), "cgroup-exec")
	var b [1]byte
	n, _ := f.Read(b[:])
	f.Close()
	if n != 1 {
		fmt.Fprintln(os.Stderr, "cgroup-exec: not placed in a cgroup; not executing")
		return 1
	}
	err = unix.Exec(args[1], args[2:], os.Environ())
	fmt.Fprintf(os.Stderr, "cgroup-exec: exec %s: %v\n", args[1], err)
	return 127
}
