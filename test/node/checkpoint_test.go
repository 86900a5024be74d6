package node

import (
	"archive/tar"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/checkpoint"
	"github.com/stagelet/stagelet/internal/testutil"
	"github.com/stagelet/stagelet/preflight"
)

// TestCheckpointContainer: on Debian's own kernel, where its criu works,
// CheckpointContainer saves a running counter of an nspawn pod and of a
// fly pod, in its own PID namespace (the kubelet's default) and in the
// pod's, into an archive holding criu's images of it, its writable layer
// and its record; the counter goes on counting. The nspawn archives are
// restored into a container of a new pod (CreateContainer naming the
// archive as its image, as with CRI-O), where the counter goes on from
// where it was, to its new log; one that shared its pod's PID namespace
// is refused beside its original, whose PIDs it needs, and restored
// once that stopped. Times and sizes are logged.
func TestCheckpointContainer(t *testing.T) {
	e := nodeEnv(t)
	needCRIU(t)
	e.install(t, "")
	t.Cleanup(func() { stopService(t) })
	rt, img := client(t)
	ref := pullBusybox(t, img)
	archives := t.TempDir()
	for _, tc := range []struct {
		name, namespace, handler string
		pid                      runtimeapi.NamespaceMode
	}{
		{"ckpt-nspawn", "default", "", runtimeapi.NamespaceMode_CONTAINER},
		{"ckpt-nspawn-shared", "default", "", runtimeapi.NamespaceMode_POD},
		{"ckpt-fly", "kube-system", "fly", runtimeapi.NamespaceMode_CONTAINER},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := startPod(t, rt, ref, tc.name, tc.namespace, tc.handler, "")
			c := ctx(t)
			cr, err := rt.CreateContainer(c, &runtimeapi.CreateContainerRequest{
				PodSandboxId: p.id, SandboxConfig: p.cfg,
				Config: &runtimeapi.ContainerConfig{
					Metadata: &runtimeapi.ContainerMetadata{Name: "counter"},
					Image:    &runtimeapi.ImageSpec{Image: ref},
					Command:  []string{"sh", "-c", testutil.CounterCmd},
					LogPath:  "counter.log",
					Linux: &runtimeapi.LinuxContainerConfig{SecurityContext: &runtimeapi.LinuxContainerSecurityContext{
						NamespaceOptions: &runtimeapi.NamespaceOption{Pid: tc.pid},
					}},
				},
			})
			if err != nil {
				t.Fatalf("CreateContainer: %v", err)
			}
			id := cr.ContainerId
			if _, err := rt.StartContainer(c, &runtimeapi.StartContainerRequest{ContainerId: id}); err != nil {
				t.Fatalf("StartContainer: %v", err)
			}
			count := testutil.Counting(t, rt, id)

			archive := filepath.Join(archives, tc.name+".tar")
			before := count()
			start := time.Now()
			if _, err := rt.CheckpointContainer(c, &runtimeapi.CheckpointContainerRequest{ContainerId: id, Location: archive, Timeout: 120}); err != nil {
				t.Fatalf("CheckpointContainer: %v\n%s", err, journal(t))
			}
			took := time.Since(start)
			fi, err := os.Stat(archive)
			if err != nil {
				t.Fatal(err)
			}
			dir := t.TempDir()
			got, err := checkpoint.Read(archive, dir)
			if err != nil {
				t.Fatal(err)
			}
			if got.ID != id || got.Name != "counter" || got.Pod != tc.name || got.Namespace != tc.namespace {
				t.Errorf("archive says %+v", got)
			}
			imgs, _ := os.ReadDir(filepath.Join(dir, checkpoint.ImagesDir))
			var names []string
			var imgBytes int64
			for _, f := range imgs {
				names = append(names, f.Name())
				if info, err := f.Info(); err == nil {
					imgBytes += info.Size()
				}
			}
			for _, want := range []string{"pstree.img", "inventory.img"} {
				if !strings.Contains(strings.Join(names, " "), want) {
					t.Errorf("criu images lack %s: %v", want, names)
				}
			}
			if !layerHas(t, filepath.Join(dir, checkpoint.RootfsDiff), "tmp/count") {
				t.Errorf("the writable layer lacks tmp/count")
			}
			t.Logf("%s: CheckpointContainer took %v; archive %d bytes, criu images %d bytes in %d files",
				tc.name, took.Round(time.Millisecond), fi.Size(), imgBytes, len(imgs))
			checkpointctl(t, archive, "counter", "stagelet-"+map[string]string{"": "nspawn", "fly": "fly"}[tc.handler])

			// Left running: it goes on counting.
			n0 := count()
			testutil.WaitFor(t, time.Minute, "the counter counts on after the checkpoint", func() (bool, string) {
				n := count()
				return n > n0, strconv.Itoa(n)
			})
			st, err := rt.ContainerStatus(c, &runtimeapi.ContainerStatusRequest{ContainerId: id})
			if err != nil || st.Status.State != runtimeapi.ContainerState_CONTAINER_RUNNING {
				t.Errorf("after the checkpoint: %v, %v", st, err)
			}
			atDump := layerFile(t, filepath.Join(dir, checkpoint.RootfsDiff), "tmp/count")
			switch {
			case tc.pid == runtimeapi.NamespaceMode_POD:
				// Its PIDs come back with it: not while the original
				// holds them, once it stopped.
				cr, err := rt.CreateContainer(c, restoreRequest(p, "counter-beside", archive))
				if err != nil {
					t.Fatalf("CreateContainer from %s: %v", archive, err)
				}
				_, err = rt.StartContainer(c, &runtimeapi.StartContainerRequest{ContainerId: cr.ContainerId})
				if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "are taken") {
					t.Errorf("restore beside the original in its pod's PID namespace: %v, want FailedPrecondition saying its PIDs are taken", err)
				}
				if _, err := rt.StopContainer(c, &runtimeapi.StopContainerRequest{ContainerId: id, Timeout: 10}); err != nil {
					t.Fatal(err)
				}
				restoreInto(t, rt, p, "counter-again", archive, before, atDump)
			default:
				q := startPod(t, rt, ref, tc.name+"-restored", tc.namespace, tc.handler, "")
				restoreInto(t, rt, q, "counter", archive, before, atDump)
			}
		})
	}
	// Nothing but the archives.
	ents, _ := os.ReadDir(archives)
	for _, e := range ents {
		if !strings.HasSuffix(e.Name(), ".tar") {
			t.Errorf("left beside the archives: %s", e.Name())
		}
	}
}

// needCRIU skips a test where criu does not work: none is installed, or
// its check fails on this kernel. The daemon's own choice
// (preflight.FindCRIU), so that the test runs where the daemon can
// checkpoint.
func needCRIU(t *testing.T) {
	t.Helper()
	path, ver, _, err := preflight.FindCRIU(t.Context(), "")
	if err != nil {
		t.Skipf("no criu works in this node image: %v", err)
	}
	t.Logf("criu %s (%s)", ver, path)
}

// restoreRequest creates container name in pod q from a checkpoint
// archive, as CRI-O takes one: the archive's path as its image.
func restoreRequest(q *pod, name, archive string) *runtimeapi.CreateContainerRequest {
	return &runtimeapi.CreateContainerRequest{
		PodSandboxId: q.id, SandboxConfig: q.cfg,
		Config: &runtimeapi.ContainerConfig{
			Metadata: &runtimeapi.ContainerMetadata{Name: name},
			Image:    &runtimeapi.ImageSpec{Image: archive},
			LogPath:  name + ".log",
		},
	}
}

// restoreInto restores the counter's archive into container name of pod
// q: the counter goes on from where it was, at least before (its count
// before the checkpoint) and at most atDump (the count its layer holds,
// read after the dump), to its new log; it stops and goes as any
// container.
func restoreInto(t *testing.T, rt runtimeapi.RuntimeServiceClient, q *pod, name, archive string, before int, atDump string) {
	t.Helper()
	c := ctx(t)
	cr, err := rt.CreateContainer(c, restoreRequest(q, name, archive))
	if err != nil {
		t.Fatalf("CreateContainer from %s: %v\n%s", archive, err, journal(t))
	}
	start := time.Now()
	if _, err := rt.StartContainer(c, &runtimeapi.StartContainerRequest{ContainerId: cr.ContainerId}); err != nil {
		t.Fatalf("StartContainer (restore): %v\n%s", err, journal(t))
	}
	took := time.Since(start)
	first := testutil.CountsOn(t, filepath.Join(q.logDir, name+".log"))
	dumped, _ := strconv.Atoi(strings.TrimSpace(atDump))
	if first-1 < before || first-1 > dumped {
		t.Errorf("the restored counter began its log at %d: want one past its count at the dump, between %d (before the checkpoint) and %d (its layer)", first, before, dumped)
	}
	st, err := rt.ContainerStatus(c, &runtimeapi.ContainerStatusRequest{ContainerId: cr.ContainerId})
	if err != nil || st.Status.State != runtimeapi.ContainerState_CONTAINER_RUNNING {
		t.Fatalf("restored container: %v, %v", st, err)
	}
	r, err := rt.ExecSync(c, &runtimeapi.ExecSyncRequest{ContainerId: cr.ContainerId, Cmd: []string{"cat", "/tmp/count"}, Timeout: 30})
	if err != nil || r.ExitCode != 0 {
		t.Errorf("exec in the restored container: %v %v", r, err)
	}
	t.Logf("%s: restored in %v (StartContainer); its log goes on from %d (checkpointed between %d and %d)", name, took.Round(time.Millisecond), first, before, dumped)
	// It stops and goes as any container does.
	if _, err := rt.StopContainer(c, &runtimeapi.StopContainerRequest{ContainerId: cr.ContainerId, Timeout: 10}); err != nil {
		t.Errorf("StopContainer (restored): %v", err)
	}
	st, err = rt.ContainerStatus(c, &runtimeapi.ContainerStatusRequest{ContainerId: cr.ContainerId})
	if err != nil || st.Status.State != runtimeapi.ContainerState_CONTAINER_EXITED {
		t.Errorf("restored container after stop: %v, %v", st, err)
	}
	if _, err := rt.RemoveContainer(c, &runtimeapi.RemoveContainerRequest{ContainerId: cr.ContainerId}); err != nil {
		t.Errorf("RemoveContainer (restored): %v", err)
	}
}

// TestCheckpointPod: CheckpointPod saves an nspawn pod's and a fly pod's
// containers (a sleeper and two counters), paused together, into a
// directory; they go on. RestorePod makes a new pod of it whose
// counters, once started, count on from where they were, to their new
// logs. Times and sizes are logged.
func TestCheckpointPod(t *testing.T) {
	e := nodeEnv(t)
	needCRIU(t)
	e.install(t, "")
	t.Cleanup(func() { stopService(t) })
	rt, img := client(t)
	ref := pullBusybox(t, img)
	for _, tc := range []struct{ name, namespace, handler string }{
		{"podckpt-nspawn", "default", ""},
		{"podckpt-fly", "kube-system", "fly"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := startPod(t, rt, ref, tc.name, tc.namespace, tc.handler, "")
			c := ctx(t)
			// Each in its own PID namespace, as the kubelet asks unless
			// the pod shares one (whose PIDs a restore would need free).
			var configs []*runtimeapi.ContainerConfig
			var ids []string
			for _, name := range []string{"sleeper", "one", "two"} {
				cmd := testutil.CounterCmd
				if name == "sleeper" {
					cmd = "exec sleep 100000"
				}
				cfg := &runtimeapi.ContainerConfig{
					Metadata: &runtimeapi.ContainerMetadata{Name: name},
					Image:    &runtimeapi.ImageSpec{Image: ref},
					Command:  []string{"sh", "-c", cmd},
					LogPath:  name + ".log",
					Linux: &runtimeapi.LinuxContainerConfig{SecurityContext: &runtimeapi.LinuxContainerSecurityContext{
						NamespaceOptions: &runtimeapi.NamespaceOption{Pid: runtimeapi.NamespaceMode_CONTAINER},
					}},
				}
				cr, err := rt.CreateContainer(c, &runtimeapi.CreateContainerRequest{PodSandboxId: p.id, SandboxConfig: p.cfg, Config: cfg})
				if err != nil {
					t.Fatal(err)
				}
				if _, err := rt.StartContainer(c, &runtimeapi.StartContainerRequest{ContainerId: cr.ContainerId}); err != nil {
					t.Fatal(err)
				}
				if name != "sleeper" {
					testutil.CountsOn(t, filepath.Join(p.logDir, name+".log"))
				}
				ids = append(ids, cr.ContainerId)
				configs = append(configs, cfg)
			}
			dir := t.TempDir()
			start := time.Now()
			if _, err := rt.CheckpointPod(c, &runtimeapi.CheckpointPodRequest{PodSandboxId: p.id, OutputPath: dir, ContainerIds: ids}); err != nil {
				t.Fatalf("CheckpointPod: %v\n%s", err, journal(t))
			}
			took := time.Since(start)
			ents, _ := os.ReadDir(dir)
			var files []string
			var size int64
			for _, e := range ents {
				fi, _ := e.Info()
				size += fi.Size()
				files = append(files, fmt.Sprintf("%s (%d bytes)", e.Name(), fi.Size()))
			}
			t.Logf("%s: CheckpointPod of 3 containers took %v; %d bytes: %s", tc.name, took.Round(time.Millisecond), size, strings.Join(files, ", "))
			if len(ents) != 4 {
				t.Errorf("pod checkpoint holds %v, want pod.dump and three archives", files)
			}
			for _, id := range ids {
				st, err := rt.ContainerStatus(c, &runtimeapi.ContainerStatusRequest{ContainerId: id})
				if err != nil || st.Status.State != runtimeapi.ContainerState_CONTAINER_RUNNING {
					t.Errorf("after CheckpointPod: %v %v", st, err)
				}
			}

			q := &pod{logDir: t.TempDir(), handler: tc.handler}
			q.cfg = &runtimeapi.PodSandboxConfig{
				Metadata:     &runtimeapi.PodSandboxMetadata{Name: tc.name + "-restored", Namespace: tc.namespace, Uid: fmt.Sprintf("%s-%d", tc.name, time.Now().UnixNano())},
				Hostname:     tc.name,
				LogDirectory: q.logDir,
				Linux:        &runtimeapi.LinuxPodSandboxConfig{},
			}
			start = time.Now()
			resp, err := rt.RestorePod(c, &runtimeapi.RestorePodRequest{CheckpointPath: dir, Config: q.cfg, RuntimeHandler: tc.handler, ContainerConfigs: configs})
			if err != nil {
				t.Fatalf("RestorePod: %v\n%s", err, journal(t))
			}
			q.id = resp.PodSandboxId
			t.Cleanup(func() { q.removeQuietly(t) })
			if len(resp.RestoredContainers) != 3 {
				t.Fatalf("restored %v", resp.RestoredContainers)
			}
			for _, r := range resp.RestoredContainers {
				if _, err := rt.StartContainer(c, &runtimeapi.StartContainerRequest{ContainerId: r.ContainerId}); err != nil {
					t.Fatalf("StartContainer %s (restore): %v\n%s", r.Name, err, journal(t))
				}
			}
			t.Logf("%s: RestorePod and three StartContainers took %v", tc.name, time.Since(start).Round(time.Millisecond))
			for _, name := range []string{"one", "two"} {
				if first := testutil.CountsOn(t, filepath.Join(q.logDir, name+".log")); first < 3 {
					t.Errorf("restored counter %s began at %d, not where it was", name, first)
				}
			}
		})
	}
}

// layerFile is the content of entry name of the layer tar at path.
func layerFile(t *testing.T, path, name string) string {
	t.Helper()
	b, ok := layerEntry(t, path, name)
	if !ok {
		t.Fatalf("layer %s has no %s", path, name)
	}
	return string(b)
}

// checkpointctl reads the archive as CRI-O's and containerd's users
// would: show finds the container, inspect --ps-tree reads criu's images
// of its processes (the counter's shell). The payload has it when the
// module proxy could build it (scripts/test-node.sh).
func checkpointctl(t *testing.T, archive string, want ...string) {
	t.Helper()
	ctl := os.Getenv("STAGELET_CHECKPOINTCTL")
	if _, err := os.Stat(ctl); ctl == "" || err != nil {
		t.Logf("checkpointctl is not in the payload (%q): the archive is not read with it", ctl)
		return
	}
	for _, args := range [][]string{{"show", archive}, {"inspect", "--ps-tree", archive}} {
		cmd := exec.Command(ctl, args...)
		cmd.Env = append(os.Environ(), "TMPDIR="+t.TempDir())
		out, err := cmd.CombinedOutput()
		t.Logf("checkpointctl %s:\n%s", args[0], out)
		if err != nil {
			t.Errorf("checkpointctl %s: %v", args[0], err)
			continue
		}
		w := want
		if args[0] == "inspect" {
			w = []string{"sh"}
		}
		for _, s := range w {
			if !strings.Contains(string(out), s) {
				t.Errorf("checkpointctl %s does not show %q", args[0], s)
			}
		}
	}
}

// layerHas says whether the layer tar at path holds an entry name.
func layerHas(t *testing.T, path, name string) bool {
	t.Helper()
	_, ok := layerEntry(t, path, name)
	return ok
}

// layerEntry is the content of entry name of the layer tar at path, and
// whether it has one.
func layerEntry(t *testing.T, path, name string) ([]byte, bool) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	tr := tar.NewReader(f)
	for {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return nil, false
		}
		if err != nil {
			t.Fatal(err)
		}
		if hdr.Name == name {
			b, err := io.ReadAll(tr)
			if err != nil {
				t.Fatal(err)
			}
			return b, true
		}
	}
}
