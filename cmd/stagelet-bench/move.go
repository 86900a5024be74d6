package main

import (
	"archive/tar"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"google.golang.org/protobuf/proto"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/checkpoint"
	"github.com/stagelet/stagelet/internal/testutil"
	"github.com/stagelet/stagelet/preflight"
	"github.com/stagelet/stagelet/test/e2e/harness"
)

// move: time a container's move instead (measureMoves).
var move = flag.Bool("move", false, fmt.Sprintf("instead: -n times, alternately, move a counter from one pod to another on the daemon through CRI, as the kubelet's checkpoint flow does: the whole VM of a kvm pod (%d MiB) through a saved VM and live (its VM streamed over the daemons' authenticated connection, here to itself on 127.0.0.1) and, beside them, the container alone with CRIU in an nspawn pod (skipped, saying why, without a working criu); print each phase's median for each and the ratios to CRIU", moveVMMiB))

// moveVMMiB is the memory of the moved kvm pod's VM (and of the pod
// taking it, which must have the same), set by the daemon's policy.
const moveVMMiB = 256

// moveKVMPolicy is the daemon's policy in a run with -move: the kvm
// handler's VMs sized as moveVMMiB says.
var moveKVMPolicy = fmt.Sprintf("version: 1\ndefault_stage1: fly\nhandlers:\n  fly: {stage1: fly}\n  nspawn: {stage1: nspawn}\n  kvm: {stage1: kvm, options: {memory: %dMi}}\n", moveVMMiB)

// checkMoveFlags refuses, with -move, the flags it cannot honour.
func checkMoveFlags() error {
	if !*move {
		return nil
	}
	set := map[string]bool{}
	flag.Visit(func(f *flag.Flag) { set[f.Name] = true })
	for _, other := range []string{"stage1", "scale", "fileio", "endpoint", "memory-limit", "no-image-disks", "against", "beside", "metrics"} {
		if set[other] {
			return fmt.Errorf("-%s is not for -move (which moves a kvm pod's VM of %d MiB, its image on an erofs disk, and an nspawn container)", other, moveVMMiB)
		}
	}
	return nil
}

// moveWay is one way a container moves: its stage1 and how it is saved
// (live: streamed, stagelet.io/checkpoint: live); key names it in
// results.
type moveWay struct {
	key, stage1, name string
	live              bool
}

// moveWays: CRIU's, the last, is what the others are compared with.
var moveWays = []moveWay{
	{"kvm", "kvm", "kvm (whole VM)", false},
	{"kvm-live", "kvm", "kvm (live)", true},
	{"nspawn", "nspawn", "nspawn (CRIU)", false},
}

// moveRun is one move's figures.
type moveRun struct {
	// checkpoint: the CheckpointContainer call; paused: how long the
	// guest was stopped for the migration's last round, as qemu measured
	// it (kvm only; 0 when unknown); bytes: the archive's size.
	checkpoint, paused time.Duration
	bytes              int64
	// stopSource: the source stopped once it is saved, as a move stops
	// it: StopContainer without a grace period, then StopPodSandbox; restore: CreateContainer + StartContainer from
	// the archive in the target pod (run before the checkpoint);
	// downtime: from the checkpoint's end (then the source's stop and
	// the restore) to the restored container's first ExecSync answer;
	// for a live move, which leaves the source running, from the
	// source's last ExecSync answer.
	stopSource, restore, downtime time.Duration
	// For a live move: the bytes streamed, and the daemon's downtime,
	// from the guest's pause to its agent answering with the network.
	streamed       int64
	daemonDowntime time.Duration
}

// moveResult holds, per way (by stage1), its runs, or why it was skipped.
type moveResult struct {
	runs    map[string][]moveRun
	skipped map[string]string
}

// measureMoves moves a counter n times per way, the ways alternating in
// each round so that the machine's drift weighs on both alike. Every pod
// and archive is removed once its run ends.
func measureMoves(ctx context.Context, tb *fixtureTB, d *harness.Daemon, ref string, podNet bool, n int) (*moveResult, error) {
	res := &moveResult{runs: map[string][]moveRun{}, skipped: map[string]string{}}
	if _, _, _, err := preflight.FindCRIU(ctx, ""); err != nil {
		res.skipped["nspawn"] = fmt.Sprintf("no criu works here: %v", err)
	}
	if d.LiveAddress() == "" {
		res.skipped["kvm-live"] = "the daemon offers no live moves (checkpoint.live_address)"
	}
	var dir string
	if err := tb.do(func() { dir = tb.TempDir() }); err != nil {
		return nil, err
	}
	for run := range n {
		for _, w := range moveWays {
			if res.skipped[w.key] != "" {
				continue
			}
			if err := ctx.Err(); err != nil {
				return nil, err
			}
			r, err := moveOnce(ctx, d, ref, w, podNet, fmt.Sprintf("move-%s-%d", w.key, run), dir)
			if err != nil {
				return nil, fmt.Errorf("%s, run %d: %w", w.name, run, err)
			}
			res.runs[w.key] = append(res.runs[w.key], r)
		}
	}
	return res, nil
}

// moveOnce starts a counter in a pod of w's stage1 and an empty pod
// beside it, checkpoints the counter into an archive in dir, stops its
// pod (unless it moves live: it runs on until the stream ends, asked for
// its count meanwhile) and restores the archive into the other, timing
// each step, and waits for the restored counter to answer with a count
// not below the one read just before the checkpoint. Both pods and the
// archive go at the end.
func moveOnce(ctx context.Context, d *harness.Daemon, ref string, w moveWay, podNet bool, name, dir string) (r moveRun, err error) {
	stage1 := w.stage1
	rt := d.Runtime()
	var pods, ctrs []string
	defer func() {
		if rerr := removeMoved(ctx, rt, pods, ctrs); rerr != nil {
			err = errors.Join(err, rerr)
		}
	}()
	src, to, toCfg, err := startMovePods(ctx, d, ref, stage1, w.live, podNet, name)
	if src != nil {
		pods, ctrs = append(pods, src.podID), append(ctrs, src.ctrID)
	}
	if to != "" {
		pods = append(pods, to)
	}
	if err != nil {
		return r, err
	}
	before, err := waitCount(ctx, rt, src.ctrID, 1, time.Minute)
	if err != nil {
		return r, fmt.Errorf("the counter before its checkpoint: %w", err)
	}
	archive := filepath.Join(dir, name+".tar")
	defer os.Remove(archive)
	began := time.Now()
	if _, err := rt.CheckpointContainer(ctx, &runtimeapi.CheckpointContainerRequest{ContainerId: src.ctrID, Location: archive, Timeout: 300}); err != nil {
		return r, fmt.Errorf("CheckpointContainer: %w", err)
	}
	saved := time.Now()
	r.checkpoint = saved.Sub(began)
	// A live move's source runs on until the stream ends: its last
	// answer starts the downtime. Any other stops at once.
	lastAnswer := make(chan time.Time, 1)
	if w.live {
		go followSource(ctx, rt, src.ctrID, lastAnswer)
	} else if err := stopSource(ctx, rt, src); err != nil {
		return r, err
	} else {
		r.stopSource = time.Since(saved)
	}
	began = time.Now()
	ctr, err := rt.CreateContainer(ctx, &runtimeapi.CreateContainerRequest{PodSandboxId: to, SandboxConfig: toCfg, Config: &runtimeapi.ContainerConfig{
		Metadata: &runtimeapi.ContainerMetadata{Name: "counter"},
		Image:    &runtimeapi.ImageSpec{Image: archive},
		LogPath:  "counter.log",
	}})
	if err != nil {
		return r, fmt.Errorf("CreateContainer from the archive: %w", err)
	}
	ctrs = append(ctrs, ctr.ContainerId)
	if _, err := rt.StartContainer(ctx, &runtimeapi.StartContainerRequest{ContainerId: ctr.ContainerId}); err != nil {
		return r, fmt.Errorf("StartContainer from the archive: %w", err)
	}
	r.restore = time.Since(began)
	if _, err := waitCount(ctx, rt, ctr.ContainerId, before, time.Minute); err != nil {
		return r, fmt.Errorf("the restored counter: %w", err)
	}
	answered := time.Now()
	r.downtime = answered.Sub(saved)
	if w.live {
		last := <-lastAnswer
		if last.IsZero() {
			return r, errors.New("the source never answered after its checkpoint")
		}
		r.downtime = answered.Sub(last)
		if r.paused, r.streamed, r.daemonDowntime, err = liveFigures(d.LogTail(400)); err != nil {
			return r, err
		}
	}

	err = archiveFigures(&r, archive, stage1 == "kvm" && !w.live)
	return r, err
}

// archiveFigures reads into r the archive's size and, for a saved VM
// (vm), the guest's pause.
func archiveFigures(r *moveRun, archive string, vm bool) error {
	fi, err := os.Stat(archive)
	if err != nil {
		return err
	}
	r.bytes = fi.Size()
	if vm {
		r.paused, err = vmPause(archive)
	}
	return err
}

// followSource asks the counter of container ctr for its count until
// it no longer answers, and sends when it last did (zero: never).
func followSource(ctx context.Context, rt runtimeapi.RuntimeServiceClient, ctr string, last chan<- time.Time) {
	var at time.Time
	defer func() { last <- at }()
	for ctx.Err() == nil {
		resp, err := rt.ExecSync(ctx, &runtimeapi.ExecSyncRequest{ContainerId: ctr, Cmd: []string{"cat", "/tmp/count"}, Timeout: 30})
		if err != nil || resp.ExitCode != 0 {
			return
		}
		at = time.Now()
	}
}

// stopSource stops a move's source once it is saved: what it does after
// its checkpoint is not moved (and the counter would hold a grace
// period, ignoring SIGTERM).
func stopSource(ctx context.Context, rt runtimeapi.RuntimeServiceClient, src *benchPod) error {
	if _, err := rt.StopContainer(ctx, &runtimeapi.StopContainerRequest{ContainerId: src.ctrID, Timeout: 0}); err != nil {
		return fmt.Errorf("StopContainer of the source: %w", err)
	}
	if _, err := rt.StopPodSandbox(ctx, &runtimeapi.StopPodSandboxRequest{PodSandboxId: src.podID}); err != nil {
		return fmt.Errorf("StopPodSandbox of the source: %w", err)
	}
	return nil
}

// startMovePods starts a move's source pod, its counter running, and
// its target pod, empty; it returns what it started also on failure.
func startMovePods(ctx context.Context, d *harness.Daemon, ref, stage1 string, live, podNet bool, name string) (src *benchPod, to string, toCfg *runtimeapi.PodSandboxConfig, err error) {
	rt := d.Runtime()
	podCfg, ctrCfg, err := benchConfigs(d.LogsDir, ref, stage1, podNet, name+"-from")
	if err != nil {
		return nil, "", nil, err
	}
	if live {
		if podCfg.Annotations == nil {
			podCfg.Annotations = map[string]string{}
		}
		podCfg.Annotations["stagelet.io/checkpoint"] = "live"
	}
	ctrCfg.Metadata.Name = "counter"
	ctrCfg.Command = []string{"sh", "-c", testutil.CounterCmd}
	ctrCfg.LogPath = "counter.log"
	// The container in its own PID namespace, as the kubelet asks by
	// default (and as CRIU needs: the pod's init is not saved).
	ns := proto.Clone(ctrCfg.Linux.SecurityContext.NamespaceOptions).(*runtimeapi.NamespaceOption)
	ns.Pid = runtimeapi.NamespaceMode_CONTAINER
	ctrCfg.Linux.SecurityContext.NamespaceOptions = ns
	src, err = startPodCfg(ctx, rt, stage1, podCfg, ctrCfg)
	if err != nil {
		return nil, "", nil, fmt.Errorf("the source pod: %w", err)
	}
	toCfg, _, err = benchConfigs(d.LogsDir, ref, stage1, podNet, name+"-to")
	if err != nil {
		return src, "", nil, err
	}
	resp, err := rt.RunPodSandbox(ctx, &runtimeapi.RunPodSandboxRequest{Config: toCfg, RuntimeHandler: stage1})
	if err != nil {
		return src, "", nil, fmt.Errorf("the target pod: RunPodSandbox: %w", err)
	}
	return src, resp.PodSandboxId, toCfg, nil
}

// waitCount asks the counter of container ctr for its count with
// ExecSync until it answers with a count of least or more, within limit,
// and returns it; a lower count is an error (the counter lost its state).
func waitCount(ctx context.Context, rt runtimeapi.RuntimeServiceClient, ctr string, least int, limit time.Duration) (int, error) {
	deadline := time.Now().Add(limit)
	var last string
	for {
		cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		resp, err := rt.ExecSync(cctx, &runtimeapi.ExecSyncRequest{ContainerId: ctr, Cmd: []string{"cat", "/tmp/count"}, Timeout: 30})
		cancel()
		switch {
		case err != nil:
			last = err.Error()
		case resp.ExitCode != 0:
			last = fmt.Sprintf("cat /tmp/count exited %d: %s", resp.ExitCode, resp.Stderr)
		default:
			n, perr := strconv.Atoi(strings.TrimSpace(string(resp.Stdout)))
			if perr == nil && n >= least {
				return n, nil
			}
			if perr == nil && n > 0 && least > 1 {
				return 0, fmt.Errorf("count %d, below its count at the checkpoint (%d)", n, least)
			}
			last = fmt.Sprintf("count %q", resp.Stdout)
		}
		if err := ctx.Err(); err != nil {
			return 0, err
		}
		if time.Now().After(deadline) {
			return 0, fmt.Errorf("no count of at least %d after %v: %s", least, limit, last)
		}
		time.Sleep(2 * time.Millisecond) // polling the container
	}
}

// removeMoved removes the containers and pods of a move: the containers
// stopped at once (the counter does not end at SIGTERM), then the pods.
func removeMoved(ctx context.Context, rt runtimeapi.RuntimeServiceClient, pods, ctrs []string) error {
	var errs []error
	for _, c := range ctrs {
		if _, err := rt.StopContainer(ctx, &runtimeapi.StopContainerRequest{ContainerId: c, Timeout: 0}); err != nil {
			errs = append(errs, fmt.Errorf("StopContainer %s: %w", c, err))
		}
		if _, err := rt.RemoveContainer(ctx, &runtimeapi.RemoveContainerRequest{ContainerId: c}); err != nil {
			errs = append(errs, fmt.Errorf("RemoveContainer %s: %w", c, err))
		}
	}
	for _, p := range pods {
		if _, err := rt.StopPodSandbox(ctx, &runtimeapi.StopPodSandboxRequest{PodSandboxId: p}); err != nil {
			errs = append(errs, fmt.Errorf("StopPodSandbox %s: %w", p, err))
		}
		if _, err := rt.RemovePodSandbox(ctx, &runtimeapi.RemovePodSandboxRequest{PodSandboxId: p}); err != nil {
			errs = append(errs, fmt.Errorf("RemovePodSandbox %s: %w", p, err))
		}
	}
	return errors.Join(errs...)
}

// savedVMEntry is the description of a saved VM in a kvm checkpoint
// archive (stage1/kvm/save.go: vm.json among the archive's images).
const savedVMEntry = checkpoint.ImagesDir + "/vm.json"

// vmPause reads from a kvm checkpoint archive how long the guest was
// stopped for the migration's last round, as qemu measured it and
// stage1 kvm recorded it beside the VM's state.
func vmPause(archive string) (time.Duration, error) {
	f, err := os.Open(archive)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	return savedVMPause(f)
}

// savedVMPause finds savedVMEntry in the tar stream r and returns its
// migration's downtime.
func savedVMPause(r io.Reader) (time.Duration, error) {
	tr := tar.NewReader(r)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return 0, fmt.Errorf("no %s in the archive", savedVMEntry)
		}
		if err != nil {
			return 0, err
		}
		if h.Name != savedVMEntry {
			continue
		}
		var sv struct {
			Migration struct {
				Downtime time.Duration
			} `json:"migration"`
		}
		if err := json.NewDecoder(tr).Decode(&sv); err != nil {
			return 0, fmt.Errorf("%s: %w", savedVMEntry, err)
		}
		if sv.Migration.Downtime <= 0 {
			return 0, fmt.Errorf("%s: no migration downtime", savedVMEntry)
		}
		return sv.Migration.Downtime, nil
	}
}

// movePhase is one row of the move report: its label, and how it reads
// a run's figure (ok false where the way has none).
type movePhase struct {
	label string
	bytes bool
	of    func(moveRun) (v float64, ok bool)
}

func msOf(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

var movePhases = []movePhase{
	{"CheckpointContainer", false, func(r moveRun) (float64, bool) { return msOf(r.checkpoint), true }},
	{"  guest paused for the last round (qemu)", false, func(r moveRun) (float64, bool) { return msOf(r.paused), r.paused > 0 }},
	{"  archive size", true, func(r moveRun) (float64, bool) { return float64(r.bytes), true }},
	{"source stopped: StopContainer (no grace), StopPodSandbox", false, func(r moveRun) (float64, bool) { return msOf(r.stopSource), r.stopSource > 0 }},
	{"restore: CreateContainer + StartContainer", false, func(r moveRun) (float64, bool) { return msOf(r.restore), true }},
	{"downtime: checkpoint's end (live: last answer) to the first ExecSync", false, func(r moveRun) (float64, bool) { return msOf(r.downtime), true }},
	{"  live: streamed", true, func(r moveRun) (float64, bool) { return float64(r.streamed), r.streamed > 0 }},
	{"  live: guest paused to its agent answering, by the daemon", false, func(r moveRun) (float64, bool) { return msOf(r.daemonDowntime), r.daemonDowntime > 0 }},
}

// liveFigures reads a live move's figures from the daemon's log: how long
// the guest paused for the last round (the source's "VM moved live"),
// the bytes streamed and the downtime to the agent's answer (the
// target's "taken from a live move"), the last of each.
func liveFigures(log string) (paused time.Duration, streamed int64, downtime time.Duration, err error) {
	var sent, taken string
	for _, l := range strings.Split(log, "\n") {
		switch {
		case strings.Contains(l, "kvm: VM moved live"):
			sent = l
		case strings.Contains(l, "kvm: VM taken from a live move"):
			taken = l
		}
	}
	if sent == "" || taken == "" {
		return 0, 0, 0, errors.New("the daemon logged no live move")
	}
	if paused, err = time.ParseDuration(testutil.LogField(sent, "paused")); err != nil {
		return 0, 0, 0, fmt.Errorf("the live move's pause: %w", err)
	}
	if streamed, err = strconv.ParseInt(testutil.LogField(taken, "bytes"), 10, 64); err != nil {
		return 0, 0, 0, fmt.Errorf("the live move's bytes: %w", err)
	}
	if downtime, err = time.ParseDuration(testutil.LogField(taken, "downtime")); err != nil {
		return 0, 0, 0, fmt.Errorf("the live move's downtime: %w", err)
	}
	return paused, streamed, downtime, nil
}

// medianOf is the median of the phase's figures over runs, ok false
// when no run has one.
func (ph movePhase) medianOf(runs []moveRun) (float64, bool) {
	var vs []float64
	for _, r := range runs {
		if v, ok := ph.of(r); ok {
			vs = append(vs, v)
		}
	}
	if len(vs) == 0 {
		return 0, false
	}
	slices.Sort(vs)
	if len(vs)%2 == 1 {
		return vs[len(vs)/2], true
	}
	return (vs[len(vs)/2-1] + vs[len(vs)/2]) / 2, true
}

func (ph movePhase) format(v float64) string {
	if ph.bytes {
		return fmt.Sprintf("%.1f MB", v/1e6)
	}
	return fmt.Sprintf("%.1f ms", v)
}

// reportMoves prints, per phase, each way's median and the other ways'
// ratios to the last's (CRIU), then the skipped ways and why.
func reportMoves(w io.Writer, n int, what string, r *moveResult) {
	fmt.Fprintf(w, "stagelet-bench: a counter's move to another pod on the same daemon through CRI, %s, median of %d runs\n", what, n)
	fmt.Fprintf(w, "(the target pod runs before the checkpoint; the kvm pods' VMs have %d MiB; the CRIU container is paused over its dump and the reading of its layer, within CheckpointContainer; a live move's source runs on until its VM has streamed)\n\n", moveVMMiB)
	base := moveWays[len(moveWays)-1]
	fmt.Fprintf(w, "%-66s", "phase")
	for _, way := range moveWays {
		fmt.Fprintf(w, " %16s", way.name)
	}
	for _, way := range moveWays[:len(moveWays)-1] {
		fmt.Fprintf(w, " %16s", way.key+" / "+base.key)
	}
	fmt.Fprintln(w)
	for _, ph := range movePhases {
		fmt.Fprintf(w, "%-66s", ph.label)
		meds := map[string]float64{}
		for _, way := range moveWays {
			v, ok := ph.medianOf(r.runs[way.key])
			if !ok {
				fmt.Fprintf(w, " %16s", "-")
				continue
			}
			fmt.Fprintf(w, " %16s", ph.format(v))
			meds[way.key] = v
		}
		for _, way := range moveWays[:len(moveWays)-1] {
			q := "-"
			if a, b := meds[way.key], meds[base.key]; a > 0 && b > 0 {
				q = fmt.Sprintf("%.2fx", a/b)
			}
			fmt.Fprintf(w, " %16s", q)
		}
		fmt.Fprintln(w)
	}
	for _, way := range moveWays {
		if why := r.skipped[way.key]; why != "" {
			fmt.Fprintf(w, "%s: skipped: %s\n", way.name, why)
		}
	}
}

// saveMoves writes the timed phases' medians, per way, to -save's file.
func saveMoves(r *moveResult) error {
	var rows []callRow
	for _, way := range moveWays {
		for _, ph := range movePhases {
			if ph.bytes {
				continue
			}
			var ds []time.Duration
			for _, run := range r.runs[way.key] {
				if v, ok := ph.of(run); ok {
					ds = append(ds, time.Duration(v*float64(time.Millisecond)))
				}
			}
			if len(ds) > 0 {
				rows = append(rows, callRow{way.key + " move: " + strings.TrimSpace(ph.label), ds})
			}
		}
	}
	return saveFigures(rows)
}
