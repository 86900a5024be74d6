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
	"github.com/stagelet/stagelet/stage1"
)

// Checkpoints (CheckpointContainer, CheckpointPod, RestorePod) need two
// things: a stage1 whose pods can be saved (Capabilities.NoCheckpoint
// says why one's cannot) and, for the stage1s that save processes with
// CRIU, a CRIU that works on this kernel (Options.CRIU). Each call checks
// its arguments and these first, so that a node where checkpoints cannot
// work says why (FailedPrecondition) rather than that the call does not
// exist. CheckpointContainer is done where the pod's stage1 saves apps
// (stage1.AppCheckpointer); the pod calls answer Unimplemented for now.

// CheckpointContainer saves a running container, which goes on running,
// into the archive file location (the kubelet's checkpoint API names one
// under its checkpoints directory), in the layout of package checkpoint:
// its processes as CRIU images, its writable layer and its record. The
// archive appears whole or not at all. InvalidArgument (no location, or a
// relative one), NotFound, FailedPrecondition (the container does not
// run; its stage1 or this node cannot checkpoint; criu failed, with its
// reason), Unimplemented (a stage1 that does not save apps).
func (b *Broker) CheckpointContainer(ctx context.Context, id, location string) error {
	if err := archivePath("location", location); err != nil {
		return err
	}
	c, p, err := b.containerAndPod(ctx, id)
	if err != nil {
		return err
	}
	c.op.Lock() // neither stopped nor removed meanwhile
	defer c.op.Unlock()
	if err := b.checkpointRunning(c); err != nil {
		return err
	}
	if err := b.checkpointable(ctx, p.rec.Stage1); err != nil {
		return err
	}
	h, err := b.podHandle(p)
	if err != nil {
		return err
	}
	saver, ok := h.Pod.(stage1.AppCheckpointer)
	if !ok {
		return errdefs.New(errdefs.ErrUnimplemented, "stage1 %s: checkpointing a container is not implemented yet", p.rec.Stage1)
	}
	actx, cancel := agentCtx(ctx, agentTimeout)
	st, err := h.ContainerStatus(actx, c.rec.ID)
	cancel()
	if err != nil {
		return err
	}
	if st.State != api.StateRunning || st.PID <= 0 {
		return errdefs.FailedPrecondition("container %s is %s: only a running container can be checkpointed", c.rec.ID, st.State)
	}
	// The images live beside the archive until it is written: plain
	// files criu writes, removed whatever happens.
	images, err := os.MkdirTemp(filepath.Dir(location), ".stagelet-criu-")
	if err != nil {
		return fmt.Errorf("checkpoint %s: %w", c.rec.ID, err)
	}
	defer os.RemoveAll(images)
	start := time.Now()
	img, err := saver.CheckpointApp(ctx, c.rec.ID, st.PID, images)
	if err != nil {
		return err
	}
	dumped := time.Since(start)
	meta, dir, err := b.checkpointMeta(c, p)
	if err != nil {
		return err
	}
	if meta.Processes, err = json.Marshal(img); err != nil {
		return fmt.Errorf("checkpoint %s: %w", c.rec.ID, err)
	}
	// The layer is read after the dump, while the app runs on: a file it
	// writes in between is newer in the archive than in its images. A
	// restore (to come) that must match them freezes the app over both.
	size, err := checkpoint.Write(location, meta, dir, images)
	if err != nil {
		return fmt.Errorf("checkpoint %s: %w", c.rec.ID, err)
	}
	b.log.InfoContext(ctx, "container checkpointed", "pod", p.id(), "container", c.rec.ID, "archive", location,
		"bytes", size, "dump", dumped, "took", time.Since(start))
	return nil
}

// checkpointMeta is what a checkpoint archive says of container c of pod
// p, and the directory of its writable layer.
func (b *Broker) checkpointMeta(c *container, p *pod) (*checkpoint.Container, string, error) {
	b.mu.Lock()
	rec, pod, s1 := *c.rec, p.rec.Config.Metadata, p.rec.Stage1
	b.mu.Unlock()
	config, err := json.Marshal(rec.Config)
	if err != nil {
		return nil, "", fmt.Errorf("checkpoint %s: %w", rec.ID, err)
	}
	meta := &checkpoint.Container{ID: rec.ID, Name: rec.Config.Metadata.Name, Pod: pod.Name, Namespace: pod.Namespace,
		Image: rec.ImageName, ImageID: rec.ImageID, Stage1: s1, Created: rec.CreatedAt, Config: config}
	if rec.App != nil {
		meta.Args, meta.Env, meta.Cwd = rec.App.Args, rec.App.Env, rec.App.Cwd
	}
	return meta, rec.Dir, nil
}

// CheckpointPod checkpoints a pod and the running containers named
// (CRI v0.37: all of them running in the pod, none twice) into the
// existing empty directory outputPath. InvalidArgument, NotFound (the pod,
// or a named container not in it), FailedPrecondition (a named container
// does not run; the pod's stage1 or this node cannot checkpoint),
// Unimplemented.
func (b *Broker) CheckpointPod(ctx context.Context, podID, outputPath string, containerIDs []string) error {
	if err := checkpointDir("output_path", outputPath, true); err != nil {
		return err
	}
	if len(containerIDs) == 0 {
		return errdefs.InvalidArgument("container_ids: the containers to checkpoint are required")
	}
	p, err := b.lookupPod(podID)
	if err != nil {
		return err
	}
	seen := map[string]bool{}
	for _, id := range containerIDs {
		c, cp, err := b.containerAndPod(ctx, id)
		if err != nil {
			return err
		}
		if cp != p {
			return errdefs.NotFound("container %s is not in pod %s", c.rec.ID, p.id())
		}
		if seen[c.rec.ID] {
			return errdefs.InvalidArgument("container_ids: %s is named twice", c.rec.ID)
		}
		seen[c.rec.ID] = true
		if err := b.checkpointRunning(c); err != nil {
			return err
		}
	}
	if err := b.checkpointable(ctx, p.rec.Stage1); err != nil {
		return err
	}
	return errdefs.New(errdefs.ErrUnimplemented, "stage1 %s: checkpointing a pod is not implemented yet", p.rec.Stage1)
}

// RestorePod makes a pod from the checkpoint in directory checkpointPath,
// with containers named containerNames. The pod goes through the same
// policy decision as a new one with cfg, so a policy changed since the
// checkpoint may refuse it, saying why. InvalidArgument, NotFound (no such
// checkpoint), PermissionDenied and FailedPrecondition (the policy's
// refusals; the chosen stage1 or this node cannot restore),
// Unimplemented: every restore is refused for now, and the pod's ID will
// come with them.
func (b *Broker) RestorePod(ctx context.Context, checkpointPath string, cfg *PodConfig, containerNames []string) error {
	if err := checkpointDir("checkpoint_path", checkpointPath, false); err != nil {
		return err
	}
	if cfg == nil {
		return errdefs.InvalidArgument("config: the restored pod's configuration is required")
	}
	if len(containerNames) == 0 {
		return errdefs.InvalidArgument("container_configs: the restored containers' configurations are required")
	}
	seen := map[string]bool{}
	for _, n := range containerNames {
		if n == "" {
			return errdefs.InvalidArgument("container_configs: a configuration without metadata.name")
		}
		if seen[n] {
			return errdefs.InvalidArgument("container_configs: %q is named twice", n)
		}
		seen[n] = true
	}
	if err := b.validatePodConfig(cfg); err != nil {
		return err
	}
	// As RunPod decides, without counting a pod start.
	d, err := b.policy.Load().Decide(policyPod(cfg), b.caps)
	if err != nil {
		return err
	}
	if _, ok := b.opts.Backends[d.Stage1]; !ok {
		return errdefs.FailedPrecondition("stage1 %q is not available on this node", d.Stage1)
	}
	if err := b.checkpointable(ctx, d.Stage1); err != nil {
		return err
	}
	return errdefs.New(errdefs.ErrUnimplemented, "stage1 %s: restoring a pod is not implemented yet", d.Stage1)
}

// checkpointDir checks the directory of a pod checkpoint given in field:
// absolute, existing, and empty when it is to be written.
func checkpointDir(field, p string, empty bool) error {
	if p == "" {
		return errdefs.InvalidArgument("%s: the checkpoint directory is required", field)
	}
	if !filepath.IsAbs(p) {
		return errdefs.InvalidArgument("%s: %q is not an absolute path", field, p)
	}
	fi, err := os.Stat(p)
	if err != nil {
		return errdefs.NotFound("%s: %v", field, err)
	}
	if !fi.IsDir() {
		return errdefs.InvalidArgument("%s: %s is not a directory", field, p)
	}
	if empty {
		names, err := os.ReadDir(p)
		if err != nil {
			return errdefs.InvalidArgument("%s: %v", field, err)
		}
		if len(names) > 0 {
			return errdefs.InvalidArgument("%s: %s is not empty", field, p)
		}
	}
	return nil
}

// checkpointRunning refuses a container that does not run.
func (b *Broker) checkpointRunning(c *container) error {
	b.mu.Lock()
	state := c.rec.State
	b.mu.Unlock()
	if state != ContainerRunning {
		return errdefs.FailedPrecondition("container %s is %s: only a running container can be checkpointed", c.rec.ID, state)
	}
	return nil
}

// archivePath checks the path of a checkpoint archive given in field: an
// absolute path in an existing directory, not a directory or device
// itself (a file there is replaced).
func archivePath(field, p string) error {
	if p == "" {
		return errdefs.InvalidArgument("%s: the checkpoint archive's path is required", field)
	}
	if !filepath.IsAbs(p) {
		return errdefs.InvalidArgument("%s: %q is not an absolute path", field, p)
	}
	if fi, err := os.Stat(filepath.Dir(p)); err != nil || !fi.IsDir() {
		return errdefs.InvalidArgument("%s: the directory of %s does not exist", field, p)
	}
	if fi, err := os.Lstat(p); err == nil && !fi.Mode().IsRegular() {
		return errdefs.InvalidArgument("%s: %s exists and is not a file", field, p)
	}
	return nil
}

// checkpointable says why pods of stage1 name cannot be checkpointed or
// restored on this node; nil when they can.
func (b *Broker) checkpointable(ctx context.Context, name string) error {
	if why := b.caps[name].NoCheckpoint; why != "" {
		return errdefs.FailedPrecondition("stage1 %s cannot checkpoint or restore: %s", name, why)
	}
	if b.opts.CRIU == nil {
		return errdefs.FailedPrecondition("checkpoints need CRIU, which this daemon was not given")
	}
	if err := b.opts.CRIU(ctx); err != nil {
		return errdefs.FailedPrecondition("checkpoints need CRIU: %v", err)
	}
	return nil
}
