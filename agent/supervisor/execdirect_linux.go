package supervisor

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"syscall"

	"github.com/moby/sys/capability"
	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/agent/wire"
	"github.com/stagelet/stagelet/cgroups"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/osthread"
	"github.com/stagelet/stagelet/seccomp"
)

// An exec's command is started straight from the agent where it can be.
// One of the agent's threads, locked to a goroutine, takes on the app's
// cgroup, security module labels, PID, UTS and mount namespaces, working
// directory, capability bounding set, no_new_privs and system call filter;
// it then forks the command (syscall.ForkExec, which in the child makes a
// session, switches to the app's groups and user and executes) and is
// retired with its goroutine, never going back to the Go runtime
// (internal/osthread: never the main thread, which Go parks instead). No copy
// of the agent starts, as `agent exec-init` does: starting a Go program is
// most of an exec's time in a VM pod, where it runs emulated.
//
// All of that is per thread in Linux, and inherited by a fork:
// the namespaces a thread joined with setns (its own file system
// attributes first, unshare CLONE_FS), its bounding set, no_new_privs, a
// filter installed without TSYNC, its SELinux and AppArmor exec labels and,
// on cgroup v1, the cgroups it was moved into (it moves back once the
// command is forked). On cgroup v2 the command is cloned into the app's
// cgroup (CLONE_INTO_CGROUP).
//
// The command gets what `agent exec-init` gives it (TestExecPathsAgree):
// the same capability sets after execve (the bounding set is the app's;
// the inheritable and ambient sets are empty; the effective and permitted
// sets are what execve makes of them for the app's user, as after
// exec-init's), the same filter, user, groups, directory, environment,
// namespaces and cgroups. One difference: its OOM score is set just after
// it started, not before (a score is per process, a thread cannot carry
// one).
//
// The command goes through `agent exec-init` instead where a thread cannot
// take all of that on:
//   - the app's filter would stop a system call made between its
//     installation on the thread and the command's execve (directCalls);
//     such a call could kill the agent, not only the command;
//   - the app's cgroup is a v2 cgroup on a kernel without
//     CLONE_INTO_CGROUP;
//   - the agent was told so (--exec-init).

// directExec is what a thread needs to start an exec's command.
type directExec struct {
	app  *api.AppSpec
	args []string
	// mnt is the app's mount namespace; uts and pidns its UTS and PID
	// namespaces when the command joins them (nil otherwise), cgns its
	// cgroup namespace when the thread can join it (see enterApp).
	mnt, uts, pidns, cgns *os.File
	cg                    *cgroups.Cgroup // nil: none
	// guard is cg's gate against a Kill while the thread is in it; nil
	// without cg.
	guard  *guardedCgroup
	filter *seccomp.Filter // nil: none
	caps   []capability.Cap
	stdio  []*os.File // unused with a terminal
	tty    bool
	size   *api.TerminalSize
}

// directCalls are the system calls made between the installation of the
// app's filter on the forking thread and the command's execve: by the
// thread in syscall.forkExec (its status pipe, signal mask, the clone and
// the read of the child's status), by the child in
// syscall.forkAndExecInChild1 for the attributes the direct path sets
// (signal handlers reset, setsid, setgroups, setgid, setuid, chdir, the
// stdio, the controlling terminal, the file limit Go restores), and by the
// Go runtime on the thread until it exits (locks, memory, signals, the
// signal stack it removes, the thread's exit).
func directCalls(clone3, tty bool) []seccomp.Call {
	var calls []seccomp.Call
	for _, name := range []string{
		"pipe2", "rt_sigprocmask", "close", "read", "write", "wait4", "futex", "sched_yield", "nanosleep",
		"mmap", "munmap", "madvise", "rt_sigreturn", "sigaltstack", "getpid", "gettid", "tgkill",
		"exit", "exit_group",
		"rt_sigaction", "setsid", "setgroups", "setgid", "setuid", "chdir", "dup3", "fcntl",
		"prlimit64", "execve",
	} {
		calls = append(calls, seccomp.Call{Name: name})
	}
	if clone3 {
		calls = append(calls, seccomp.Call{Name: "clone3"})
	} else {
		calls = append(calls, seccomp.Call{Name: "clone", Fixed: map[int]uint64{0: unix.CLONE_VM | unix.CLONE_VFORK | uint64(unix.SIGCHLD)}})
	}
	if tty {
		calls = append(calls, seccomp.Call{Name: "ioctl", Fixed: map[int]uint64{0: 0, 1: unix.TIOCSCTTY, 2: 1}})
	}
	return calls
}

// planDirect returns how to start the exec s directly, or nil when it
// goes through `agent exec-init`.
func (l *linuxSystem) planDirect(s *startSpec, cg *cgroups.Cgroup) (*directExec, error) {
	if l.execInit {
		return nil, nil
	}
	app := s.app
	clone3 := false
	if cg != nil && cg.IsV2() {
		if !cgroups.CloneIntoCgroup() {
			return nil, nil
		}
		clone3 = true
	}
	warn := func(format string, args ...any) {
		l.log.Warn("exec", "app", app.ID, "warning", fmt.Sprintf(format, args...))
	}
	filter, err := compileSeccomp(app, false, warn)
	if err != nil {
		return nil, err
	}
	if filter != nil {
		ok, err := filter.Lets(directCalls(clone3, s.cio.tty)...)
		if err != nil {
			return nil, fmt.Errorf("app %s: seccomp: %w", app.ID, err)
		}
		if !ok {
			return nil, nil
		}
	}
	caps, err := targetCaps(app, warn)
	if err != nil {
		return nil, fmt.Errorf("capabilities: %w", err)
	}
	return &directExec{app: app, args: s.args, cg: cg, filter: filter, caps: caps, tty: s.cio.tty, size: s.size}, nil
}

// startDirect starts d's command with stdio as cio says.
func (l *linuxSystem) startDirect(d *directExec, cio childIO) (*child, error) {
	c, stdio, theirs, err := openStdio(cio)
	if err != nil {
		return nil, err
	}
	d.stdio = stdio
	// The thread ends with forkDirect: what it took on reaches no other
	// goroutine.
	var pid, master int
	var wait <-chan syscall.WaitStatus
	err = osthread.Run(func() error {
		var err error
		pid, master, wait, err = l.forkDirect(d)
		return err
	})
	for _, f := range theirs {
		f.Close()
	}
	if err != nil {
		c.closeStdio()
		return nil, classify(err)
	}
	if master >= 0 {
		c.pty = newTerminal(os.NewFile(uintptr(master), "pty-master"))
	}
	p, err := os.FindProcess(pid) // never fails on Linux
	if err != nil {
		c.closeStdio()
		return nil, err
	}
	c.proc, c.pid, c.wait = p, pid, wait
	l.log.Debug("exec started from the agent's thread", "app", d.app.ID, "pid", pid)
	setOOMScoreAdj(d.app.Resources.OOMScoreAdj, "/proc/"+strconv.Itoa(pid)+"/oom_score_adj", func(format string, args ...any) {
		l.log.Warn("exec", "app", d.app.ID, "warning", fmt.Sprintf(format, args...))
	})
	return c, nil
}

// forkDirect runs on a locked thread that is retired afterwards: it takes
// on the app's attributes and forks the command. It returns the command's
// pid, the channel of its exit status and, with a terminal, the
// terminal's master (else -1).
func (l *linuxSystem) forkDirect(d *directExec) (pid, master int, wait <-chan syscall.WaitStatus, err error) {
	app := d.app
	// Only the descriptors in files reach the command; one the agent
	// inherited without close-on-exec must not. (Marked while /proc is
	// still the agent's, should the kernel lack close_range.)
	cloexecFrom(3)
	if d.guard != nil {
		// Released after the thread left the app's cgroups (deferred
		// below, so run before this).
		d.guard.gate.RLock()
		defer d.guard.gate.RUnlock()
	}
	placed, err := takeOnAgentSide(d, l.own)
	if err != nil {
		return 0, -1, nil, err
	}
	cgroupFD := -1
	if placed != nil {
		// Once the command is forked, the thread leaves the app's
		// cgroups (v1), which must not hold an agent's thread.
		defer func() {
			if rerr := placed.Release(); rerr != nil {
				l.log.Warn("exec", "app", app.ID, "warning", rerr.Error())
			}
		}()
		cgroupFD = placed.CgroupFD
	}
	if err := enterApp(d); err != nil {
		return 0, -1, nil, err
	}
	// The last step: the terminal's slave it opens is closed when it
	// returns, before the deferred release and unlock above run.
	return l.forkInApp(d, cgroupFD)
}

// forkInApp is forkDirect's last step, on its thread, which has taken on
// the app's cgroup, labels, capabilities and namespaces: it enters the
// working directory, finds the command, opens its terminal, restricts the
// thread (no_new_privs, the app's filter) and forks the command, into
// cgroupFD unless -1. It returns what forkDirect does; the terminal's
// slave is closed when it returns, its master on failure.
func (l *linuxSystem) forkInApp(d *directExec, cgroupFD int) (pid, master int, wait <-chan syscall.WaitStatus, err error) {
	app := d.app
	dir := enterDirectCwd(app.Cwd)
	env := execEnv(app.Env, d.tty)
	path, err := lookPath(d.args[0], env)
	if err != nil {
		return 0, -1, nil, failedPrecondition(err)
	}
	files := make([]uintptr, 3)
	for i, f := range d.stdio {
		files[i] = f.Fd()
	}
	master = -1
	fail := func(err error) (int, int, <-chan syscall.WaitStatus, error) {
		if master >= 0 {
			unix.Close(master)
		}
		return 0, -1, nil, err
	}
	if d.tty {
		m, slave, err := openTerminal(app.UID, d.size)
		if err != nil {
			return fail(failedPrecondition(err))
		}
		defer unix.Close(slave)
		master = m
		files = []uintptr{uintptr(slave), uintptr(slave), uintptr(slave)}
	}
	if err := restrictThread(app.NoNewPrivs, d.filter); err != nil {
		return fail(err)
	}
	attr := &syscall.ProcAttr{
		Dir:   dir,
		Env:   env,
		Files: files,
		Sys: &syscall.SysProcAttr{
			Setsid:      true,
			Setctty:     d.tty,
			Credential:  &syscall.Credential{Uid: app.UID, Gid: app.GID, Groups: app.AdditionalGIDs},
			UseCgroupFD: cgroupFD >= 0,
			CgroupFD:    cgroupFD,
		},
	}
	wait, err = l.reaper.startWith(func() (int, error) {
		var err error
		pid, err = syscall.ForkExec(path, d.args, attr)
		return pid, err
	})
	if err != nil {
		if dir != "" {
			return fail(failedPrecondition(fmt.Errorf("exec %s in %s as user %d: %w", d.args[0], dir, app.UID, err)))
		}
		return fail(failedPrecondition(fmt.Errorf("exec %s: %w", d.args[0], err)))
	}
	return pid, master, wait, nil
}

// enterDirectCwd enters the app's working directory cwd ("" is /) as the
// agent: it may be reachable by root only. Where that fails it returns
// the directory, for the command to try again as the app's user (else "").
func enterDirectCwd(cwd string) (dir string) {
	if cwd == "" {
		cwd = "/"
	}
	if unix.Chdir(cwd) != nil {
		dir = cwd
	}
	return dir
}

// restrictThread sets no_new_privs on the calling thread when asked, then
// installs filter (nil: none) on it alone, as the last step before the
// fork.
func restrictThread(noNewPrivs bool, filter *seccomp.Filter) error {
	if noNewPrivs {
		if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
			return fmt.Errorf("no_new_privs: %w", err)
		}
	}
	if filter != nil {
		if err := seccomp.InstallThread(filter); err != nil {
			return failedPrecondition(err)
		}
	}
	return nil
}

// takeOnAgentSide gives the calling thread, while it is still in the
// agent's mount namespace (its /proc and cgroup file systems), the app's
// cgroup (home is where it goes back to), security module exec labels and
// capability sets. It returns the thread's cgroup placement (nil without
// a cgroup), to be released after the fork; on failure it has released
// it.
func takeOnAgentSide(d *directExec, home *cgroups.Cgroup) (placed *cgroups.ThreadPlacement, err error) {
	app := d.app
	if d.cg != nil {
		if placed, err = d.cg.PlaceThread(home); err != nil {
			return nil, fmt.Errorf("app %s: join cgroup: %w", app.ID, err)
		}
		defer func() {
			if err != nil {
				_ = placed.Release()
				placed = nil
			}
		}()
	}
	if err := setExecLabels(app); err != nil {
		return placed, err
	}
	// The bounding set only bounds what execve grants: the thread keeps
	// the rights it needs until the fork. The inheritable and ambient
	// sets are emptied, as exec-init does.
	if err := dropBounding(d.caps); err != nil {
		return placed, err
	}
	own, err := capability.NewPid2(0)
	if err == nil {
		err = own.Load()
	}
	var known []capability.Cap
	if err == nil {
		known, err = capability.ListSupported()
	}
	if err == nil {
		// (Clear takes whole groups: CAPS would also empty the
		// effective set.)
		own.Unset(capability.INHERITABLE|capability.AMBIENT, known...)
		err = own.Apply(capability.CAPS | capability.AMBS)
	}
	if err != nil {
		return placed, fmt.Errorf("capabilities: %w", err)
	}
	return placed, nil
}

// enterApp moves the calling thread into the app's cgroup namespace
// (d.cgns, unless nil), PID namespace (for its children), UTS namespace
// and, last, mount namespace.
//
// The cgroup namespace is joined only where the thread was moved into
// the app's cgroups (cgroup v1): a command cloned into a v2 cgroup
// (CLONE_INTO_CGROUP) must be cloned from a thread that sees both its
// own cgroup and the app's, which the app's namespace hides where cgroup2
// delegates at namespaces (nsdelegate). Such a command reads its cgroup
// relative to the agent's (/proc/self/cgroup "0::/app-ID"), and so do
// the mounts it reads: the same directory, named from another root.
func enterApp(d *directExec) error {
	if d.cgns != nil {
		if err := unix.Setns(int(d.cgns.Fd()), unix.CLONE_NEWCGROUP); err != nil {
			return failedPrecondition(fmt.Errorf("join the app's cgroup namespace: %w", err))
		}
	}
	if d.pidns != nil {
		if err := unix.Setns(int(d.pidns.Fd()), unix.CLONE_NEWPID); err != nil {
			return failedPrecondition(fmt.Errorf("enter the app's PID namespace: %w", err))
		}
	}
	if d.uts != nil {
		if err := unix.Setns(int(d.uts.Fd()), unix.CLONE_NEWUTS); err != nil {
			return failedPrecondition(fmt.Errorf("join uts namespace: %w", err))
		}
	}
	if err := joinMountNS(int(d.mnt.Fd())); err != nil {
		return failedPrecondition(fmt.Errorf("enter the app's mount namespace: %w", err))
	}
	return nil
}

// classify gives an error of the direct path the class exec-init's
// report would have: a childError's own, else FailedPrecondition.
func classify(err error) error {
	var ce *childError
	if errors.As(err, &ce) {
		return errdefs.New(wire.ClassOf(ce.code), "%w", ce.err)
	}
	return errdefs.New(errdefs.ErrFailedPrecondition, "%w", err)
}

// execEnv is the environment of an exec'd command: the app's, with a
// default PATH and, on a terminal, TERM.
func execEnv(env []string, tty bool) []string {
	if _, ok := envValue(env, "TERM"); tty && !ok {
		env = append(slices.Clip(env), "TERM=xterm")
	}
	if _, ok := envValue(env, "PATH"); !ok {
		env = append(slices.Clip(env), "PATH="+defaultPath)
	}
	return env
}
