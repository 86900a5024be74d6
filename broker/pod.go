package broker

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"go.opentelemetry.io/otel/attribute"

	"github.com/stagelet/stagelet/cgroups"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/logctx"
	"github.com/stagelet/stagelet/internal/lsm"
	"github.com/stagelet/stagelet/internal/mountsafe"
	"github.com/stagelet/stagelet/internal/sysctl"
	"github.com/stagelet/stagelet/policy"
	"github.com/stagelet/stagelet/stage1"
	"github.com/stagelet/stagelet/stage1/podconn"
	"github.com/stagelet/stagelet/tracing"
)

func podNameKey(m PodMetadata) string {
	return fmt.Sprintf("%s_%s_%s_%d", m.Name, m.Namespace, m.UID, m.Attempt)
}

func (b *Broker) validatePodConfig(c *PodConfig) error {
	if err := validatePodConfig(c); err != nil {
		return err
	}
	slice := cgroups.SliceOf(c.CgroupParent) != ""
	switch {
	case c.CgroupParent == "":
	case b.opts.SystemdCgroup && !slice:
		return errdefs.InvalidArgument("config.linux.cgroup_parent: %q is not a systemd slice, and this node uses the systemd cgroup driver (the kubelet's --cgroup-driver must be systemd too)", c.CgroupParent)
	case !b.opts.SystemdCgroup && slice:
		return errdefs.InvalidArgument("config.linux.cgroup_parent: %q is a systemd slice, and this node uses the cgroupfs cgroup driver (the kubelet's --cgroup-driver must be cgroupfs too, or set cgroup_driver: systemd)", c.CgroupParent)
	}
	return nil
}

func validatePodConfig(c *PodConfig) error {
	if err := checkPodInput(c); err != nil {
		return err
	}
	switch {
	case c.Metadata.Name == "":
		return errdefs.InvalidArgument("config.metadata.name: must not be empty")
	case c.Metadata.Namespace == "":
		return errdefs.InvalidArgument("config.metadata.namespace: must not be empty")
	case c.Metadata.UID == "":
		return errdefs.InvalidArgument("config.metadata.uid: must not be empty")
	}
	if c.CgroupParent != "" && (path.Clean(c.CgroupParent) != c.CgroupParent || strings.Contains(c.CgroupParent, "..")) {
		return errdefs.InvalidArgument("config.linux.cgroup_parent: %q must be a clean path without ..", c.CgroupParent)
	}
	if c.LogDirectory != "" && !filepath.IsAbs(c.LogDirectory) {
		return errdefs.InvalidArgument("config.log_directory: %q must be an absolute path", c.LogDirectory)
	}
	if err := checkSysctls(c); err != nil {
		return err
	}
	for _, p := range c.PortMappings {
		if p.ContainerPort <= 0 || p.ContainerPort > 65535 || p.HostPort < 0 || p.HostPort > 65535 {
			return errdefs.InvalidArgument("config.port_mappings: port %d→%d out of range", p.HostPort, p.ContainerPort)
		}
	}
	return nil
}

// policyPod is what the policy reads of a pod.
func policyPod(c *PodConfig) policy.Pod {
	return policy.Pod{
		Handler:     c.RuntimeHandler,
		Namespace:   c.Metadata.Namespace,
		Labels:      c.Labels,
		Annotations: c.Annotations,
		Privileged:  c.Privileged,
		HostNetwork: c.HostNetwork,
		HostPID:     c.HostPID,
		HostIPC:     c.HostIPC,
		UserNS:      c.UserNS != nil,
	}
}

// decide asks the policy for the pod's stage1. A refusal carries its
// errdefs class (PermissionDenied, InvalidArgument, FailedPrecondition)
// and names the rule, handler or allow-list that refused.
func (b *Broker) decide(ctx context.Context, c *PodConfig) (policy.Decision, error) {
	d, err := b.policy.Load().Decide(policyPod(c), b.caps)
	if err != nil {
		b.count("refused")
		b.obs.PolicyRefused(refusalReason(err))
		b.log.WarnContext(ctx, "pod refused by policy", "name", podNameKey(c.Metadata), "err", err)
		return d, err
	}
	if _, ok := b.opts.Backends[d.Stage1]; !ok {
		// The policy checks this too; never start a pod on a stage1 the
		// node lacks.
		b.count("refused")
		b.obs.PolicyRefused(RefusedStage1Unavailable)
		return d, errdefs.FailedPrecondition("stage1 %q is not available on this node", d.Stage1)
	}
	b.count(d.Stage1)
	b.obs.PolicyDecided(d.Stage1, d.Rule)
	return d, nil
}

// RunPod creates and starts a pod and returns its ID. A retry of a request
// still in progress, or already done, with the same configuration returns
// the same pod; a different configuration under a reserved name is
// AlreadyExists.
//
// The policy's decision and the pod's SELinux labels (whose MCS level
// go-selinux allocates, checking the contexts through selinuxfs) are had
// without b.mu, which List and Status take: the name is looked up before
// and reserved after, under b.mu, and a level had for a name another call
// reserved meanwhile is released.
func (b *Broker) RunPod(ctx context.Context, cfg *PodConfig) (string, error) {
	runAt := time.Now()
	if err := b.validatePodConfig(cfg); err != nil {
		return "", err
	}
	key := podNameKey(cfg.Metadata)
	hash := hashOf(cfg)

	b.mu.Lock()
	existing, err := b.podNamedLocked(key, hash)
	b.mu.Unlock()
	if existing != nil || err != nil {
		return b.answerRetry(ctx, existing, err)
	}
	dec, err := b.decideTraced(ctx, cfg)
	if err != nil {
		return "", err
	}
	seLinux, err := b.podLabels(cfg)
	if err != nil {
		return "", err
	}
	be := b.opts.Backends[dec.Stage1]
	id := newID()
	ctx = logctx.With(ctx, "pod", id)
	p := b.newPod(id, cfg, hash, dec, runAt)
	p.rec.SELinux = seLinux

	b.mu.Lock()
	existing, err = b.podNamedLocked(key, hash)
	if existing == nil && err == nil {
		b.podNames[key] = p
		b.pods[id] = p
	}
	b.mu.Unlock()
	if existing != nil || err != nil {
		b.releaseLabels(seLinux)
		return b.answerRetry(ctx, existing, err)
	}

	// The pod is created in the background: when the kubelet's call times
	// out, creation goes on and the kubelet's retry gets this pod.
	go b.startInBackground(ctx, p, be, key, dec)
	if err := awaitPod(ctx, p); err != nil {
		return "", err
	}
	return id, nil
}

// podNamedLocked is the pod reserved under name key, if any, when its
// configuration's hash is hash; AlreadyExists when it is another's.
// Called with b.mu held.
func (b *Broker) podNamedLocked(key, hash string) (*pod, error) {
	existing, ok := b.podNames[key]
	if !ok {
		return nil, nil
	}
	if existing.rec.ConfigHash != hash {
		return nil, errdefs.AlreadyExists("pod sandbox name %q is reserved for %s", key, existing.rec.ID)
	}
	return existing, nil
}

// answerRetry answers a RunPod of a name already reserved
// (podNamedLocked's answer): err, or existing's ID once its creation
// ended well.
func (b *Broker) answerRetry(ctx context.Context, existing *pod, err error) (string, error) {
	if err != nil {
		return "", err
	}
	if err := awaitPod(ctx, existing); err != nil {
		return "", err
	}
	id := existing.id()
	b.log.DebugContext(ctx, "RunPodSandbox retry answered with the existing pod", "pod", id)
	return id, nil
}

// decideTraced is decide in a span of its own.
func (b *Broker) decideTraced(ctx context.Context, cfg *PodConfig) (policy.Decision, error) {
	_, span := tracing.Start(ctx, "policy.decide")
	dec, err := b.decide(ctx, cfg)
	span.SetAttributes(attribute.String("stagelet.stage1", dec.Stage1), attribute.String("stagelet.policy.rule", dec.Rule),
		attribute.String("stagelet.policy.chosen_by", dec.ChosenBy))
	tracing.End(span, err)
	return dec, err
}

// podHostname is the pod's hostname: its client's, else the node's, as
// containerd gives it: its containers' HOSTNAME, /etc/hostname and, in
// its own UTS namespace, hostname. Where the node's cannot be read the
// pod has none.
func podHostname(cfg *PodConfig) string {
	if cfg.Hostname != "" {
		return cfg.Hostname
	}
	if h, err := os.Hostname(); err == nil && len(h) <= maxHostname {
		return h
	}
	return ""
}

// newPod is pod id of cfg (whose hash is hash), placed by dec, being
// created for a RunPod call made at runAt: its creation ends when its
// created channel closes.
func (b *Broker) newPod(id string, cfg *PodConfig, hash string, dec policy.Decision, runAt time.Time) *pod {
	return &pod{
		rec: &PodRecord{
			ID:         id,
			State:      PodCreating,
			Config:     *cfg,
			ConfigHash: hash,
			Stage1:     dec.Stage1,
			Rule:       dec.Rule,
			ChosenBy:   dec.ChosenBy,
			Options:    dec.Options,
			Reasons:    dec.Reasons,
			RunDir:     filepath.Join(b.podsRunDir(), id),

			PrivilegedWithoutHostDevices: dec.PrivilegedWithoutHostDevices,
			CreatedAt:                    time.Now(),
		},
		created: make(chan struct{}),
		runAt:   runAt,
	}
}

// startInBackground starts pod p, reserved under name key, on stage1 be
// as dec chose (startPod) holding the pod's op lock, bounded by
// createTimeout and not by ctx, and then ends p's creation: p.err is set
// and p.created closed. A failed pod's name and ID are released, for a
// retry to create it anew.
func (b *Broker) startInBackground(ctx context.Context, p *pod, be stage1.Backend, key string, dec policy.Decision) {
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), createTimeout)
	defer cancel()
	cctx, span := tracing.Start(cctx, "pod.start", attribute.String("stagelet.stage1", dec.Stage1), attribute.String("stagelet.pod", p.rec.ID))
	p.op.Lock()
	err := b.startPod(cctx, p, be)
	p.op.Unlock()
	tracing.End(span, err)
	id := p.rec.ID
	if err != nil {
		b.mu.Lock()
		delete(b.podNames, key)
		delete(b.pods, id)
		b.mu.Unlock()
		b.releaseLabels(p.rec.SELinux)
		b.log.WarnContext(ctx, "pod failed to start", "pod", id, "name", key, "stage1", dec.Stage1, "err", err)
	} else {
		b.log.InfoContext(ctx, "pod started", "pod", id, "name", key, "stage1", dec.Stage1, "reasons", dec.Reasons)
	}
	p.err = err
	close(p.created)
}

// awaitPod waits until the creation of p ends, and returns why it failed,
// or ctx's error when ctx ends first.
func awaitPod(ctx context.Context, p *pod) error {
	if err := waitCreated(ctx, p.created); err != nil {
		return err
	}
	return p.err
}

// createTimeout bounds the creation of a pod or container that goes on
// after the caller gave up waiting.
const createTimeout = 4 * time.Minute

// podCgroupParent is the cgroup parent of a pod of config c: the
// kubelet's when it gives one, the node's otherwise.
func (b *Broker) podCgroupParent(c *PodConfig) string {
	if c.CgroupParent != "" {
		return c.CgroupParent
	}
	return b.opts.CgroupParent
}

func (b *Broker) podSpec(rec *PodRecord) *stage1.PodSpec {
	c := rec.Config
	// The kubelet's pod cgroup (cgroupfs driver: /kubepods/<qos>/pod<uid>;
	// systemd: kubepods-<qos>-pod<uid>.slice) when it gives one, so its QoS
	// limits and accounting cover the pod; the node's parent otherwise.
	parent := b.podCgroupParent(&c)
	spec := &stage1.PodSpec{
		ID:           rec.ID,
		Name:         c.Metadata.Name,
		Namespace:    c.Metadata.Namespace,
		UID:          c.Metadata.UID,
		Hostname:     podHostname(&c),
		RunDir:       rec.RunDir,
		CgroupParent: parent,
		HostNetwork:  c.HostNetwork,
		HostPID:      c.HostPID,
		HostIPC:      c.HostIPC,
		Options:      rec.Options,
		NetSysctls:   sysctlsOf(&c, sysctl.Net),
		Resources:    podResourcesOf(&c),
		UserNS:       c.UserNS,
		AgentBinary:  b.opts.AgentBinary,
		FailedLogDir: b.failedLogDir(),
	}
	// Where SELinux is off the pod's labels are what it asked for,
	// shown in its status: nothing applies them, a backend neither.
	if lsm.SELinuxEnabled() {
		spec.SELinuxProcessLabel, spec.SELinuxMountLabel = rec.SELinux.Process, rec.SELinux.Mount
	}
	return spec
}

// failedLogDir keeps the backends' logs of pods that failed to start.
func (b *Broker) failedLogDir() string { return filepath.Join(b.opts.RunDir, "failed-pods") }

// keepFailedLogs is how many logs of failed pods failedLogDir keeps.
const keepFailedLogs = 32

// pruneFailedLogs removes all but the newest keepFailedLogs files of
// failedLogDir.
func (b *Broker) pruneFailedLogs() {
	ents, err := os.ReadDir(b.failedLogDir())
	if err != nil || len(ents) <= keepFailedLogs {
		return
	}
	type file struct {
		name string
		mod  time.Time
	}
	var files []file
	for _, e := range ents {
		if fi, err := e.Info(); err == nil && fi.Mode().IsRegular() {
			files = append(files, file{e.Name(), fi.ModTime()})
		}
	}
	slices.SortFunc(files, func(a, b file) int { return b.mod.Compare(a.mod) })
	for _, f := range files[min(keepFailedLogs, len(files)):] {
		os.Remove(filepath.Join(b.failedLogDir(), f.name))
	}
}

// networkReady says whether pod networking can take a pod now.
func networkReady(n Network) bool {
	ok, _ := n.Status()
	return ok
}

// startPod takes the pod's resources, recording each before it is taken,
// and releases them all on failure. Called with p.op held.
func (b *Broker) startPod(ctx context.Context, p *pod, be stage1.Backend) (err error) {
	rec := p.rec
	spec := b.podSpec(rec)
	if err := b.plan(ctx, rec, spec, be); err != nil {
		return err // nothing taken yet
	}
	if !rec.Config.HostNetwork && b.opts.Network != nil && networkReady(b.opts.Network) {
		// The pod's network namespace goes in its first record, before
		// prepareNetwork makes it: one record write less on the way. (A
		// pod refused for an unready network records none: nothing to
		// tear down.)
		b.mu.Lock()
		rec.NetNS = b.opts.Network.NetNSPath(rec.ID)
		b.mu.Unlock()
	}
	if err := b.rec.savePod(rec); err != nil {
		return fmt.Errorf("persist pod record: %w", err)
	}
	defer func() {
		if err == nil {
			return
		}
		b.mu.Lock()
		state := rec.BackendState
		b.mu.Unlock()
		if derr := be.DestroyPod(context.WithoutCancel(ctx), spec, state); derr != nil {
			b.log.ErrorContext(ctx, "releasing a pod that failed to start", "pod", rec.ID, "err", derr)
		}
		if nerr := b.teardownNetwork(context.WithoutCancel(ctx), rec, true); nerr != nil {
			b.log.ErrorContext(ctx, "releasing the network of a pod that failed to start", "pod", rec.ID, "err", nerr)
		}
		if rerr := mountsafe.RemoveAll(rec.RunDir); rerr != nil {
			b.log.ErrorContext(ctx, "removing the run directory of a pod that failed to start", "pod", rec.ID, "err", rerr)
		}
		b.rec.deletePod(rec.ID)
		b.pruneFailedLogs()
	}()
	if err := os.MkdirAll(rec.RunDir, 0o700); err != nil {
		return err
	}
	started, err := b.startInNetwork(ctx, rec, spec, be)
	if err != nil {
		return err
	}
	h, err := b.preparePod(ctx, p, started)
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			b.nriUndoRunPod(p)
		}
	}()
	b.mu.Lock()
	p.handle = h
	rec.BackendState = h.State()
	rec.State = PodReady
	cp := *rec
	b.mu.Unlock()
	if err := b.rec.savePod(&cp); err != nil {
		b.mu.Lock()
		p.handle = nil
		b.mu.Unlock()
		h.Stop(context.WithoutCancel(ctx), 0)
		return fmt.Errorf("persist pod record: %w", err)
	}
	b.watch(p, h)
	b.mu.Lock()
	b.publishLocked(EventCreated, p, nil)
	b.publishLocked(EventStarted, p, nil)
	b.mu.Unlock()
	return nil
}

// preparePod opens started, pod p's agent, sets the pod's IPC sysctls in
// it and tells NRI plugins the pod runs; on failure the agent is stopped.
func (b *Broker) preparePod(ctx context.Context, p *pod, started stage1.Pod) (*podconn.Pod, error) {
	h := b.openPod(started, p.rec)
	if ipc := sysctlsOf(&p.rec.Config, sysctl.IPC); len(ipc) > 0 {
		// In the pod's IPC namespace, which the agent runs in; before
		// any container can start.
		if err := h.SetSysctls(ctx, ipc); err != nil {
			h.Stop(context.WithoutCancel(ctx), 0)
			return nil, fmt.Errorf("config.linux.sysctls: %w", err)
		}
	}
	if err := b.nriRunPod(ctx, p); err != nil {
		h.Stop(context.WithoutCancel(ctx), 0)
		return nil, err
	}
	return h, nil
}

// plan asks a stage1 that plans its pods (stage1.PodPlanner) whether it
// can run the pod, before anything is taken for it: a pod the policy
// sent to a stage1 that cannot run it is refused with the stage1's
// reason and what chose the stage1.
func (b *Broker) plan(ctx context.Context, rec *PodRecord, spec *stage1.PodSpec, be stage1.Backend) error {
	pl, ok := be.(stage1.PodPlanner)
	if !ok {
		return nil
	}
	plan, err := pl.PlanPod(spec)
	if err != nil {
		return fmt.Errorf("stage1 %s (%s) cannot run the pod: %w", be.Name(), chosenBy(rec), err)
	}
	b.log.DebugContext(ctx, "stage1 plan", "pod", rec.ID, "stage1", be.Name(), "plan", plan)
	return nil
}

// chosenBy says what chose a pod's stage1, for messages.
func chosenBy(rec *PodRecord) string {
	if rec.ChosenBy == "" {
		return "chosen by the policy"
	}
	return "chosen by " + rec.ChosenBy
}

// startInNetwork makes the pod's network namespace and starts the pod in
// it through be. CNI ADD runs while the pod starts, unless the stage1
// reads the pod's network when it starts (NetworkBeforeStart): a pod's
// start then takes the longer of the two instead of their sum. The pod's
// files (/etc/hosts holds its addresses) are written once both are done,
// before any container is created. On failure the caller releases both
// (the stage1's state is persisted as it goes).
func (b *Broker) startInNetwork(ctx context.Context, rec *PodRecord, spec *stage1.PodSpec, be stage1.Backend) (stage1.Pod, error) {
	nctx, span := tracing.Start(ctx, "pod.netns")
	err := b.prepareNetwork(nctx, rec)
	tracing.End(span, err)
	if err != nil {
		return nil, err
	}
	spec.NetNSPath = rec.NetNS
	persist := func(state []byte) error {
		b.mu.Lock()
		rec.BackendState = state
		cp := *rec
		b.mu.Unlock()
		return b.rec.savePod(&cp)
	}
	start := func(ctx context.Context) (stage1.Pod, error) {
		ctx, span := tracing.Start(ctx, "stage1.start_pod", attribute.String("stagelet.stage1", be.Name()))
		started, err := be.StartPod(ctx, spec, persist)
		tracing.End(span, err)
		if err != nil {
			return nil, fmt.Errorf("stage1 %s (%s): start pod: %w", be.Name(), chosenBy(rec), err)
		}
		return started, nil
	}
	var started stage1.Pod
	if be.Capabilities().NetworkBeforeStart {
		if err := b.attachNetwork(ctx, rec); err != nil {
			return nil, err
		}
		var err error
		if started, err = start(ctx); err != nil {
			return nil, err
		}
	} else {
		actx, cancel := context.WithCancel(ctx)
		defer cancel()
		attached := make(chan error, 1)
		go func() { attached <- b.attachNetwork(actx, rec) }()
		var err error
		if started, err = start(ctx); err != nil {
			cancel() // of no use now: the caller releases what it made
			<-attached
			return nil, err
		}
		if err := <-attached; err != nil {
			return nil, err // the pod runs: the caller destroys it
		}
	}
	_, span = tracing.Start(ctx, "pod.files")
	err = b.writePodFiles(rec)
	tracing.End(span, err)
	if err != nil {
		return nil, fmt.Errorf("pod files: %w", err)
	}
	return started, nil
}

// podStopTimeout is how long the apps of a pod being stopped get between
// SIGTERM and SIGKILL. The kubelet stops containers with their own grace
// period before it stops the pod, so this only catches what is left.
const podStopTimeout = 2 * time.Second

// StopPod stops every container of the pod and the pod's isolation.
// Idempotent: an unknown or already stopped pod is not an error.
func (b *Broker) StopPod(ctx context.Context, id string) error {
	p, err := b.lookupPod(id)
	if errdefs.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return err
	}
	if err := waitCreated(ctx, p.created); err != nil {
		return err
	}
	if p.err != nil {
		return nil // creation failed: nothing runs
	}
	p.op.Lock()
	defer p.op.Unlock()
	return b.stopPodLocked(ctx, p)
}

func (b *Broker) stopPodLocked(ctx context.Context, p *pod) error {
	b.withdrawOffer(p)
	b.mu.Lock()
	h := p.handle
	state := p.rec.State
	podID := p.rec.ID
	b.mu.Unlock()
	if h == nil {
		// Stopped before, or its agent died: nothing to ask the agent.
		// Whatever it left running is killed, and the network released;
		// both are idempotent.
		b.mu.Lock()
		rec := *p.rec
		b.mu.Unlock()
		if rec.Gone {
			if be, ok := b.opts.Backends[rec.Stage1]; ok {
				if err := be.DestroyPod(ctx, b.podSpec(&rec), rec.BackendState); err != nil {
					return fmt.Errorf("stop pod %s: %w", podID, err)
				}
			}
		}
		if err := b.teardownNetwork(ctx, &rec, false); err != nil {
			return fmt.Errorf("stop pod %s: %w", podID, err)
		}
		if state == PodNotReady {
			return b.recordNetworkReleased(p, rec.NetworkReleased)
		}
	}
	if h != nil {
		// Stop the containers first so their exit statuses are kept.
		for _, c := range b.containersOf(podID) {
			if err := b.stopContainer(ctx, c, podStopTimeout); err != nil && !errors.Is(err, errdefs.ErrUnavailable) {
				return err
			}
		}
		b.unwatch(p) // the agent is about to go away on purpose
		if err := h.Stop(ctx, podStopTimeout); err != nil && !errors.Is(err, stage1.ErrPodGone) {
			b.watch(p, h) // still ready: keep listening
			return fmt.Errorf("stop pod %s: %w", podID, err)
		}
	}
	b.mu.Lock()
	netRec := *p.rec
	b.mu.Unlock()
	if err := b.teardownNetwork(ctx, &netRec, false); err != nil {
		return fmt.Errorf("stop pod %s: %w", podID, err)
	}
	b.markContainersGone(ctx, podID, "the pod was stopped")
	b.mu.Lock()
	p.rec.NetworkReleased = netRec.NetworkReleased
	p.handle = nil
	wasReady := p.rec.State == PodReady
	p.rec.State = PodNotReady
	cp := *p.rec
	if wasReady {
		b.publishLocked(EventStopped, p, nil)
	}
	b.mu.Unlock()
	b.log.InfoContext(ctx, "pod stopped", "pod", podID)
	return b.rec.savePod(&cp)
}

// recordNetworkReleased persists that a stopped pod's network was
// released, when that is news.
func (b *Broker) recordNetworkReleased(p *pod, released bool) error {
	b.mu.Lock()
	if p.rec.NetworkReleased == released {
		b.mu.Unlock()
		return nil
	}
	p.rec.NetworkReleased = released
	cp := *p.rec
	b.mu.Unlock()
	return b.rec.savePod(&cp)
}

// RemovePod stops the pod if needed, removes its containers and releases
// every resource. Idempotent: an unknown pod is not an error.
func (b *Broker) RemovePod(ctx context.Context, id string) error {
	p, err := b.lookupPod(id)
	if errdefs.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return err
	}
	if err := waitCreated(ctx, p.created); err != nil {
		return err
	}
	if p.err != nil {
		return nil
	}
	p.op.Lock()
	defer p.op.Unlock()
	if err := b.stopPodLocked(ctx, p); err != nil {
		return err
	}
	b.mu.Lock()
	rec := *p.rec
	b.mu.Unlock()
	for _, c := range b.containersOf(rec.ID) {
		if err := b.removeContainer(ctx, c); err != nil {
			return err
		}
	}
	// Its containers' file systems are gone with it.
	p.releasing.Wait()
	if be, ok := b.opts.Backends[rec.Stage1]; ok {
		if err := be.DestroyPod(ctx, b.podSpec(&rec), rec.BackendState); err != nil {
			return fmt.Errorf("remove pod %s: %w", rec.ID, err)
		}
	}
	if err := b.teardownNetwork(ctx, &rec, true); err != nil {
		return fmt.Errorf("remove pod %s: %w", rec.ID, err)
	}
	// Never through a mount: what the backend left mounted stays, and
	// the removal fails until it is gone.
	if err := mountsafe.RemoveAll(rec.RunDir); err != nil {
		return fmt.Errorf("remove pod %s: %w", rec.ID, err)
	}
	if err := b.rec.deletePod(rec.ID); err != nil {
		return err
	}
	b.mu.Lock()
	delete(b.pods, rec.ID)
	if b.podNames[podNameKey(rec.Config.Metadata)] == p {
		delete(b.podNames, podNameKey(rec.Config.Metadata))
	}
	b.publishLocked(EventDeleted, p, nil)
	b.mu.Unlock()
	b.releaseLabels(rec.SELinux)
	b.log.InfoContext(ctx, "pod removed", "pod", rec.ID)
	return nil
}

// PodStatus is a pod's status as the broker knows it.
type PodStatus struct {
	Record PodRecord
	// Ready: the pod's agent runs.
	Ready bool
	// Info is verbose detail (stage1, reasons, backend details).
	Info map[string]string
}

// PodStatus returns a pod's status; NotFound for an unknown or removed pod.
func (b *Broker) PodStatus(ctx context.Context, id string, verbose bool) (*PodStatus, error) {
	p, err := b.lookupPod(id)
	if err != nil {
		return nil, err
	}
	st := b.podStatus(p)
	if st == nil {
		return nil, errdefs.NotFound("pod sandbox %q not found", id)
	}
	if verbose {
		b.mu.Lock()
		h, info := p.handle, p.agent
		b.mu.Unlock()
		st.Info = map[string]string{
			"stage1":  st.Record.Stage1,
			"reasons": strings.Join(st.Record.Reasons, "; "),
			"runDir":  st.Record.RunDir,
		}
		if st.Record.Rule != "" {
			st.Info["rule"] = st.Record.Rule
		}
		if l := st.Record.SELinux; l.Process != "" {
			st.Info["selinuxProcessLabel"] = l.Process
			st.Info["selinuxMountLabel"] = l.Mount
		}
		for k, v := range st.Record.Options {
			st.Info["option."+k] = v
		}
		if h != nil {
			for k, v := range h.Details() {
				st.Info["stage1."+k] = v
			}
			if info != nil {
				st.Info["agent.pid"] = fmt.Sprint(info.PID)
				st.Info["agent.kernel"] = info.Kernel
			}
		}
	}
	return st, nil
}

// podStatus is the pod's status from its record: its agent's events keep
// the record current (watch), so reading it asks no agent.
func (b *Broker) podStatus(p *pod) *PodStatus {
	select {
	case <-p.created:
		if p.err != nil {
			return nil
		}
	default:
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	return &PodStatus{Record: *p.rec, Ready: p.rec.State == PodReady && p.handle != nil}
}

// PodFilter selects pods; zero fields match everything.
type PodFilter struct {
	ID            string
	State         string // PodReady or PodNotReady
	LabelSelector map[string]string
}

// PodSummary is what a list of pods shows of one: a few fields of its
// record, copied under the broker's lock. Labels and Annotations are the
// record's own maps, which nothing changes after RunPodSandbox: read
// them, never write them.
type PodSummary struct {
	ID                  string
	Metadata            PodMetadata
	Stage1              string
	Ready               bool
	CreatedAt           time.Time
	Labels, Annotations map[string]string
}

// ListPods returns the pods matching f, oldest first, pods being created
// left out. It holds the broker's lock once and copies only what a list
// shows: the kubelet asks every second.
func (b *Broker) ListPods(f PodFilter) []PodSummary {
	b.mu.Lock()
	defer b.mu.Unlock()
	match := make([]*pod, 0, len(b.pods))
	for id, p := range b.pods {
		if f.ID != "" && id != f.ID && !strings.HasPrefix(id, f.ID) {
			continue
		}
		select {
		case <-p.created:
			if p.err != nil {
				continue
			}
		default:
		}
		r := p.rec
		if r.State == PodCreating {
			continue
		}
		if f.State != "" && (f.State == PodReady) != (r.State == PodReady && p.handle != nil) {
			continue
		}
		if !labelsMatch(r.Config.Labels, f.LabelSelector) {
			continue
		}
		match = append(match, p)
	}
	// Sorted by pointer, not by the larger summaries.
	sortByCreated(match, func(p *pod) (time.Time, string) { return p.rec.CreatedAt, p.rec.ID })
	out := make([]PodSummary, len(match))
	for i, p := range match {
		r := p.rec
		out[i] = PodSummary{
			ID: r.ID, Metadata: r.Config.Metadata, Stage1: r.Stage1, Ready: r.State == PodReady && p.handle != nil,
			CreatedAt: r.CreatedAt, Labels: r.Config.Labels, Annotations: r.Config.Annotations,
		}
	}
	return out
}

func labelsMatch(labels, sel map[string]string) bool {
	for k, v := range sel {
		if labels[k] != v {
			return false
		}
	}
	return true
}

// sortByCreated sorts s oldest first, by the creation time and ID key
// gives, read once per element: the kubelet's lists sort every pod and
// container every second.
func sortByCreated[T any](s []T, key func(T) (time.Time, string)) {
	type keyed struct {
		at int64 // Unix nanoseconds: creation times are recent
		id string
		v  T
	}
	ks := make([]keyed, len(s))
	for i, v := range s {
		t, id := key(v)
		ks[i] = keyed{t.UnixNano(), id, v}
	}
	slices.SortFunc(ks, func(a, b keyed) int {
		if c := cmp.Compare(a.at, b.at); c != 0 {
			return c
		}
		return strings.Compare(a.id, b.id)
	})
	for i := range ks {
		s[i] = ks[i].v
	}
}

// podHandle returns the running pod's handle or FailedPrecondition.
func (b *Broker) podHandle(p *pod) (*podconn.Pod, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if p.handle == nil || p.rec.State != PodReady {
		return nil, errdefs.FailedPrecondition("pod sandbox %s is not ready", p.rec.ID)
	}
	return p.handle, nil
}

// podGone records that a running pod's agent is gone. The pod's resources
// stay until StopPodSandbox/RemovePodSandbox. Its containers exit with
// the message msg when its agent went on purpose (why), agentGoneMessage
// when msg is "".
func (b *Broker) podGone(ctx context.Context, p *pod, h *podconn.Pod, why error, msg string) {
	b.mu.Lock()
	if p.handle != h || h == nil {
		b.mu.Unlock()
		return
	}
	p.handle = nil
	p.rec.State = PodNotReady
	p.rec.Gone = true
	cp := *p.rec
	b.publishLocked(EventStopped, p, nil)
	b.mu.Unlock()
	b.unwatch(p)
	h.StopLogs()
	if msg == "" {
		b.log.WarnContext(ctx, "the pod's agent is gone; the pod is not ready", "pod", cp.ID, "stage1", cp.Stage1, "err", why)
		msg = agentGoneMessage
	} else {
		b.log.InfoContext(ctx, "the pod is not ready: "+msg, "pod", cp.ID, "stage1", cp.Stage1)
	}
	b.markContainersGone(ctx, cp.ID, msg)
	if err := b.rec.savePod(&cp); err != nil {
		b.log.ErrorContext(ctx, "persist pod record", "pod", cp.ID, "err", err)
	}
}

// UpdatePodResources records a ready pod's new total limits, which the
// kubelet sends after it resized the pod's containers. A pod whose stage1
// sizes it (a VM: stage1.PodResizer) checks they fit first, and refuses
// with FailedPrecondition when they do not; the others run beneath the
// cgroup the kubelet itself resizes. FailedPrecondition for a pod that is
// not ready.
func (b *Broker) UpdatePodResources(ctx context.Context, id string, r Resources) error {
	if err := checkResources("resources", &r); err != nil {
		return err
	}
	if r.CpusetCpus != "" || r.CpusetMems != "" {
		return errdefs.InvalidArgument("resources.cpuset_cpus, cpuset_mems: a cpuset is a container's, not a pod's")
	}
	p, err := b.lookupPod(id)
	if err != nil {
		return err
	}
	if err := waitCreated(ctx, p.created); err != nil {
		return err
	}
	if p.err != nil {
		return errdefs.NotFound("pod sandbox %q not found", id)
	}
	p.op.Lock()
	defer p.op.Unlock()
	h, err := b.podHandle(p)
	if err != nil {
		return err
	}
	if err := b.nriUpdatePod(ctx, p, appResources(r)); err != nil {
		return fmt.Errorf("update pod sandbox %s: %w", id, err)
	}
	if rs, ok := h.Pod.(stage1.PodResizer); ok {
		actx, cancel := agentCtx(ctx, agentTimeout)
		defer cancel()
		if err := rs.UpdatePodResources(actx, podResources(&r)); err != nil {
			return fmt.Errorf("update pod sandbox %s: %w", id, err)
		}
	}
	b.mu.Lock()
	cp := r
	p.rec.Config.Resources = &cp
	rec := *p.rec
	b.mu.Unlock()
	if err := b.rec.savePod(&rec); err != nil {
		return fmt.Errorf("persist pod record: %w", err)
	}
	b.log.InfoContext(ctx, "pod limits changed", "pod", id, "resources", r)
	b.nriPostUpdatePod(p)
	return nil
}

func podResources(r *Resources) stage1.PodResources {
	if r == nil {
		return stage1.PodResources{}
	}
	return stage1.PodResources{MemoryLimit: r.MemoryLimit, CPUQuota: r.CPUQuota, CPUPeriod: r.CPUPeriod, CPUShares: r.CPUShares}
}

// podResourcesOf is a pod's limits and its overhead's memory.
func podResourcesOf(c *PodConfig) stage1.PodResources {
	r := podResources(c.Resources)
	if c.Overhead != nil {
		r.OverheadMemory = c.Overhead.MemoryLimit
	}
	return r
}
