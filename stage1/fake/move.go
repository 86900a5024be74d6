package fake

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/livemove"
	"github.com/stagelet/stagelet/stage1"
)

// A pod of a Backend with MovesLive moves live as a kvm pod does, over
// the frames of package livemove: what moves is its guest (the agent
// with its apps running), handed over in memory, since both pods are in
// this process. The stream carries a token naming the guest, put aside
// while it is on its way (moving), as a VM's state streams while the
// VM is paused:
//
//   - the source waits for the target's Ready, puts its guest aside (its
//     agent no longer answers), and sends the token and End;
//   - the target takes the guest and says Loaded; the source says Go and
//     is gone for good;
//   - the target stops its own guest and runs the one it took.
//
// A target that fails before Loaded gives the guest back and the source
// runs on with it; a connection lost after Loaded leaves it on neither.

// describedPod is what DescribePod writes, which the target checks.
type describedPod struct {
	Memory int64 `json:"memory"`
}

const describedName = "fake-pod.json"

// moving holds the guests on their way, by token.
var moving = struct {
	sync.Mutex
	guests map[string]*guest
}{guests: map[string]*guest{}}

// movingPod is a fake pod of a fixed size (sizedPod) that moves live.
type movingPod struct {
	*sizedPod
}

var (
	_ stage1.PodSender   = (*movingPod)(nil)
	_ stage1.PodReceiver = (*movingPod)(nil)
)

// SavePod implements stage1.PodSaver: a fake pod moves only live.
func (p *movingPod) SavePod(ctx context.Context, dir string) (*stage1.PodSaved, error) {
	return nil, errdefs.FailedPrecondition("fake: pod %s moves only live", p.id)
}

// RestorePod implements stage1.PodRestorer: see SavePod.
func (p *movingPod) RestorePod(ctx context.Context, dir string) (*stage1.PodRestored, error) {
	return nil, errdefs.FailedPrecondition("fake: pod %s takes a pod only live", p.id)
}

// DescribePod implements stage1.PodSender.
func (p *movingPod) DescribePod(ctx context.Context, dir string) error {
	b, err := json.Marshal(describedPod{Memory: p.memory})
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, describedName), b, 0o600)
}

// SendPod implements stage1.PodSender.
func (p *movingPod) SendPod(ctx context.Context, conn net.Conn) (*stage1.PodSaved, error) {
	start := time.Now()
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	defer stop()
	if _, err := livemove.Expect(conn, livemove.FrameReady); err != nil {
		return nil, fmt.Errorf("fake: waiting for the target: %w", err)
	}
	token, err := p.setAside()
	if err != nil {
		return nil, err
	}
	paused := time.Now()
	err = livemove.WriteFrame(conn, livemove.FrameData, []byte(token))
	if err == nil {
		err = livemove.WriteFrame(conn, livemove.FrameEnd, nil)
	}
	if err == nil {
		_, err = livemove.Expect(conn, livemove.FrameLoaded)
	}
	if err != nil {
		if !p.takeBack(token) {
			p.gone()
			return nil, fmt.Errorf("fake: the move of pod %s failed with the target holding it: the pod is on neither: %w", p.id, err)
		}
		return nil, fmt.Errorf("fake: the move of pod %s: %w", p.id, err)
	}
	// The target holds the guest: from here on it is never run here.
	p.gone()
	if err := livemove.WriteFrame(conn, livemove.FrameGo, nil); err != nil {
		return nil, fmt.Errorf("fake: pod %s went to the target, which did not hear it may run it: %w", p.id, err)
	}
	return &stage1.PodSaved{Bytes: int64(len(token)), Total: time.Since(start), Downtime: time.Since(paused)}, nil
}

// setAside takes the pod's guest out of it, under a new token: its agent
// no longer answers.
func (p *movingPod) setAside() (string, error) {
	b := make([]byte, 16)
	if _, err := rand.Read(b); err != nil {
		return "", err
	}
	token := hex.EncodeToString(b)
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.g == nil || p.dead {
		return "", errdefs.FailedPrecondition("fake: pod %s is gone", p.id)
	}
	moving.Lock()
	moving.guests[token] = p.g
	moving.Unlock()
	p.paused = true
	return token, nil
}

// takeBack lets the pod run its guest again after a failed move: false
// when the target kept it.
func (p *movingPod) takeBack(token string) bool {
	moving.Lock()
	_, ok := moving.guests[token]
	delete(moving.guests, token)
	moving.Unlock()
	if ok {
		p.mu.Lock()
		p.paused = false
		p.mu.Unlock()
	}
	return ok
}

// gone ends the pod whose guest went to another: its agent is gone,
// its guest untouched.
func (p *movingPod) gone() {
	p.mu.Lock()
	p.g, p.paused = nil, false
	p.mu.Unlock()
	p.Die()
}

// ReceivePod implements stage1.PodReceiver.
func (p *movingPod) ReceivePod(ctx context.Context, dir string, conn net.Conn) (_ *stage1.PodRestored, err error) {
	defer func() {
		if err != nil {
			livemove.Fail(conn, err)
		}
	}()
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	defer stop()
	raw, err := os.ReadFile(filepath.Join(dir, describedName))
	if err != nil {
		return nil, errdefs.InvalidArgument("fake: the moving pod's description: %w", err)
	}
	var d describedPod
	if err := json.Unmarshal(raw, &d); err != nil {
		return nil, errdefs.InvalidArgument("fake: the moving pod's description: %w", err)
	}
	if d.Memory != p.memory {
		return nil, errdefs.FailedPrecondition("fake: the moving pod has %d bytes of memory, this one %d", d.Memory, p.memory)
	}
	if err := livemove.WriteFrame(conn, livemove.FrameReady, nil); err != nil {
		return nil, err
	}
	var buf bytes.Buffer
	_, n, err := livemove.ReceiveStream(&buf, conn)
	if err != nil {
		return nil, err
	}
	token := buf.String()
	moving.Lock()
	g := moving.guests[token]
	delete(moving.guests, token)
	moving.Unlock()
	if g == nil {
		return nil, errdefs.InvalidArgument("fake: no guest is on its way under the token sent")
	}
	loaded := time.Now()
	if err := livemove.WriteFrame(conn, livemove.FrameLoaded, nil); err != nil {
		moving.Lock()
		moving.guests[token] = g // the source takes it back
		moving.Unlock()
		return nil, err
	}
	if _, err := livemove.Expect(conn, livemove.FrameGo); err != nil {
		g.stop()
		return nil, fmt.Errorf("fake: the source did not say the pod may run here: %w", err)
	}
	p.mu.Lock()
	own := p.g
	p.g = g
	p.mu.Unlock()
	if own != nil {
		own.stop()
		if err := os.RemoveAll(own.stateDir); err != nil {
			return nil, err
		}
	}
	return &stage1.PodRestored{Bytes: n, Load: time.Since(loaded), Downtime: time.Since(loaded)}, nil
}
