package podconn

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/logfile"
)

// A container created with AppSpec.HostLog has its CRI log written here,
// on the host, at its LogPath, from its agent's log session (OpLogs):
// one writer per container, from CreateContainer (or FollowLog, for a
// container the daemon recovered) until the app's output ended, or
// RemoveContainer, or StopLogs. A session that breaks is opened again;
// the agent then sends again what was not acknowledged, which the
// writer acknowledges once it wrote it: lines written but not yet
// acknowledged when the daemon died are written twice, none are lost.

// Retry bounds of a broken log session.
const (
	logRetryMin = 100 * time.Millisecond
	logRetryMax = 5 * time.Second
)

// hostLogs are a pod's log writers, by container.
type hostLogs struct {
	mu sync.Mutex
	w  map[string]*hostLog
	// errors counts the writes and opens of log files that failed.
	errors atomic.Uint64
}

// hostLog writes one container's log file.
type hostLog struct {
	id, path string
	cancel   context.CancelFunc
	done     chan struct{}

	mu sync.Mutex // guards f; held by a frame's write and by reopen
	f  *os.File
	// failing: the last write failed (its error was logged).
	failing bool
}

// FollowLog creates (or opens) container id's log at path (a host path)
// and starts writing it from its agent's log session, unless it is
// written already. For a container
// created with HostLog; CreateContainer calls it, the broker calls it for
// the containers it recovers.
func (c *Conn) FollowLog(id, path string) {
	c.logs.mu.Lock()
	defer c.logs.mu.Unlock()
	if c.logs.w == nil {
		c.logs.w = map[string]*hostLog{}
	}
	if _, ok := c.logs.w[id]; ok {
		return
	}
	ctx, cancel := context.WithCancel(context.Background())
	hl := &hostLog{id: id, path: path, cancel: cancel, done: make(chan struct{})}
	c.logs.w[id] = hl
	// The file is there once the container is created, empty until
	// it writes, as the kubelet may read it any time after the start.
	hl.mu.Lock()
	err := hl.openLocked()
	hl.mu.Unlock()
	if err != nil {
		c.logs.errors.Add(1)
		c.log.Warn("create the container's log; opening it again at its first line", "container", id, "err", err)
	}
	go c.followLog(ctx, hl)
}

// followLog runs hl's sessions until the app's output ended, the app is
// gone or ctx ends; a broken session is opened again after a pause that
// grows while they keep failing.
func (c *Conn) followLog(ctx context.Context, hl *hostLog) {
	defer close(hl.done)
	defer hl.close()
	wait := logRetryMin
	for {
		wrote := false
		err := c.Client.Logs(ctx, hl.id, func(p []byte) error {
			wrote = true
			c.writeLog(hl, p)
			return nil
		})
		switch {
		case err == nil:
			c.log.Debug("the container's output ended: its log is complete", "container", hl.id)
			return
		case ctx.Err() != nil:
			return
		case errdefs.IsNotFound(err) || errors.Is(err, errdefs.ErrFailedPrecondition):
			c.log.Warn("the container's log cannot be followed", "container", hl.id, "err", err)
			return
		}
		if wrote {
			wait = logRetryMin
		}
		c.log.Debug("the container's log session broke; opening it again", "container", hl.id, "err", err, "in", wait)
		t := time.NewTimer(wait)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return
		}
		wait = min(2*wait, logRetryMax)
	}
}

// writeLog appends p, whole lines, to hl's file, opening it first when
// it is not open. A failure (a full disk, a path that is no file) is
// counted and logged when it starts, and p is dropped, as the agent
// drops what it cannot write to its own log file: the container never
// waits on the host's disk.
func (c *Conn) writeLog(hl *hostLog, p []byte) {
	hl.mu.Lock()
	defer hl.mu.Unlock()
	err := hl.openLocked()
	if err == nil {
		_, err = hl.f.Write(p)
	}
	if err != nil {
		c.logs.errors.Add(1)
		if !hl.failing {
			c.log.Warn("write the container's log; its lines are dropped until a write succeeds", "container", hl.id, "err", err)
		}
		hl.failing = true
		return
	}
	if hl.failing {
		c.log.Info("the container's log is written again", "container", hl.id)
		hl.failing = false
	}
}

// openLocked opens hl's file when it is not open.
func (hl *hostLog) openLocked() error {
	if hl.f != nil {
		return nil
	}
	f, err := logfile.Open(hl.path)
	if err != nil {
		return err
	}
	hl.f = f
	return nil
}

// reopen closes hl's file and opens its path again, between two frames:
// no line is split or lost.
func (hl *hostLog) reopen() error {
	hl.mu.Lock()
	defer hl.mu.Unlock()
	f, err := logfile.Open(hl.path)
	if err != nil {
		return err
	}
	if hl.f != nil {
		hl.f.Close()
	}
	hl.f = f
	return nil
}

func (hl *hostLog) close() {
	hl.mu.Lock()
	defer hl.mu.Unlock()
	if hl.f != nil {
		hl.f.Close()
		hl.f = nil
	}
}

// following returns the writer of container id's log, nil when none
// runs.
func (c *Conn) following(id string) *hostLog {
	c.logs.mu.Lock()
	defer c.logs.mu.Unlock()
	hl := c.logs.w[id]
	if hl == nil {
		return nil
	}
	select {
	case <-hl.done:
		return nil
	default:
		return hl
	}
}

// reopenHostLog reopens container id's log file on the host, when the
// daemon writes it. handled is false when it does not.
func (c *Conn) reopenHostLog(id string) (handled bool, err error) {
	hl := c.following(id)
	if hl == nil {
		return false, nil
	}
	if err := hl.reopen(); err != nil {
		return true, fmt.Errorf("reopen log of %s: %w", id, err)
	}
	return true, nil
}

// StopLog stops writing container id's log and returns once its file is
// closed. Idempotent.
func (c *Conn) StopLog(id string) {
	c.logs.mu.Lock()
	hl := c.logs.w[id]
	delete(c.logs.w, id)
	c.logs.mu.Unlock()
	if hl != nil {
		hl.cancel()
		<-hl.done
	}
}

// StopLogs stops every log writer of the pod (its agent is gone, or the
// daemon stops) and returns once their files are closed. Idempotent.
func (c *Conn) StopLogs() {
	c.logs.mu.Lock()
	ws := c.logs.w
	c.logs.w = nil
	c.logs.mu.Unlock()
	for _, hl := range ws {
		hl.cancel()
	}
	for _, hl := range ws {
		<-hl.done
	}
}

// LogErrors counts the writes of the pod's containers' log files on the
// host that failed since the connection was opened.
func (c *Conn) LogErrors() uint64 { return c.logs.errors.Load() }
