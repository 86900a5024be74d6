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
	opts, fset, err := parseAgentFlags(args)
	if err != nil {
		return 2
	}
	if opts.netns != "" || opts.privateIPC {
		// Does not return on success.
		err := reexecInNamespaces(opts.netns, opts.privateIPC, args)
		fmt.Fprintf(os.Stderr, "stagelet agent: --netns %q --private-ipc=%v: %v\n", opts.netns, opts.privateIPC, err)
		return 1
	}
	if opts.socket == "" || opts.stateDir == "" || fset.NArg() != 0 {
		fmt.Fprintln(os.Stderr, "stagelet agent: --socket and --state-dir are required, and no arguments")
		fset.Usage()
		return 2
	}
	var lvl slog.Level
	if err := lvl.UnmarshalText([]byte(strings.ToLower(opts.level))); err != nil {
		fmt.Fprintf(os.Stderr, "stagelet agent: bad --log-level %q\n", opts.level)
		return 2
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: lvl})).With("component", "agent")

	// Signals first: SIGCHLD for the reaper is set up in New; SIGTERM must
	// not be lost while starting.
	term := make(chan os.Signal, 1)
	signal.Notify(term, unix.SIGTERM, unix.SIGINT)

	if !prepareAgentProcess(log, opts.hostname) {
		return 1
	}
	return serveAgent(opts, log, term)
}

// agentOptions are the flags of `stagelet agent`.
type agentOptions struct {
	socket, stateDir, level string
	stopTimeout             time.Duration
	netns, hostname         string
	memoryCgroup            string
	execInit, privateIPC    bool
}

// parseAgentFlags parses the flags of `stagelet agent`. The flag set is
// returned for its remaining arguments and usage; a parse error has
// already been reported on stderr.
func parseAgentFlags(args []string) (*agentOptions, *flag.FlagSet, error) {
	var o agentOptions
	fset := flag.NewFlagSet("stagelet agent", flag.ContinueOnError)
	fset.StringVar(&o.socket, "socket", "", "unix socket to serve the agent protocol on")
	fset.StringVar(&o.stateDir, "state-dir", "", "directory for the apps' records")
	fset.StringVar(&o.level, "log-level", "info", "log level: debug, info, warn, error")
	fset.DurationVar(&o.stopTimeout, "shutdown-timeout", 10*time.Second, "how long apps get between SIGTERM and SIGKILL when the agent is terminated by a signal")
	fset.StringVar(&o.netns, "netns", "", "network namespace to run in (a bind-mounted netns file); the agent re-executes itself inside it")
	fset.StringVar(&o.hostname, "hostname", "", "hostname to set in the agent's UTS namespace, which must be the pod's own (nspawn's)")
	fset.StringVar(&o.memoryCgroup, "memory-cgroup", "", "cgroup v1: the pod's memory cgroup directory, beneath which the apps' memory cgroups go when the agent itself is charged to another")
	fset.BoolVar(&o.execInit, "exec-init", false, "start every exec'd command through `stagelet agent exec-init`, never straight from the agent (to tell the two apart when debugging)")
	fset.BoolVar(&o.privateIPC, "private-ipc", false, "run in a new IPC namespace (the agent re-executes itself in it): for a pod that does not share the host's")
	if err := fset.Parse(args); err != nil {
		return nil, nil, err
	}
	return &o, fset, nil
}

// prepareAgentProcess sets the pod's hostname, when given, and readies
// the process to start apps: as PID 1 it mounts /proc if missing and
// makes its cgroups writable, otherwise it becomes the child subreaper.
// It logs what goes wrong; false means the agent cannot start.
func prepareAgentProcess(log *slog.Logger, hostname string) bool {
	if hostname != "" {
		if err := unix.Sethostname([]byte(hostname)); err != nil {
			log.Error("set the pod's hostname", "hostname", hostname, "err", err)
			return false
		}
	}
	if os.Getpid() == 1 {
		if err := ensureProc(); err != nil {
			log.Error("mount /proc", "err", err)
			return false
		}
		if err := writableCgroups(); err != nil {
			log.Warn("cannot make the agent's cgroups writable: app limits and stats may be off", "err", err)
		}
	} else if err := unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); err != nil {
		log.Warn("cannot become child subreaper: orphans of apps are not reaped by the agent", "err", err)
	}
	return true
}

// serveAgent starts the agent and serves its protocol on o.socket until
// OpShutdown or a signal on term (which stops every app first), then
// removes the socket. It returns the process exit code.
func serveAgent(o *agentOptions, log *slog.Logger, term <-chan os.Signal) int {
	a, err := New(Config{StateDir: o.stateDir, Logger: log, MemoryCgroup: o.memoryCgroup, ExecInit: o.execInit})
	if err != nil {
		log.Error("start", "err", err)
		return 1
	}
	l, err := listenUnix(o.socket)
	if err != nil {
		log.Error("listen", "socket", o.socket, "err", err)
		return 1
	}
	defer os.Remove(o.socket)
	go func() {
		select {
		case s := <-term:
			log.Info("terminating: stopping every app", "signal", s.String())
			a.StopAll(o.stopTimeout)
			a.Close()
		case <-a.Done():
		}
	}()
	log.Info("agent serving", "socket", o.socket, "pid", os.Getpid())
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
