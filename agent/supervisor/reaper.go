package supervisor

import (
	"errors"
	"log/slog"
	"os"
	"os/signal"
	"strconv"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
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
}

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
	}
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
