package supervisor

import (
	"context"
	"net"
	"os"
	"syscall"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/cgroups"
	"github.com/stagelet/stagelet/internal/rlimit"
)

// System is what the agent does to the system beneath its apps: it starts
// their processes and execs, gives them cgroups, sets the pod's IPC
// sysctls and reaches its loopback. Everything else, the app table and its
// records, events, exec, attach and port-forward sessions, the protocol,
// is the agent's and the same over any System. Linux (the default, see
// Config.System) runs real processes; Toy runs every process in-process,
// for tests that have no root (stage1/fake). Its methods are unexported:
// those two are the only ones.
type System interface {
	// start starts a process as s says and returns once it runs s.args
	// (or failed to, and is gone).
	start(s *startSpec) (*child, error)
	// adopt takes pid, a child of the agent it did not start (a restored
	// app's process), as an app's process, with the channel that receives
	// its exit status once. FailedPrecondition when it cannot.
	adopt(pid int) (process, <-chan syscall.WaitStatus, error)
	// runRestorer runs argv, a restorer of an app whose processes are to
	// be the agent's, as a child of the agent in the app's cgroup cg with
	// files as its fds 3 on, and returns its exit code and output once it
	// exited. ctx's end kills it.
	runRestorer(ctx context.Context, cg cgroup, argv []string, files []*os.File) (*api.ExecResult, error)
	// podCgroup is the agent's own cgroup, the parent of every app's, and
	// appCgroup app id's; nil (an untyped nil) when cgroups are not
	// available.
	podCgroup() cgroup
	appCgroup(id string) cgroup
	// setSysctls sets IPC sysctls in the pod's IPC namespace (scratch: a
	// directory of the agent's).
	setSysctls(sysctls map[string]string, scratch string) error
	// dialPort connects to TCP port on the pod's loopback: FailedPrecondition
	// when nothing accepts.
	dialPort(port int32) (net.Conn, error)
	// kernel names the kernel the apps run on (Info).
	kernel() string
	// useRlimits makes the agent's children start with the limits ls
	// (nil: as they are), where they differ from its own, warning where
	// it cannot; see linuxSystem's.
	useRlimits(ls []rlimit.Limit)
}

// startSpec is a process to start: an app's own, or an exec'd command in a
// running app.
type startSpec struct {
	app  *api.AppSpec
	args []string
	// exec: a command in the running app whose process is pid (appProc);
	// otherwise the app's process, in the PID namespace of the process pid
	// when the app's PIDNamespace is a target's.
	exec    bool
	pid     int
	appProc process
	cio     childIO
	size    *api.TerminalSize // an exec's terminal's first size
	cg      cgroup            // the app's; nil: none
	// deadline bounds the setup; zero: none.
	deadline time.Time
}

// process is a started process as the agent controls it: *os.Process for
// Linux.
type process interface {
	Signal(os.Signal) error
	Release() error
}

// cgroup is a cgroup as the agent uses it: *cgroups.Cgroup for Linux.
type cgroup interface {
	Create() error
	Set(cgroups.Resources) error
	SetDevices([]specs.LinuxDeviceCgroup) error
	Add(pid int) error
	Kill() error
	OOMKills() (uint64, error)
	Stats() (*cgroups.Stats, error)
	Delete() error
}

// child is a started process of an app or an exec with the agent's ends
// of its stdio: pipes for stdout and stderr and, when asked, for stdin;
// or, for a child on a terminal, the terminal's master.
type child struct {
	proc process
	pid  int
	// wait delivers the process's status once it exited.
	wait <-chan syscall.WaitStatus
	// sync is the linux system's socket to a child in setup (`agent
	// init|exec-init`); nil once it runs its command.
	sync   net.Conn
	stdin  *os.File // nil: the child's stdin is /dev/null
	stdout *os.File
	stderr *os.File
	pty    *terminal // set by the handshake of a child on a terminal
}

// childIO is the stdio a child gets.
type childIO struct {
	// stdin: a pipe whose write end the agent keeps (else /dev/null).
	stdin bool
	// tty: the child opens a terminal and sends its master in the
	// handshake; its stdio starts on /dev/null and the agent gets no pipes.
	tty bool
}

// closeStdio closes the agent's ends of the child's stdio.
func (c *child) closeStdio() {
	for _, f := range []*os.File{c.stdin, c.stdout, c.stderr} {
		if f != nil {
			f.Close()
		}
	}
	if c.pty != nil {
		c.pty.Close()
	}
}
