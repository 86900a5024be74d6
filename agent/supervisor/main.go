package supervisor

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/agent/transport"
	"github.com/stagelet/stagelet/cgroups"
)

// Main runs `stagelet agent ARGS` and returns the process exit code:
//
//	stagelet agent --socket PATH --state-dir DIR [--log-level L] [--shutdown-timeout D] [--netns PATH] [--private-ipc] [--hostname NAME] [--memory-cgroup DIR] [--exec-init]
//
// With --netns the agent first re-executes itself inside that network
// namespace, with --private-ipc inside a new IPC namespace, so that it and
// every app it starts live there.
// serves the agent protocol on a unix socket (mode 0600; a stale socket is
// replaced) until OpShutdown or SIGTERM/SIGINT (both stop every app first),
// then returns 0. As PID 1 it mounts /proc if missing and makes its own
// cgroups writable when they are mounted read-only; otherwise it makes
// itself the child subreaper, so that orphans of apps are reaped by it.
//
// `stagelet agent guest` is the init of a kvm pod's VM (package
// guestinit; the command dispatches it).
//
// `stagelet agent init` and `stagelet agent exec-init` are internal: the
// agent runs them to start an app or an exec'd command.
func Main(args []string) int {
	if len(args) > 0 {
		switch args[0] {
		case cmdInit, cmdExecInit:
			return childMain(args[0])
		}
	}
	fset := flag.NewFlagSet("stagelet agent", flag.ContinueOnError)
	socket := fset.String("socket", "", "unix socket to serve the agent protocol on")
	stateDir := fset.String("state-dir", "", "directory for the apps' records")
	level := fset.String("log-level", "info", "log level: debug, info, warn, error")
	stopTimeout := fset.Duration("shutdown-timeout", 10*time.Second, "how long apps get between SIGTERM and SIGKILL when the agent is terminated by a signal")
	netns := fset.String("netns", "", "network namespace to run in (a bind-mounted netns file); the agent re-executes itself inside it")
	hostname := fset.String("hostname", "", "hostname to set in the agent's UTS namespace, which must be the pod's own (nspawn's)")
	memoryCgroup := fset.String("memory-cgroup", "", "cgroup v1: the pod's memory cgroup directory, beneath which the apps' memory cgroups go when the agent itself is charged to another")
	execInit := fset.Bool("exec-init", false, "start every exec'd command through `stagelet agent exec-init`, never straight from the agent (to tell the two apart when debugging)")
	privateIPC := fset.Bool("private-ipc", false, "run in a new IPC namespace (the agent re-executes itself in it): for a pod that does not share the host's")
	if err := fset.Parse(args); err != nil {
		return 2
	}
	if *netns != "" || *privateIPC {
		// Does not return on success.
		err := reexecInNamespaces(*netns, *privateIPC, args)
		fmt.Fprintf(os.Stderr, "stagelet agent: --netns %q --private-ipc=%v: %v\n", *netns, *privateIPC, err)
		return 1
	}
	if *socket == "" || *stateDir == "" || fset.NArg() != 0 {
		fmt.Fprintln(os.Stderr, "stagelet agent: --socket and --state-dir are required, and no arguments")
		fset.Usage()
		return 2
	}
	var lvl slog.Level
	if err := lvl.UnmarshalText([]byte(strings.ToLower(*level))); err != nil {
		fmt.Fprintf(os.Stderr, "stagelet agent: bad --log-level %q\n", *level)
		return 2
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: lvl})).With("component", "agent")

	// Signals first: SIGCHLD for the reaper is set up in New; SIGTERM must
	// not be lost while starting.
	term := make(chan os.Signal, 1)
	signal.Notify(term, unix.SIGTERM, unix.SIGINT)

	if *hostname != "" {
		if err := unix.Sethostname([]byte(*hostname)); err != nil {
			log.Error("set the pod's hostname", "hostname", *hostname, "err", err)
			return 1
		}
	}
	if os.Getpid() == 1 {
		if err := ensureProc(); err != nil {
			log.Error("mount /proc", "err", err)
			return 1
		}
		if err := writableCgroups(); err != nil {
			log.Warn("cannot make the agent's cgroups writable: app limits and stats may be off", "err", err)
		}
	} else if err := unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); err != nil {
		log.Warn("cannot become child subreaper: orphans of apps are not reaped by the agent", "err", err)
	}

	a, err := New(Config{StateDir: *stateDir, Logger: log, MemoryCgroup: *memoryCgroup, ExecInit: *execInit})
	if err != nil {
		log.Error("start", "err", err)
		return 1
	}
	l, err := listenUnix(*socket)
	if err != nil {
		log.Error("listen", "socket", *socket, "err", err)
		return 1
	}
	defer os.Remove(*socket)
	go func() {
		select {
		case s := <-term:
			log.Info("terminating: stopping every app", "signal", s.String())
			a.StopAll(*stopTimeout)
			a.Close()
		case <-a.Done():
		}
	}()
	log.Info("agent serving", "socket", *socket, "pid", os.Getpid())
	if err := a.Serve(l); err != nil {
		log.Error("serve", "err", err)
		return 1
	}
	log.Info("agent exiting")
	return 0
}

// listenUnix listens on path with mode 0600, replacing a stale socket; a
// socket some process still accepts on is not replaced.
func listenUnix(path string) (net.Listener, error) {
	if st, err := os.Lstat(path); err == nil {
		if st.Mode()&fs.ModeSocket == 0 {
			return nil, fmt.Errorf("%s exists and is not a socket", path)
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		c, err := transport.DialUnix(ctx, path)
		cancel()
		if err == nil {
			c.Close()
			return nil, fmt.Errorf("%s: another process serves this socket", path)
		}
		if err := os.Remove(path); err != nil {
			return nil, err
		}
	} else if !errors.Is(err, fs.ErrNotExist) {
		return nil, err
	}
	old := syscall.Umask(0o177)
	l, err := transport.ListenUnix(path)
	syscall.Umask(old)
	if err != nil {
		return nil, err
	}
	l.(*net.UnixListener).SetUnlinkOnClose(false)
	if err := os.Chmod(path, 0o600); err != nil {
		l.Close()
		return nil, err
	}
	return l, nil
}

// ensureProc mounts /proc when the agent is PID 1 and the /proc it has is
// not its PID namespace's: nothing mounted one (a bare system), or it is
// the parent namespace's (a kvm pod's agent in the pod's user namespace,
// started by the VM's init). Starting apps re-executes /proc/self/exe,
// and the agent finds its apps by the PIDs it sees.
func ensureProc() error {
	if self, err := os.Readlink("/proc/self"); err == nil && self == "1" {
		return nil
	}
	if err := os.MkdirAll("/proc", 0o555); err != nil {
		return err
	}
	return unix.Mount("proc", "/proc", "proc", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "")
}

// writableCgroups makes the agent's own cgroup directories writable when
// they sit on a read-only mount, as systemd-nspawn mounts the cgroup
// hierarchies of a container: each read-only directory is bound onto
// itself and the bind is remounted read-write. Only for PID 1, whose mount
// namespace is the pod's own. No cgroups at all is not an error.
func writableCgroups() error {
	cg, err := cgroups.Self()
	if err != nil {
		return nil
	}
	seen := map[string]bool{}
	for _, dir := range cg.Paths {
		if seen[dir] {
			continue
		}
		seen[dir] = true
		var st unix.Statfs_t
		if err := unix.Statfs(dir, &st); err != nil {
			return fmt.Errorf("%s: %w", dir, err)
		}
		if st.Flags&unix.ST_RDONLY == 0 {
			continue
		}
		keep := uintptr(st.Flags) & (unix.ST_NOSUID | unix.ST_NODEV | unix.ST_NOEXEC) // same values as MS_*
		if err := unix.Mount(dir, dir, "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("bind %s: %w", dir, err)
		}
		if err := unix.Mount("", dir, "", unix.MS_BIND|unix.MS_REMOUNT|keep, ""); err != nil {
			return fmt.Errorf("remount %s read-write: %w", dir, err)
		}
	}
	return nil
}
