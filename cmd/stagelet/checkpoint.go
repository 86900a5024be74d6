package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/encoding/protojson"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/checkpoint"
)

const checkpointUsage = `usage:
  stagelet checkpoint image [-insecure] ARCHIVE REF
      push checkpoint archive ARCHIVE (the kubelet's checkpoint API, or
      CheckpointContainer) as checkpoint image REF: a pod on any node of
      CRI-O, containerd or stagelet that names REF gets the container
      restored instead of started
  stagelet checkpoint pod [-socket S] POD DIR [CONTAINER...]
      checkpoint pod POD's running containers (or those named) into the
      empty directory DIR, made when missing (CRI CheckpointPod), leaving
      them running
  stagelet checkpoint restore-pod [-socket S] -config POD.json DIR
      make a pod of the pod checkpoint DIR (CRI RestorePod) with the pod
      configuration POD.json (as crictl runp reads it) and start its
      restored containers; prints the pod's ID
`

// checkpointMain is `stagelet checkpoint`: checkpoint images, and pod
// checkpoints driven from the command line.
func checkpointMain(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, checkpointUsage)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, unix.SIGTERM)
	defer stop()
	var err error
	switch args[0] {
	case "image":
		err = checkpointImage(ctx, args[1:], stdout, stderr)
	case "pod":
		err = checkpointPod(ctx, args[1:], stdout, stderr)
	case "restore-pod":
		err = restorePod(ctx, args[1:], stdout, stderr)
	case "help", "-h", "--help":
		fmt.Fprint(stdout, checkpointUsage)
		return 0
	default:
		fmt.Fprintf(stderr, "stagelet checkpoint: unknown command %q\n%s", args[0], checkpointUsage)
		return 2
	}
	if err == errUsage {
		return 2
	}
	if err != nil {
		fmt.Fprintf(stderr, "stagelet checkpoint %s: %v\n", args[0], err)
		return 1
	}
	return 0
}

// errUsage: the command line was wrong, and usage was printed.
var errUsage = errors.New("usage")

// checkpointFlags parses a subcommand's flags, wanting between min and
// max positional arguments (max < 0: any number).
func checkpointFlags(fs *flag.FlagSet, args []string, stderr io.Writer, min, max int) ([]string, error) {
	fs.SetOutput(stderr)
	fs.Usage = func() { fmt.Fprint(stderr, checkpointUsage) }
	if err := fs.Parse(args); err != nil {
		return nil, errUsage
	}
	if fs.NArg() < min || max >= 0 && fs.NArg() > max {
		fs.Usage()
		return nil, errUsage
	}
	return fs.Args(), nil
}

func checkpointImage(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("checkpoint image", flag.ContinueOnError)
	plain := fs.Bool("insecure", false, "push over plain HTTP (registries on 127.0.0.1 and localhost always are)")
	pos, err := checkpointFlags(fs, args, stderr, 2, 2)
	if err != nil {
		return err
	}
	var opts []name.Option
	if *plain {
		opts = append(opts, name.Insecure)
	}
	ref, err := name.ParseReference(pos[1], opts...)
	if err != nil {
		return err
	}
	img, err := checkpoint.Image(pos[0])
	if err != nil {
		return err
	}
	start := time.Now()
	if err := remote.Write(ref, img, remote.WithContext(ctx)); err != nil {
		return err
	}
	d, err := img.Digest()
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "%s@%s\n", ref.Context().Name(), d)
	fmt.Fprintf(stderr, "pushed %s in %v\n", ref, time.Since(start).Round(time.Millisecond))
	return nil
}

// criClient dials the daemon's CRI socket.
func criClient(socket string) (runtimeapi.RuntimeServiceClient, func(), error) {
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, nil, err
	}
	return runtimeapi.NewRuntimeServiceClient(conn), func() { conn.Close() }, nil
}

func checkpointPod(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("checkpoint pod", flag.ContinueOnError)
	socket := fs.String("socket", defaultSocket, "the daemon's CRI socket")
	pos, err := checkpointFlags(fs, args, stderr, 2, -1)
	if err != nil {
		return err
	}
	dir, err := filepath.Abs(pos[1])
	if err != nil {
		return err
	}
	// The daemon wants an empty directory: made here when missing, and
	// removed again (still empty) when the checkpoint fails.
	made := false
	if err := os.Mkdir(dir, 0o700); err == nil {
		made = true
	} else if !errors.Is(err, os.ErrExist) {
		return err
	}
	rt, closeConn, err := criClient(*socket)
	if err != nil {
		return err
	}
	defer closeConn()
	ids := pos[2:]
	if len(ids) == 0 {
		ids, err = runningContainers(ctx, rt, pos[0])
	}
	start := time.Now()
	if err == nil {
		_, err = rt.CheckpointPod(ctx, &runtimeapi.CheckpointPodRequest{PodSandboxId: pos[0], OutputPath: dir, ContainerIds: ids})
	}
	if err != nil && made {
		os.Remove(dir)
	}
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "%s\n", dir)
	fmt.Fprintf(stderr, "checkpointed pod %s in %v\n", pos[0], time.Since(start).Round(time.Millisecond))
	return nil
}

// runningContainers are the IDs of pod's running containers.
func runningContainers(ctx context.Context, rt runtimeapi.RuntimeServiceClient, pod string) ([]string, error) {
	resp, err := rt.ListContainers(ctx, &runtimeapi.ListContainersRequest{Filter: &runtimeapi.ContainerFilter{
		PodSandboxId: pod, State: &runtimeapi.ContainerStateValue{State: runtimeapi.ContainerState_CONTAINER_RUNNING},
	}})
	if err != nil {
		return nil, err
	}
	var ids []string
	for _, c := range resp.Containers {
		ids = append(ids, c.Id)
	}
	if len(ids) == 0 {
		return nil, fmt.Errorf("pod %s has no running container", pod)
	}
	return ids, nil
}

func restorePod(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("checkpoint restore-pod", flag.ContinueOnError)
	socket := fs.String("socket", defaultSocket, "the daemon's CRI socket")
	config := fs.String("config", "", "the pod's configuration (a CRI PodSandboxConfig in JSON, as crictl runp reads)")
	handler := fs.String("runtime", "", "the pod's runtime handler (RuntimeClass)")
	pos, err := checkpointFlags(fs, args, stderr, 1, 1)
	if err != nil {
		return err
	}
	if *config == "" {
		fs.Usage()
		return errUsage
	}
	dir, err := filepath.Abs(pos[0])
	if err != nil {
		return err
	}
	b, err := os.ReadFile(*config)
	if err != nil {
		return err
	}
	var cfg runtimeapi.PodSandboxConfig
	if err := protojson.Unmarshal(b, &cfg); err != nil {
		return fmt.Errorf("%s: %w", *config, err)
	}
	desc, err := checkpoint.ReadPod(dir)
	if err != nil {
		return err
	}
	// Each container as it was checkpointed: its name and image, its
	// log beside the pod's.
	var ctrs []*runtimeapi.ContainerConfig
	for _, c := range desc.Containers {
		meta, err := checkpoint.ReadMeta(filepath.Join(dir, c.Archive))
		if err != nil {
			return err
		}
		ctrs = append(ctrs, &runtimeapi.ContainerConfig{
			Metadata: &runtimeapi.ContainerMetadata{Name: c.Name},
			Image:    &runtimeapi.ImageSpec{Image: meta.Image},
			LogPath:  c.Name + ".log",
		})
	}
	rt, closeConn, err := criClient(*socket)
	if err != nil {
		return err
	}
	defer closeConn()
	start := time.Now()
	resp, err := rt.RestorePod(ctx, &runtimeapi.RestorePodRequest{CheckpointPath: dir, Config: &cfg, RuntimeHandler: *handler, ContainerConfigs: ctrs})
	if err != nil {
		return err
	}
	// Started together: each start restores its processes.
	for _, c := range resp.RestoredContainers {
		if _, err := rt.StartContainer(ctx, &runtimeapi.StartContainerRequest{ContainerId: c.ContainerId}); err != nil {
			return fmt.Errorf("pod %s: start restored container %s (%s): %w", resp.PodSandboxId, c.Name, c.ContainerId, err)
		}
	}
	fmt.Fprintf(stdout, "%s\n", resp.PodSandboxId)
	fmt.Fprintf(stderr, "restored pod %s with %d containers in %v\n", resp.PodSandboxId, len(resp.RestoredContainers), time.Since(start).Round(time.Millisecond))
	return nil
}
