package kvm

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"time"

	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/livemove"
	"github.com/stagelet/stagelet/stage1"
)

// A kvm pod also moves live: qemu's pre-copy migration streams the VM to
// the other node's daemon while the guest runs on, over the connection
// package livemove authenticated, and the guest pauses only for the last
// round. Neither qemu touches the network or a file: each daemon passes
// its qemu one end of a socket pair (QMP getfd, migration URI fd:) and
// copies between the pair and the connection.
//
// The hand-over, so that the pod never runs on both nodes: the source
// streams the state and sends End, its VM paused; the target loads it,
// still paused (-S), and says Loaded; the source then says Go and stops
// its VM for good, and only then does the target run its VM. A target
// that fails before Loaded tells the source, which runs its VM on. A
// connection lost between Loaded and Go leaves the pod on neither node.

var (
	_ stage1.PodSender   = (*Pod)(nil)
	_ stage1.PodReceiver = (*Pod)(nil)
)

// liveFD is the name the migration's descriptor has in qemu.
const liveFD = "livemove"

// Bounds of the hand-over's steps: the target readying its qemu (its
// own VM stopped and a new one started), the source's qemu closing the
// stream, the target loading the last of the state, the source stopping.
const (
	liveReadyTimeout = 2 * time.Minute
	liveCloseTimeout = 30 * time.Second
	liveLoadTimeout  = 2 * time.Minute
	liveGoTimeout    = time.Minute
	// liveResumeTimeout bounds the source's resume after a failed move.
	liveResumeTimeout = 10 * time.Second
)

// liveEnd is the source's End frame: how the send went.
type liveEnd struct {
	// Bytes is what qemu's stream carried of the VM's memory.
	Bytes int64 `json:"bytes"`
	// Total is the migration's time; Downtime qemu's last round, from
	// the guest's pause to the end of the stream.
	Total    time.Duration `json:"total"`
	Downtime time.Duration `json:"downtime"`
	// PausedAt is when the guest paused, by the source's clock.
	PausedAt time.Time `json:"pausedAt"`
}

// DescribePod implements stage1.PodSender: dir/vm.json, as SavePod
// writes it, without the state. FailedPrecondition as for SavePod.
func (p *Pod) DescribePod(ctx context.Context, dir string) error {
	if err := p.movable(); err != nil {
		return err
	}
	disks, err := p.Disks()
	if err != nil {
		return err
	}
	return writeSavedVM(dir, savedVM{Version: savedVMVersion, VM: p.st.VM, Disks: disks})
}

// SendPod implements stage1.PodSender.
func (p *Pod) SendPod(ctx context.Context, conn net.Conn) (*stage1.PodSaved, error) {
	if err := p.movable(); err != nil {
		return nil, err
	}
	defer context.AfterFunc(ctx, func() { conn.SetDeadline(time.Now()) })()
	conn.SetReadDeadline(time.Now().Add(liveReadyTimeout))
	if _, err := livemove.Expect(conn, livemove.FrameReady); err != nil {
		return nil, fmt.Errorf("kvm: waiting for the target to ready its VM: %w", err)
	}
	q, err := p.outgoingQMP(ctx)
	if err != nil {
		return nil, err
	}
	defer q.Close()
	ours, err := q.passSocket(ctx, liveFD)
	if err != nil {
		return nil, err
	}
	defer ours.Close()
	sent := make(chan error, 1)
	go func() {
		_, err := livemove.SendStream(conn, ours)
		sent <- err
	}()
	// stopSending ends the copier within grace, so that no Fail frame
	// the caller writes lands between its frames.
	stopSending := func(grace time.Duration) {
		ours.Close()
		conn.SetWriteDeadline(time.Now().Add(grace))
		<-sent
		conn.SetWriteDeadline(time.Time{})
	}
	m, err := q.migrateOut(ctx, "fd:"+liveFD)
	completed := time.Now()
	if err != nil {
		stopSending(liveCloseTimeout)
		return nil, errors.Join(err, p.resume(ctx, q))
	}
	// qemu closes its end once the stream is complete.
	select {
	case err = <-sent:
	case <-time.After(liveCloseTimeout):
		err = errdefs.New(errdefs.ErrDeadlineExceeded, "kvm: qemu kept the migration's stream open %v after it completed", liveCloseTimeout)
		stopSending(0)
	}
	if err != nil {
		return nil, errors.Join(fmt.Errorf("kvm: streaming the VM: %w", err), p.resume(ctx, q))
	}
	end := liveEnd{Bytes: m.Bytes, Total: m.Total, Downtime: m.Downtime, PausedAt: completed.Add(-m.Downtime)}
	b, err := json.Marshal(end)
	if err == nil {
		err = livemove.WriteFrame(conn, livemove.FrameEnd, b)
	}
	if err == nil {
		conn.SetReadDeadline(time.Now().Add(liveLoadTimeout))
		_, err = livemove.Expect(conn, livemove.FrameLoaded)
	}
	if err != nil {
		return nil, errors.Join(fmt.Errorf("kvm: the target did not load the VM: %w", err), p.resume(ctx, q))
	}
	// The target holds the VM: this one, paused since the last round,
	// never runs again (only resume continues it, and only before
	// Loaded), so the target is told at once, and the VM stopped after.
	gerr := livemove.WriteFrame(conn, livemove.FrameGo, nil)
	if err := p.stopVM(context.WithoutCancel(ctx)); err != nil {
		// Paused, it never runs again: the pod moved all the same.
		p.log.WarnContext(ctx, "kvm: the VM moved; stopping its paused qemu here failed", "err", err)
	}
	if gerr != nil {
		return nil, fmt.Errorf("kvm: the VM stopped here, and the target was not told to run it: the pod runs on neither node: %w", gerr)
	}
	p.log.InfoContext(ctx, "kvm: VM moved live", "to", conn.RemoteAddr(), "bytes", m.Bytes, "paused", m.Downtime, "took", m.Total)
	return &stage1.PodSaved{Bytes: m.Bytes, Total: m.Total, Downtime: m.Downtime}, nil
}

// resume runs the source's VM on after a move that failed: qemu resumes
// a VM whose migration failed by itself, not one that completed.
// It runs when ctx ended too, within liveResumeTimeout.
func (p *Pod) resume(ctx context.Context, q *qmp) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), liveResumeTimeout)
	defer cancel()
	st, err := q.status(ctx)
	if err != nil || st == "running" {
		return err
	}
	if _, err := q.run(ctx, "cont", nil); err != nil {
		return fmt.Errorf("kvm: running the VM on after the failed move: %w", err)
	}
	p.log.WarnContext(ctx, "kvm: the move failed; the VM runs on here")
	return nil
}

// ReceivePod implements stage1.PodReceiver.
func (p *Pod) ReceivePod(ctx context.Context, dir string, conn net.Conn) (_ *stage1.PodRestored, err error) {
	defer context.AfterFunc(ctx, func() { conn.SetDeadline(time.Now()) })()
	// Until the source said Go, a failure is told to the source, which
	// runs its VM on, and stops the VM here; after, this VM is the pod's
	// only one.
	committed, stopped := false, false
	defer func() {
		if err == nil || committed {
			return
		}
		livemove.Fail(conn, err)
		if stopped {
			if serr := p.stopVM(context.WithoutCancel(ctx)); serr != nil {
				p.log.WarnContext(ctx, "kvm: stopping the VM of a failed move", "err", serr)
			}
			err = fmt.Errorf("%w (the pod's own VM was stopped)", err)
		}
	}()
	sv, err := p.readSavedVM(dir)
	if err != nil {
		return nil, err
	}
	disks, err := p.localDisks(ctx, sv.Disks)
	if err != nil {
		return nil, err
	}
	if err := p.canLoad(); err != nil {
		return nil, err
	}
	res, err := p.b.resolveTools()
	if err != nil {
		return nil, err
	}
	if err := p.stopVM(ctx); err != nil {
		return nil, err
	}
	stopped = true
	qemu, gcfg, logPath, err := p.startIncoming(ctx, res, disks, true)
	if err != nil {
		return nil, err
	}
	lctx, cancel := context.WithTimeout(ctx, liveLoadTimeout)
	defer cancel()
	q, err := dialQMP(lctx, p.st.qmpSocket(), processAlive(qemu))
	if err != nil {
		return nil, err
	}
	defer q.Close()
	end, n, loadStart, err := q.receive(lctx, qemu, conn)
	if err != nil {
		return nil, fmt.Errorf("kvm: receiving the VM (qemu log %s): %w", logPath, err)
	}
	if err := livemove.WriteFrame(conn, livemove.FrameLoaded, nil); err != nil {
		return nil, err
	}
	conn.SetReadDeadline(time.Now().Add(liveGoTimeout))
	if _, err := livemove.Expect(conn, livemove.FrameGo); err != nil {
		return nil, fmt.Errorf("kvm: the source did not say it stopped its VM, which may run on there: %w", err)
	}
	committed = true
	if _, err := q.run(lctx, "cont", nil); err != nil {
		return nil, fmt.Errorf("kvm: %w", err)
	}
	if err := p.takeNetwork(ctx, qemu, gcfg); err != nil {
		return nil, err
	}
	r := &stage1.PodRestored{Load: time.Since(loadStart), Bytes: n, Downtime: time.Since(end.PausedAt)}
	p.log.InfoContext(ctx, "kvm: VM taken from a live move", "from", conn.RemoteAddr(), "bytes", n, "load", r.Load, "downtime", r.Downtime, "sourcePaused", end.Downtime)
	return r, nil
}

// receive has qemu, started with -incoming defer and -S, take the VM
// that conn's source streams, and waits for it to be loaded: the
// source's account of the send, the bytes received and when the stream
// ended.
func (q *qmp) receive(ctx context.Context, qemu interface{ Alive() bool }, conn net.Conn) (liveEnd, int64, time.Time, error) {
	var end liveEnd
	ours, err := q.passSocket(ctx, liveFD)
	if err != nil {
		return end, 0, time.Time{}, err
	}
	defer ours.Close()
	if _, err := q.run(ctx, "migrate-incoming", map[string]any{"uri": "fd:" + liveFD}); err != nil {
		return end, 0, time.Time{}, err
	}
	if err := livemove.WriteFrame(conn, livemove.FrameReady, nil); err != nil {
		return end, 0, time.Time{}, err
	}
	raw, n, err := livemove.ReceiveStream(ours, conn)
	if err != nil {
		return end, n, time.Time{}, err
	}
	ended := time.Now()
	ours.Close()
	if err := json.Unmarshal(raw, &end); err != nil {
		return end, n, ended, errdefs.InvalidArgument("the source's account of the move: %w", err)
	}
	return end, n, ended, q.waitLoaded(ctx, qemu)
}

// canLoad says why the pod's VM cannot be replaced by a saved or moving
// one: nil when it can.
func (p *Pod) canLoad() error {
	// What this pod's own guest mounted goes with it; what its qemu was
	// given beside the saved VM's devices would not load.
	p.vfio.mu.Lock()
	n := len(p.vfio.ids)
	p.vfio.mu.Unlock()
	if n > 0 {
		return errdefs.FailedPrecondition("kvm: the pod's VM was given host PCI devices, which the saved VM has not")
	}
	if _, ok := p.st.Get(roleAppArmor); ok || p.spec.SELinuxProcessLabel != "" {
		return errdefs.FailedPrecondition("kvm: the pod's qemu runs confined (SELinux or AppArmor), and would not read a saved VM")
	}
	return nil
}

// passSocket gives qemu one end of a new socket pair as descriptor name
// (getfd), and returns the other.
func (q *qmp) passSocket(ctx context.Context, name string) (*os.File, error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("kvm: socketpair: %w", err)
	}
	ours, theirs := os.NewFile(uintptr(fds[0]), "livemove"), os.NewFile(uintptr(fds[1]), "livemove-qemu")
	defer theirs.Close()
	if err := q.sendFD(theirs); err != nil {
		ours.Close()
		return nil, fmt.Errorf("kvm: passing qemu the migration's socket: %w", err)
	}
	if _, err := q.run(ctx, "getfd", map[string]any{"fdname": name}); err != nil {
		ours.Close()
		return nil, fmt.Errorf("kvm: %w", err)
	}
	return ours, nil
}

// waitLoaded waits for qemu, started with -incoming defer and -S, to
// have loaded its VM: paused, no longer in migration.
func (q *qmp) waitLoaded(ctx context.Context, qemu interface{ Alive() bool }) error {
	for delay := time.Millisecond; ; delay = min(2*delay, 10*time.Millisecond) {
		st, err := q.status(ctx)
		if err != nil {
			if !qemu.Alive() {
				return fmt.Errorf("qemu exited while loading the VM: %w", errdefs.ErrUnavailable)
			}
			return err
		}
		switch st {
		case "paused":
			return nil
		case "inmigrate":
		default:
			return fmt.Errorf("loading the VM: the VM is %s", st)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("loading the VM: %w", errdefs.ErrDeadlineExceeded)
		case <-time.After(delay): // polling qemu for the load's end
		}
	}
}
