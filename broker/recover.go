package broker

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/stagelet/stagelet/cgroups"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/lsm"
	"github.com/stagelet/stagelet/internal/mountsafe"
	"github.com/stagelet/stagelet/stage1"
	"github.com/stagelet/stagelet/stage1/podconn"
)

// Recover reloads the persisted records, reattaches to every pod that
// still runs, marks what died as exited, and cleans up what a crash left
// half made. A record that cannot be read is moved to quarantine (one a
// newer stagelet wrote is left in place), and nothing its pod or
// container holds is touched: not its directories, its network namespace,
// nor the containers of a pod whose record is set aside.
//
// Pods are reattached in parallel (RecoverParallel at a time) under one
// deadline (RecoverTimeout): a pod not reattached by then is left as it
// is, not ready, for the next start to try again. Ready reports true once
// Recover returns; it is called once, before serving.
func (b *Broker) Recover(ctx context.Context) (RecoveryResult, error) {
	start := time.Now()
	b.recordNodeCgroup()
	pods, ctrs, bad, err := b.rec.loadAll(true)
	if err != nil {
		return RecoveryResult{}, err
	}
	// aside: IDs of pods and containers whose records are set aside, now
	// or by an earlier start; what they name is left alone.
	aside := b.setAside(ctx, bad)
	b.quarantined.Store(int32(len(b.rec.quarantined())))
	byPod := map[string][]*ContainerRecord{}
	podIDs := map[string]bool{}
	for _, p := range pods {
		podIDs[p.ID] = true
	}
	for _, c := range ctrs {
		switch {
		case aside[c.PodID]:
			b.log.WarnContext(ctx, "leaving alone a container whose pod's record is set aside", "container", c.ID, "pod", c.PodID)
			aside[c.ID] = true
			continue
		case !podIDs[c.PodID]:
			b.log.WarnContext(ctx, "removing a container whose pod is gone", "container", c.ID, "pod", c.PodID)
			b.discardContainer(ctx, c)
			continue
		}
		byPod[c.PodID] = append(byPod[c.PodID], c)
	}
	res := RecoveryResult{Pods: len(pods), BadRecords: len(bad)}
	b.recoverPods(ctx, pods, byPod, &res)
	keep := func(id string) bool { return podIDs[id] || aside[id] }
	res.OrphanCgroups = b.collectCgroups(keep) + b.collectBackends(ctx, keep)
	b.collectOrphans(ctx, aside)
	b.collectNetNS(ctx, aside)
	res.SetAside = len(aside)
	res.Took = time.Since(start)
	b.ready.Store(true)
	b.log.InfoContext(ctx, "recovery done", "pods", res.Pods, "ready", res.Ready, "gone", res.Gone, "unrecovered", res.Unrecovered,
		"stopped", res.Stopped, "discarded", res.Discarded, "badRecords", res.BadRecords, "setAside", res.SetAside,
		"orphanCgroups", res.OrphanCgroups, "took", res.Took)
	b.obs.Recovered(res)
	return res, nil
}

// recoverPods recovers the pods, RecoverParallel at a time within
// RecoverTimeout, and counts their outcomes in res.
func (b *Broker) recoverPods(ctx context.Context, pods []*PodRecord, byPod map[string][]*ContainerRecord, res *RecoveryResult) {
	rctx, cancel := context.WithTimeout(ctx, RecoverTimeout)
	defer cancel()
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		slot = make(chan struct{}, RecoverParallel)
	)
	for _, rec := range pods {
		wg.Add(1)
		slot <- struct{}{}
		go func() {
			defer func() { <-slot; wg.Done() }()
			r := b.recoverPod(rctx, rec, byPod[rec.ID])
			mu.Lock()
			defer mu.Unlock()
			switch r {
			case "ready":
				res.Ready++
			case "gone":
				res.Gone++
			case "unrecovered":
				res.Unrecovered++
			case "stopped":
				res.Stopped++
			case "discarded":
				res.Discarded++
			}
		}()
	}
	wg.Wait()
}

// setAside quarantines the records that cannot be read (a newer
// stagelet's stay where they are) and returns the IDs of every pod and
// container whose record is set aside, now or by an earlier start.
func (b *Broker) setAside(ctx context.Context, bad map[string]badRecord) map[string]bool {
	aside := map[string]bool{}
	for _, id := range b.rec.quarantined() {
		aside[id] = true
	}
	for path, br := range bad {
		aside[br.ID] = true
		if br.Newer {
			b.log.ErrorContext(ctx, "leaving a record a newer stagelet wrote where it is; what it names is left alone and unmanaged", "path", path, "err", br.Reason)
			continue
		}
		dst, err := b.rec.quarantine(path)
		if err != nil {
			b.log.ErrorContext(ctx, "a record cannot be read, nor moved to quarantine; what it names is left alone", "path", path, "err", br.Reason, "quarantine", err)
			continue
		}
		b.log.ErrorContext(ctx, "quarantined a record that cannot be read; what it names is left alone", "path", path, "to", dst, "err", br.Reason)
	}
	return aside
}

// RecoveryResult is what Recover found and did, pod by pod.
type RecoveryResult struct {
	Pods int // pod records read
	// Ready: reattached; Gone: their isolation had died; Unrecovered:
	// not reattached (a state this stagelet cannot read, an unregistered
	// stage1, the deadline), left as they are; Stopped: stopped before
	// the restart; Discarded: half created, released.
	Ready, Gone, Unrecovered, Stopped, Discarded int
	// BadRecords could not be read; SetAside are the pods and containers
	// whose records are set aside (quarantined or newer), this time or
	// before.
	BadRecords, SetAside int
	// OrphanCgroups: pod cgroups no record named, released with the
	// processes they held.
	OrphanCgroups int
	Took          time.Duration
}

// Recovery bounds: how many pods are reattached at once, and how long
// the whole recovery may take.
var (
	RecoverParallel = 16
	RecoverTimeout  = 2 * time.Minute
)

func (b *Broker) discardContainer(ctx context.Context, c *ContainerRecord) {
	if err := b.opts.Images.UnmountRootfs(ctx, c.Dir); err != nil {
		b.log.ErrorContext(ctx, "releasing a container's rootfs", "container", c.ID, "err", err)
		return
	}
	b.rec.deleteContainer(c.ID)
}

// recoverPod brings one pod record back; it returns "ready", "gone",
// "unrecovered" (the backend could not reattach, and the pod may still
// run), "stopped" or "discarded".
func (b *Broker) recoverPod(ctx context.Context, rec *PodRecord, ctrs []*ContainerRecord) string {
	log := b.log.With("pod", rec.ID, "stage1", rec.Stage1)
	if rec.State == PodCreating {
		b.discardCreatingPod(ctx, log, rec, ctrs)
		return "discarded"
	}
	p := &pod{rec: rec, created: make(chan struct{})}
	close(p.created)
	// The pod holds its MCS level until it is removed: no new pod gets it.
	lsm.ReserveSELinux(rec.SELinux)
	result := "stopped"
	if rec.State == PodReady {
		result = b.reattach(ctx, log, rec, p)
	}
	b.mu.Lock()
	b.pods[rec.ID] = p
	b.podNames[podNameKey(rec.Config.Metadata)] = p
	b.mu.Unlock()

	live := b.recoverContainers(ctx, log, p, ctrs)
	if result == "unrecovered" {
		// Its apps may run on: their state is unknown, in memory only,
		// so that a daemon that reattaches finds their records as they
		// were.
		b.mu.Lock()
		for _, c := range live {
			if c.rec.State == ContainerRunning || c.rec.State == ContainerCreated {
				c.rec.State = ContainerUnknown
				c.rec.Message = "this stagelet cannot reattach to the container's pod"
			}
		}
		b.mu.Unlock()
		return result
	}
	if p.handle == nil {
		for _, c := range live {
			b.markGone(ctx, c, "the pod's agent was gone when the daemon restarted")
		}
		return result
	}
	followLogs(p.handle, live)
	// Containers may have started or exited while the daemon was down:
	// following the agent begins with its full status, the one resync;
	// recovery waits for it, so the first status read is current.
	synced := b.watch(p, p.handle)
	t := time.NewTimer(agentTimeout)
	defer t.Stop()
	select {
	case <-synced:
	case <-t.C:
		log.WarnContext(ctx, "the pod's agent has not sent its status yet; its containers' records may lag until it does", "after", agentTimeout)
	case <-ctx.Done():
	}
	return result
}

// reattach gives a pod that was ready back its agent connection. A pod
// whose stage1 is not registered, or whose backend cannot read its state,
// is "unrecovered" (its record is left as it is on disk); one that died
// while the daemon was down is "gone", its address and ports released.
func (b *Broker) reattach(ctx context.Context, log *slog.Logger, rec *PodRecord, p *pod) string {
	be, ok := b.opts.Backends[rec.Stage1]
	result := "stopped"
	if !ok {
		log.ErrorContext(ctx, "the pod's stage1 is not registered in this daemon; marking it not ready and leaving what it holds as it is")
		rec.State = PodNotReady
		result = "unrecovered"
	} else if h, err := be.RecoverPod(ctx, b.podSpec(rec), rec.BackendState); err == nil {
		p.handle = b.openPod(h, rec)
		result = "ready"
	} else {
		// Gone: StopPodSandbox asks the backend to release what is
		// left before the network goes.
		rec.State = PodNotReady
		rec.Gone = true
		result = "gone"
		if errors.Is(err, stage1.ErrPodGone) {
			log.WarnContext(ctx, "the pod died while the daemon was down")
			// Nothing runs in the pod: release its address and
			// ports now; the netns itself goes with
			// RemovePodSandbox.
			if err := b.teardownNetwork(ctx, rec, false); err != nil {
				log.ErrorContext(ctx, "releasing a dead pod's network", "err", err)
			}
		} else {
			// It may still run (a state from a newer stagelet, say):
			// it keeps its network, and stopping it fails as long as
			// its backend cannot read its state.
			log.ErrorContext(ctx, "reattaching to the pod failed; marking it not ready and leaving what it holds as it is", "err", err)
			result = "unrecovered"
		}
	}
	// An unrecovered pod's record stays as it was on disk, so that a
	// daemon that can read it (a newer one, or this one once it is
	// repaired) reattaches to the pod.
	if result != "unrecovered" {
		if err := b.rec.savePod(rec); err != nil {
			log.ErrorContext(ctx, "persist pod record", "err", err)
		}
	}
	return result
}

// discardCreatingPod releases what a pod whose creation was interrupted
// took (its stage1's resources, containers, network, run directory), then
// its record; on a failure the record stays for the next start.
func (b *Broker) discardCreatingPod(ctx context.Context, log *slog.Logger, rec *PodRecord, ctrs []*ContainerRecord) {
	be, ok := b.opts.Backends[rec.Stage1]
	log.WarnContext(ctx, "releasing a pod whose creation was interrupted")
	if ok {
		if err := be.DestroyPod(ctx, b.podSpec(rec), rec.BackendState); err != nil {
			log.ErrorContext(ctx, "releasing pod resources", "err", err)
			return
		}
	}
	for _, c := range ctrs {
		b.discardContainer(ctx, c)
	}
	if err := b.teardownNetwork(ctx, rec, true); err != nil {
		log.ErrorContext(ctx, "releasing the pod's network", "err", err)
		return
	}
	if err := mountsafe.RemoveAll(rec.RunDir); err != nil {
		log.ErrorContext(ctx, "removing the pod's run directory", "err", err)
		return
	}
	b.rec.deletePod(rec.ID)
}

// recoverContainers puts a recovered pod's containers back in the broker,
// releasing those whose creation was interrupted, and returns the others.
func (b *Broker) recoverContainers(ctx context.Context, log *slog.Logger, p *pod, ctrs []*ContainerRecord) []*container {
	var live []*container
	for _, cr := range ctrs {
		if cr.State == ContainerCreating {
			log.WarnContext(ctx, "releasing a container whose creation was interrupted", "container", cr.ID)
			if p.handle != nil {
				actx, cancel := agentCtx(ctx, agentTimeout)
				if err := p.handle.RemoveContainer(actx, cr.ID); err != nil && !errdefs.IsNotFound(err) {
					log.ErrorContext(ctx, "forgetting a half-created container in the agent", "container", cr.ID, "err", err)
				}
				cancel()
			}
			b.discardContainer(ctx, cr)
			continue
		}
		if cr.VolumeImageIDs == nil {
			cr.VolumeImageIDs = b.volumeImageIDs(cr.Config.Mounts)
		}
		c := &container{rec: cr, created: make(chan struct{})}
		close(c.created)
		if cr.App != nil && p.rec.SELinux.Process == "" {
			// Recorded before pods held the level: each such container
			// holds its own until the daemon restarts.
			lsm.ReserveSELinux(lsm.Labels{Process: cr.App.SELinuxProcessLabel, Mount: cr.App.SELinuxMountLabel})
		}
		b.mu.Lock()
		b.ctrs[cr.ID] = c
		b.ctrNames[ctrNameKey(cr.PodID, cr.Config.Metadata)] = c
		b.mu.Unlock()
		live = append(live, c)
	}
	return live
}

// collectCgroups releases the pod cgroups beneath the node's cgroup
// parent that no pod record names (keep), with whatever still runs in
// them, and returns how many it released. With the systemd driver, or no
// node cgroup parent, there is nothing of the daemon's own to search.
func (b *Broker) collectCgroups(keep func(id string) bool) int {
	parent := b.opts.CgroupParent
	if parent == "" || b.opts.SystemdCgroup || cgroups.SliceOf(parent) != "" {
		return 0
	}
	found, err := cgroups.CollectPodCgroups(parent, keep)
	if err != nil {
		b.log.Error("searching for pod cgroups no record names", "parent", parent, "err", err)
	}
	n := 0
	for _, o := range found {
		if o.Err != nil {
			b.log.Error("a pod cgroup no record names cannot be released; it is left", "pod", o.PodID, "processes", o.Procs, "err", o.Err)
			continue
		}
		b.log.Warn("released a pod cgroup no record names", "pod", o.PodID, "killedProcesses", o.Procs)
		n++
	}
	return n
}

// collectBackends asks each stage1 that takes host resources of its own
// beyond the pod cgroups (stage1.Collector) to release those of pods no
// record names, and returns for how many pods they did.
func (b *Broker) collectBackends(ctx context.Context, keep func(id string) bool) int {
	pods := map[string]bool{}
	for name, be := range b.opts.Backends {
		c, ok := be.(stage1.Collector)
		if !ok {
			continue
		}
		ids, err := c.Collect(ctx, keep)
		for _, id := range ids {
			b.log.WarnContext(ctx, "released host resources no record names", "stage1", name, "pod", id)
			pods[id] = true
		}
		if err != nil {
			b.log.ErrorContext(ctx, "releasing host resources no record names: what failed is left", "stage1", name, "err", err)
		}
	}
	return len(pods)
}

// collectOrphans removes container filesystems and pod run directories
// that no record names (left by a crash between taking and recording,
// which the record-first order makes rare), except those of the IDs set
// aside.
func (b *Broker) collectOrphans(ctx context.Context, aside map[string]bool) {
	b.mu.Lock()
	dirs := map[string]bool{}
	runDirs := map[string]bool{}
	for _, c := range b.ctrs {
		dirs[c.rec.Dir] = true
	}
	for _, p := range b.pods {
		runDirs[p.rec.RunDir] = true
	}
	b.mu.Unlock()
	if ents, err := os.ReadDir(b.containersDir()); err == nil {
		for _, e := range ents {
			d := filepath.Join(b.containersDir(), e.Name())
			if !dirs[d] && !aside[e.Name()] {
				b.log.WarnContext(ctx, "removing an orphaned container filesystem", "dir", d)
				if err := b.opts.Images.UnmountRootfs(ctx, d); err != nil {
					b.log.ErrorContext(ctx, "removing an orphaned container filesystem", "dir", d, "err", err)
				}
			}
		}
	}
	if ents, err := os.ReadDir(b.podsRunDir()); err == nil {
		for _, e := range ents {
			d := filepath.Join(b.podsRunDir(), e.Name())
			if !runDirs[d] && !aside[e.Name()] {
				b.log.WarnContext(ctx, "removing an orphaned pod run directory", "dir", d)
				// No record names it: no pod the daemon manages uses
				// what is mounted beneath it (and a pod's processes in
				// the node's cgroup parent were released above). It is
				// detached (made private first, so nothing propagates
				// to a volume's source), then removed without crossing
				// a mount.
				if err := mountsafe.RemoveUnmounted(d); err != nil {
					b.log.ErrorContext(ctx, "removing an orphaned pod run directory: what is mounted in it stays", "dir", d, "err", err)
				}
			}
		}
	}
}

// volumeImageIDs are the IDs of the stored images that mounts' image
// volumes name: what a record written before records kept them (its
// VolumeImageIDs) had in use, for RemoveImage.
func (b *Broker) volumeImageIDs(mounts []Mount) []string {
	var ids []string
	for _, m := range mounts {
		if m.Image == "" {
			continue
		}
		if img, err := b.opts.Images.Get(m.Image); err == nil && !slices.Contains(ids, img.ID) {
			ids = append(ids, img.ID)
		}
	}
	return ids
}

// followLogs has h write the logs of its pod's recovered containers that
// the daemon writes on the host (AppSpec.HostLog): each session begins
// with what the agent holds that the daemon before did not acknowledge.
// Called before the pod's agent is followed: nothing else writes the
// records yet.
func followLogs(h *podconn.Pod, live []*container) {
	for _, c := range live {
		if app := c.rec.App; app != nil && app.HostLog && c.rec.State != ContainerUnknown {
			h.FollowLog(c.rec.ID, app.LogPath)
		}
	}
}
