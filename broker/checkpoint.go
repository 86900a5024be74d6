package broker

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/checkpoint"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/stage1"
	"github.com/stagelet/stagelet/stage1/podconn"
)

// Checkpoints (CheckpointContainer, CheckpointPod, RestorePod) need two
// things: a stage1 whose pods can be saved (Capabilities.NoCheckpoint
// says why one's cannot) and, for the stage1s that save processes with
// CRIU, a CRIU that works on this kernel (Options.CRIU). Each call checks
// its arguments and these first, so that a node where checkpoints cannot
// work says why (FailedPrecondition) rather than that the call does not
// exist. The containers saved are paused together over their dumps and
// the reading of their layers (stage1.AppCheckpointer), so that what is
// saved is of one moment, and resumed before the call returns.

// CheckpointContainer saves a running container, which goes on running,
// into the archive file location (the kubelet's checkpoint API names one
// under its checkpoints directory), in the layout of package checkpoint:
// its processes as CRIU images, its writable layer and its record. The
// archive appears whole or not at all. InvalidArgument (no location, or a
// relative one), NotFound, FailedPrecondition (the container does not
// run; its stage1 or this node cannot checkpoint; criu failed, with its
// reason), ResourceExhausted (the archive's file system is full),
// Unimplemented (a stage1 that does not save apps).
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
	if handled, err := b.checkpointWholePod(ctx, p, c, location); handled {
		return err
	}
	h, saver, err := b.appCheckpointer(ctx, p)
	if err != nil {
		return err
	}
	start := time.Now()
	sizes, err := b.saveContainers(ctx, p, h, saver, []*container{c}, []string{location})
	if err != nil {
		return err
	}
	b.log.InfoContext(ctx, "container checkpointed", "pod", p.id(), "container", c.rec.ID, "archive", location,
		"bytes", sizes[0], "took", time.Since(start))
	return nil
}

// appCheckpointer is the handle of pod p and its stage1's saver of apps:
// FailedPrecondition when the stage1 or this node cannot checkpoint,
// Unimplemented when the stage1 does not save apps.
func (b *Broker) appCheckpointer(ctx context.Context, p *pod) (*podconn.Pod, stage1.AppCheckpointer, error) {
	b.mu.Lock()
	name := p.rec.Stage1
	b.mu.Unlock()
	if err := b.checkpointable(ctx, name); err != nil {
		return nil, nil, err
	}
	h, err := b.podHandle(p)
	if err != nil {
		return nil, nil, err
	}
	saver, ok := h.Pod.(stage1.AppCheckpointer)
	if !ok {
		// Unimplemented, as a restore on such a stage1 answers: what
		// critest and the kubelet take for "this runtime does not".
		return nil, nil, errdefs.New(errdefs.ErrUnimplemented, "stage1 %s cannot checkpoint a container", name)
	}
	return h, saver, nil
}

// saveContainers saves running containers cs of pod p, each into the
// archive file paths[i]: all are paused over their dumps and the reading
// of their layers, and resumed before it returns. It returns the
// archives' sizes. An archive appears whole or not at all; on failure
// none of them is left.
func (b *Broker) saveContainers(ctx context.Context, p *pod, h *podconn.Pod, saver stage1.AppCheckpointer, cs []*container, paths []string) (sizes []int64, err error) {
	ids := make([]string, len(cs))
	pids := make([]int, len(cs))
	for i, c := range cs {
		ids[i] = c.rec.ID
		actx, cancel := agentCtx(ctx, agentTimeout)
		st, err := h.ContainerStatus(actx, c.rec.ID)
		cancel()
		if err != nil {
			return nil, err
		}
		if st.State != api.StateRunning || st.PID <= 0 {
			return nil, errdefs.FailedPrecondition("container %s is %s: only a running container can be checkpointed", c.rec.ID, st.State)
		}
		pids[i] = st.PID
	}
	thaw, err := saver.FreezeApps(ctx, ids)
	if err != nil {
		return nil, err
	}
	defer func() {
		if terr := thaw(); terr != nil {
			b.log.ErrorContext(ctx, "resuming checkpointed containers", "pod", p.id(), "containers", ids, "err", terr)
			if err == nil {
				err = fmt.Errorf("checkpoint: resume the containers: %w", terr)
			}
		}
		if err != nil {
			for _, path := range paths[:len(sizes)] {
				os.Remove(path)
			}
		}
	}()
	for i, c := range cs {
		size, err := b.saveContainer(ctx, p, saver, c, pids[i], paths[i])
		if err != nil {
			return sizes, err
		}
		sizes = append(sizes, size)
	}
	return sizes, nil
}

// saveContainer saves paused container c of pod p, whose first process
// its agent numbers pid, into the archive file path.
func (b *Broker) saveContainer(ctx context.Context, p *pod, saver stage1.AppCheckpointer, c *container, pid int, path string) (int64, error) {
	// The images live beside the archive until it is written: plain
	// files criu writes, removed whatever happens.
	images, err := os.MkdirTemp(filepath.Dir(path), ".stagelet-criu-")
	if err != nil {
		return 0, errdefs.Storage(fmt.Errorf("checkpoint %s: %w", c.rec.ID, err), filepath.Dir(path))
	}
	defer os.RemoveAll(images)
	criu, err := b.criu(ctx)
	if err != nil {
		return 0, err
	}
	start := time.Now()
	img, err := saver.CheckpointApp(ctx, &stage1.AppSave{CRIU: criu, ID: c.rec.ID, PID: pid, Dir: images})
	if err != nil {
		return 0, err
	}
	dumped := time.Since(start)
	meta, dir, err := b.checkpointMeta(c, p)
	if err != nil {
		return 0, err
	}
	if meta.Processes, err = json.Marshal(img); err != nil {
		return 0, fmt.Errorf("checkpoint %s: %w", c.rec.ID, err)
	}
	size, err := checkpoint.Write(path, meta, dir, images)
	if err != nil {
		// A full file system is ResourceExhausted, naming it.
		return 0, errdefs.Storage(fmt.Errorf("checkpoint %s: %w", c.rec.ID, err), filepath.Dir(path))
	}
	b.log.DebugContext(ctx, "container saved", "container", c.rec.ID, "dump", dumped, "took", time.Since(start))
	return size, nil
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
// existing empty directory outputPath: a container archive each and the
// pod's description (package checkpoint's pod checkpoint). The
// containers are paused together and resumed before it returns; on
// failure nothing is left in outputPath. InvalidArgument, NotFound (the
// pod, or a named container not in it), FailedPrecondition (a named
// container does not run; the pod's stage1 or this node cannot
// checkpoint; criu failed), ResourceExhausted (outputPath's file system
// is full), Unimplemented (a stage1 that does not save apps).
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
	cs, err := b.podCheckpointContainers(ctx, p, containerIDs)
	if err != nil {
		return err
	}
	// Locked in one order, so that two checkpoints never wait on each
	// other; neither stopped nor removed meanwhile.
	slices.SortFunc(cs, func(x, y *container) int { return strings.Compare(x.rec.ID, y.rec.ID) })
	for _, c := range cs {
		c.op.Lock()
		defer c.op.Unlock()
		if err := b.checkpointRunning(c); err != nil {
			return err
		}
	}
	if handled, err := b.checkpointWholePodDir(ctx, p, cs, outputPath); handled {
		return err
	}
	h, saver, err := b.appCheckpointer(ctx, p)
	if err != nil {
		return err
	}
	start := time.Now()
	b.mu.Lock()
	desc := &checkpoint.Pod{ID: p.rec.ID, Name: p.rec.Config.Metadata.Name, Namespace: p.rec.Config.Metadata.Namespace, Stage1: p.rec.Stage1}
	podCfg := p.rec.Config
	paths := make([]string, len(cs))
	for i, c := range cs {
		name := c.rec.Config.Metadata.Name
		desc.Containers = append(desc.Containers, checkpoint.PodContainer{Name: name, ID: c.rec.ID, Archive: checkpoint.ArchiveName(name)})
		paths[i] = filepath.Join(outputPath, checkpoint.ArchiveName(name))
	}
	b.mu.Unlock()
	if desc.Config, err = json.Marshal(podCfg); err != nil {
		return fmt.Errorf("checkpoint pod %s: %w", p.id(), err)
	}
	sizes, err := b.saveContainers(ctx, p, h, saver, cs, paths)
	if err != nil {
		return err
	}
	if err := checkpoint.WritePod(outputPath, desc); err != nil {
		for _, path := range paths {
			os.Remove(path)
		}
		return errdefs.Storage(err, outputPath)
	}
	var total int64
	for _, n := range sizes {
		total += n
	}
	b.log.InfoContext(ctx, "pod checkpointed", "pod", p.id(), "containers", len(cs), "dir", outputPath, "bytes", total, "took", time.Since(start))
	return nil
}

// podCheckpointContainers are the containers containerIDs of pod p, to
// checkpoint together: NotFound (one not in p), InvalidArgument (one
// named twice, or two of one name).
func (b *Broker) podCheckpointContainers(ctx context.Context, p *pod, containerIDs []string) ([]*container, error) {
	var cs []*container
	seen := map[string]bool{}
	names := map[string]bool{}
	for _, id := range containerIDs {
		c, cp, err := b.containerAndPod(ctx, id)
		if err != nil {
			return nil, err
		}
		if cp != p {
			return nil, errdefs.NotFound("container %s is not in pod %s", c.rec.ID, p.id())
		}
		if seen[c.rec.ID] {
			return nil, errdefs.InvalidArgument("container_ids: %s is named twice", c.rec.ID)
		}
		seen[c.rec.ID] = true
		b.mu.Lock()
		name := c.rec.Config.Metadata.Name
		b.mu.Unlock()
		if names[name] {
			return nil, errdefs.InvalidArgument("container_ids: two containers are named %q, which a restore could not tell apart", name)
		}
		names[name] = true
		cs = append(cs, c)
	}
	return cs, nil
}

// RestoredContainer is a container RestorePod made: its CRI name and ID.
type RestoredContainer struct {
	Name, ID string
}

// RestorePod makes a pod from the pod checkpoint in directory
// checkpointPath (CheckpointPod's), with containers configured by ctrs,
// one for each container of the checkpoint, matched by name (CRI
// v0.37). The pod goes through the same policy decision as a new one
// with cfg, so a policy changed since the checkpoint may refuse it,
// saying why; the stage1 chosen must be the checkpoint's. The containers
// are created, as CreateContainer makes one from its archive; each one's
// StartContainer restores its processes. On failure nothing made is
// left. InvalidArgument, NotFound (no such checkpoint), PermissionDenied
// and FailedPrecondition (the policy's refusals; the chosen stage1 or
// this node cannot restore it; a container's configuration does not
// match its checkpoint).
func (b *Broker) RestorePod(ctx context.Context, checkpointPath string, cfg *PodConfig, ctrs []*ContainerConfig) (string, []RestoredContainer, error) {
	desc, err := b.checkRestorePod(ctx, checkpointPath, cfg, ctrs)
	if err != nil {
		return "", nil, err
	}
	podID, err := b.RunPod(ctx, cfg)
	if err != nil {
		return "", nil, err
	}
	var out []RestoredContainer
	for _, c := range ctrs {
		id, err := b.restoreContainer(ctx, podID, filepath.Join(checkpointPath, checkpoint.ArchiveName(c.Metadata.Name)), c)
		if err != nil {
			dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
			rerr := b.StopPod(dctx, podID)
			if rerr == nil {
				rerr = b.RemovePod(dctx, podID)
			}
			cancel()
			if rerr != nil {
				b.log.ErrorContext(ctx, "removing the pod of a failed restore", "pod", podID, "err", rerr)
			}
			return "", nil, fmt.Errorf("restore container %s: %w", c.Metadata.Name, err)
		}
		out = append(out, RestoredContainer{Name: c.Metadata.Name, ID: id})
	}
	b.log.InfoContext(ctx, "pod restored", "pod", podID, "from", checkpointPath, "checkpointed", desc.ID, "containers", len(out))
	return podID, out, nil
}

// checkRestorePod checks a RestorePod's arguments against the checkpoint
// and the policy, and returns the checkpoint's description.
func (b *Broker) checkRestorePod(ctx context.Context, checkpointPath string, cfg *PodConfig, ctrs []*ContainerConfig) (*checkpoint.Pod, error) {
	if err := checkpointDir("checkpoint_path", checkpointPath, false); err != nil {
		return nil, err
	}
	if cfg == nil {
		return nil, errdefs.InvalidArgument("config: the restored pod's configuration is required")
	}
	if len(ctrs) == 0 {
		return nil, errdefs.InvalidArgument("container_configs: the restored containers' configurations are required")
	}
	seen := map[string]bool{}
	for _, c := range ctrs {
		n := c.Metadata.Name
		if n == "" {
			return nil, errdefs.InvalidArgument("container_configs: a configuration without metadata.name")
		}
		if seen[n] {
			return nil, errdefs.InvalidArgument("container_configs: %q is named twice", n)
		}
		seen[n] = true
	}
	if err := b.validatePodConfig(cfg); err != nil {
		return nil, err
	}
	// As RunPod decides, without counting a pod start.
	d, err := b.policy.Load().Decide(policyPod(cfg), b.caps)
	if err != nil {
		return nil, err
	}
	if _, ok := b.opts.Backends[d.Stage1]; !ok {
		return nil, errdefs.FailedPrecondition("stage1 %q is not available on this node", d.Stage1)
	}
	if err := b.checkpointable(ctx, d.Stage1); err != nil {
		return nil, err
	}
	desc, err := checkpoint.ReadPod(checkpointPath)
	if err != nil {
		return nil, err
	}
	if desc.Stage1 != d.Stage1 {
		return nil, errdefs.FailedPrecondition("checkpoint_path: the pod was checkpointed on stage1 %s, and the policy puts this one on %s", desc.Stage1, d.Stage1)
	}
	var want []string
	for _, c := range desc.Containers {
		want = append(want, c.Name)
		if !seen[c.Name] {
			return nil, errdefs.InvalidArgument("container_configs: no configuration for the checkpoint's container %q", c.Name)
		}
	}
	if len(want) != len(ctrs) {
		return nil, errdefs.InvalidArgument("container_configs: the checkpoint holds containers %v, not the %d configured", want, len(ctrs))
	}
	return desc, nil
}

// restoreContainer creates container cfg in pod podID from its archive,
// once the archive's image is the one cfg names.
func (b *Broker) restoreContainer(ctx context.Context, podID, archive string, cfg *ContainerConfig) (string, error) {
	meta, err := checkpoint.ReadMeta(archive)
	if err != nil {
		return "", err
	}
	var old ContainerConfig
	if err := json.Unmarshal(meta.Config, &old); err != nil {
		return "", errdefs.InvalidArgument("checkpoint archive %s: the container's configuration: %w", archive, err)
	}
	// The kubelet names an image by the ID it resolved, with the pod's
	// own spelling as the user's.
	if !slices.Contains([]string{old.Image, meta.Image, meta.ImageID}, cfg.Image) && (cfg.UserImage == "" || cfg.UserImage != old.UserImage) {
		return "", errdefs.FailedPrecondition("config.image: %q, and the checkpointed container ran %q (%s)", cfg.Image, old.Image, meta.ImageID)
	}
	c := *cfg
	c.Image = archive
	return b.CreateContainer(ctx, podID, &c)
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
		return errdefs.NotFound("%s: %w", field, err)
	}
	if !fi.IsDir() {
		return errdefs.InvalidArgument("%s: %s is not a directory", field, p)
	}
	if empty {
		names, err := os.ReadDir(p)
		if err != nil {
			return errdefs.InvalidArgument("%s: %w", field, err)
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
	if b.caps[name].WholePodCheckpoint {
		return nil // saved whole by the stage1, without CRIU
	}
	_, err := b.criu(ctx)
	return err
}

// criu is the criu binary that works on this node: FailedPrecondition,
// saying why, when none does.
func (b *Broker) criu(ctx context.Context) (string, error) {
	if b.opts.CRIU == nil {
		return "", errdefs.FailedPrecondition("checkpoints need CRIU, which this daemon was not given")
	}
	path, err := b.opts.CRIU(ctx)
	if err != nil {
		return "", errdefs.FailedPrecondition("checkpoints need CRIU: %w", err)
	}
	return path, nil
}
