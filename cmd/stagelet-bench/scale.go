package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/proto"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/test/e2e/harness"
)

// scaleRow is the list latencies at one number of running pods, and the
// time a restarted daemon took to answer with them all ready.
type scaleRow struct {
	pods           int
	listContainers []time.Duration
	listPods       []time.Duration
	restart        []time.Duration
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
// ListContainers and calls ListPodSandbox at the gRPC level (what the
// kubelet's relist does every second) and restartRuns kill -9 restarts of
// the daemon until it answers with every pod ready. Then it times n
// exits, from the
// container's own finish time to its CONTAINER_STOPPED event reaching a
// GetContainerEvents subscriber.
func measureScale(ctx context.Context, d *harness.Daemon, ref, stage1 string, podNet bool, levels []int, calls, n int) ([]scaleRow, []time.Duration, error) {
	rt := d.Runtime()
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
		row, err := timeLists(ctx, rt, level, calls)
		if err != nil {
			return nil, nil, err
		}
		for range restartRuns {
			took, err := timeRestart(ctx, d, level)
			if err != nil {
				return nil, nil, err
			}
			row.restart = append(row.restart, took)
		}
		rt = d.Runtime() // the restarted daemon's connection
		rows = append(rows, row)
	}
	lat, err := exitToEvent(ctx, rt, pods[0], n)
	return rows, lat, err
}

// timeLists times calls ListContainers and calls ListPodSandbox on rt,
// which runs level pods of one container each.
func timeLists(ctx context.Context, rt runtimeapi.RuntimeServiceClient, level, calls int) (scaleRow, error) {
	row := scaleRow{pods: level}
	for range calls {
		began := time.Now()
		lc, err := rt.ListContainers(ctx, &runtimeapi.ListContainersRequest{})
		if err != nil {
			return row, err
		}
		row.listContainers = append(row.listContainers, time.Since(began))
		if len(lc.Containers) != level {
			return row, fmt.Errorf("ListContainers at %d pods listed %d containers", level, len(lc.Containers))
		}
		began = time.Now()
		lp, err := rt.ListPodSandbox(ctx, &runtimeapi.ListPodSandboxRequest{})
		if err != nil {
			return row, err
		}
		row.listPods = append(row.listPods, time.Since(began))
		if len(lp.Items) != level {
			return row, fmt.Errorf("ListPodSandbox at %d pods listed %d pods", level, len(lp.Items))
		}
	}
	return row, nil
}

// runExternal times another CRI runtime (containerd, CRI-O) at endpoint,
// on pods of image run with the runtime's default handler, which must be
// the only pods it runs: with levels, the list calls the way measureScale
// times stagelet's, on host-network pods (externalScale); otherwise the
// calls measure times, n runs each (externalCalls). Every pod it started
// is removed at the end.
func runExternal(ctx context.Context, endpoint, image string, levels []int, calls, n int, podNet bool) (err error) {
	conn, err := grpc.NewClient("unix://"+strings.TrimPrefix(endpoint, "unix://"),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(16<<20)))
	if err != nil {
		return err
	}
	defer conn.Close()
	rt, is := runtimeapi.NewRuntimeServiceClient(conn), runtimeapi.NewImageServiceClient(conn)
	v, err := rt.Version(ctx, &runtimeapi.VersionRequest{})
	if err != nil {
		return fmt.Errorf("%s: %w", endpoint, err)
	}
	if lp, err := rt.ListPodSandbox(ctx, &runtimeapi.ListPodSandboxRequest{}); err != nil {
		return err
	} else if len(lp.Items) != 0 {
		return fmt.Errorf("%s runs %d pods already: the figures need it to run only the bench's", endpoint, len(lp.Items))
	}
	if _, err := is.PullImage(ctx, &runtimeapi.PullImageRequest{Image: &runtimeapi.ImageSpec{Image: image}}); err != nil {
		return fmt.Errorf("pull %s: %w", image, err)
	}
	logs, err := os.MkdirTemp("/var/tmp", "stagelet-bench-logs-")
	if err != nil {
		return err
	}
	defer func() {
		// Whatever is left (all of it after a failure): stopped and
		// removed.
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Minute)
		defer cancel()
		lp, lerr := rt.ListPodSandbox(cctx, &runtimeapi.ListPodSandboxRequest{})
		err = errors.Join(err, lerr)
		for _, p := range lp.GetItems() {
			if _, cerr := rt.StopPodSandbox(cctx, &runtimeapi.StopPodSandboxRequest{PodSandboxId: p.Id}); cerr != nil {
				err = errors.Join(err, cerr)
			} else if _, cerr := rt.RemovePodSandbox(cctx, &runtimeapi.RemovePodSandboxRequest{PodSandboxId: p.Id}); cerr != nil {
				err = errors.Join(err, cerr)
			}
		}
		err = errors.Join(err, os.RemoveAll(logs))
	}()
	if levels == nil {
		return externalCalls(ctx, rt, v, endpoint, logs, image, n, podNet)
	}
	return externalScale(ctx, rt, v, endpoint, logs, image, levels, calls)
}

// externalScale is runExternal's list calls at each level.
func externalScale(ctx context.Context, rt runtimeapi.RuntimeServiceClient, v *runtimeapi.VersionResponse, endpoint, logs, image string, levels []int, calls int) error {
	var started int
	var rows []scaleRow
	for _, level := range levels {
		for ; started < level; started++ {
			if _, err := startPodOn(ctx, rt, logs, image, "", false, fmt.Sprintf("scale-%d", started)); err != nil {
				return fmt.Errorf("pod %d: %w", started, err)
			}
		}
		row, err := timeLists(ctx, rt, level, calls)
		if err != nil {
			return err
		}
		rows = append(rows, row)
	}
	fmt.Printf("stagelet-bench: %s %s at %s, host-network pods, list calls at the gRPC level, %d calls each\n\n", v.RuntimeName, v.RuntimeVersion, endpoint, calls)
	const line = "%-72s %10s %10s\n"
	fmt.Printf(line, "measure", "median", "p90")
	for _, r := range rows {
		fmt.Printf(line, fmt.Sprintf("ListContainers, %d pods running", r.pods), us(median(r.listContainers)), us(percentile(r.listContainers, 90)))
		fmt.Printf(line, fmt.Sprintf("ListPodSandbox, %d pods running", r.pods), us(median(r.listPods)), us(percentile(r.listPods, 90)))
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

func reportScale(w io.Writer, what string, calls int, rows []scaleRow, lat []time.Duration) {
	fmt.Fprintf(w, "stagelet-bench: stage1 %s, list calls at the gRPC level, %d calls each\n\n", what, calls)
	const row = "%-72s %10s %10s\n"
	fmt.Fprintf(w, row, "measure", "median", "p90")
	for _, r := range rows {
		fmt.Fprintf(w, row, fmt.Sprintf("ListContainers, %d pods running", r.pods), us(median(r.listContainers)), us(percentile(r.listContainers, 90)))
		fmt.Fprintf(w, row, fmt.Sprintf("ListPodSandbox, %d pods running", r.pods), us(median(r.listPods)), us(percentile(r.listPods, 90)))
		fmt.Fprintf(w, row, fmt.Sprintf("kill -9 and restart to all %d pods ready (%d restarts)", r.pods, len(r.restart)), ms(median(r.restart)), ms(percentile(r.restart, 90)))
	}
	fmt.Fprintf(w, row, fmt.Sprintf("container exit to its GetContainerEvents event (%d exits)", len(lat)), ms(median(lat)), ms(percentile(lat, 90)))
}
