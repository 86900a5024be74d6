package broker

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/opencontainers/runtime-spec/specs-go"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/image"
	"github.com/stagelet/stagelet/internal/bindmount"
	"github.com/stagelet/stagelet/internal/logctx"
	"github.com/stagelet/stagelet/internal/lsm"
	"github.com/stagelet/stagelet/ocihooks"
	"github.com/stagelet/stagelet/stage1"
	"github.com/stagelet/stagelet/stage1/podconn"
	"github.com/stagelet/stagelet/tracing"
)

// agentTimeout bounds agent calls that have no timeout of their own.
const agentTimeout = 30 * time.Second

func ctrNameKey(podID string, m ContainerMetadata) string {
	return fmt.Sprintf("%s/%s_%d", podID, m.Name, m.Attempt)
}

func validateContainerConfig(c *ContainerConfig) error {
	if err := checkContainerInput(c); err != nil {
		return err
	}
	if c.Metadata.Name == "" {
		return errdefs.InvalidArgument("config.metadata.name: must not be empty")
	}
	if c.Image == "" {
		return errdefs.InvalidArgument("config.image.image: must not be empty")
	}
	for i, m := range c.Mounts {
		if !filepath.IsAbs(m.ContainerPath) {
			return errdefs.InvalidArgument("config.mounts[%d].container_path: %q must be an absolute path", i, m.ContainerPath)
		}
		switch {
		case m.Image != "" && m.HostPath != "":
			return errdefs.InvalidArgument("config.mounts[%d]: host_path and image: a mount has one source", i)
		case m.Image == "" && m.ImageSubPath != "":
			return errdefs.InvalidArgument("config.mounts[%d].image_sub_path: given without image", i)
		case m.Image == "" && !filepath.IsAbs(m.HostPath):
			return errdefs.InvalidArgument("config.mounts[%d].host_path: %q must be an absolute path", i, m.HostPath)
		}
		if m.RecursiveReadonly {
			// As the kubelet and containerd define it: a recursively
			// read-only mount is read-only and propagates nothing.
			if !m.Readonly {
				return errdefs.InvalidArgument("config.mounts[%d]: recursive_read_only needs readonly", i)
			}
			if m.Propagation != "" && m.Propagation != "private" {
				return errdefs.InvalidArgument("config.mounts[%d]: recursive_read_only needs private propagation, not %s", i, m.Propagation)
			}
		}
	}
	sec := &c.Security
	if sec.RunAsGroup != nil && sec.RunAsUser == nil && sec.RunAsUsername == "" {
		return errdefs.InvalidArgument("config.linux.security_context.run_as_group: given without run_as_user or run_as_username")
	}
	for _, list := range []struct {
		field string
		paths []string
	}{{"masked_paths", sec.MaskedPaths}, {"readonly_paths", sec.ReadonlyPaths}} {
		for _, p := range list.paths {
			if !filepath.IsAbs(p) {
				return errdefs.InvalidArgument("config.linux.security_context.%s: %q must be an absolute path", list.field, p)
			}
		}
	}
	if sec.PIDMode == PIDModeTarget && sec.PIDTarget == "" {
		return errdefs.InvalidArgument("config.linux.security_context.namespace_options: pid TARGET without target_id")
	}
	if filepath.IsAbs(c.LogPath) || strings.Contains(c.LogPath, "..") {
		return errdefs.InvalidArgument("config.log_path: %q must be relative to the pod's log directory", c.LogPath)
	}
	for _, kv := range c.Env {
		if kv.Key == "" || strings.ContainsRune(kv.Key, '=') {
			return errdefs.InvalidArgument("config.envs: invalid variable name %q", kv.Key)
		}
	}
	return nil
}

// CreateContainer creates a container in a ready pod: it resolves the
// image, makes the container's rootfs and registers the app with the pod's
// agent. A retry with the same configuration returns the same container.
func (b *Broker) CreateContainer(ctx context.Context, podID string, cfg *ContainerConfig) (string, error) {
	p, restore, err := b.admitContainer(ctx, podID, cfg)
	if err != nil {
		return "", err
	}
	podID = p.rec.ID
	key := ctrNameKey(podID, cfg.Metadata)
	hash := hashOf(cfg)

	b.mu.Lock()
	if existing, ok := b.ctrNames[key]; ok {
		same := existing.rec.ConfigHash == hash
		id := existing.rec.ID
		b.mu.Unlock()
		if !same {
			return "", errdefs.AlreadyExists("container name %q is reserved for %s", key, id)
		}
		if err := awaitContainer(ctx, existing); err != nil {
			return "", err
		}
		return id, nil
	}
	id := newID()
	ctx = logctx.With(ctx, "container", id)
	c := b.newContainer(id, podID, cfg, hash)
	b.ctrNames[key] = c
	b.ctrs[id] = c
	b.mu.Unlock()

	// Created in the background, like pods: a retry after the caller's
	// timeout gets this container.
	go b.createInBackground(ctx, p, c, cfg, key, restore)
	if err := awaitContainer(ctx, c); err != nil {
		return "", err
	}
	return id, nil
}

// admitContainer checks a CreateContainer request for cfg in pod podID
// before anything is reserved: cfg is valid, the pod was created (else
// NotFound), and the policy, the pod's stage1 and its user namespace
// allow the container. It returns the pod and whether cfg's image is a
// checkpoint to restore (isCheckpoint).
func (b *Broker) admitContainer(ctx context.Context, podID string, cfg *ContainerConfig) (*pod, bool, error) {
	if err := validateContainerConfig(cfg); err != nil {
		return nil, false, err
	}
	p, err := b.lookupPod(podID)
	if err != nil {
		return nil, false, err
	}
	if err := waitCreated(ctx, p.created); err != nil {
		return nil, false, err
	}
	if p.err != nil {
		return nil, false, errdefs.NotFound("pod sandbox %q not found", podID)
	}
	if err := b.checkPrivileged(p, cfg); err != nil {
		return nil, false, err
	}
	if err := b.checkCpuset(p, &cfg.Resources, "config.linux.resources"); err != nil {
		return nil, false, err
	}
	b.mu.Lock()
	podNS := p.rec.Config.UserNS
	b.mu.Unlock()
	restore := b.isCheckpoint(cfg.Image)
	if restore {
		if err := b.checkRestorable(ctx, p); err != nil {
			return nil, false, err
		}
	}
	if !sameUserNS(cfg.Security.UserNS, podNS) {
		return nil, false, errdefs.InvalidArgument("config.linux.security_context.namespace_options.userns_options: the container asks for %s, and its pod runs in %s: a container shares its pod's user namespace", describeUserNS(cfg.Security.UserNS), describeUserNS(podNS))
	}
	return p, restore, nil
}

// newContainer is container id of cfg (whose hash is hash) in pod podID,
// being created: its creation ends when its created channel closes.
func (b *Broker) newContainer(id, podID string, cfg *ContainerConfig, hash string) *container {
	return &container{
		rec: &ContainerRecord{
			ID:         id,
			PodID:      podID,
			State:      ContainerCreating,
			Config:     *cfg,
			ConfigHash: hash,
			ImageName:  cfg.Image,
			Dir:        filepath.Join(b.containersDir(), id),
			CreatedAt:  time.Now(),
		},
		created: make(chan struct{}),
	}
}

// createInBackground creates container c of cfg, reserved under name key,
// in pod p (createContainer) holding the pod's op lock, bounded by
// createTimeout and not by ctx, and then ends c's creation: c.err is set
// and c.created closed. A failed container's name and ID are released,
// for a retry to create it anew.
func (b *Broker) createInBackground(ctx context.Context, p *pod, c *container, cfg *ContainerConfig, key string, restore bool) {
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), createTimeout)
	defer cancel()
	p.op.Lock()
	err := b.createContainer(cctx, p, c, restore)
	p.op.Unlock()
	id := c.rec.ID
	if err != nil {
		b.mu.Lock()
		delete(b.ctrNames, key)
		delete(b.ctrs, id)
		b.mu.Unlock()
	} else {
		b.log.InfoContext(ctx, "container created", "pod", c.rec.PodID, "container", id, "name", cfg.Metadata.Name, "image", cfg.Image)
	}
	c.err = err
	close(c.created)
}

// awaitContainer waits until the creation of c ends, and returns why it
// failed, or ctx's error when ctx ends first.
func awaitContainer(ctx context.Context, c *container) error {
	if err := waitCreated(ctx, c.created); err != nil {
		return err
	}
	return c.err
}

// checkPrivileged rechecks the policy when a container is privileged but
// its pod's sandbox was not: the pod's stage1 was chosen for an
// unprivileged pod, and the policy may place (or refuse) privileged pods
// differently. The pod's stage1 is never changed.
func (b *Broker) checkPrivileged(p *pod, cfg *ContainerConfig) error {
	if !cfg.Security.Privileged {
		return nil
	}
	b.mu.Lock()
	pc := p.rec.Config
	stage1 := p.rec.Stage1
	b.mu.Unlock()
	if pc.Privileged {
		return nil
	}
	pc.Privileged = true
	d, err := b.policy.Load().Decide(policyPod(&pc), b.caps)
	if err != nil {
		return fmt.Errorf("privileged container %q: %w", cfg.Metadata.Name, err)
	}
	if d.Stage1 != stage1 {
		return errdefs.New(errdefs.ErrPermissionDenied,
			"privileged container %q: the policy puts privileged pods on stage1 %q, but this pod runs on %q (chosen for an unprivileged sandbox); mark the pod sandbox privileged",
			cfg.Metadata.Name, d.Stage1, stage1)
	}
	return nil
}

func sameUserNS(a, b *stage1.IDMapping) bool {
	return a == nil && b == nil || a != nil && b != nil && *a == *b
}

func describeUserNS(m *stage1.IDMapping) string {
	if m == nil {
		return "the host's user namespace"
	}
	return fmt.Sprintf("a user namespace mapping %d IDs from host ID %d", m.Size, m.HostID)
}

// checkCpuset refuses a cpuset for a container of a pod in a VM: a
// cpuset names host CPUs and memory nodes, which its guest does not see.
func (b *Broker) checkCpuset(p *pod, r *Resources, field string) error {
	if r.CpusetCpus == "" && r.CpusetMems == "" {
		return nil
	}
	b.mu.Lock()
	stage1 := p.rec.Stage1
	b.mu.Unlock()
	if b.caps[stage1].KernelIsolated {
		return errdefs.InvalidArgument("%s.cpuset_cpus, cpuset_mems: the pod runs in a VM (stage1 %s), whose vCPUs and memory are not the host's CPUs and memory nodes: a cpuset would need the VM's vCPUs pinned to host CPUs, which this stage1 does not do", field, stage1)
	}
	return nil
}

// mountRootfs mounts container rec's rootfs from img in its directory:
// in a pod with a user namespace of its own, the pod's root owns the
// image's files as the host's root does. A container restored from a
// checkpoint gets the checkpoint's writable layer.
func (b *Broker) mountRootfs(ctx context.Context, p *pod, img *admittedImage, rec *ContainerRecord) (string, error) {
	if rec.Restore != nil {
		if err := b.importCheckpointLayer(ctx, rec); err != nil {
			return "", err
		}
	}
	b.mu.Lock()
	podNS, podSELinux := p.rec.Config.UserNS, p.rec.SELinux
	guest := b.caps[p.rec.Stage1].KernelIsolated
	b.mu.Unlock()
	sel, err := containerSELinux(&rec.Config.Security, podSELinux, guest)
	if err != nil {
		return "", err
	}
	var userns *image.UserNS
	if podNS != nil {
		f, err := bindmount.UserNSFile(podNS.HostID, podNS.Size)
		if err != nil {
			return "", err
		}
		defer f.Close()
		userns = &image.UserNS{File: f, UID: int(podNS.HostID), GID: int(podNS.HostID)}
	}
	return b.opts.Images.MountRootfs(ctx, img.img.ID, rec.Dir, userns, sel.Mount)
}

// mountImageVolumes mounts the images of cfg's image volumes, vols (by
// mount index, from admitVolumes), beneath the container's directory dir
// (dir/ivol/<n>, which goes with its rootfs) and returns the config with
// their paths as the mounts' host paths, read-only. An image is mounted
// by its ID: a tag moved since the check cannot swap it.
func (b *Broker) mountImageVolumes(cfg *ContainerConfig, vols map[int]*admittedImage, dir string) (*ContainerConfig, error) {
	out := *cfg
	out.Mounts = slices.Clone(cfg.Mounts)
	for i, m := range out.Mounts {
		if m.Image == "" {
			continue
		}
		v := vols[i]
		if v == nil {
			return nil, fmt.Errorf("config.mounts[%d].image %s: not admitted", i, m.Image)
		}
		path, err := b.opts.Images.MountImageVolume(v.img.ID, filepath.Join(dir, "ivol", strconv.Itoa(i)), m.ImageSubPath)
		if err != nil {
			return nil, fmt.Errorf("config.mounts[%d].image %s: %w", i, m.Image, err)
		}
		out.Mounts[i].HostPath, out.Mounts[i].Readonly = path, true
	}
	return &out, nil
}

// createContainer creates container c in pod p; restore: its image is a
// checkpoint (isCheckpoint).
func (b *Broker) createContainer(ctx context.Context, p *pod, c *container, restore bool) (err error) {
	h, err := b.podHandle(p)
	if err != nil {
		return err
	}
	rec := c.rec
	b.mu.Lock()
	namespace := p.rec.Config.Metadata.Namespace
	b.mu.Unlock()
	if restore {
		if err := b.unpackCheckpoint(ctx, rec, p, namespace); err != nil {
			return err
		}
		defer b.removeUnpacked(ctx, rec, &err)
	}
	img, err := b.containerImage(ctx, &rec.Config, restore, namespace)
	if err != nil {
		return err
	}
	vols, err := b.admitVolumes(ctx, &rec.Config, namespace)
	if err != nil {
		return err
	}
	if err := b.claimImages(rec, img, vols); err != nil {
		return err
	}
	// Record before taking the rootfs, so a crash leaves a record that
	// recovery cleans up.
	if err := b.rec.saveContainer(rec); err != nil {
		return fmt.Errorf("persist container record: %w", err)
	}
	defer b.releaseFailedRootfs(ctx, rec, &err)
	mctx, span := tracing.Start(ctx, "container.rootfs")
	rootfs, cfg, err := b.mountContainerFS(mctx, p, img, vols, rec)
	tracing.End(span, err)
	if err != nil {
		return err
	}
	app, pci, err := b.containerApp(p, img.img, rec, cfg, rootfs)
	if err != nil {
		return err
	}
	if err := b.nriCreateContainer(ctx, p, c, app); err != nil {
		return err
	}
	b.recordApp(p, rec, app, rootfs)
	if err := b.createInPod(ctx, h, p, c, app, pci); err != nil {
		b.nriUndoCreate(ctx, p, c)
		return err
	}
	return nil
}

// releaseFailedRootfs undoes, when *err is set (createContainer failed),
// what createContainer did for container rec since it saved its record:
// it unmounts its rootfs and deletes its record.
func (b *Broker) releaseFailedRootfs(ctx context.Context, rec *ContainerRecord, err *error) {
	if *err == nil {
		return
	}
	if uerr := b.opts.Images.UnmountRootfs(ctx, rec.Dir); uerr != nil {
		b.log.ErrorContext(ctx, "releasing rootfs of a container that failed to be created", "container", rec.ID, "err", uerr)
	}
	b.rec.deleteContainer(rec.ID)
}

// mountContainerFS mounts container rec's file systems in pod p: its
// rootfs from img (mountRootfs) and its image volumes from vols
// (mountImageVolumes). It returns the rootfs and rec's config with the
// image volumes' paths; what it mounted before failing is left to
// releaseFailedRootfs.
func (b *Broker) mountContainerFS(ctx context.Context, p *pod, img *admittedImage, vols map[int]*admittedImage, rec *ContainerRecord) (string, *ContainerConfig, error) {
	rootfs, err := b.mountRootfs(ctx, p, img, rec)
	if err != nil {
		return "", nil, fmt.Errorf("container rootfs: %w", err)
	}
	cfg, err := b.mountImageVolumes(&rec.Config, vols, rec.Dir)
	if err != nil {
		return "", nil, err
	}
	return rootfs, cfg, nil
}

// containerApp builds the app spec of container rec in pod p from cfg
// (rec's config with its image volumes mounted), img and rootfs, and
// picks the PCI devices it gets: NotFound when the container whose PID
// namespace it asks to share is not in its pod.
func (b *Broker) containerApp(p *pod, img *image.Image, rec *ContainerRecord, cfg *ContainerConfig, rootfs string) (*api.AppSpec, []string, error) {
	b.mu.Lock()
	podCfg, podSELinux := p.rec.Config, p.rec.SELinux
	guest := b.caps[p.rec.Stage1].KernelIsolated
	hostLogs := b.caps[p.rec.Stage1].HostLogs
	var target *ContainerRecord
	if t := rec.Config.Security.PIDTarget; t != "" {
		if tc, ok := b.ctrs[t]; ok && tc.rec.PodID == rec.PodID {
			target = tc.rec
		}
	}
	b.mu.Unlock()
	if rec.Config.Security.PIDMode == PIDModeTarget && target == nil {
		return nil, nil, errdefs.NotFound("config.linux.security_context.namespace_options.target_id: container %q is not in pod sandbox %s", rec.Config.Security.PIDTarget, rec.PodID)
	}
	app, err := buildAppSpec(rec.ID, &podCfg, podSELinux, cfg, img, rootfs, guest)
	if err != nil {
		return nil, nil, err
	}
	app.Rlimits = slices.Clone(b.opts.Rlimits)
	// The daemon writes the log on the host (podconn.FollowLog) where the
	// pod's agent cannot reach the host's files but through a share that
	// keeps the pod from moving.
	app.HostLog = hostLogs && app.LogPath != ""
	// Volumes that ask for it get the container's mount label, as in
	// containerd and CRI-O: private to its pod's level. Others keep
	// theirs, which the container reads only where the policy lets it.
	for _, m := range cfg.Mounts {
		if m.SelinuxRelabel {
			if err := lsm.Relabel(m.HostPath, app.SELinuxMountLabel); err != nil {
				return nil, nil, errdefs.InvalidArgument("config.mounts %s: %w", m.ContainerPath, err)
			}
		}
	}
	pci, err := b.appDevices(p, &rec.Config, app)
	if err != nil {
		return nil, nil, err
	}
	return app, pci, nil
}

// recordApp adds pod p's files (resolv.conf, hostname, hosts) to app's
// mounts and records app and rootfs in container rec, under b.mu.
func (b *Broker) recordApp(p *pod, rec *ContainerRecord, app *api.AppSpec, rootfs string) {
	b.mu.Lock()
	podRec := *p.rec
	b.mu.Unlock()
	app.Mounts = append(app.Mounts, podFileMounts(&podRec, app.Mounts, rec.Config.Security.ReadonlyRootfs)...)
	b.mu.Lock()
	rec.Rootfs = rootfs
	rec.LogPath = app.LogPath
	rec.App = app
	b.mu.Unlock()
}

// createInPod has pod p's agent (h) create container c from app, with the
// PCI devices pci, then records c created, publishes EventCreated and
// saves c's record; when the record cannot be saved, the agent removes
// the container again.
func (b *Broker) createInPod(ctx context.Context, h *podconn.Pod, p *pod, c *container, app *api.AppSpec, pci []string) error {
	rec := c.rec
	actx, cancel := agentCtx(ctx, agentTimeout)
	defer cancel()
	st, err := h.CreateContainer(actx, &stage1.ContainerSpec{AppSpec: *app, PCIDevices: pci, ImageID: rec.ImageID})
	if err != nil {
		return fmt.Errorf("create container in pod: %w", err)
	}
	pid := func() int {
		if st == nil {
			return 0
		}
		return st.PID
	}
	if err := b.runHooks(ctx, c, string(specs.StateCreated), pid, ocihooks.Prestart, ocihooks.CreateRuntime); err != nil {
		h.RemoveContainer(context.WithoutCancel(ctx), rec.ID)
		return fmt.Errorf("create container: %w", err)
	}
	b.mu.Lock()
	rec.State = ContainerCreated
	if st != nil && !st.CreatedAt.IsZero() {
		rec.CreatedAt = st.CreatedAt
	}
	cp := *rec
	b.publishLocked(EventCreated, p, c)
	b.mu.Unlock()
	if err := b.rec.saveContainer(&cp); err != nil {
		h.RemoveContainer(context.WithoutCancel(ctx), rec.ID)
		return fmt.Errorf("persist container record: %w", err)
	}
	return nil
}

// claimImages records that container rec uses img and, as volumes, vols,
// unless one was removed since it was looked up. It holds imageMu, which
// RemoveImage holds from its look at the containers' images to the
// removal: an image a container being created uses is never removed.
func (b *Broker) claimImages(rec *ContainerRecord, img *admittedImage, vols map[int]*admittedImage) error {
	b.imageMu.Lock()
	defer b.imageMu.Unlock()
	var volIDs []string
	for _, i := range slices.Sorted(maps.Keys(vols)) {
		if !slices.Contains(volIDs, vols[i].img.ID) {
			volIDs = append(volIDs, vols[i].img.ID)
		}
	}
	for _, id := range append([]string{img.img.ID}, volIDs...) {
		if _, err := b.opts.Images.Get(id); err != nil {
			return fmt.Errorf("image %s, removed while the container was created: %w", id, err)
		}
	}
	name := imageName(&rec.Config, img.img)
	b.mu.Lock()
	rec.ImageID, rec.ImageName, rec.VolumeImageIDs = img.img.ID, name, volIDs
	b.mu.Unlock()
	return nil
}

// admitVolumes admits the image of each of cfg's image volumes
// (admitImage), by mount index: NotFound for one not pulled.
func (b *Broker) admitVolumes(ctx context.Context, cfg *ContainerConfig, namespace string) (map[int]*admittedImage, error) {
	vols := map[int]*admittedImage{}
	for i, m := range cfg.Mounts {
		if m.Image == "" {
			continue
		}
		img, err := b.opts.Images.Get(m.Image)
		if errdefs.IsNotFound(err) {
			return nil, errdefs.NotFound("config.mounts[%d].image %q (volume %s) not found: pull it first", i, m.Image, m.ContainerPath)
		}
		if err != nil {
			return nil, fmt.Errorf("config.mounts[%d].image %s: %w", i, m.Image, err)
		}
		named := m.UserImage
		if named == "" && !isImageID(m.Image, img.ID) {
			named = m.Image
		}
		a, err := b.admitImage(ctx, namespace, useVolume(m.ContainerPath), named, img)
		if err != nil {
			return nil, err
		}
		vols[i] = a
	}
	return vols, nil
}

// containerImage is the stored image of container config cfg, admitted
// for namespace (admitImage): NotFound when it was not pulled.
// The image of a container restored from a checkpoint is pulled when
// missing, as CRI-O does: a checkpoint taken on another node needs it, and
// the kubelet pulled the checkpoint image only.
func (b *Broker) containerImage(ctx context.Context, cfg *ContainerConfig, restore bool, namespace string) (*admittedImage, error) {
	img, err := b.opts.Images.Get(cfg.Image)
	switch {
	case restore && errdefs.IsNotFound(err):
		img, err = b.pullCheckpointed(ctx, cfg, namespace)
	case errdefs.IsNotFound(err):
		return nil, errdefs.NotFound("image %q not found: pull it first", cfg.Image)
	}
	if err != nil {
		return nil, err
	}
	use := useContainerImage
	if restore {
		use = useCheckpointedRan
	}
	return b.admitImage(ctx, namespace, use, authorName(cfg, img), img)
}

// pullCheckpointed pulls the image of a checkpointed container, cfg: by
// the reference its pod's author gave, since the kubelet names images by
// their IDs, which cannot be pulled; the image pulled must be the one the
// container ran.
func (b *Broker) pullCheckpointed(ctx context.Context, cfg *ContainerConfig, namespace string) (*image.Image, error) {
	byID := strings.HasPrefix(cfg.Image, "sha256:")
	ref := cfg.Image
	if cfg.UserImage != "" {
		ref = cfg.UserImage
	} else if byID {
		return nil, errdefs.NotFound("the checkpointed container's image %s is not on this node, and the checkpoint names no reference to pull it by", cfg.Image)
	}
	verify, err := b.pullVerifier(ctx, namespace, ref)
	if err != nil {
		return nil, err
	}
	img, err := b.opts.Images.Pull(ctx, ref, nil, verify)
	if err != nil {
		return nil, fmt.Errorf("the checkpointed container's image: %w", err)
	}
	if byID && img.ID != cfg.Image {
		return nil, errdefs.FailedPrecondition("the checkpointed container ran image %s; %s is now %s", cfg.Image, ref, img.ID)
	}
	return img, nil
}

// containerPod returns a container (whose creation finished) and its pod.
func (b *Broker) containerAndPod(ctx context.Context, id string) (*container, *pod, error) {
	c, err := b.lookupContainer(id)
	if err != nil {
		return nil, nil, err
	}
	if err := waitCreated(ctx, c.created); err != nil {
		return nil, nil, err
	}
	if c.err != nil {
		return nil, nil, errdefs.NotFound("container %q not found", id)
	}
	b.mu.Lock()
	p := b.pods[c.rec.PodID]
	b.mu.Unlock()
	if p == nil {
		return nil, nil, errdefs.NotFound("pod sandbox of container %q not found", id)
	}
	return c, p, nil
}

// StartContainer starts a created container.
func (b *Broker) StartContainer(ctx context.Context, id string) error {
	c, p, err := b.containerAndPod(ctx, id)
	if err != nil {
		return err
	}
	c.op.Lock()
	defer c.op.Unlock()
	b.mu.Lock()
	state := c.rec.State
	b.mu.Unlock()
	if state != ContainerCreated {
		return errdefs.FailedPrecondition("container %s is %s, not created", c.rec.ID, state)
	}
	h, err := b.podHandle(p)
	if err != nil {
		return err
	}
	if err := b.nriStartContainer(ctx, p, c); err != nil {
		return fmt.Errorf("start container %s: %w", c.rec.ID, err)
	}
	b.mu.Lock()
	restore := c.rec.Restore != nil
	b.mu.Unlock()

	actx, cancel := agentCtx(ctx, agentTimeout)
	defer cancel()
	var st *api.AppStatus
	if restore {
		st, err = b.startRestored(ctx, h, c)
	} else {
		st, err = h.StartContainer(actx, c.rec.ID)
	}
	if err != nil {
		// The agent records a failed start as an exit; keep that truth.
		if st2, serr := h.ContainerStatus(actx, c.rec.ID); serr == nil && st2.State == api.StateExited {
			b.applyAppStatus(ctx, c, st2)
		}
		return fmt.Errorf("start container %s: %w", c.rec.ID, err)
	}
	b.applyAppStatus(ctx, c, st)
	if err := b.runHooks(ctx, c, string(specs.StateRunning), func() int { return st.PID }, ocihooks.Poststart); err != nil {
		// As runc: the container does not run on after its poststart
		// hook failed.
		sctx, cancel := agentCtx(context.WithoutCancel(ctx), agentTimeout)
		defer cancel()
		if sst, serr := h.StopContainer(sctx, c.rec.ID, 0); serr == nil {
			b.applyAppStatus(ctx, c, sst)
		}
		return fmt.Errorf("start container %s: %w", c.rec.ID, err)
	}
	b.log.InfoContext(ctx, "container started", "pod", p.rec.ID, "container", c.rec.ID)
	return nil
}

// applyAppStatus folds the agent's view of a container into its record,
// persists the record if anything changed and publishes the change. A
// container only moves forward: created, running, exited; a status that
// arrives late (a start's reply after the exit's event) changes nothing.
func (b *Broker) applyAppStatus(ctx context.Context, c *container, st *api.AppStatus) {
	if st == nil {
		return
	}
	if st.State == api.StateExited {
		b.reportExit(ctx, c)
	}
	b.mu.Lock()
	rec := c.rec
	changed := false
	event := ""
	switch st.State {
	case api.StateRunning:
		if rec.State == ContainerCreated {
			rec.State, changed, event = ContainerRunning, true, EventStarted
		}
	case api.StateExited:
		if rec.State != ContainerExited {
			rec.State, changed, event = ContainerExited, true, EventStopped
		}
		if rec.ExitCode != st.ExitCode || rec.Reason != st.Reason || rec.Message != st.Message || !rec.FinishedAt.Equal(st.FinishedAt) {
			rec.ExitCode, rec.Reason, rec.Message, rec.FinishedAt = st.ExitCode, st.Reason, st.Message, st.FinishedAt
			changed = true
		}
	}
	if !st.StartedAt.IsZero() && !rec.StartedAt.Equal(st.StartedAt) {
		rec.StartedAt, changed = st.StartedAt, true
	}
	cp := *rec
	var started func()
	if p := b.pods[rec.PodID]; p != nil && event != "" {
		b.publishLocked(event, p, c)
		if event == EventStarted && !p.runAt.IsZero() {
			stage1, took := p.rec.Stage1, time.Since(p.runAt)
			p.runAt = time.Time{}
			started = func() { b.obs.PodStarted(stage1, took) }
		}
	}
	b.mu.Unlock()
	if started != nil {
		started()
	}
	if changed {
		if err := b.rec.saveContainer(&cp); err != nil {
			b.log.ErrorContext(ctx, "persist container record", "container", cp.ID, "err", err)
		}
	}
}

// UpdateContainerResources changes a created or running container's
// limits in its pod's agent (the kubelet's in-place resize), then records
// them, so ContainerStatus reads them back. Zero fields stay as they are.
// InvalidArgument for a change of oom_score_adj (set only when a process
// starts); FailedPrecondition when the container has exited, its pod is
// not ready, or the kernel refuses a value.
func (b *Broker) UpdateContainerResources(ctx context.Context, id string, r Resources) error {
	if err := checkResources("linux", &r); err != nil {
		return err
	}
	c, p, err := b.containerAndPod(ctx, id)
	if err != nil {
		return err
	}
	c.op.Lock()
	defer c.op.Unlock()
	b.mu.Lock()
	state, oom := c.rec.State, c.rec.Config.Resources.OOMScoreAdj
	b.mu.Unlock()
	if state != ContainerCreated && state != ContainerRunning {
		return errdefs.FailedPrecondition("container %s is %s: its limits cannot change", id, state)
	}
	if r.OOMScoreAdj != 0 && r.OOMScoreAdj != oom {
		return errdefs.InvalidArgument("linux.oom_score_adj: %d cannot change to %d in a container that exists", oom, r.OOMScoreAdj)
	}
	if err := b.checkCpuset(p, &r, "linux"); err != nil {
		return err
	}
	upd, err := b.nriUpdateContainer(ctx, p, c, appResources(r))
	if err != nil {
		return fmt.Errorf("update container %s: %w", id, err)
	}
	if err := b.applyResources(ctx, p, c, upd); err != nil {
		return err
	}
	b.nriPostUpdate(p, c)
	return nil
}

// mergeResources sets in cur the limits upd sets (its non-zero fields).
func mergeResources(cur *api.Resources, upd api.Resources) {
	for _, f := range []struct{ dst, src *int64 }{
		{&cur.CPUShares, &upd.CPUShares}, {&cur.CPUQuota, &upd.CPUQuota}, {&cur.CPUPeriod, &upd.CPUPeriod},
		{&cur.MemoryLimit, &upd.MemoryLimit}, {&cur.PidsLimit, &upd.PidsLimit},
	} {
		if *f.src != 0 {
			*f.dst = *f.src
		}
	}
	if upd.CpusetCpus != "" {
		cur.CpusetCpus = upd.CpusetCpus
	}
	if upd.CpusetMems != "" {
		cur.CpusetMems = upd.CpusetMems
	}
}

// applyResources has container c's agent apply its limits upd (zero
// fields stay as they are; oom_score_adj never changes), then records
// them in c's config and app spec. c.op is held.
func (b *Broker) applyResources(ctx context.Context, p *pod, c *container, upd api.Resources) error {
	h, err := b.podHandle(p)
	if err != nil {
		return err
	}
	actx, cancel := agentCtx(ctx, agentTimeout)
	defer cancel()
	upd.OOMScoreAdj = 0 // a process's, set when it starts
	if err := h.UpdateContainerResources(actx, c.rec.ID, upd); err != nil {
		b.refreshOnRefusal(ctx, p, c, err)
		return fmt.Errorf("update container %s: %w", c.rec.ID, err)
	}
	b.mu.Lock()
	cur := &c.rec.Config.Resources
	for _, f := range []struct{ dst, src *int64 }{
		{&cur.CPUShares, &upd.CPUShares}, {&cur.CPUQuota, &upd.CPUQuota}, {&cur.CPUPeriod, &upd.CPUPeriod}, {&cur.MemoryLimit, &upd.MemoryLimit},
	} {
		if *f.src != 0 {
			*f.dst = *f.src
		}
	}
	if upd.CpusetCpus != "" {
		cur.CpusetCpus = upd.CpusetCpus
	}
	if upd.CpusetMems != "" {
		cur.CpusetMems = upd.CpusetMems
	}
	if c.rec.App != nil {
		// A new spec, not a change to the one copies of the record
		// saved outside b.mu may be reading.
		app := *c.rec.App
		mergeResources(&app.Resources, upd)
		c.rec.App = &app
	}
	cp := *c.rec
	b.mu.Unlock()
	if err := b.rec.saveContainer(&cp); err != nil {
		return fmt.Errorf("persist container record: %w", err)
	}
	b.log.InfoContext(ctx, "container limits changed", "container", c.rec.ID, "resources", cp.Config.Resources)
	return nil
}

// StopContainer stops a running container: SIGTERM, then SIGKILL after
// timeout. Idempotent: unknown, created or exited containers are fine.
func (b *Broker) StopContainer(ctx context.Context, id string, timeout time.Duration) error {
	c, _, err := b.containerAndPod(ctx, id)
	if errdefs.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return err
	}
	return b.stopContainer(ctx, c, timeout)
}

func (b *Broker) stopContainer(ctx context.Context, c *container, timeout time.Duration) error {
	c.op.Lock()
	defer c.op.Unlock()
	b.mu.Lock()
	state := c.rec.State
	p := b.pods[c.rec.PodID]
	b.mu.Unlock()
	if state != ContainerRunning || p == nil {
		return nil
	}
	h, err := b.podHandle(p)
	if err != nil {
		return nil // the pod is not running: neither is the container
	}
	actx, cancel := agentCtx(ctx, timeout+agentTimeout)
	defer cancel()
	st, err := h.StopContainer(actx, c.rec.ID, timeout)
	if errdefs.IsNotFound(err) {
		b.markGone(ctx, c, "the pod's agent no longer knows the container")
		return nil
	}
	if err != nil {
		return fmt.Errorf("stop container %s: %w", c.rec.ID, err)
	}
	b.applyAppStatus(ctx, c, st)
	b.log.InfoContext(ctx, "container stopped", "container", c.rec.ID, "exitCode", st.ExitCode)
	return nil
}

// markGone records a container as exited when the truth about its end is
// lost (its pod's agent died or forgot it).
func (b *Broker) markGone(ctx context.Context, c *container, why string) {
	b.mu.Lock()
	rec := c.rec
	if rec.State != ContainerRunning && rec.State != ContainerCreated {
		b.mu.Unlock()
		return
	}
	rec.State = ContainerExited
	rec.ExitCode = 255
	rec.Reason = api.ReasonError
	rec.Message = why
	rec.FinishedAt = time.Now()
	cp := *rec
	if p := b.pods[rec.PodID]; p != nil {
		b.publishLocked(EventStopped, p, c)
	}
	b.mu.Unlock()
	if err := b.rec.saveContainer(&cp); err != nil {
		b.log.ErrorContext(ctx, "persist container record", "container", cp.ID, "err", err)
	}
}

// agentGoneMessage is the exit message of the containers of a pod whose agent
// went (podGone).
const agentGoneMessage = "the pod's agent is gone"

func (b *Broker) markContainersGone(ctx context.Context, podID, why string) {
	for _, c := range b.containersOf(podID) {
		b.markGone(ctx, c, why)
	}
}

func (b *Broker) containersOf(podID string) []*container {
	b.mu.Lock()
	defer b.mu.Unlock()
	var out []*container
	for _, c := range b.ctrs {
		if c.rec.PodID != podID {
			continue
		}
		select {
		case <-c.created:
			if c.err == nil {
				out = append(out, c)
			}
		default:
		}
	}
	return out
}

// RemoveContainer removes a container, stopping it first if it runs.
// Idempotent.
func (b *Broker) RemoveContainer(ctx context.Context, id string) error {
	c, _, err := b.containerAndPod(ctx, id)
	if errdefs.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return err
	}
	return b.removeContainer(ctx, c)
}

func (b *Broker) removeContainer(ctx context.Context, c *container) error {
	if err := b.stopContainer(ctx, c, 0); err != nil {
		return err
	}
	c.op.Lock()
	defer c.op.Unlock()
	b.mu.Lock()
	if b.ctrs[c.rec.ID] != c {
		// A concurrent removal (the kubelet's, or its pod's) came first:
		// its file system is released once, by that one.
		b.mu.Unlock()
		return nil
	}
	rec := *c.rec
	p := b.pods[rec.PodID]
	b.mu.Unlock()
	var unshare func(string) error
	if p != nil {
		if h, err := b.podHandle(p); err == nil {
			actx, cancel := agentCtx(ctx, agentTimeout)
			err := h.ForgetContainer(actx, rec.ID)
			cancel()
			if err != nil && !errdefs.IsNotFound(err) && !errors.Is(err, errdefs.ErrUnavailable) {
				return fmt.Errorf("remove container %s: %w", rec.ID, err)
			}
			unshare = h.UnshareContainer
		}
	}
	if p == nil {
		if err := b.opts.Images.UnmountRootfs(ctx, rec.Dir); err != nil {
			return fmt.Errorf("remove container %s rootfs: %w", rec.ID, err)
		}
	}
	if err := b.rec.deleteContainer(rec.ID); err != nil {
		return err
	}
	b.runHooks(ctx, c, string(specs.StateStopped), func() int { return 0 }, ocihooks.Poststop) //nolint:errcheck // poststop failures are logged (not fatal)
	if p != nil {
		b.releaseRootfs(ctx, p, rec.ID, rec.Dir, unshare)
	}
	b.mu.Lock()
	delete(b.ctrs, rec.ID)
	key := ctrNameKey(rec.PodID, rec.Config.Metadata)
	if b.ctrNames[key] == c {
		delete(b.ctrNames, key)
	}
	if p != nil {
		b.publishLocked(EventDeleted, p, c)
	}
	b.mu.Unlock()
	b.log.InfoContext(ctx, "container removed", "container", rec.ID)
	return nil
}

// releaseRootfs undoes what was shared of a removed container with its
// pod (unshare, when set: its binds into the pod) and unmounts and
// removes its file system, off the reply path: its record is deleted and
// the agent forgot it. Unmounting the overlay and its binds and removing
// its writable layer were most of RemoveContainer's time, which the
// kubelet waits on for every container of every deleted pod. The pod's
// removal waits for it (and its stage1 releases any bind left), and so
// does Close. A daemon that stops before it is done finds the directory
// without a record at its next start, and removes it then
// (collectOrphans); it never removes through a mount. Its logs carry
// ctx's values (the request's ID), not its end: it outlives the request.
func (b *Broker) releaseRootfs(ctx context.Context, p *pod, id, dir string, unshare func(string) error) {
	ctx = context.WithoutCancel(ctx)
	p.releasing.Add(1)
	b.releasing.Add(1)
	go func() {
		defer b.releasing.Done()
		defer p.releasing.Done()
		if unshare != nil {
			if err := unshare(id); err != nil {
				// Its overlay stays mounted through a bind: its layer is
				// left alone, for the next start (collectOrphans), the
				// binds for the pod's removal.
				b.log.ErrorContext(ctx, "undoing the binds of a removed container; its file system stays until the next start", "container", id, "err", err)
				return
			}
		}
		if err := b.opts.Images.UnmountRootfs(ctx, dir); err != nil {
			b.log.ErrorContext(ctx, "releasing a removed container's file system; the next start retries", "container", id, "dir", dir, "err", err)
		}
	}()
}

// ContainerStatus is a container's record, which its pod's agent's events
// keep current: reading it asks no agent.
func (b *Broker) ContainerStatus(ctx context.Context, id string) (*ContainerRecord, error) {
	c, _, err := b.containerAndPod(ctx, id)
	if err != nil {
		return nil, err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	cp := *c.rec
	return &cp, nil
}

// refresh asks the pod's agent about containers the record says are live:
// after the agent refused a call for one (refreshOnRefusal), which its
// exit event may not have reached the broker before.
func (b *Broker) refresh(ctx context.Context, p *pod, cs []*container) {
	var live []*container
	b.mu.Lock()
	for _, c := range cs {
		if c.rec.State == ContainerRunning {
			live = append(live, c)
		}
	}
	b.mu.Unlock()
	if len(live) == 0 {
		return
	}
	h, err := b.podHandle(p)
	if err != nil {
		return
	}
	actx, cancel := agentCtx(ctx, 5*time.Second)
	defer cancel()
	apps, err := h.ListContainers(actx)
	if err != nil {
		b.log.WarnContext(ctx, "cannot reach the pod's agent", "pod", p.rec.ID, "err", err)
		if errors.Is(err, errdefs.ErrUnavailable) {
			b.agentGone(ctx, p, h, err)
		}
		return
	}
	byID := map[string]*api.AppStatus{}
	for _, a := range apps {
		byID[a.ID] = a
	}
	for _, c := range live {
		if st, ok := byID[c.rec.ID]; ok {
			b.applyAppStatus(ctx, c, st)
		} else {
			b.markGone(ctx, c, "the pod's agent no longer knows the container")
		}
	}
}

// ContainerFilter selects containers; zero fields match everything.
type ContainerFilter struct {
	ID            string
	PodID         string
	State         string
	LabelSelector map[string]string
}

// ContainerSummary is what a list of containers shows of one: a few
// fields of its record, copied under the broker's lock. Labels and
// Annotations are the record's own maps, which nothing changes after
// CreateContainer: read them, never write them.
type ContainerSummary struct {
	ID, PodID           string
	Metadata            ContainerMetadata
	ImageName, ImageID  string
	State               string
	CreatedAt           time.Time
	Labels, Annotations map[string]string
}

// ListContainers returns the containers matching f, oldest first, from
// the records alone. It copies only what a list shows: the kubelet asks
// every second.
func (b *Broker) ListContainers(ctx context.Context, f ContainerFilter) []ContainerSummary {
	b.mu.Lock()
	defer b.mu.Unlock()
	match := make([]*container, 0, len(b.ctrs))
	for id, c := range b.ctrs {
		select {
		case <-c.created:
			if c.err != nil {
				continue
			}
		default:
			continue
		}
		r := c.rec
		if f.ID != "" && id != f.ID && !strings.HasPrefix(id, f.ID) {
			continue
		}
		if f.PodID != "" && r.PodID != f.PodID && !strings.HasPrefix(r.PodID, f.PodID) {
			continue
		}
		if b.pods[r.PodID] == nil {
			continue
		}
		if f.State != "" && r.State != f.State {
			continue
		}
		if !labelsMatch(r.Config.Labels, f.LabelSelector) {
			continue
		}
		match = append(match, c)
	}
	// Sorted by pointer, not by the larger summaries.
	sortByCreated(match, func(c *container) (time.Time, string) { return c.rec.CreatedAt, c.rec.ID })
	out := make([]ContainerSummary, len(match))
	for i, c := range match {
		r := c.rec
		out[i] = ContainerSummary{
			ID: r.ID, PodID: r.PodID, Metadata: r.Config.Metadata, ImageName: r.ImageName, ImageID: r.ImageID,
			State: r.State, CreatedAt: r.CreatedAt, Labels: r.Config.Labels, Annotations: r.Config.Annotations,
		}
	}
	return out
}

// ExecSync runs cmd in a running container and returns its output. A
// timeout is DeadlineExceeded, as the kubelet's probes expect.
func (b *Broker) ExecSync(ctx context.Context, id string, cmd []string, timeout time.Duration) (*api.ExecResult, error) {
	if err := CheckCommand("cmd", cmd); err != nil {
		return nil, err
	}
	c, p, h, err := b.runningContainer(ctx, id)
	if err != nil {
		return nil, err
	}
	actx, cancel := context.WithCancel(ctx)
	if timeout > 0 {
		actx, cancel = context.WithTimeout(ctx, timeout+agentTimeout)
	}
	defer cancel()
	res, err := h.ExecSync(actx, c.rec.ID, cmd, timeout)
	if err != nil {
		b.refreshOnRefusal(ctx, p, c, err)
		return nil, err
	}
	if res.TimedOut {
		return nil, errdefs.New(errdefs.ErrDeadlineExceeded, "command %q timed out after %s", strings.Join(cmd, " "), timeout)
	}
	return res, nil
}

// ReopenLog asks the agent to reopen a running container's log file.
func (b *Broker) ReopenLog(ctx context.Context, id string) error {
	c, p, h, err := b.runningContainer(ctx, id)
	if err != nil {
		return err
	}
	actx, cancel := agentCtx(ctx, agentTimeout)
	defer cancel()
	err = h.ReopenLog(actx, c.rec.ID)
	b.refreshOnRefusal(ctx, p, c, err)
	return err
}

// runningContainer returns a container its record says runs, with its
// pod's handle. The record is not refreshed first: the agent refuses a call
// for an app that has exited (FailedPrecondition), and refreshOnRefusal
// then brings the record up to date, so a call costs one agent round trip.
func (b *Broker) runningContainer(ctx context.Context, id string) (*container, *pod, *podconn.Pod, error) {
	c, p, err := b.containerAndPod(ctx, id)
	if err != nil {
		return nil, nil, nil, err
	}
	b.mu.Lock()
	state := c.rec.State
	b.mu.Unlock()
	if state != ContainerRunning {
		return nil, nil, nil, errdefs.FailedPrecondition("container %s is %s, not running", c.rec.ID, state)
	}
	h, err := b.podHandle(p)
	if err != nil {
		return nil, nil, nil, err
	}
	return c, p, h, nil
}

// refreshOnRefusal updates a container's record from its agent after the
// agent refused a call because the app no longer runs.
func (b *Broker) refreshOnRefusal(ctx context.Context, p *pod, c *container, err error) {
	if errors.Is(err, errdefs.ErrFailedPrecondition) {
		b.refresh(ctx, p, []*container{c})
	}
}

// imageName is the image a container's status names: the reference the
// pod's author wrote when the caller passed it (the kubelet compares it
// with the pod's spec to see a container's image change), else the
// reference the container was created from, or, when that was the image's
// ID, the image's first tag, as containerd reports it.
func imageName(cfg *ContainerConfig, img *image.Image) string {
	byID := strings.HasPrefix(img.ID, "sha256:"+strings.TrimPrefix(cfg.Image, "sha256:"))
	switch {
	case cfg.UserImage != "":
		return cfg.UserImage
	case byID && len(img.RepoTags) > 0:
		return img.RepoTags[0]
	default:
		return cfg.Image
	}
}
