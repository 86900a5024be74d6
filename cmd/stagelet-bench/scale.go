package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/proto"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/test/e2e/harness"
)

// scaleRow is the status-path latencies at one number of running pods,
// by call (statusCalls' names), and the time a restarted daemon took to
// answer with them all ready.
type scaleRow struct {
	pods  int
	calls map[string][]time.Duration
	// size is each call's reply size in bytes, on the wire.
	size map[string]int
	// refused are the calls another runtime failed, and its error.
	refused map[string]error
	restart []time.Duration
	// other is another runtime's, timed in the same rounds (-beside).
	other *scaleRow
}

// statusCall is one call of the status path (what the kubelet's relist,
// its stats and its probes of the runtime ask), timed at the gRPC level;
// it fails when the answer is not what level running pods of one
// container each give. pod and ctr are one of them.
type statusCall struct {
	name string
	call func(ctx context.Context, rt runtimeapi.RuntimeServiceClient, is runtimeapi.ImageServiceClient, level int, pod, ctr string) (proto.Message, error)
}

// statusCalls are timed in this order, one round of each at a time, so
// that drift of the machine touches them alike.
var statusCalls = []statusCall{
	{"ListContainers", func(ctx context.Context, rt runtimeapi.RuntimeServiceClient, _ runtimeapi.ImageServiceClient, level int, _, _ string) (proto.Message, error) {
		r, err := rt.ListContainers(ctx, &runtimeapi.ListContainersRequest{})
		return r, count(err, "containers", len(r.GetContainers()), level)
	}},
	{"ListPodSandbox", func(ctx context.Context, rt runtimeapi.RuntimeServiceClient, _ runtimeapi.ImageServiceClient, level int, _, _ string) (proto.Message, error) {
		r, err := rt.ListPodSandbox(ctx, &runtimeapi.ListPodSandboxRequest{})
		return r, count(err, "pods", len(r.GetItems()), level)
	}},
	{"ListContainerStats", func(ctx context.Context, rt runtimeapi.RuntimeServiceClient, _ runtimeapi.ImageServiceClient, level int, _, _ string) (proto.Message, error) {
		r, err := rt.ListContainerStats(ctx, &runtimeapi.ListContainerStatsRequest{})
		return r, count(err, "container stats", len(r.GetStats()), level)
	}},
	{"ListPodSandboxStats", func(ctx context.Context, rt runtimeapi.RuntimeServiceClient, _ runtimeapi.ImageServiceClient, level int, _, _ string) (proto.Message, error) {
		r, err := rt.ListPodSandboxStats(ctx, &runtimeapi.ListPodSandboxStatsRequest{})
		return r, count(err, "pod stats", len(r.GetStats()), level)
	}},
	{"PodSandboxStatus", func(ctx context.Context, rt runtimeapi.RuntimeServiceClient, _ runtimeapi.ImageServiceClient, _ int, pod, _ string) (proto.Message, error) {
		r, err := rt.PodSandboxStatus(ctx, &runtimeapi.PodSandboxStatusRequest{PodSandboxId: pod})
		if err == nil && r.GetStatus().GetState() != runtimeapi.PodSandboxState_SANDBOX_READY {
			err = fmt.Errorf("pod %s is %s", pod, r.GetStatus().GetState())
		}
		return r, err
	}},
	{"ContainerStatus", func(ctx context.Context, rt runtimeapi.RuntimeServiceClient, _ runtimeapi.ImageServiceClient, _ int, _, ctr string) (proto.Message, error) {
		r, err := rt.ContainerStatus(ctx, &runtimeapi.ContainerStatusRequest{ContainerId: ctr})
		if err == nil && r.GetStatus().GetState() != runtimeapi.ContainerState_CONTAINER_RUNNING {
			err = fmt.Errorf("container %s is %s", ctr, r.GetStatus().GetState())
		}
		return r, err
	}},
	{"ListImages", func(ctx context.Context, _ runtimeapi.RuntimeServiceClient, is runtimeapi.ImageServiceClient, _ int, _, _ string) (proto.Message, error) {
		r, err := is.ListImages(ctx, &runtimeapi.ListImagesRequest{})
		if err == nil && len(r.GetImages()) == 0 {
			err = errors.New("ListImages listed no image")
		}
		return r, err
	}},
	{"Status", func(ctx context.Context, rt runtimeapi.RuntimeServiceClient, _ runtimeapi.ImageServiceClient, _ int, _, _ string) (proto.Message, error) {
		r, err := rt.Status(ctx, &runtimeapi.StatusRequest{})
		if err == nil && len(r.GetStatus().GetConditions()) == 0 {
			err = errors.New("the runtime status has no condition")
		}
		return r, err
	}},
}

// count checks that a list call listed want items.
func count(err error, what string, got, want int) error {
	if err == nil && got != want {
		err = fmt.Errorf("listed %d %s at %d pods", got, what, want)
	}
	return err
}

// restartRuns is how many daemon restarts are timed at each level.
const restartRuns = 3

// parseLevels reads "10,50,100": increasing pod counts.
func parseLevels(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 1 || (len(out) > 0 && n <= out[len(out)-1]) {
			return nil, fmt.Errorf("-scale %q: want increasing pod counts such as 10,50,100", s)
		}
		out = append(out, n)
	}
	return out, nil
}

// measureScale starts pods up to each level and, at each, times calls
// rounds of the status-path calls at the gRPC level (statusCalls: the
// kubelet's relist does the first two every second) and restartRuns kill
// -9 restarts of the daemon until it answers with every pod ready. Then it
// times n exits, from the container's own finish time to its
// CONTAINER_STOPPED event reaching a GetContainerEvents subscriber. other
// (nil: none) is another runtime given as many pods of its own at each
// level, whose calls are timed in the same rounds, alternately with
// stagelet's (row.other).
func measureScale(ctx context.Context, d *harness.Daemon, ref, stage1 string, podNet bool, levels []int, calls, n int, other *external) ([]scaleRow, []time.Duration, error) {
	var rows []scaleRow
	var pods []*benchPod
	for _, level := range levels {
		for len(pods) < level {
			bp, err := startPod(ctx, d, ref, stage1, podNet, fmt.Sprintf("scale-%d", len(pods)))
			if err != nil {
				return nil, nil, fmt.Errorf("pod %d: %w", len(pods), err)
			}
			pods = append(pods, bp)
		}
		row := newScaleRow(level)
		targets := []*target{{rt: d.Runtime(), is: d.Image(), row: row}}
		if other != nil {
			if err := other.startPods(ctx, level); err != nil {
				return nil, nil, err
			}
			row.other = newScaleRow(level)
			targets = append(targets, &target{rt: other.rt, is: other.is, other: true, row: row.other})
		}
		if err := timeRounds(ctx, targets, level, calls); err != nil {
			return nil, nil, err
		}
		for range restartRuns {
			took, err := timeRestart(ctx, d, level)
			if err != nil {
				return nil, nil, err
			}
			row.restart = append(row.restart, took)
		}
		rows = append(rows, *row)
	}
	lat, err := exitToEvent(ctx, d.Runtime(), pods[0], n)
	return rows, lat, err
}

func newScaleRow(pods int) *scaleRow {
	return &scaleRow{pods: pods, calls: map[string][]time.Duration{}, size: map[string]int{}, refused: map[string]error{}}
}

// target is a runtime whose status-path calls timeRounds times into row.
// other: not stagelet, whose failed calls are left out of the rounds and
// reported (containerd 1.6 fails ListPodSandboxStats for pods without a
// cgroup parent); stagelet's fail the run.
type target struct {
	rt    runtimeapi.RuntimeServiceClient
	is    runtimeapi.ImageServiceClient
	other bool
	row   *scaleRow
}

// timeRounds times calls rounds of statusCalls on each target, which runs
// level pods of one container each. Within a round each call is made on
// every target in turn, the order reversed every other round, so that
// the machine's drift touches them alike.
func timeRounds(ctx context.Context, targets []*target, level, calls int) error {
	ids := make([][2]string, len(targets))
	for i, t := range targets {
		lc, err := t.rt.ListContainers(ctx, &runtimeapi.ListContainersRequest{})
		if err != nil {
			return err
		}
		if len(lc.Containers) == 0 {
			return fmt.Errorf("no container runs at %d pods", level)
		}
		ids[i] = [2]string{lc.Containers[0].PodSandboxId, lc.Containers[0].Id}
	}
	order := make([]int, len(targets))
	for round := range calls {
		for i := range order {
			order[i] = i
		}
		if round%2 == 1 {
			slices.Reverse(order)
		}
		for _, c := range statusCalls {
			for _, i := range order {
				t := targets[i]
				if t.row.refused[c.name] != nil {
					continue
				}
				began := time.Now()
				reply, err := c.call(ctx, t.rt, t.is, level, ids[i][0], ids[i][1])
				if err != nil {
					if t.other {
						t.row.refused[c.name] = err
						continue
					}
					return fmt.Errorf("%s: %w", c.name, err)
				}
				t.row.calls[c.name] = append(t.row.calls[c.name], time.Since(began))
				t.row.size[c.name] = proto.Size(reply)
			}
		}
	}
	return nil
}

// external is another CRI runtime (containerd, CRI-O) at endpoint, whose
// pods run image with its default handler; it must run no other pods.
type external struct {
	endpoint, image string
	conn            *grpc.ClientConn
	rt              runtimeapi.RuntimeServiceClient
	is              runtimeapi.ImageServiceClient
	v               *runtimeapi.VersionResponse
	// logs holds its pods' logs; started counts the pods it runs.
	logs    string
	started int
}

// openExternal connects to the runtime at endpoint, checks that it runs
// no pod and pulls image.
func openExternal(ctx context.Context, endpoint, image string) (*external, error) {
	conn, err := grpc.NewClient("unix://"+strings.TrimPrefix(endpoint, "unix://"),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(16<<20)))
	if err != nil {
		return nil, err
	}
	x := &external{endpoint: endpoint, image: image, conn: conn,
		rt: runtimeapi.NewRuntimeServiceClient(conn), is: runtimeapi.NewImageServiceClient(conn)}
	if x.v, err = x.rt.Version(ctx, &runtimeapi.VersionRequest{}); err != nil {
		conn.Close()
		return nil, fmt.Errorf("%s: %w", endpoint, err)
	}
	lp, err := x.rt.ListPodSandbox(ctx, &runtimeapi.ListPodSandboxRequest{})
	if err == nil && len(lp.Items) != 0 {
		err = fmt.Errorf("%s runs %d pods already: the figures need it to run only the bench's", endpoint, len(lp.Items))
	}
	if err == nil {
		if _, err = x.is.PullImage(ctx, &runtimeapi.PullImageRequest{Image: &runtimeapi.ImageSpec{Image: image}}); err != nil {
			err = fmt.Errorf("pull %s: %w", image, err)
		}
	}
	if err == nil {
		x.logs, err = os.MkdirTemp("/var/tmp", "stagelet-bench-logs-")
	}
	if err != nil {
		conn.Close()
		return nil, err
	}
	return x, nil
}

// startPods starts host-network pods until level run.
func (x *external) startPods(ctx context.Context, level int) error {
	for ; x.started < level; x.started++ {
		if _, err := startPodOn(ctx, x.rt, x.logs, x.image, "", false, fmt.Sprintf("scale-%d", x.started)); err != nil {
			return fmt.Errorf("%s: pod %d: %w", x.endpoint, x.started, err)
		}
	}
	return nil
}

// close stops and removes every pod the runtime runs (the bench's: all of
// them after a failure too) and the logs, and disconnects.
func (x *external) close(ctx context.Context) error {
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Minute)
	defer cancel()
	lp, err := x.rt.ListPodSandbox(cctx, &runtimeapi.ListPodSandboxRequest{})
	for _, p := range lp.GetItems() {
		if _, cerr := x.rt.StopPodSandbox(cctx, &runtimeapi.StopPodSandboxRequest{PodSandboxId: p.Id}); cerr != nil {
			err = errors.Join(err, cerr)
		} else if _, cerr := x.rt.RemovePodSandbox(cctx, &runtimeapi.RemovePodSandboxRequest{PodSandboxId: p.Id}); cerr != nil {
			err = errors.Join(err, cerr)
		}
	}
	return errors.Join(err, os.RemoveAll(x.logs), x.conn.Close())
}

// runExternal times another CRI runtime at endpoint alone, on pods of
// image: with levels, the status-path calls the way measureScale times
// stagelet's, on host-network pods (externalScale); otherwise the calls
// measure times, n runs each (externalCalls). Every pod it started is
// removed at the end.
func runExternal(ctx context.Context, endpoint, image string, levels []int, calls, n int, podNet bool) (err error) {
	x, err := openExternal(ctx, endpoint, image)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, x.close(ctx)) }()
	if levels == nil {
		return externalCalls(ctx, x.rt, x.v, endpoint, x.logs, image, n, podNet)
	}
	return externalScale(ctx, x, levels, calls)
}

// externalScale is runExternal's status-path calls at each level.
func externalScale(ctx context.Context, x *external, levels []int, calls int) error {
	var rows []*scaleRow
	for _, level := range levels {
		if err := x.startPods(ctx, level); err != nil {
			return err
		}
		row := newScaleRow(level)
		if err := timeRounds(ctx, []*target{{rt: x.rt, is: x.is, other: true, row: row}}, level, calls); err != nil {
			return err
		}
		rows = append(rows, row)
	}
	fmt.Printf("stagelet-bench: %s %s at %s, host-network pods, status-path calls at the gRPC level, %d rounds\n\n", x.v.RuntimeName, x.v.RuntimeVersion, x.endpoint, calls)
	const line = "%-72s %10s %10s\n"
	fmt.Printf(line, "measure", "median", "p90")
	for _, r := range rows {
		reportCallsAt(os.Stdout, line, *r)
	}
	return nil
}

// externalCalls is runExternal's timed calls, as measure times
// stagelet's: n pods started, exec in the first, then each torn down as
// the kubelet does.
func externalCalls(ctx context.Context, rt runtimeapi.RuntimeServiceClient, v *runtimeapi.VersionResponse, endpoint, logs, image string, n int, podNet bool) error {
	res := &result{}
	pods, ctrs, err := measureRunning(ctx, rt, logs, image, n, "", podNet, res, nil)
	if err != nil {
		return err
	}
	if err := measureTeardown(ctx, rt, ctrs, pods, res); err != nil {
		return err
	}
	network := "host network"
	if podNet {
		network = "pod network (its own CNI config)"
	}
	fmt.Printf("stagelet-bench: %s %s at %s, %s, %d runs each\n\n", v.RuntimeName, v.RuntimeVersion, endpoint, network, n)
	return reportCalls(os.Stdout, res)
}

// timeRestart kills the daemon with SIGKILL, as a crash would, starts it
// again and returns the time from its start until ListPodSandbox answers
// with all pods pods ready.
func timeRestart(ctx context.Context, d *harness.Daemon, pods int) (time.Duration, error) {
	if err := d.Kill9(ctx); err != nil {
		return 0, err
	}
	began := time.Now()
	if err := d.Launch(); err != nil {
		return 0, err
	}
	_, err := d.WaitReady(ctx, func(ctx context.Context) error {
		lp, err := d.Runtime().ListPodSandbox(ctx, &runtimeapi.ListPodSandboxRequest{})
		if err != nil {
			return err
		}
		ready := 0
		for _, p := range lp.Items {
			if p.State == runtimeapi.PodSandboxState_SANDBOX_READY {
				ready++
			}
		}
		if ready != pods {
			return fmt.Errorf("%d of %d pods ready", ready, pods)
		}
		return nil
	})
	return time.Since(began), err
}

// exitToEvent runs n containers that exit at once in bp's pod and returns,
// for each, the time from its finish (as its status records it) to its
// CONTAINER_STOPPED event's arrival.
func exitToEvent(ctx context.Context, rt runtimeapi.RuntimeServiceClient, bp *benchPod, n int) ([]time.Duration, error) {
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := rt.GetContainerEvents(sctx, &runtimeapi.GetEventsRequest{})
	if err != nil {
		return nil, err
	}
	evs := make(chan arrival, 64)
	go func() {
		defer close(evs)
		for {
			ev, err := stream.Recv()
			if err != nil {
				return
			}
			evs <- arrival{ev, time.Now()}
		}
	}()
	// Each container's CREATED event is awaited before it starts: the
	// first one also proves the subscription is in place.
	var out []time.Duration
	for i := range n {
		cfg := proto.Clone(bp.ctrCfg).(*runtimeapi.ContainerConfig)
		cfg.Metadata = &runtimeapi.ContainerMetadata{Name: fmt.Sprintf("exits-%d", i)}
		cfg.Command = []string{"true"}
		cfg.LogPath = fmt.Sprintf("exits-%d.log", i)
		c, err := rt.CreateContainer(ctx, &runtimeapi.CreateContainerRequest{PodSandboxId: bp.podID, Config: cfg, SandboxConfig: bp.podCfg})
		if err != nil {
			return nil, err
		}
		if err := waitEvent(evs, runtimeapi.ContainerEventType_CONTAINER_CREATED_EVENT, c.ContainerId, nil); err != nil {
			return nil, err
		}
		if _, err := rt.StartContainer(ctx, &runtimeapi.StartContainerRequest{ContainerId: c.ContainerId}); err != nil {
			return nil, err
		}
		var d time.Duration
		err = waitEvent(evs, runtimeapi.ContainerEventType_CONTAINER_STOPPED_EVENT, c.ContainerId, func(ev *runtimeapi.ContainerEventResponse, at time.Time) error {
			for _, st := range ev.ContainersStatuses {
				if st.Id == c.ContainerId && st.FinishedAt > 0 {
					d = at.Sub(time.Unix(0, st.FinishedAt))
					return nil
				}
			}
			return fmt.Errorf("the stopped event of %s has no finish time", c.ContainerId)
		})
		if err != nil {
			return nil, err
		}
		out = append(out, d)
		if _, err := rt.RemoveContainer(ctx, &runtimeapi.RemoveContainerRequest{ContainerId: c.ContainerId}); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// arrival is an event and when the subscriber received it.
type arrival struct {
	ev *runtimeapi.ContainerEventResponse
	at time.Time
}

// waitEvent reads evs until an event of typ about id, at most a minute,
// and hands it to f.
func waitEvent(evs <-chan arrival, typ runtimeapi.ContainerEventType, id string, f func(*runtimeapi.ContainerEventResponse, time.Time) error) error {
	timeout := time.After(time.Minute)
	for {
		select {
		case a, ok := <-evs:
			if !ok {
				return fmt.Errorf("the event stream ended waiting for %s of %s", typ, id)
			}
			ev, at := a.ev, a.at
			if ev.ContainerEventType == typ && ev.ContainerId == id {
				if f != nil {
					return f(ev, at)
				}
				return nil
			}
		case <-timeout:
			return fmt.Errorf("no %s event for %s in a minute", typ, id)
		}
	}
}

func reportScale(w io.Writer, what string, calls int, rows []scaleRow, lat []time.Duration, other *external) {
	fmt.Fprintf(w, "stagelet-bench: stage1 %s, status-path calls at the gRPC level, %d rounds\n", what, calls)
	if other == nil {
		fmt.Fprintln(w)
		const row = "%-72s %10s %10s\n"
		fmt.Fprintf(w, row, "measure", "median", "p90")
		for _, r := range rows {
			reportCallsAt(w, row, r)
			fmt.Fprintf(w, row, fmt.Sprintf("kill -9 and restart to all %d pods ready (%d restarts)", r.pods, len(r.restart)), ms(median(r.restart)), ms(percentile(r.restart, 90)))
		}
		fmt.Fprintf(w, row, fmt.Sprintf("container exit to its GetContainerEvents event (%d exits)", len(lat)), ms(median(lat)), ms(percentile(lat, 90)))
		return
	}
	fmt.Fprintf(w, "beside %s %s at %s (host-network pods of %s), each call made on both in turn\n\n", other.v.RuntimeName, other.v.RuntimeVersion, other.endpoint, other.image)
	const row = "%-52s %10s %10s %10s %10s %7s\n"
	fmt.Fprintf(w, row, "measure (reply bytes: stagelet/other)", "stagelet", "p90", "other", "p90", "ratio")
	for _, r := range rows {
		for _, c := range statusCalls {
			d, o := r.calls[c.name], r.other.calls[c.name]
			name := fmt.Sprintf("%s, %d pods (%d/%d)", c.name, r.pods, r.size[c.name], r.other.size[c.name])
			if err := r.other.refused[c.name]; err != nil {
				fmt.Fprintf(w, row, name, us(median(d)), us(percentile(d, 90)), "failed", "", "")
				fmt.Fprintf(w, "    (the other runtime: %v)\n", err)
				continue
			}
			fmt.Fprintf(w, row, name, us(median(d)), us(percentile(d, 90)), us(median(o)), us(percentile(o, 90)),
				fmt.Sprintf("%.2f", float64(median(d))/float64(median(o))))
		}
		fmt.Fprintf(w, row, fmt.Sprintf("kill -9 and restart, %d pods ready (%d)", r.pods, len(r.restart)), ms(median(r.restart)), ms(percentile(r.restart, 90)), "", "", "")
	}
	fmt.Fprintf(w, row, fmt.Sprintf("container exit to its event (%d exits)", len(lat)), ms(median(lat)), ms(percentile(lat, 90)), "", "", "")
}

// reportCallsAt prints r's status-path calls, one line each in line's
// format.
func reportCallsAt(w io.Writer, line string, r scaleRow) {
	for _, c := range statusCalls {
		if err := r.refused[c.name]; err != nil {
			fmt.Fprintf(w, "%s, %d pods running: failed: %v\n", c.name, r.pods, err)
			continue
		}
		d := r.calls[c.name]
		fmt.Fprintf(w, line, fmt.Sprintf("%s, %d pods running (%d-byte reply)", c.name, r.pods, r.size[c.name]), us(median(d)), us(percentile(d, 90)))
	}
}

// pickCalls keeps the calls only names (comma-separated); all for "".
func pickCalls(calls []statusCall, only string) ([]statusCall, error) {
	if only == "" {
		return calls, nil
	}
	var out []statusCall
	for _, name := range strings.Split(only, ",") {
		i := slices.IndexFunc(calls, func(c statusCall) bool { return c.name == strings.TrimSpace(name) })
		if i < 0 {
			return nil, fmt.Errorf("-only: no status-path call %q", name)
		}
		out = append(out, calls[i])
	}
	return out, nil
}
