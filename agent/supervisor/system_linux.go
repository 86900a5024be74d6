package supervisor

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/agent/wire"
	"github.com/stagelet/stagelet/cgroups"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/rlimit"
)

// linuxSystem is the real System: apps and execs are `stagelet agent
// init|exec-init` children, reaped by the agent, set up through a sync
// socket (see init.go) in the cgroups beneath the agent's own.
type linuxSystem struct {
	log    *slog.Logger
	exe    string
	reaper *reaper
	// cg is the agent's own cgroup, the parent of every app's; nil when
	// cgroups are not available (limits are then not applied).
	cg *cgroups.Cgroup
	// own is the cgroup the agent's threads are in (cg but for the
	// memory controller, see withMemory); nil with cg.
	own *cgroups.Cgroup
	// execInit: every exec goes through `agent exec-init`.
	execInit bool

	mu sync.Mutex
	// gates are the apps' cgroup gates (guardedCgroup), by app ID.
	gates map[string]*sync.RWMutex
	// rlimits are the limits last given to useRlimits.
	rlimits []rlimit.Limit
}

// Linux returns the real System: exe is the stagelet binary re-executed
// to start apps and execs (empty: /proc/self/exe). It reaps every child
// of the process from then on, and, on a pure cgroup v2 host, moves the
// process into a leaf of its cgroup (so that the cgroup may hand
// controllers to the apps'); a process makes one.
func Linux(exe string, log *slog.Logger) System { return newLinux(exe, log, "", false) }

// newLinux is Linux whose apps' memory cgroups go beneath memoryCgroup,
// when set on a cgroup v1 host (see Config.MemoryCgroup), and whose execs
// all go through `agent exec-init` with execInit.
func newLinux(exe string, log *slog.Logger, memoryCgroup string, execInit bool) System {
	if log == nil {
		log = slog.Default()
	}
	if exe == "" {
		exe = "/proc/self/exe"
	}
	l := &linuxSystem{log: log, exe: exe, execInit: execInit}
	if cg, err := cgroups.EnterLeaf(cgroups.LeafName); err != nil {
		log.Warn("cgroups unavailable: app limits and stats are off", "err", err)
	} else {
		l.own, l.cg = cg, withMemory(cg, memoryCgroup, log)
	}
	l.reaper = newReaper(log)
	return l
}

// withMemory is cg with its memory directory replaced by dir
// (cgroups.WithMemory: the pod cgroup's memory cgroup, where the agent
// itself is charged to the runtime's, cgroups.RuntimeMemoryCgroup), when
// dir is set, cg a cgroup v1 cgroup with a memory controller and dir a
// memory cgroup; otherwise cg, with a warning when dir was set.
func withMemory(cg *cgroups.Cgroup, dir string, log *slog.Logger) *cgroups.Cgroup {
	if dir == "" {
		return cg
	}
	if _, ok := cg.Paths["memory"]; !ok || cg.IsV2() {
		log.Warn("no cgroup v1 memory controller: the pod's memory cgroup is not used", "memoryCgroup", dir)
		return cg
	}
	if fi, err := os.Stat(filepath.Join(dir, "memory.limit_in_bytes")); err != nil || !fi.Mode().IsRegular() {
		log.Warn("not a memory cgroup: the apps' memory cgroups stay beneath the agent's", "memoryCgroup", dir, "err", err)
		return cg
	}
	return cgroups.WithMemory(cg, &cgroups.Cgroup{Paths: map[string]string{"memory": dir}})
}

func (l *linuxSystem) podCgroup() cgroup {
	if l.cg == nil {
		return nil
	}
	return l.cg
}

func (l *linuxSystem) appCgroup(id string) cgroup {
	if l.cg == nil {
		return nil
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	gate, ok := l.gates[id]
	if !ok {
		if l.gates == nil {
			l.gates = map[string]*sync.RWMutex{}
		}
		gate = &sync.RWMutex{}
		l.gates[id] = gate
	}
	return &guardedCgroup{Cgroup: l.cg.Child(api.AppCgroup(id)), gate: gate, forget: func() {
		l.mu.Lock()
		delete(l.gates, id)
		l.mu.Unlock()
	}}
}

// guardedCgroup is an app's cgroup under the linux system. On cgroup v1 a
// thread of the agent that starts a process in the app (an exec's command
// from the agent's thread, a restorer) sits in the app's cgroups until it
// forked (cgroups.PlaceThread, Cgroup.Start). A Kill of the app's cgroup
// then (the app's process exited, its OOM group fired) would freeze that
// thread, and a Go thread stopped in user space stalls the whole agent at
// the runtime's next stop-the-world, for good; and its sweep would SIGKILL
// the agent, whose PID the cgroup lists while one of its threads is in it.
// So such a start holds the gate shared (place) and Kill holds it alone:
// Kill waits for the thread to leave, and a start waits for a Kill under
// way. All of an app's cgroups share one gate.
type guardedCgroup struct {
	*cgroups.Cgroup
	gate *sync.RWMutex
	// forget drops the gate once the cgroup is deleted.
	forget func()
}

// Kill implements cgroup: the cgroup's Kill once no thread of the agent
// is placed in it.
func (c *guardedCgroup) Kill() error {
	c.gate.Lock()
	defer c.gate.Unlock()
	return c.Cgroup.Kill()
}

// Delete implements cgroup.
func (c *guardedCgroup) Delete() error {
	if err := c.Cgroup.Delete(); err != nil {
		return err
	}
	c.forget()
	return nil
}

// place runs f, which puts a thread of the agent into the cgroup and takes
// it out again, never while a Kill of it runs.
func (c *guardedCgroup) place(f func() error) error {
	c.gate.RLock()
	defer c.gate.RUnlock()
	return f()
}

// useRlimits gives the agent's own process the limits of ls that differ
// from its own, so that every process it starts (an app's init, an
// exec'd command, one forked from the agent's thread, which no per-child
// limit reaches) gets them: in a VM's guest the agent, the kernel's init,
// starts with the kernel's defaults. For open files only a hard limit
// that differs counts: the agent's soft one was raised by the Go runtime,
// which gives its children the one the agent started with, the daemon's
// children's in every stage1 that starts the agent from the daemon.
func (l *linuxSystem) useRlimits(ls []rlimit.Limit) {
	if ls == nil {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if slices.Equal(ls, l.rlimits) {
		return
	}
	own, err := rlimit.Of(0)
	if err != nil {
		l.log.Warn("the apps' resource limits", "err", err)
		return
	}
	var differ []rlimit.Limit
	for _, want := range ls {
		i := slices.IndexFunc(own, func(o rlimit.Limit) bool { return o.Type == want.Type })
		switch {
		case i < 0:
			differ = append(differ, want)
		case want.Type == "RLIMIT_NOFILE" && own[i].Hard != want.Hard:
			differ = append(differ, want)
		case want.Type != "RLIMIT_NOFILE" && own[i] != want:
			differ = append(differ, want)
		}
	}
	warn := func(format string, args ...any) {
		l.log.Warn("the apps' resource limits", "warning", fmt.Sprintf(format, args...))
	}
	if err := rlimit.Apply(differ, warn); err != nil {
		l.log.Warn("the apps' resource limits", "err", err)
		return
	}
	l.rlimits = slices.Clone(ls)
}

func (l *linuxSystem) setSysctls(sysctls map[string]string, scratch string) error {
	return setIPCSysctls(sysctls, scratch)
}

func (l *linuxSystem) kernel() string {
	var u unix.Utsname
	if unix.Uname(&u) != nil {
		return ""
	}
	return unix.ByteSliceToString(u.Release[:])
}

// dialPort connects to port on the loopback of the network namespace the
// agent runs in (the pod's): 127.0.0.1 first, then ::1.
func (l *linuxSystem) dialPort(port int32) (net.Conn, error) {
	p := strconv.Itoa(int(port))
	d := net.Dialer{Timeout: dialTimeout}
	conn, err4 := d.Dial("tcp4", net.JoinHostPort("127.0.0.1", p))
	if err4 != nil {
		var err6 error
		if conn, err6 = d.Dial("tcp6", net.JoinHostPort("::1", p)); err6 != nil {
			return nil, errdefs.FailedPrecondition("port-forward: cannot connect to port %s in the pod: IPv4: %v; IPv6: %v", p, err4, err6)
		}
	}
	return conn, nil
}

// start spawns `agent init` (an app) or `agent exec-init` (an exec) and
// takes it through its handshake. A child that fails its setup is killed;
// the error then carries what it wrote to its stderr, if anything (a Go
// runtime's fatal error, say).
func (l *linuxSystem) start(s *startSpec) (*child, error) {
	var c *child
	var err error
	ps := &procSpec{App: s.app, Args: s.args, TTY: s.cio.tty}
	if s.exec {
		ps.JoinUTS, ps.Size = s.app.OwnUTS(), s.size
		c, err = l.spawnExec(s)
	} else {
		c, err = l.spawnApp(s)
	}
	if err != nil {
		return nil, err
	}
	if c.sync == nil {
		return c, nil // started directly (execdirect_linux.go)
	}
	if !s.deadline.IsZero() {
		c.sync.SetDeadline(s.deadline)
	}
	herr := l.handshake(c, ps, s.cg, s.app.ID)
	if herr == nil {
		return c, nil
	}
	_ = signalProc(c.proc, syscall.SIGKILL)
	ws := <-c.wait
	if c.stderr != nil && !errors.Is(herr, errdefs.ErrDeadlineExceeded) {
		// The child is gone and the agent's copy of its end closed: what
		// it wrote reads to its end, unless something it left holds the
		// pipe (bounded).
		c.stderr.SetReadDeadline(time.Now().Add(drainTimeout))
		out, _ := io.ReadAll(io.LimitReader(c.stderr, 2048))
		if out = bytes.TrimSpace(out); len(out) > 0 {
			herr = fmt.Errorf("%w; exit code %d, stderr: %s", herr, exitCode(ws), out)
		}
	}
	c.closeStdio()
	c.proc.Release()
	return nil, herr
}

// spawnApp spawns an app's init in new mount (and UTS, and PID) namespaces,
// or in the PID namespace of the process s.pid (a target's).
func (l *linuxSystem) spawnApp(s *startSpec) (*child, error) {
	spec := s.app
	cloneflags := uintptr(syscall.CLONE_NEWNS)
	if spec.OwnUTS() {
		cloneflags |= syscall.CLONE_NEWUTS
	}
	if spec.PIDNamespace == api.PIDNamespaceContainer {
		cloneflags |= syscall.CLONE_NEWPID
	}
	spawn := func() (*child, error) {
		return l.spawn(cmdInit, &syscall.SysProcAttr{Setsid: true, Cloneflags: cloneflags}, s.cio)
	}
	if spec.PIDNamespace != api.PIDNamespaceTarget {
		return spawn()
	}
	ns, err := os.Open("/proc/" + strconv.Itoa(s.pid) + "/ns/pid")
	if err != nil {
		return nil, errdefs.FailedPrecondition("app %s: target %s of its PID namespace is not running: %w", spec.ID, spec.PIDTarget, err)
	}
	defer ns.Close()
	var c *child
	err = forkInPIDNamespace(ns, func() error {
		var err error
		c, err = spawn()
		return err
	})
	return c, err
}

// spawnExec starts an exec's command in the mount, UTS and PID namespaces
// of the running app whose process is s.pid, directly from a thread of the
// agent where it can (execdirect_linux.go), else through `agent
// exec-init`: FailedPrecondition when that process is gone.
func (l *linuxSystem) spawnExec(s *startSpec) (*child, error) {
	id, pid, spec := s.app.ID, s.pid, s.app
	// Hold the app's mount (and UTS) namespace open, then check the
	// app's process still exists: its pid cannot have been reused yet.
	mnt, err := os.Open("/proc/" + strconv.Itoa(pid) + "/ns/mnt")
	if err != nil {
		return nil, errdefs.FailedPrecondition("app %s is not running: %w", id, err)
	}
	defer mnt.Close()
	// The app's cgroup namespace (its init made one, see cgroupview.go).
	cgns, err := os.Open("/proc/" + strconv.Itoa(pid) + "/ns/cgroup")
	if err != nil {
		return nil, errdefs.FailedPrecondition("app %s is not running: %w", id, err)
	}
	defer cgns.Close()
	extra := []*os.File{mnt, cgns}
	if spec.OwnUTS() {
		uts, err := os.Open("/proc/" + strconv.Itoa(pid) + "/ns/uts")
		if err != nil {
			return nil, errdefs.FailedPrecondition("app %s is not running: %w", id, err)
		}
		defer uts.Close()
		extra = append(extra, uts)
	}
	if err := s.appProc.Signal(syscall.Signal(0)); err != nil {
		return nil, errdefs.FailedPrecondition("app %s is not running", id)
	}
	var pidns *os.File
	if spec.PIDNamespace == api.PIDNamespaceContainer || spec.PIDNamespace == api.PIDNamespaceTarget {
		pidns, err = os.Open("/proc/" + strconv.Itoa(pid) + "/ns/pid")
		if err != nil {
			return nil, errdefs.FailedPrecondition("app %s is not running: %w", id, err)
		}
		defer pidns.Close()
	}
	// A thread can place its fork in a cgroup of the cgroups package.
	if gc, ok := s.cg.(*guardedCgroup); ok || s.cg == nil {
		var cg *cgroups.Cgroup
		if ok {
			cg = gc.Cgroup
		}
		d, err := l.planDirect(s, cg)
		if err != nil {
			return nil, classify(err)
		}
		if d != nil {
			d.guard = gc
			d.mnt, d.pidns = mnt, pidns
			if spec.OwnUTS() {
				d.uts = extra[2]
			}
			if cg == nil || !cg.IsV2() {
				d.cgns = cgns
			}
			if !s.deadline.IsZero() && time.Now().After(s.deadline) {
				return nil, fmt.Errorf("app %s: %w", id, errdefs.ErrDeadlineExceeded)
			}
			return l.startDirect(d, s.cio)
		}
	}
	spawn := func() (*child, error) {
		return l.spawn(cmdExecInit, &syscall.SysProcAttr{Setsid: true}, s.cio, extra...)
	}
	if pidns == nil {
		return spawn()
	}
	var c *child
	err = forkInPIDNamespace(pidns, func() error {
		var err error
		c, err = spawn()
		return err
	})
	return c, err
}

// spawn starts `agent <cmd>` with the sync socket as fd 3, extra files
// after it, and stdio as cio says.
func (l *linuxSystem) spawn(cmd string, sys *syscall.SysProcAttr, cio childIO, extra ...*os.File) (*child, error) {
	c, stdio, theirs, err := openStdio(cio)
	if err != nil {
		return nil, err
	}
	fail := func(err error) (*child, error) {
		for _, f := range theirs {
			f.Close()
		}
		if c.sync != nil {
			c.sync.Close()
		}
		c.closeStdio()
		return nil, err
	}
	parent, childSock, err := socketPair()
	if err != nil {
		return fail(err)
	}
	c.sync = parent
	theirs = append(theirs, childSock)
	attr := &os.ProcAttr{
		Dir:   "/",
		Env:   []string{},
		Files: append(append(stdio, childSock), extra...),
		Sys:   sys,
	}
	p, wait, err := l.reaper.start(l.exe, []string{"stagelet", "agent", cmd}, attr)
	if err != nil {
		return fail(errdefs.FailedPrecondition("start %s: %w", cmd, err))
	}
	for _, f := range theirs {
		f.Close()
	}
	c.proc, c.pid, c.wait = p, p.Pid, wait
	return c, nil
}

// openStdio returns a child holding the agent's ends of the stdio cio
// asks for, the child's stdio (/dev/null where cio asks for none; all of
// it with a terminal, which the child opens) and the files to close once
// the child started.
func openStdio(cio childIO) (*child, []*os.File, []*os.File, error) {
	c := &child{}
	var theirs []*os.File
	fail := func(err error) (*child, []*os.File, []*os.File, error) {
		for _, f := range theirs {
			f.Close()
		}
		c.closeStdio()
		return nil, nil, nil, err
	}
	devnull, err := os.OpenFile(os.DevNull, os.O_RDWR, 0)
	if err != nil {
		return fail(err)
	}
	theirs = append(theirs, devnull)
	stdio := []*os.File{devnull, devnull, devnull}
	if cio.stdin && !cio.tty {
		r, w, err := os.Pipe()
		if err != nil {
			return fail(err)
		}
		c.stdin, stdio[0] = w, r
		theirs = append(theirs, r)
	}
	if !cio.tty {
		for i, mine := range []**os.File{&c.stdout, &c.stderr} {
			r, w, err := os.Pipe()
			if err != nil {
				return fail(err)
			}
			*mine, stdio[i+1] = r, w
			theirs = append(theirs, w)
		}
	}
	return c, stdio, theirs, nil
}

// handshake moves the child into cg, sends it spec and reads its messages
// until it executes the command (nil) or reports a failure (an error of
// the class it names). A child on a terminal sends its master, kept in
// c.pty. The sync socket is closed on return.
func (l *linuxSystem) handshake(c *child, spec *procSpec, cg cgroup, id string) error {
	defer c.sync.Close()
	if cg != nil {
		if err := cg.Add(c.pid); err != nil {
			return fmt.Errorf("app %s: join cgroup: %w", id, err)
		}
	}
	// The spec goes without json.Encoder's trailing newline: the child's
	// decoder stops at the closing brace, and a byte it leaves unread
	// would turn its close-on-exec into a connection reset here.
	b, err := json.Marshal(spec)
	if err != nil {
		return fmt.Errorf("app %s: encode spec: %w", id, err)
	}
	if _, err := c.sync.Write(b); err != nil {
		return fmt.Errorf("app %s: send spec to init: %w", id, err)
	}
	rr, err := newRightsReader(c.sync)
	if err != nil {
		return err
	}
	defer rr.close()
	dec := json.NewDecoder(rr)
	execing := false
	for {
		var m syncMsg
		if err := dec.Decode(&m); err != nil {
			if errors.Is(err, os.ErrDeadlineExceeded) {
				return fmt.Errorf("app %s: %w", id, errdefs.ErrDeadlineExceeded)
			}
			// After "exec" the socket closes by close-on-exec: EOF, or a
			// reset when the child left something unread.
			if execing && (errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET)) {
				if spec.TTY && c.pty == nil {
					return fmt.Errorf("app %s: init ran the command without a terminal", id)
				}
				return nil // close-on-exec closed the socket: the command runs
			}
			return fmt.Errorf("app %s: init died during setup (%v)", id, err)
		}
		switch {
		case m.Error != "":
			return errdefs.New(wire.ClassOf(m.Code), "%s", m.Error)
		case m.Warn != "":
			l.log.Warn("app init", "app", id, "warning", m.Warn)
		case m.PTY:
			f := rr.take("pty-master")
			if f == nil || c.pty != nil {
				if f != nil {
					f.Close()
				}
				return fmt.Errorf("app %s: init sent a bad terminal message", id)
			}
			c.pty = newTerminal(f)
		case m.Exec:
			execing = true
		}
	}
}

// socketPair returns two connected stream sockets: the agent's end as a
// net.Conn (deadlines work) and the child's as a file.
func socketPair() (net.Conn, *os.File, error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, nil, fmt.Errorf("socketpair: %w", err)
	}
	pf := os.NewFile(uintptr(fds[0]), "sync")
	conn, err := net.FileConn(pf)
	pf.Close()
	if err != nil {
		unix.Close(fds[1])
		return nil, nil, err
	}
	return conn, os.NewFile(uintptr(fds[1]), "sync-child"), nil
}

func (l *linuxSystem) adopt(pid int) (process, <-chan syscall.WaitStatus, error) {
	wait, err := l.reaper.adopt(pid)
	if err != nil {
		return nil, nil, err
	}
	p, err := os.FindProcess(pid) // never fails on Linux
	if err != nil {
		return nil, nil, err
	}
	return p, wait, nil
}

// restorerOutput bounds the output of a restorer kept for its error.
const restorerOutput = 64 << 10

func (l *linuxSystem) runRestorer(ctx context.Context, cg cgroup, argv []string, files []*os.File) (*api.ExecResult, error) {
	if len(argv) == 0 {
		return nil, errdefs.InvalidArgument("restore: no restorer")
	}
	path, err := exec.LookPath(argv[0])
	if err != nil {
		return nil, errdefs.FailedPrecondition("restore: %w", err)
	}
	outR, outW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	defer outR.Close()
	cmd := exec.Command(path, argv[1:]...)
	cmd.Stdout, cmd.Stderr, cmd.ExtraFiles = outW, outW, files
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	wait, err := l.reaper.startWith(func() (int, error) {
		var err error
		if c, ok := cg.(*guardedCgroup); ok && c != nil {
			err = c.place(func() error { return c.Start(cmd) })
		} else {
			err = cmd.Start()
		}
		if err != nil {
			return 0, err
		}
		return cmd.Process.Pid, nil
	})
	outW.Close()
	if err != nil {
		return nil, errdefs.FailedPrecondition("restore: start %s: %w", argv[0], err)
	}
	defer cmd.Process.Release()
	out := capBuffer{budget: &outputBudget{left: restorerOutput}}
	read := make(chan struct{})
	go func() {
		_, _ = io.Copy(&out, outR)
		close(read)
	}()
	var ws syscall.WaitStatus
	select {
	case ws = <-wait:
	case <-ctx.Done():
		_ = cmd.Process.Kill()
		ws = <-wait
	}
	// What the restorer left behind may hold its output open: read what
	// came, for a moment.
	_ = outR.SetReadDeadline(time.Now().Add(time.Second))
	<-read
	res := &api.ExecResult{ExitCode: exitCode(ws), Stdout: out.buf.Bytes()}
	if ctx.Err() != nil {
		return res, fmt.Errorf("restore: %s: %w", argv[0], errdefs.ErrDeadlineExceeded)
	}
	return res, nil
}
