package supervisor

import (
	"bytes"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/errdefs"
)

// reaper is the one place that waits for children of the agent process. On
// every SIGCHLD it calls wait4(-1, WNOHANG) until nothing is left to reap
// and hands each exit status to whoever registered the pid; other children
// (orphans of apps re-parented to the agent as PID 1 or child subreaper)
// are reaped and dropped.
//
// Processes must be started through start, which registers the pid while
// holding the same lock the reaping loop takes, so a child that exits at
// once is never reaped before anybody waits for it. Nothing else in the
// process may wait for children (no exec.Cmd.Wait, no os.Process.Wait).
type reaper struct {
	log     *slog.Logger
	mu      sync.Mutex
	waiters map[int]chan syscall.WaitStatus
	sigs    chan os.Signal
	// orphans are the last exits of children nobody waited for, oldest
	// first: a restored process (see adopt) may exit before it is adopted.
	orphans []orphanExit
}

// orphanExit is the exit of a child nobody waited for.
type orphanExit struct {
	pid int
	ws  syscall.WaitStatus
}

// maxOrphans bounds the orphan exits kept.
const maxOrphans = 64

func newReaper(log *slog.Logger) *reaper {
	r := &reaper{
		log:     log,
		waiters: map[int]chan syscall.WaitStatus{},
		sigs:    make(chan os.Signal, 1),
	}
	signal.Notify(r.sigs, unix.SIGCHLD)
	go r.loop()
	// Children that exited before the handler was installed.
	r.sigs <- unix.SIGCHLD
	return r
}

func (r *reaper) loop() {
	for range r.sigs {
		r.reap()
	}
}

func (r *reaper) reap() {
	r.mu.Lock()
	defer r.mu.Unlock()
	for {
		var ws syscall.WaitStatus
		pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil)
		if errors.Is(err, syscall.EINTR) {
			continue
		}
		if err != nil || pid <= 0 {
			return
		}
		if ch, ok := r.waiters[pid]; ok {
			delete(r.waiters, pid)
			ch <- ws // buffered: never blocks
			continue
		}
		r.log.Debug("reaped orphan", "pid", pid, "status", describeWait(ws))
		if len(r.orphans) == maxOrphans {
			r.orphans = r.orphans[1:]
		}
		r.orphans = append(r.orphans, orphanExit{pid, ws})
	}
}

// adopt returns the channel that receives the exit status of pid, a child
// of this process that start did not start (a restored process handed to
// it), once: at once when it exited already. FailedPrecondition when pid is
// neither a child nor among the last exits of children.
func (r *reaper) adopt(pid int) (<-chan syscall.WaitStatus, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	ch := make(chan syscall.WaitStatus, 1)
	for i := len(r.orphans) - 1; i >= 0; i-- {
		if r.orphans[i].pid == pid {
			ch <- r.orphans[i].ws
			r.orphans = slices.Delete(r.orphans, i, i+1)
			return ch, nil
		}
	}
	ppid, err := parentOf(pid)
	if err != nil {
		return nil, errdefs.FailedPrecondition("process %d: %w", pid, err)
	}
	if ppid != os.Getpid() {
		return nil, errdefs.FailedPrecondition("process %d is not the agent's child (its parent is %d)", pid, ppid)
	}
	if _, ok := r.waiters[pid]; ok {
		return nil, errdefs.FailedPrecondition("process %d is waited for already", pid)
	}
	r.waiters[pid] = ch
	return ch, nil
}

// parentOf is the parent of process pid, from /proc/<pid>/stat.
func parentOf(pid int) (int, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, err
	}
	// pid (comm) state ppid ...: comm may hold spaces and parentheses.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, fmt.Errorf("bad stat %q", b)
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 2 {
		return 0, fmt.Errorf("bad stat %q", b)
	}
	return strconv.Atoi(f[1])
}

// start starts a process like os.StartProcess and returns it with the
// channel that receives its exit status once. The caller must not Wait on
// the process.
func (r *reaper) start(name string, argv []string, attr *os.ProcAttr) (*os.Process, <-chan syscall.WaitStatus, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	p, err := os.StartProcess(name, argv, attr)
	if err != nil {
		return nil, nil, err
	}
	ch := make(chan syscall.WaitStatus, 1)
	r.waiters[p.Pid] = ch
	return p, ch, nil
}

// startWith runs start, which starts a process some other way than start
// does (an exec.Cmd placed in a cgroup) and returns its pid, and returns
// the channel that receives the process's exit status once. The caller
// must not Wait on the process.
func (r *reaper) startWith(start func() (int, error)) (<-chan syscall.WaitStatus, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	pid, err := start()
	if err != nil {
		return nil, err
	}
	ch := make(chan syscall.WaitStatus, 1)
	r.waiters[pid] = ch
	return ch, nil
}

// exitCode is the exit code a shell would show: the process's own code,
// or 128+signal when a signal killed it.
func exitCode(ws syscall.WaitStatus) int32 {
	switch {
	case ws.Exited():
		return int32(ws.ExitStatus())
	case ws.Signaled():
		return 128 + int32(ws.Signal())
	}
	return 255
}

func describeWait(ws syscall.WaitStatus) string {
	if ws.Signaled() {
		return "killed by " + ws.Signal().String()
	}
	return "exit " + strconv.Itoa(int(exitCode(ws)))
}
