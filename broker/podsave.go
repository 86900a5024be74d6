package broker

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/checkpoint"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/livemove"
	"github.com/stagelet/stagelet/stage1"
	"github.com/stagelet/stagelet/stage1/podconn"
)

// A stage1 whose pods are saved whole (Capabilities.WholePodCheckpoint: a
// VM, memory and all) is checkpointed through the kubelet's own flow, as
// CRIU's containers are: CheckpointContainer of the pod's one container
// saves the pod (stage1.PodSaver) into the archive's checkpoint/ in place
// of CRIU's images, and a container created from that archive in a pod of
// that stage1 restores it at StartContainer (stage1.PodRestorer): the
// saved pod's apps replace the new pod's, the container's app taking the
// new container's ID. A checkpoint archive carries one container, so a
// pod of more than one cannot be saved this way, nor restored into.

// PodImage is what a whole-pod checkpoint says of its container.
type PodImage struct {
	// App is the container's ID in the saved pod's agent.
	App string `json:"app"`
}

// checkpointWholePod is CheckpointContainer for a stage1 that saves whole
// pods: handled is false for any other, which checkpoints its apps. The
// caller holds c.op. FailedPrecondition when the pod has other
// containers, or cannot be saved (the stage1's reason).
func (b *Broker) checkpointWholePod(ctx context.Context, p *pod, c *container, location string) (handled bool, err error) {
	b.mu.Lock()
	name := p.rec.Stage1
	b.mu.Unlock()
	if !b.caps[name].WholePodCheckpoint {
		return false, nil
	}
	if err := b.checkpointable(ctx, name); err != nil {
		return true, err
	}
	h, err := b.podHandle(p)
	if err != nil {
		return true, err
	}
	saver, ok := h.Pod.(stage1.PodSaver)
	if !ok {
		return true, errdefs.New(errdefs.ErrUnimplemented, "stage1 %s cannot checkpoint a pod", name)
	}
	if err := b.onlyContainer(p, c); err != nil {
		return true, err
	}
	live, err := b.movesLive(p)
	if err != nil {
		return true, err
	}
	start := time.Now()
	images, err := os.MkdirTemp(filepath.Dir(location), ".stagelet-pod-")
	if err != nil {
		return true, errdefs.Storage(fmt.Errorf("checkpoint %s: %w", c.rec.ID, err), filepath.Dir(location))
	}
	defer os.RemoveAll(images)
	var (
		saved *stage1.PodSaved
		offer *livemove.Offer
	)
	if live {
		offer, err = b.offerLive(ctx, h, images)
		if err != nil {
			return true, fmt.Errorf("checkpoint %s: %w", c.rec.ID, err)
		}
		defer func() {
			if err != nil {
				offer.Close()
			}
		}()
	} else if saved, err = saver.SavePod(ctx, images); err != nil {
		return true, fmt.Errorf("checkpoint %s: %w", c.rec.ID, err)
	}
	meta, dir, err := b.checkpointMeta(c, p)
	if err != nil {
		return true, err
	}
	if meta.SavedPod, err = json.Marshal(PodImage{App: c.rec.ID}); err != nil {
		return true, fmt.Errorf("checkpoint %s: %w", c.rec.ID, err)
	}
	size, err := checkpoint.Write(location, meta, dir, images)
	if err != nil {
		return true, errdefs.Storage(fmt.Errorf("checkpoint %s: %w", c.rec.ID, err), filepath.Dir(location))
	}
	if live {
		b.serveLive(p, c, h, offer)
		b.log.InfoContext(ctx, "container's whole pod offered to move live", "pod", p.id(), "container", c.rec.ID, "archive", location,
			"bytes", size, "address", offer.Ticket().Address, "expires", offer.Ticket().Expires, "took", time.Since(start))
		return true, nil
	}
	b.log.InfoContext(ctx, "container checkpointed with its whole pod", "pod", p.id(), "container", c.rec.ID, "archive", location,
		"bytes", size, "podImageBytes", saved.Bytes, "paused", saved.Downtime, "save", saved.Total, "took", time.Since(start))
	return true, nil
}

// checkpointWholePodDir is CheckpointPod for a stage1 that saves whole
// pods: handled is false for any other. The pod checkpoint in outputPath
// holds the one container's archive (checkpointWholePod) and the pod's
// description. The caller holds every c.op. FailedPrecondition when
// not exactly the pod's one container is named.
func (b *Broker) checkpointWholePodDir(ctx context.Context, p *pod, cs []*container, outputPath string) (handled bool, err error) {
	b.mu.Lock()
	s1 := p.rec.Stage1
	b.mu.Unlock()
	if !b.caps[s1].WholePodCheckpoint {
		return false, nil
	}
	if len(cs) != 1 {
		return true, errdefs.FailedPrecondition("stage1 %s saves a pod whole with its one container: name that container, not %d", s1, len(cs))
	}
	c := cs[0]
	b.mu.Lock()
	name := c.rec.Config.Metadata.Name
	desc := &checkpoint.Pod{ID: p.rec.ID, Name: p.rec.Config.Metadata.Name, Namespace: p.rec.Config.Metadata.Namespace, Stage1: s1,
		Containers: []checkpoint.PodContainer{{Name: name, ID: c.rec.ID, Archive: checkpoint.ArchiveName(name)}}}
	podCfg := p.rec.Config
	b.mu.Unlock()
	if desc.Config, err = json.Marshal(podCfg); err != nil {
		return true, fmt.Errorf("checkpoint pod %s: %w", p.id(), err)
	}
	path := filepath.Join(outputPath, checkpoint.ArchiveName(name))
	if _, err := b.checkpointWholePod(ctx, p, c, path); err != nil {
		return true, err
	}
	if err := checkpoint.WritePod(outputPath, desc); err != nil {
		os.Remove(path)
		return true, errdefs.Storage(err, outputPath)
	}
	return true, nil
}

// onlyContainer refuses a whole-pod checkpoint or restore of container c
// when pod p has others: an archive carries one container.
func (b *Broker) onlyContainer(p *pod, c *container) error {
	var others []string
	for _, o := range b.containersOf(p.id()) {
		if o != c {
			others = append(others, o.rec.ID)
		}
	}
	if len(others) > 0 {
		return errdefs.FailedPrecondition("pod %s is saved whole with its container %s, and a checkpoint archive carries one container: it has %d more (%v)", p.id(), c.rec.ID, len(others), others)
	}
	return nil
}

// parsePodImage reads a whole-pod checkpoint's account of its container.
func parsePodImage(raw json.RawMessage, archive string) (*PodImage, error) {
	var pi PodImage
	if err := json.Unmarshal(raw, &pi); err != nil || pi.App == "" {
		return nil, errdefs.InvalidArgument("%s: no account of the saved pod's container", archive)
	}
	return &pi, nil
}

// startRestoredPod starts container c, created from a whole-pod
// checkpoint, by having its pod take the saved pod in place of its own
// apps, and the saved container's app its ID. The pod's record is saved
// with the stage1's new state, and its agent followed again. The caller
// holds c.op.
func (b *Broker) startRestoredPod(ctx context.Context, h *podconn.Pod, c *container) (*api.AppStatus, error) {
	restorer, ok := h.Pod.(stage1.PodRestorer)
	if !ok {
		return nil, errdefs.FailedPrecondition("container %s was created from a checkpoint of a whole pod, and its pod's stage1 cannot restore one", c.rec.ID)
	}
	b.mu.Lock()
	r, podID, app := c.rec.Restore, c.rec.PodID, c.rec.App
	b.mu.Unlock()
	p, err := b.lookupPod(podID)
	if err != nil {
		return nil, err
	}
	if err := b.onlyContainer(p, c); err != nil {
		return nil, err
	}
	rctx, cancel := context.WithTimeout(ctx, restoreTimeout)
	defer cancel()
	start := time.Now()
	// A live move's checkpoint holds a ticket: the pod streams from its
	// source, which must take it before anything here changes.
	receiver, conn, err := b.dialLive(rctx, h, r.Images)
	if err != nil {
		return nil, fmt.Errorf("restore container %s: %w", c.rec.ID, err)
	}
	if conn != nil {
		defer conn.Close()
	}
	// The pod's agent goes away and comes back: not a death.
	b.unwatch(p)
	defer b.watch(p, h)
	// The container's log: what the pod's own app wrote goes with its
	// VM; the saved app's is written from its agent once it has the
	// container's ID.
	h.StopLog(c.rec.ID)
	var loaded *stage1.PodRestored
	if conn != nil {
		loaded, err = receiver.ReceivePod(rctx, r.Images, conn)
	} else {
		loaded, err = restorer.RestorePod(rctx, r.Images)
	}
	if err != nil {
		return nil, err
	}
	b.mu.Lock()
	p.rec.BackendState = h.State()
	cp := *p.rec
	b.mu.Unlock()
	if err := b.rec.savePod(&cp); err != nil {
		return nil, fmt.Errorf("persist pod record: %w", err)
	}
	if err := h.Rename(rctx, r.Pod.App, c.rec.ID); err != nil {
		return nil, fmt.Errorf("restore container %s: its app %s in the restored pod: %w", c.rec.ID, r.Pod.App, err)
	}
	if app != nil && app.HostLog {
		h.FollowLog(c.rec.ID, app.LogPath)
	}
	st, err := h.ContainerStatus(rctx, c.rec.ID)
	if err != nil {
		return nil, err
	}
	if conn != nil {
		b.log.InfoContext(ctx, "container's whole pod taken from a live move", "pod", podID, "container", c.rec.ID, "from", conn.RemoteAddr(),
			"bytes", loaded.Bytes, "load", loaded.Load, "downtime", loaded.Downtime, "took", time.Since(start))
	} else {
		b.log.InfoContext(ctx, "container restored with its whole pod", "pod", podID, "container", c.rec.ID, "archive", r.Archive,
			"load", loaded.Load, "took", time.Since(start))
	}
	if err := os.RemoveAll(filepath.Join(c.rec.Dir, restoreDir)); err != nil {
		b.log.WarnContext(ctx, "removing a restored container's unpacked checkpoint", "container", c.rec.ID, "err", err)
	}
	return st, nil
}
