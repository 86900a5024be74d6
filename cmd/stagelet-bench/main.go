// Command stagelet-bench measures the real daemon on this machine: it builds
// stagelet, starts a registry on 127.0.0.1 holding the busybox image and a
// daemon on temporary directories (as the e2e suite does), then times N
// pod starts (RunPodSandbox + CreateContainer + StartContainer until the
// container is RUNNING), N ExecSync calls of `true` and N exec sessions
// over the streaming server (the Exec call, then client-go's SPDY client
// as kubectl uses it), and prints their median and p90 and the daemon's
// resident memory. With -fileio it instead times file I/O in a
// container's root file system beside a tmpfs in the same pod. With
// -scale it instead starts pods up to each given count and times
// ListContainers and ListPodSandbox at each (the kubelet's relist), then
// the time from a container's exit to its event reaching a
// GetContainerEvents subscriber. It tears everything down before it
// exits, also on failure or interrupt. It needs root. With -nri it
// measures the daemon with NRI off, on (the default) or on with a no-op
// plugin of its own connected (nri.go). With -move it times a
// counter's move between two pods through CRI's checkpoint, a kvm pod's
// whole VM beside CRIU's container on nspawn (move.go).
//
//	go run ./cmd/stagelet-bench [-n 20] [-bin path/to/stagelet] [-stage1 nspawn -scale 10,50,100] [-stage1 kvm -fileio -n 3] [-nri off|on|noop] [-move -podnet -n 3]
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/remotecommand"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/cgroups"
	"github.com/stagelet/stagelet/test/e2e/harness"
	"github.com/stagelet/stagelet/test/otlpsink"
	"github.com/stagelet/stagelet/test/testregistry"
)

// signed: the daemon checks a signature policy that requires the image's
// signature, at pull and at each CreateContainer.
var signed = flag.Bool("signature-policy", false, "the daemon checks a signature policy requiring the image's sigstore signature (by a key the bench makes and signs it with) at pull and at every CreateContainer: its cost, beside a run without (-against)")

// scrape: print the daemon's stagelet_* metrics once the pods run.
var traceRate = flag.Int("trace-rate", -1, "configure tracing (an OTLP receiver in this process) with this sampling_rate_per_million: 0 measures tracing configured but not sampled, 1000000 every call traced; -1: tracing off")

var (
	beside      = flag.String("beside", "", "with -scale: also run as many pods on another CRI runtime listening on this unix socket (containerd's, say; of -beside-image, host network) and time its status-path calls in the same rounds as stagelet's, alternately, for ratios free of the machine's drift")
	besideImage = flag.String("beside-image", "", "with -beside: the image of the other runtime's pods (one it can pull; it needs sleep)")
)

var scrape = flag.Bool("metrics", false, "enable the daemon's metrics endpoint and print its stagelet_* series once the measured pods run (before their teardown)")

// memoryLimitMiB: the measured pods' container memory limit, each pod
// in a cgroup limited to it (podLimit).
var memoryLimitMiB = flag.Int("memory-limit", 0, "give each measured pod's container a memory limit of this many MiB, and run the pod under a cgroup limited to it, as the kubelet runs a pod with that limit and no RuntimeClass overhead (0: none)")

// podLimit, in a run with -memory-limit, is each measured pod's cgroup
// parent: made and limited as the kubelet's pod<uid>, for the pod named.
var podLimit func(name string) (string, error)

// noImageDisks: kvm containers read their image over 9p, as they did
// before image disks, for a figure beside theirs.
var noImageDisks = flag.Bool("no-image-disks", false, "kvm: containers read their image over 9p as the lower layer of their overlay (kvm.image_disks: false) instead of from a read-only erofs disk of it: the design before image disks, for comparison")

// fileIO: time file I/O in a container instead (measureFileIO).
var fileIO = flag.Bool("fileio", false, fmt.Sprintf("instead: in one pod's container, time -n runs of creating, stat-ing, reading and removing %d small files and writing %d MiB + fsync, in its root file system and in a tmpfs in the pod (its /dev/shm), and print the medians and their ratio", fileIOFiles, fileIOWriteMiB))

func main() {
	n := flag.Int("n", 20, "runs of each measurement")
	bin := flag.String("bin", "", "stagelet binary to run (default: build ./cmd/stagelet)")
	verbose := flag.Bool("v", false, "log the harness's progress")
	stage1 := flag.String("stage1", "fly", "stage1 (runtime handler) of the measured pods: fly, nspawn or kvm (kvm needs the guest: make guest, STAGELET_GUEST_ASSETS)")
	podNet := flag.Bool("podnet", false, "give each pod its own network namespace and CNI attachment (otherwise the host network)")
	scale := flag.String("scale", "", "instead: start pods up to each of these counts (e.g. 10,50,100), time -calls rounds of the status-path calls (List*, *Status, the list stats; -only picks some) and 3 kill -9 restarts at each, then -n container exits to their GetContainerEvents event")
	calls := flag.Int("calls", 200, "rounds of status-path calls timed at each -scale level")
	noTemplate := flag.Bool("notemplate", false, "kvm: pods' VMs boot their kernel instead of being restored from a template")
	endpoint := flag.String("endpoint", "", "time another CRI runtime listening on this unix socket (containerd's, say) instead, on pods of -image run with its default handler: the same calls as stagelet's (-podnet: its pods in their own network, through its own CNI config), or with -scale the status-path calls on host-network pods (no restarts, no events)")
	img := flag.String("image", "", "with -endpoint: the image of the pods' containers (one the runtime can pull; it needs sleep and echo)")
	only := flag.String("only", "", "with -scale: time only these status-path calls (comma-separated names, e.g. ListContainers,Status)")
	flag.Parse()
	if *only != "" && *scale == "" {
		fmt.Fprintln(os.Stderr, "stagelet-bench: -only is for -scale")
		os.Exit(2)
	}
	var levels []int
	if *scale != "" {
		var err error
		if levels, err = parseLevels(*scale); err != nil {
			fmt.Fprintln(os.Stderr, "stagelet-bench:", err)
			os.Exit(2)
		}
		if statusCalls, err = pickCalls(statusCalls, *only); err != nil {
			fmt.Fprintln(os.Stderr, "stagelet-bench:", err)
			os.Exit(2)
		}
	}
	level := slog.LevelWarn
	if *verbose {
		level = slog.LevelDebug
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	if os.Geteuid() != 0 {
		fmt.Fprintln(os.Stderr, "stagelet-bench: needs root (the daemon mounts, pivots into rootfs and creates cgroups)")
		os.Exit(2)
	}
	if *n < 1 {
		fmt.Fprintln(os.Stderr, "stagelet-bench: -n must be at least 1")
		os.Exit(2)
	}
	if err := errors.Join(checkNRIMode(*nriMode), checkMoveFlags()); err != nil {
		fmt.Fprintln(os.Stderr, "stagelet-bench:", err)
		os.Exit(2)
	}
	// Output piped to a reader that quits (| head): its writes fail
	// instead of SIGPIPE killing the bench before its teardown. Caught,
	// not ignored, so that the daemon does not inherit it ignored.
	signal.Notify(make(chan os.Signal, 1), syscall.SIGPIPE)
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if *memoryLimitMiB != 0 && (*endpoint != "" || levels != nil || *fileIO) {
		fmt.Fprintln(os.Stderr, "stagelet-bench: -memory-limit is for stagelet's timed pod starts: not with -endpoint, -scale or -fileio")
		os.Exit(2)
	}
	if *beside != "" && (levels == nil || *besideImage == "" || *endpoint != "") {
		fmt.Fprintln(os.Stderr, "stagelet-bench: -beside is for -scale, with -beside-image, without -endpoint")
		os.Exit(2)
	}
	if *endpoint != "" {
		if *nriMode != nriOn {
			fmt.Fprintln(os.Stderr, "stagelet-bench: -nri is for stagelet's daemon: not with -endpoint")
			os.Exit(2)
		}
		if *img == "" {
			fmt.Fprintln(os.Stderr, "stagelet-bench: -endpoint needs -image")
			os.Exit(2)
		}
		if err := runExternal(ctx, *endpoint, *img, levels, *calls, *n, *podNet); err != nil {
			fmt.Fprintln(os.Stderr, "stagelet-bench:", err)
			os.Exit(1)
		}
		return
	}
	if err := run(ctx, *n, *bin, *stage1, *podNet, *noTemplate, levels, *calls, log); err != nil {
		fmt.Fprintln(os.Stderr, "stagelet-bench:", err)
		os.Exit(1)
	}
}

type result struct {
	podStart []time.Duration
	// The calls of a pod start, each timed: runPod (RunPodSandbox),
	// createCtr, startCtr (the StartContainer call; RUNNING may come
	// later, within podStart).
	runPod, createCtr, startCtr []time.Duration
	exec                        []time.Duration
	// streamTrue: Exec call to the exit status of `true`, the first (and
	// only) byte its session receives; streamEcho: Exec call to the first
	// byte of `echo`'s output.
	streamTrue []time.Duration
	streamEcho []time.Duration
	rssIdle    uint64
	rssAfter   uint64
	// mem1 is the host memory of the first pod while it ran alone; memN
	// the mean per pod once all n ran.
	mem1, memN podMem
	// templates and templateBytes: kvm templates and the host memory (or
	// disk) their memory files take, once for all the pods.
	templates     int
	templateBytes uint64
	// Teardown, as the kubelet does it on a pod's deletion: its container
	// stopped and removed, then the sandbox stopped and removed.
	stopCtr, rmCtr, stopPod, rmPod []time.Duration
	// metrics: the daemon's stagelet_* series with the pods running
	// (-metrics).
	metrics string
}

func run(ctx context.Context, n int, bin, stage1 string, podNet, noTemplate bool, levels []int, calls int, log *slog.Logger) (err error) {
	tb := newFixtureTB("stagelet-bench")
	defer func() {
		if ferr := tb.finish(); ferr != nil {
			err = errors.Join(err, ferr)
		}
	}()

	if bin == "" {
		if bin, err = buildStagelet(ctx, tb); err != nil {
			return err
		}
	}
	d, ref, err := newBenchDaemon(tb, bin, noTemplate, log)
	if err != nil {
		return err
	}
	defer teardownDaemon(d, &err)
	sctx, cancel := context.WithTimeout(ctx, time.Minute)
	err = d.Start(sctx)
	cancel()
	if err != nil {
		return err
	}
	if err := connectNoopPlugin(ctx, tb, d, log); err != nil {
		return err
	}
	unlimit := limitPods(d)
	if _, err := d.Image().PullImage(ctx, &runtimeapi.PullImageRequest{Image: &runtimeapi.ImageSpec{Image: ref}}); err != nil {
		return fmt.Errorf("pull %s: %w", ref, err)
	}
	if *move {
		mr, err := measureMoves(ctx, tb, d, ref, podNet, n)
		if err != nil {
			return err
		}
		reportMoves(os.Stdout, n, describeRun("kvm", podNet, noTemplate), mr)
		return saveMoves(mr)
	}
	network := describeRun(stage1, podNet, noTemplate)
	if *fileIO {
		fr, err := measureFileIO(ctx, d, ref, stage1, podNet, n)
		if err != nil {
			return err
		}
		reportFileIO(os.Stdout, n, stage1+", "+network, fr)
		return nil
	}
	if levels != nil {
		var other *external
		if *beside != "" {
			if other, err = openExternal(ctx, *beside, *besideImage); err != nil {
				return err
			}
			defer func() { err = errors.Join(err, other.close(ctx)) }()
		}
		rows, lat, err := measureScale(ctx, d, ref, stage1, podNet, levels, calls, n, other)
		if err != nil {
			return err
		}
		reportScale(os.Stdout, stage1+", "+network, calls, rows, lat, other)
		return nil
	}
	res, err := measure(ctx, d, ref, n, stage1, podNet)
	if err != nil {
		return err
	}
	if err := unlimit(); err != nil {
		return err
	}
	report(os.Stdout, n, stage1+", "+network, res)
	return nil
}

// buildStagelet builds ./cmd/stagelet into a temporary directory that
// tb's cleanup removes, and returns the binary's path.
func buildStagelet(ctx context.Context, tb *fixtureTB) (string, error) {
	dir, err := os.MkdirTemp("", "stagelet-bench-bin-")
	if err != nil {
		return "", err
	}
	tb.Cleanup(func() { os.RemoveAll(dir) })
	fmt.Fprintln(os.Stderr, "building stagelet ...")
	return harness.Build(ctx, dir)
}

// newBenchDaemon starts, under tb, a registry holding the busybox image
// and makes the daemon (of bin, not started yet) that pulls from it and
// runs pods on fly, nspawn or kvm by their handler. It returns the daemon
// and the image's reference.
func newBenchDaemon(tb *fixtureTB, bin string, noTemplate bool, log *slog.Logger) (*harness.Daemon, string, error) {
	var reg *testregistry.Registry
	var ref string
	var traces string
	var policy string
	if err := tb.do(func() {
		reg = testregistry.Start(tb)
		ref = reg.PushBusybox(tb, "bench/busybox", "latest")
		if *traceRate >= 0 {
			traces = otlpsink.Start(tb).Addr
		}
		if *signed {
			policy = signedPolicy(tb, reg, ref)
		}
	}); err != nil {
		return nil, "", err
	}

	handlers := "version: 1\ndefault_stage1: fly\nhandlers:\n  fly: {stage1: fly}\n  nspawn: {stage1: nspawn}\n  kvm: {stage1: kvm}\n"
	if *move {
		handlers = moveKVMPolicy
	}
	d, err := harness.New(harness.Options{
		Bin:                bin,
		InsecureRegistries: []string{reg.Host},
		Policy:             handlers,
		LogLevel:           "info",
		Logger:             log,
		KVMNoTemplate:      noTemplate,
		KVMNoImageDisks:    *noImageDisks,
		LiveAddress:        map[bool]string{true: "127.0.0.1"}[*move],
		MetricsAddress:     map[bool]string{true: "127.0.0.1:0"}[*scrape],
		TracingEndpoint:    traces,
		TracingRate:        max(*traceRate, 0),
		SignaturePolicy:    policy,
		NoNRI:              *nriMode == nriOff,
	})
	if err != nil {
		return nil, "", err
	}
	return d, ref, nil
}

// signedPolicy signs ref, in reg, with a new key and writes a policy
// that requires that key's signature for every image (a file tb's
// cleanup removes); it returns the policy's path.
func signedPolicy(tb *fixtureTB, reg *testregistry.Registry, ref string) string {
	key := testregistry.NewKey(tb)
	repo, _, _ := strings.Cut(ref, ":latest")
	reg.Sign(tb, key, repo, testregistry.Digest(tb, ref))
	dir, err := os.MkdirTemp("", "stagelet-bench-policy-")
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { os.RemoveAll(dir) })
	p := filepath.Join(dir, "policy.json")
	policy := fmt.Sprintf(`{"default": [{"type": "sigstoreSigned", "keyPath": %q, "signedIdentity": {"type": "matchRepository"}}]}`, key.PubPath)
	if err := os.WriteFile(p, []byte(policy), 0o644); err != nil {
		tb.Fatal(err)
	}
	return p
}

// teardownDaemon tears d down, within 3 minutes, and says what it had to
// release that the run left; when the run (*err) or the teardown failed,
// it prints the daemon log's last lines. A teardown's failure joins *err.
func teardownDaemon(d *harness.Daemon, err *error) {
	tctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	left, terr := d.Teardown(tctx)
	if !left.Empty() {
		fmt.Fprintf(os.Stderr, "left over after teardown (released now):\n%s\n", left)
	}
	if *err != nil || terr != nil {
		fmt.Fprintf(os.Stderr, "daemon log, last lines:\n%s\n", d.LogTail(60))
	}
	if terr != nil {
		*err = errors.Join(*err, fmt.Errorf("teardown: %w", terr))
	}
}

// limitPods, with -memory-limit, sets podLimit to make each measured pod
// a cgroup beneath d's cgroup parent limited as the kubelet's pod<uid>,
// and returns the function that removes those cgroups once their pods
// are gone (the daemon's teardown removes what a failed run left).
func limitPods(d *harness.Daemon) (remove func() error) {
	if *memoryLimitMiB <= 0 {
		return func() error { return nil }
	}
	var made []*cgroups.Cgroup
	podLimit = func(name string) (string, error) {
		parent := filepath.Join(d.CgroupParent, "kubelet-"+name)
		cg, err := cgroups.Resolve(parent)
		if err != nil {
			return "", err
		}
		made = append(made, cg)
		if err := cg.Create(); err != nil {
			return "", err
		}
		return parent, cg.Set(cgroups.Resources{MemoryLimit: int64(*memoryLimitMiB) << 20})
	}
	return func() error {
		for _, cg := range made {
			if err := cg.Delete(); err != nil {
				return err
			}
		}
		return nil
	}
}

// describeRun says what the measured pods are, for the report.
func describeRun(stage1 string, podNet, noTemplate bool) string {
	network := "host network"
	if podNet {
		network = "pod network (netns + CNI)"
	}
	if *memoryLimitMiB > 0 {
		network += fmt.Sprintf(", %d MiB memory limit and no RuntimeClass overhead", *memoryLimitMiB)
	}
	if *signed {
		network += ", signature policy requiring the image's signature"
	}
	network += ", " + describeNRI()
	if stage1 == "kvm" {
		if noTemplate {
			network += ", VMs boot their kernel"
		} else {
			network += ", VMs restored from a template"
		}
		if *noImageDisks {
			network += ", image over 9p"
		} else {
			network += ", image on an erofs disk"
		}
	}
	return network
}

func measure(ctx context.Context, d *harness.Daemon, ref string, n int, stage1 string, podNet bool) (*result, error) {
	res := &result{}
	var err error
	if res.rssIdle, err = d.RSS(); err != nil {
		return nil, err
	}
	pods, ctrs, err := measureRunning(ctx, d.Runtime(), d.LogsDir, ref, n, stage1, podNet, res, func(podID string) error {
		var err error
		res.mem1, err = podMemory(podID)
		return err
	})
	if err != nil {
		return nil, err
	}
	for _, id := range pods {
		m, err := podMemory(id)
		if err != nil {
			return nil, err
		}
		res.memN.rss += m.rss / uint64(n)
		res.memN.pss += m.pss / uint64(n)
		res.memN.procs += m.procs
	}
	if res.rssAfter, err = d.RSS(); err != nil {
		return nil, err
	}
	res.templates, res.templateBytes = templateMemory(filepath.Join(d.RunDir, "kvm-templates"))
	if *scrape {
		if res.metrics, err = scrapeMetrics(ctx, d); err != nil {
			return nil, err
		}
	}
	if err := measureTeardown(ctx, d.Runtime(), ctrs, pods, res); err != nil {
		return nil, err
	}
	return res, nil
}

// measureRunning starts n pods on rt, timing each start and its calls,
// then times ExecSync and streaming exec in the first pod's container.
// first, when set, is called with the first pod once it runs alone. It
// returns the pods and their containers, running.
func measureRunning(ctx context.Context, rt runtimeapi.RuntimeServiceClient, logsDir, ref string, n int, stage1 string, podNet bool, res *result, first func(podID string) error) (pods, ctrs []string, err error) {
	for i := range n {
		if err := ctx.Err(); err != nil {
			return pods, ctrs, err
		}
		began := time.Now()
		bp, err := startPodOn(ctx, rt, logsDir, ref, stage1, podNet, fmt.Sprintf("bench-%d", i))
		if err != nil {
			return pods, ctrs, fmt.Errorf("run %d: %w", i, err)
		}
		res.podStart = append(res.podStart, time.Since(began))
		res.runPod = append(res.runPod, bp.took[0])
		res.createCtr = append(res.createCtr, bp.took[1])
		res.startCtr = append(res.startCtr, bp.took[2])
		pods = append(pods, bp.podID)
		ctrs = append(ctrs, bp.ctrID)
		if i == 0 && first != nil {
			if err := first(bp.podID); err != nil {
				return pods, ctrs, err
			}
		}
	}
	for i := range n {
		began := time.Now()
		r, err := rt.ExecSync(ctx, &runtimeapi.ExecSyncRequest{ContainerId: ctrs[0], Cmd: []string{"true"}, Timeout: 30})
		if err != nil {
			return pods, ctrs, fmt.Errorf("exec %d: %w", i, err)
		}
		if r.ExitCode != 0 {
			return pods, ctrs, fmt.Errorf("exec %d: true exited %d: %s", i, r.ExitCode, r.Stderr)
		}
		res.exec = append(res.exec, time.Since(began))
	}
	for i := range n {
		d, err := streamExec(ctx, rt, ctrs[0], []string{"true"})
		if err != nil {
			return pods, ctrs, fmt.Errorf("streaming exec %d: %w", i, err)
		}
		res.streamTrue = append(res.streamTrue, d)
		if d, err = streamExec(ctx, rt, ctrs[0], []string{"echo", "x"}); err != nil {
			return pods, ctrs, fmt.Errorf("streaming exec %d: %w", i, err)
		}
		res.streamEcho = append(res.streamEcho, d)
	}
	return pods, ctrs, nil
}

// scrapeMetrics reads the daemon's metrics endpoint and keeps the
// stagelet_* series.
func scrapeMetrics(ctx context.Context, d *harness.Daemon) (string, error) {
	url, err := d.MetricsURL()
	if err != nil {
		return "", err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return "", err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", err
	}
	var keep []string
	for _, line := range strings.Split(string(body), "\n") {
		if strings.HasPrefix(line, "stagelet_") && !strings.Contains(line, "_bucket{") {
			keep = append(keep, line)
		}
	}
	return strings.Join(keep, "\n") + "\n", nil
}

// measureTeardown removes the pods as the kubelet removes a deleted pod,
// timing each call: StopContainer (its sleep ends at SIGTERM),
// RemoveContainer, StopPodSandbox, RemovePodSandbox.
func measureTeardown(ctx context.Context, rt runtimeapi.RuntimeServiceClient, ctrs, pods []string, res *result) error {
	timed := func(into *[]time.Duration, what string, call func() error) error {
		began := time.Now()
		if err := call(); err != nil {
			return fmt.Errorf("%s: %w", what, err)
		}
		*into = append(*into, time.Since(began))
		return nil
	}
	for i, pod := range pods {
		ctr := ctrs[i]
		for _, step := range []struct {
			into *[]time.Duration
			what string
			call func() error
		}{
			{&res.stopCtr, "StopContainer", func() error {
				_, err := rt.StopContainer(ctx, &runtimeapi.StopContainerRequest{ContainerId: ctr, Timeout: 10})
				return err
			}},
			{&res.rmCtr, "RemoveContainer", func() error {
				_, err := rt.RemoveContainer(ctx, &runtimeapi.RemoveContainerRequest{ContainerId: ctr})
				return err
			}},
			{&res.stopPod, "StopPodSandbox", func() error {
				_, err := rt.StopPodSandbox(ctx, &runtimeapi.StopPodSandboxRequest{PodSandboxId: pod})
				return err
			}},
			{&res.rmPod, "RemovePodSandbox", func() error {
				_, err := rt.RemovePodSandbox(ctx, &runtimeapi.RemovePodSandboxRequest{PodSandboxId: pod})
				return err
			}},
		} {
			if err := timed(step.into, step.what, step.call); err != nil {
				return err
			}
		}
	}
	return nil
}

// benchPod is a pod startPod started.
type benchPod struct {
	podID, ctrID string
	// took: RunPodSandbox, CreateContainer and StartContainer, each.
	took   [3]time.Duration
	podCfg *runtimeapi.PodSandboxConfig
	ctrCfg *runtimeapi.ContainerConfig
}

// startPod runs a pod named name with one container sleeping, started and
// RUNNING.
func startPod(ctx context.Context, d *harness.Daemon, ref, stage1 string, podNet bool, name string) (*benchPod, error) {
	return startPodOn(ctx, d.Runtime(), d.LogsDir, ref, stage1, podNet, name)
}

// startPodOn is startPod on any CRI runtime rt, its pods' logs beneath
// logsDir.
func startPodOn(ctx context.Context, rt runtimeapi.RuntimeServiceClient, logsDir, ref, stage1 string, podNet bool, name string) (*benchPod, error) {
	podCfg, ctrCfg, err := benchConfigs(logsDir, ref, stage1, podNet, name)
	if err != nil {
		return nil, err
	}
	return startPodCfg(ctx, rt, stage1, podCfg, ctrCfg)
}

// benchConfigs are the configurations of startPodOn's pod named name
// and of its container sleeping, the pod's log directory made.
func benchConfigs(logsDir, ref, stage1 string, podNet bool, name string) (*runtimeapi.PodSandboxConfig, *runtimeapi.ContainerConfig, error) {
	logDir := logsDir + "/" + name
	if err := os.MkdirAll(logDir, 0o755); err != nil {
		return nil, nil, err
	}
	hostNS := &runtimeapi.NamespaceOption{
		Network: runtimeapi.NamespaceMode_NODE,
		Pid:     runtimeapi.NamespaceMode_NODE,
		Ipc:     runtimeapi.NamespaceMode_NODE,
	}
	if podNet {
		hostNS.Network = runtimeapi.NamespaceMode_POD
	}
	if stage1 != "fly" { // nspawn and kvm give every pod its own PID and IPC namespaces
		hostNS.Pid, hostNS.Ipc = runtimeapi.NamespaceMode_POD, runtimeapi.NamespaceMode_POD
	}
	podCfg := &runtimeapi.PodSandboxConfig{
		Metadata:     &runtimeapi.PodSandboxMetadata{Name: name, Namespace: "bench", Uid: fmt.Sprintf("bench-uid-%d-%s", os.Getpid(), name)},
		Hostname:     name,
		LogDirectory: logDir,
		Linux: &runtimeapi.LinuxPodSandboxConfig{
			SecurityContext: &runtimeapi.LinuxSandboxSecurityContext{NamespaceOptions: hostNS},
		},
	}
	if stage1 == "" && !podNet {
		// Another runtime's runc: a host-network pod shares the node's
		// UTS namespace, and runc refuses to set a hostname in it.
		podCfg.Hostname = ""
	}
	ctrCfg := &runtimeapi.ContainerConfig{
		Metadata: &runtimeapi.ContainerMetadata{Name: "sleeper"},
		Image:    &runtimeapi.ImageSpec{Image: ref},
		Command:  []string{"sleep", "3600"},
		LogPath:  "sleeper.log",
		Linux: &runtimeapi.LinuxContainerConfig{
			Resources:       &runtimeapi.LinuxContainerResources{},
			SecurityContext: &runtimeapi.LinuxContainerSecurityContext{NamespaceOptions: hostNS},
		},
	}

	if podLimit != nil {
		parent, err := podLimit(name)
		if err != nil {
			return nil, nil, fmt.Errorf("the pod's cgroup: %w", err)
		}
		limit := int64(*memoryLimitMiB) << 20
		podCfg.Linux.CgroupParent = parent
		podCfg.Linux.Resources = &runtimeapi.LinuxContainerResources{MemoryLimitInBytes: limit}
		ctrCfg.Linux.Resources.MemoryLimitInBytes = limit
	}
	return podCfg, ctrCfg, nil
}

// startPodCfg runs pod podCfg on stage1 with its container ctrCfg,
// started and RUNNING, timing each call.
func startPodCfg(ctx context.Context, rt runtimeapi.RuntimeServiceClient, stage1 string, podCfg *runtimeapi.PodSandboxConfig, ctrCfg *runtimeapi.ContainerConfig) (*benchPod, error) {
	var took [3]time.Duration
	began := time.Now()
	pod, err := rt.RunPodSandbox(ctx, &runtimeapi.RunPodSandboxRequest{Config: podCfg, RuntimeHandler: stage1})
	if err != nil {
		return nil, fmt.Errorf("RunPodSandbox: %w", err)
	}
	took[0], began = time.Since(began), time.Now()
	ctr, err := rt.CreateContainer(ctx, &runtimeapi.CreateContainerRequest{PodSandboxId: pod.PodSandboxId, Config: ctrCfg, SandboxConfig: podCfg})
	if err != nil {
		return nil, fmt.Errorf("CreateContainer: %w", err)
	}
	took[1], began = time.Since(began), time.Now()
	if _, err := rt.StartContainer(ctx, &runtimeapi.StartContainerRequest{ContainerId: ctr.ContainerId}); err != nil {
		return nil, fmt.Errorf("StartContainer: %w", err)
	}
	took[2] = time.Since(began)
	if err := waitRunning(ctx, rt, ctr.ContainerId); err != nil {
		return nil, err
	}
	return &benchPod{podID: pod.PodSandboxId, ctrID: ctr.ContainerId, took: took, podCfg: podCfg, ctrCfg: ctrCfg}, nil
}

// streamExec runs cmd through the streaming server as kubectl exec does
// and returns the time from the Exec call to the first byte of output,
// or to the end of the session for a command without output.
func streamExec(ctx context.Context, rt runtimeapi.RuntimeServiceClient, ctr string, cmd []string) (time.Duration, error) {
	began := time.Now()
	resp, err := rt.Exec(ctx, &runtimeapi.ExecRequest{ContainerId: ctr, Cmd: cmd, Stdout: true, Stderr: true})
	if err != nil {
		return 0, err
	}
	u, err := url.Parse(resp.Url)
	if err != nil {
		return 0, err
	}
	ex, err := remotecommand.NewSPDYExecutor(&rest.Config{}, "POST", u)
	if err != nil {
		return 0, err
	}
	out := &firstByte{}
	if err := ex.StreamWithContext(ctx, remotecommand.StreamOptions{Stdout: out, Stderr: io.Discard}); err != nil {
		return 0, err
	}
	if out.at.IsZero() {
		return time.Since(began), nil
	}
	return out.at.Sub(began), nil
}

// firstByte records when its first byte was written.
type firstByte struct {
	mu sync.Mutex
	at time.Time
}

func (f *firstByte) Write(p []byte) (int, error) {
	f.mu.Lock()
	if f.at.IsZero() && len(p) > 0 {
		f.at = time.Now()
	}
	f.mu.Unlock()
	return len(p), nil
}

func waitRunning(ctx context.Context, rt runtimeapi.RuntimeServiceClient, id string) error {
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := rt.ContainerStatus(ctx, &runtimeapi.ContainerStatusRequest{ContainerId: id})
		if err != nil {
			return fmt.Errorf("ContainerStatus: %w", err)
		}
		switch resp.GetStatus().GetState() {
		case runtimeapi.ContainerState_CONTAINER_RUNNING:
			return nil
		case runtimeapi.ContainerState_CONTAINER_EXITED:
			return fmt.Errorf("container %s exited (code %d, %s)", id, resp.Status.ExitCode, resp.Status.Reason)
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("container %s not running after 30s: %s", id, resp.GetStatus().GetState())
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// percentile is the nearest-rank percentile p (0 < p <= 100) of ds.
func percentile(ds []time.Duration, p float64) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	rank := int(p/100*float64(len(s))+0.999999) - 1
	rank = max(0, min(rank, len(s)-1))
	return s[rank]
}

func median(ds []time.Duration) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func ms(d time.Duration) string { return fmt.Sprintf("%.1f ms", float64(d)/float64(time.Millisecond)) }

// us is for calls of a millisecond or less, whose differences ms rounds
// away.
func us(d time.Duration) string { return fmt.Sprintf("%d µs", d.Microseconds()) }

func mib(b uint64) string { return fmt.Sprintf("%.1f MiB", float64(b)/(1<<20)) }

func report(w io.Writer, n int, what string, r *result) {
	fmt.Fprintf(w, "stagelet-bench: stage1 %s, %d runs each\n\n", what, n)
	if err := reportCalls(w, r); err != nil {
		fmt.Fprintln(w, "stagelet-bench:", err)
	}
	fmt.Fprintln(w)
	const rss = "%-72s %10s\n"
	fmt.Fprintf(w, rss, "daemon RSS (VmRSS) before the runs", mib(r.rssIdle))
	fmt.Fprintf(w, rss, fmt.Sprintf("daemon RSS (VmRSS) after the runs, %d pods running", n), mib(r.rssAfter))
	fmt.Fprintf(w, rss, fmt.Sprintf("host memory of one pod running alone: RSS (%d processes)", r.mem1.procs), mib(r.mem1.rss))
	fmt.Fprintf(w, rss, "host memory of one pod running alone: PSS", mib(r.mem1.pss))
	fmt.Fprintf(w, rss, fmt.Sprintf("host memory per pod, %d pods running: RSS", n), mib(r.memN.rss))
	fmt.Fprintf(w, rss, fmt.Sprintf("host memory per pod, %d pods running: PSS", n), mib(r.memN.pss))
	if r.templates > 0 {
		fmt.Fprintf(w, rss, fmt.Sprintf("kvm templates' memory files, allocated (%d templates, once for all pods)", r.templates), mib(r.templateBytes))
	}
	if r.metrics != "" {
		fmt.Fprintf(w, "\nthe daemon's metrics with the %d pods running (histogram buckets left out):\n%s", n, r.metrics)
	}
}

// reportCalls prints the timed calls, the same for stagelet and another
// runtime (-endpoint), beside the figures of -against, and saves their
// medians with -save.
func reportCalls(w io.Writer, r *result) error {
	rows := []callRow{
		{"pod start: RunPodSandbox, CreateContainer, StartContainer until RUNNING", r.podStart},
		{"  the first pod's (for kvm: includes building the template)", r.podStart[:1]},
		{"  RunPodSandbox", r.runPod},
		{"  CreateContainer", r.createCtr},
		{"  StartContainer", r.startCtr},
		{"ExecSync true", r.exec},
		{"streaming exec true: Exec call to its exit status (first byte)", r.streamTrue},
		{"streaming exec echo: Exec call to the first byte of output", r.streamEcho},
		{"StopContainer (sleep, ends at SIGTERM)", r.stopCtr},
		{"RemoveContainer", r.rmCtr},
		{"StopPodSandbox", r.stopPod},
		{"RemovePodSandbox", r.rmPod},
	}
	others, err := readAgainst()
	if err != nil {
		return err
	}
	printRows(w, rows, others)
	return saveFigures(rows)
}

// templateMemory counts the kvm templates in dir and the blocks their
// memory files hold.
func templateMemory(dir string) (int, uint64) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return 0, 0
	}
	var n int
	var total uint64
	for _, e := range ents {
		var st syscall.Stat_t
		if err := syscall.Stat(filepath.Join(dir, e.Name(), "memory"), &st); err != nil {
			continue
		}
		n++
		total += uint64(st.Blocks) * 512
	}
	return n, total
}

// podMem is the host memory of a pod's processes (the pod agent, nspawn,
// qemu, the apps, ...): the sums of their RSS and PSS (smaps_rollup).
type podMem struct {
	rss, pss uint64
	procs    int
}

// podMemory sums the memory of the processes in the pod's cgroups (named
// after the pod: stagelet-pod-<id>, or its systemd unit).
func podMemory(podID string) (podMem, error) {
	var m podMem
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return m, err
	}
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		cg, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
		if err != nil || !strings.Contains(string(cg), "stagelet-pod-"+podID) {
			continue
		}
		sm, err := os.ReadFile(fmt.Sprintf("/proc/%d/smaps_rollup", pid))
		if err != nil {
			continue // exited, or a kernel thread
		}
		for _, line := range strings.Split(string(sm), "\n") {
			f := strings.Fields(line)
			if len(f) < 2 {
				continue
			}
			kb, _ := strconv.ParseUint(f[1], 10, 64)
			switch f[0] {
			case "Rss:":
				m.rss += kb << 10
			case "Pss:":
				m.pss += kb << 10
			}
		}
		m.procs++
	}
	if m.procs == 0 {
		return m, fmt.Errorf("pod %s: no process found in a cgroup named after it", podID)
	}
	return m, nil
}

// fixtureTB lets this command use the registry fixtures of package
// testregistry, which report through a testing.TB: Fatal and Skip end the
// fixture call (see do), cleanups run in finish. Only the methods the
// fixtures use are meaningful; the embedded nil TB is never called.
type fixtureTB struct {
	testing.TB
	name string

	mu       sync.Mutex
	failed   bool
	msgs     []string
	cleanups []func()
}

type fixtureStop struct{}

func newFixtureTB(name string) *fixtureTB { return &fixtureTB{name: name} }

// do runs f, turning a Fatal or Skip inside it into an error.
func (t *fixtureTB) do(f func()) (err error) {
	defer func() {
		if r := recover(); r != nil {
			if _, ok := r.(fixtureStop); !ok {
				panic(r)
			}
		}
		if t.Failed() {
			err = errors.New(strings.Join(t.msgs, "; "))
		}
	}()
	f()
	return nil
}

// finish runs the registered cleanups, last first.
func (t *fixtureTB) finish() error {
	t.mu.Lock()
	cs := t.cleanups
	t.cleanups = nil
	t.mu.Unlock()
	for i := len(cs) - 1; i >= 0; i-- {
		cs[i]()
	}
	return nil
}

func (t *fixtureTB) record(msg string, fail bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.msgs = append(t.msgs, msg)
	if fail {
		t.failed = true
	}
}

func (t *fixtureTB) Name() string { return t.name }
func (t *fixtureTB) Helper()      {}
func (t *fixtureTB) Cleanup(f func()) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.cleanups = append(t.cleanups, f)
}
func (t *fixtureTB) Log(args ...any)                 { fmt.Fprintln(os.Stderr, args...) }
func (t *fixtureTB) Logf(format string, args ...any) { fmt.Fprintf(os.Stderr, format+"\n", args...) }
func (t *fixtureTB) Error(args ...any)               { t.record(fmt.Sprint(args...), true) }
func (t *fixtureTB) Errorf(format string, args ...any) {
	t.record(fmt.Sprintf(format, args...), true)
}
func (t *fixtureTB) Fail()    { t.record("failed", true) }
func (t *fixtureTB) FailNow() { t.record("failed", true); panic(fixtureStop{}) }
func (t *fixtureTB) Failed() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.failed
}
func (t *fixtureTB) Fatal(args ...any) { t.record(fmt.Sprint(args...), true); panic(fixtureStop{}) }
func (t *fixtureTB) Fatalf(format string, args ...any) {
	t.record(fmt.Sprintf(format, args...), true)
	panic(fixtureStop{})
}
func (t *fixtureTB) Skip(args ...any) {
	t.record("skipped: "+fmt.Sprint(args...), true)
	panic(fixtureStop{})
}
func (t *fixtureTB) Skipf(format string, args ...any) {
	t.record("skipped: "+fmt.Sprintf(format, args...), true)
	panic(fixtureStop{})
}
func (t *fixtureTB) SkipNow()      { t.record("skipped", true); panic(fixtureStop{}) }
func (t *fixtureTB) Skipped() bool { return false }
func (t *fixtureTB) TempDir() string {
	dir, err := os.MkdirTemp("", "stagelet-bench-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}
func (t *fixtureTB) Context() context.Context { return context.Background() }
func (t *fixtureTB) Output() io.Writer        { return os.Stderr }
func (t *fixtureTB) Setenv(key, value string) { os.Setenv(key, value) }
func (t *fixtureTB) Chdir(dir string)         { os.Chdir(dir) }
func (t *fixtureTB) Attr(key, value string)   {}
func (t *fixtureTB) ArtifactDir() string      { return t.TempDir() }
