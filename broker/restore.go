package broker

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"time"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/checkpoint"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/image"
	"github.com/stagelet/stagelet/stage1"
	"github.com/stagelet/stagelet/stage1/podconn"
)

// A container is restored from a checkpoint archive as CRI-O does it:
// CreateContainer names the archive's path as its image (RestorePod does
// so for each container of a pod checkpoint). The container is created
// as the checkpointed one was (its image, command, environment,
// security), with the request's name, labels, annotations, log path and,
// when it gives them, mounts, devices and resources, on the archive's
// writable layer; a request naming another command is refused. StartContainer
// then has the pod's stage1 restore the archive's processes into it
// (stage1.AppRestorer) rather than start its command.

// restoreTimeout bounds the restore of a container's processes (criu).
const restoreTimeout = 5 * time.Minute

// restoreDir is where a container's checkpoint archive is unpacked,
// within its directory.
const restoreDir = "checkpoint"

// isCheckpointArchive says whether a container's image names a
// checkpoint archive: a path, which no image reference is.
func isCheckpointArchive(ref string) bool { return filepath.IsAbs(ref) }

// isCheckpoint says whether a container's image is a checkpoint to
// restore: an archive's path, or a pulled checkpoint image (one whose
// manifest annotations name a checkpointed container, as CRI-O's and
// containerd's).
func (b *Broker) isCheckpoint(ref string) bool {
	if isCheckpointArchive(ref) {
		return true
	}
	a, err := b.opts.Images.Annotations(ref)
	if err != nil {
		return false // not pulled: CreateContainer says so
	}
	_, ok := checkpoint.ImageContainer(a)
	return ok
}

// readCheckpoint reads the checkpoint ref names into dir: an archive's
// path, or a checkpoint image, which the pod's namespace policy must
// accept (admitCheckpointImage). It returns the container's description
// and how to name the checkpoint in messages.
func (b *Broker) readCheckpoint(ctx context.Context, ref, namespace, dir string) (*checkpoint.Container, string, error) {
	if isCheckpointArchive(ref) {
		meta, err := checkpoint.Read(ref, dir)
		return meta, "checkpoint archive " + ref, err
	}
	what := useCheckpointImage(ref)
	img, err := b.admitCheckpointImage(ctx, ref, namespace)
	if err != nil {
		return nil, what, err
	}
	layers, err := b.opts.Images.LayerDirs(img.img.ID)
	if err != nil {
		return nil, what, err
	}
	if len(layers) != 1 {
		return nil, what, errdefs.InvalidArgument("%s has %d layers: a checkpoint image has one, holding the archive", what, len(layers))
	}
	meta, err := checkpoint.ReadDir(layers[0], dir)
	return meta, what, err
}

// admitCheckpointImage admits checkpoint image ref for namespace
// (admitImage): its layer is the checkpointed container's changed files
// and its processes' memory, content as much as any image's.
func (b *Broker) admitCheckpointImage(ctx context.Context, ref, namespace string) (*admittedImage, error) {
	img, err := b.opts.Images.Get(ref)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", useCheckpointImage(ref), err)
	}
	named := ref
	if isImageID(ref, img.ID) {
		named = ""
	}
	return b.admitImage(ctx, namespace, useCheckpointImage(ref), named, img)
}

// checkRestorable refuses, before anything is taken, a container to be
// restored into pod p that cannot be: its stage1 or this node cannot.
func (b *Broker) checkRestorable(ctx context.Context, p *pod) error {
	b.mu.Lock()
	name := p.rec.Stage1
	b.mu.Unlock()
	if err := b.checkpointable(ctx, name); err != nil {
		return err
	}
	h, err := b.podHandle(p)
	if err != nil {
		return err
	}
	if _, ok := h.Pod.(stage1.PodRestorer); ok && b.caps[name].WholePodCheckpoint {
		return nil
	}
	if _, ok := h.Pod.(stage1.AppRestorer); !ok {
		// Unimplemented, as a checkpoint on such a stage1 answers.
		return errdefs.New(errdefs.ErrUnimplemented, "stage1 %s cannot restore a container from a checkpoint", name)
	}
	return nil
}

// unpackCheckpoint unpacks the checkpoint rec.Config.Image names (an
// archive, a checkpoint image) into rec.Dir and makes rec the restored
// container's, for pod p: its configuration the checkpointed one's with
// the request's name, labels, annotations, log path and (when it has
// any) mounts. A checkpoint image must be accepted by the policy of the
// pod's namespace. On failure rec.Dir is removed again.
func (b *Broker) unpackCheckpoint(ctx context.Context, rec *ContainerRecord, p *pod, namespace string) (err error) {
	defer b.removeUnpacked(ctx, rec, &err)
	b.mu.Lock()
	stage1Name := p.rec.Stage1
	b.mu.Unlock()
	ref := rec.Config.Image
	dir := filepath.Join(rec.Dir, restoreDir)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("restore: %w", err)
	}
	meta, archive, err := b.readCheckpoint(ctx, ref, namespace, dir)
	if err != nil {
		return err
	}
	if meta.Stage1 != stage1Name {
		return errdefs.FailedPrecondition("%s: a container of stage1 %s cannot be restored into a pod of stage1 %s", archive, meta.Stage1, stage1Name)
	}
	var old ContainerConfig
	if err := json.Unmarshal(meta.Config, &old); err != nil {
		return errdefs.InvalidArgument("%s: the container's configuration: %w", archive, err)
	}
	var img stage1.AppImage
	var saved *PodImage
	if len(meta.SavedPod) > 0 {
		if saved, err = parsePodImage(meta.SavedPod, archive); err != nil {
			return err
		}
	} else if len(meta.Processes) == 0 || json.Unmarshal(meta.Processes, &img) != nil {
		return errdefs.InvalidArgument("%s: no account of its processes' images", archive)
	}
	if isCheckpointArchive(old.Image) {
		return errdefs.InvalidArgument("%s: its container's image %q is a path", archive, old.Image)
	}
	req := rec.Config
	// The checkpoint is the process: a request that names another
	// command is refused.
	if len(req.Command) > 0 && !slices.Equal(req.Command, old.Command) ||
		len(req.Args) > 0 && !slices.Equal(req.Args, old.Args) ||
		req.WorkingDir != "" && req.WorkingDir != old.WorkingDir {
		return errdefs.FailedPrecondition("%s: the container ran %q %q in %q, not the %q %q in %q configured",
			archive, old.Command, old.Args, old.WorkingDir, req.Command, req.Args, req.WorkingDir)
	}
	cfg := old
	cfg.Metadata, cfg.Labels, cfg.Annotations, cfg.LogPath = req.Metadata, req.Labels, req.Annotations, req.LogPath
	if len(req.Mounts) > 0 {
		cfg.Mounts = req.Mounts
	}
	if len(req.Devices) > 0 || len(req.CDIDevices) > 0 {
		cfg.Devices, cfg.CDIDevices = req.Devices, req.CDIDevices
	}
	if req.Resources != (Resources{}) {
		cfg.Resources = req.Resources
	}
	if err := validateContainerConfig(&cfg); err != nil {
		return fmt.Errorf("%s: %w", archive, err)
	}
	b.mu.Lock()
	rec.Config = cfg
	rec.ImageName = cfg.Image
	rec.Restore = &RestoreRecord{Archive: ref, Images: filepath.Join(dir, checkpoint.ImagesDir), Image: &img, Pod: saved}
	b.mu.Unlock()
	return nil
}

// removeUnpacked removes the directory of container rec, with its
// unpacked checkpoint, when *err is set: it goes as its rootfs goes,
// unmounted first.
func (b *Broker) removeUnpacked(ctx context.Context, rec *ContainerRecord, err *error) {
	if *err == nil {
		return
	}
	if rerr := b.opts.Images.UnmountRootfs(ctx, rec.Dir); rerr != nil {
		b.log.ErrorContext(ctx, "removing the unpacked checkpoint of a container that failed to be created", "container", rec.ID, "err", rerr)
	}
}

// importCheckpointLayer makes the writable layer of rec's rootfs the
// checkpoint's, before the rootfs is mounted.
func (b *Broker) importCheckpointLayer(ctx context.Context, rec *ContainerRecord) error {
	f, err := os.Open(filepath.Join(rec.Dir, restoreDir, checkpoint.RootfsDiff))
	if err != nil {
		return fmt.Errorf("restore: %w", err)
	}
	defer f.Close()
	return image.ImportLayer(ctx, rec.Dir, f, b.log)
}

// startRestored starts container c of pod p, created from a checkpoint,
// by restoring the checkpoint's processes. The caller holds c.op.
func (b *Broker) startRestored(ctx context.Context, h *podconn.Pod, c *container) (*api.AppStatus, error) {
	b.mu.Lock()
	whole := c.rec.Restore.Pod != nil
	b.mu.Unlock()
	if whole {
		return b.startRestoredPod(ctx, h, c)
	}
	restorer, ok := h.Pod.(stage1.AppRestorer)
	if !ok {
		return nil, errdefs.FailedPrecondition("container %s was created from a checkpoint, and its pod's stage1 cannot restore one", c.rec.ID)
	}
	b.mu.Lock()
	spec, r := c.rec.App, c.rec.Restore
	b.mu.Unlock()
	criu, err := b.criu(ctx)
	if err != nil {
		return nil, err
	}
	rctx, cancel := context.WithTimeout(ctx, restoreTimeout)
	defer cancel()
	start := time.Now()
	st, err := h.RestoreContainer(rctx, c.rec.ID, func(io *api.RestoreIO) (int, error) {
		inAgent := func(ctx context.Context, argv []string) error { return h.RunRestorer(ctx, c.rec.ID, argv) }
		return restorer.RestoreApp(rctx, &stage1.AppRestore{CRIU: criu, Spec: spec, Images: r.Images, Image: r.Image, IO: io, InAgent: inAgent})
	})
	if err != nil {
		return nil, err
	}
	b.log.InfoContext(ctx, "container restored", "container", c.rec.ID, "archive", r.Archive, "took", time.Since(start))
	// The unpacked archive served its turn: criu's images hold as much
	// as the processes' memory. Plain files, beside the rootfs mount.
	if err := os.RemoveAll(filepath.Join(c.rec.Dir, restoreDir)); err != nil {
		b.log.WarnContext(ctx, "removing a restored container's unpacked checkpoint", "container", c.rec.ID, "err", err)
	}
	return st, nil
}
