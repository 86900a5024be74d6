package broker

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/checkpoint"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/testutil"
	"github.com/stagelet/stagelet/stage1"
)

// Checkpoint calls check their arguments, then say why this node or the
// pod's stage1 cannot checkpoint before anything else.
func TestCheckpointRefusals(t *testing.T) {
	e := newEnv(t)
	e.vm.Caps.NoCheckpoint = "its state is a VM's"
	e.net = newFakeNetwork(filepath.Join(e.run, "netns"))
	criuErr := errors.New("`criu check` fails on kernel 6.18")
	var criu error = criuErr
	e.criu = func(context.Context) (string, error) { return "criu", criu }
	b := e.broker(t)
	ctx := context.Background()
	pid, err := b.RunPod(ctx, podCfg("x"))
	if err != nil {
		t.Fatal(err)
	}
	cid, _ := b.CreateContainer(ctx, pid, ctrCfg("c"))
	archive := filepath.Join(t.TempDir(), "c.tar")

	wantErr := func(err, class error, text string) {
		t.Helper()
		if !errors.Is(err, class) || !strings.Contains(err.Error(), text) {
			t.Errorf("err = %v, want class %v saying %q", err, class, text)
		}
	}
	wantErr(b.CheckpointContainer(ctx, cid, ""), errdefs.ErrInvalidArgument, "location")
	wantErr(b.CheckpointContainer(ctx, cid, "c.tar"), errdefs.ErrInvalidArgument, "absolute")
	wantErr(b.CheckpointContainer(ctx, cid, filepath.Join(archive, "in", "none.tar")), errdefs.ErrInvalidArgument, "does not exist")
	wantErr(b.CheckpointContainer(ctx, cid, filepath.Dir(archive)), errdefs.ErrInvalidArgument, "not a file")
	wantErr(b.CheckpointContainer(ctx, "nope", archive), errdefs.ErrNotFound, "nope")
	wantErr(b.CheckpointContainer(ctx, cid, archive), errdefs.ErrFailedPrecondition, "only a running container")
	if err := b.StartContainer(ctx, cid); err != nil {
		t.Fatal(err)
	}
	wantErr(b.CheckpointContainer(ctx, cid, archive), errdefs.ErrFailedPrecondition, criuErr.Error())
	criu = nil
	wantErr(b.CheckpointContainer(ctx, cid, archive), errdefs.ErrUnimplemented, "stage1 fake")

	// A pod on a stage1 that cannot checkpoint says why, whatever CRIU.
	vmCfg := podCfg("v")
	vmCfg.HostNetwork, vmCfg.RuntimeHandler = false, "vm"
	vpid, err := b.RunPod(ctx, vmCfg)
	if err != nil {
		t.Fatal(err)
	}
	vcid, _ := b.CreateContainer(ctx, vpid, ctrCfg("c"))
	if err := b.StartContainer(ctx, vcid); err != nil {
		t.Fatal(err)
	}
	wantErr(b.CheckpointContainer(ctx, vcid, archive), errdefs.ErrFailedPrecondition, "its state is a VM's")

	// CheckpointPod: an existing empty directory, the pod's running
	// containers, each once.
	out := t.TempDir()
	wantErr(b.CheckpointPod(ctx, pid, "", []string{cid}), errdefs.ErrInvalidArgument, "output_path")
	wantErr(b.CheckpointPod(ctx, pid, filepath.Join(out, "none"), []string{cid}), errdefs.ErrNotFound, "output_path")
	wantErr(b.CheckpointPod(ctx, pid, out, nil), errdefs.ErrInvalidArgument, "container_ids")
	wantErr(b.CheckpointPod(ctx, pid, out, []string{cid, cid}), errdefs.ErrInvalidArgument, "twice")
	wantErr(b.CheckpointPod(ctx, pid, out, []string{vcid}), errdefs.ErrNotFound, "not in pod")
	wantErr(b.CheckpointPod(ctx, vpid, out, []string{vcid}), errdefs.ErrFailedPrecondition, "its state is a VM's")
	wantErr(b.CheckpointPod(ctx, pid, out, []string{cid}), errdefs.ErrUnimplemented, "stage1 fake")
	if err := os.WriteFile(filepath.Join(out, "f"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	wantErr(b.CheckpointPod(ctx, pid, out, []string{cid}), errdefs.ErrInvalidArgument, "not empty")

	// RestorePod: the policy decides as for a new pod, then the stage1.
	in := t.TempDir()
	_, _, err = b.RestorePod(ctx, filepath.Join(in, "none"), podCfg("r"), []*ContainerConfig{ctrCfg("c")})
	wantErr(err, errdefs.ErrNotFound, "checkpoint_path")
	_, _, err = b.RestorePod(ctx, in, podCfg("r"), nil)
	wantErr(err, errdefs.ErrInvalidArgument, "container_configs")
	_, _, err = b.RestorePod(ctx, in, podCfg("r"), []*ContainerConfig{ctrCfg("c"), ctrCfg("c")})
	wantErr(err, errdefs.ErrInvalidArgument, "twice")
	locked := podCfg("r")
	locked.Metadata.Namespace, locked.Privileged = "locked", true
	_, _, err = b.RestorePod(ctx, in, locked, []*ContainerConfig{ctrCfg("c")})
	wantErr(err, errdefs.ErrPermissionDenied, "no privileged pods in locked")
	restoreVM := podCfg("r")
	restoreVM.HostNetwork, restoreVM.RuntimeHandler = false, "vm"
	_, _, err = b.RestorePod(ctx, in, restoreVM, []*ContainerConfig{ctrCfg("c")})
	wantErr(err, errdefs.ErrFailedPrecondition, "its state is a VM's")
	_, _, err = b.RestorePod(ctx, in, podCfg("r"), []*ContainerConfig{ctrCfg("c")})
	wantErr(err, errdefs.ErrNotFound, "no pod checkpoint")

	// Without a CRIU check, refused.
	e.criu = nil
	b2 := e.broker(t)
	wantErr(b2.CheckpointContainer(ctx, cid, archive), errdefs.ErrFailedPrecondition, "CRIU")
}

// Where the pod's stage1 saves apps, CheckpointContainer writes the
// archive: the stage1's images, the container's writable layer and its
// record; the container goes on running, and nothing else is left.
func TestCheckpointContainerWritesArchive(t *testing.T) {
	e := newEnv(t)
	e.criu = func(context.Context) (string, error) { return "criu", nil }
	var saved []string
	var failSave error
	e.be.SaveApp = func(id string, pid int, dir string) error {
		if pid <= 0 {
			return errors.New("no pid")
		}
		if failSave != nil {
			os.WriteFile(filepath.Join(dir, "core-1.img"), nil, 0o600) // a part written
			return failSave
		}
		saved = append(saved, id)
		return os.WriteFile(filepath.Join(dir, "pstree.img"), []byte("images of "+id), 0o600)
	}
	b := e.broker(t)
	ctx := context.Background()
	pid, err := b.RunPod(ctx, podCfg("x"))
	if err != nil {
		t.Fatal(err)
	}
	cid, _ := b.CreateContainer(ctx, pid, ctrCfg("c"))
	if err := b.StartContainer(ctx, cid); err != nil {
		t.Fatal(err)
	}
	rec, err := b.ContainerStatus(ctx, cid)
	if err != nil {
		t.Fatal(err)
	}
	// What the container wrote: its layer.
	if err := os.MkdirAll(filepath.Join(rec.Dir, "upper", "tmp"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(rec.Dir, "upper", "tmp", "count"), []byte("42\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	archive := filepath.Join(dir, "c.tar")
	if err := b.CheckpointContainer(ctx, cid, archive); err != nil {
		t.Fatal(err)
	}
	if len(saved) != 1 || saved[0] != cid {
		t.Errorf("apps saved: %v", saved)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 1 {
		t.Errorf("left beside the archive: %v", ents)
	}
	out := t.TempDir()
	got, err := checkpoint.Read(archive, out)
	if err != nil {
		t.Fatal(err)
	}
	if got.ID != cid || got.Name != "c" || got.Pod != "x" || got.Namespace != "default" || got.Stage1 != "fake" || got.Image != rec.ImageName {
		t.Errorf("archive says %+v", got)
	}
	if b, err := os.ReadFile(filepath.Join(out, "checkpoint", "pstree.img")); err != nil || string(b) != "images of "+cid {
		t.Errorf("images: %q, %v", b, err)
	}
	layer, err := os.ReadFile(filepath.Join(out, checkpoint.RootfsDiff))
	if err != nil || !strings.Contains(string(layer), "tmp/count") {
		t.Errorf("layer lacks tmp/count: %v", err)
	}
	if st, err := b.ContainerStatus(ctx, cid); err != nil || st.State != ContainerRunning {
		t.Errorf("after the checkpoint: %+v, %v", st, err)
	}

	// A failed save leaves no archive, and no images.
	failSave = errdefs.FailedPrecondition("criu said no")
	failing := filepath.Join(dir, "again.tar")
	if err := b.CheckpointContainer(ctx, cid, failing); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Errorf("failed save: %v", err)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 1 {
		t.Errorf("a failed checkpoint left: %v", ents)
	}
}

// A container created with a checkpoint archive as its image is the
// checkpointed one (its command, image, writable layer) under the
// request's name, labels and log; its start has the stage1 restore the
// archive's images, and a failed restore exits it with the stage1's
// reason. Archives that cannot be restored are refused at create, and
// leave nothing.
func TestRestoreFromArchive(t *testing.T) {
	e := newEnv(t)
	e.criu = func(context.Context) (string, error) { return "criu", nil }
	e.vm.Caps.NoCheckpoint = "its state is a VM's"
	e.net = newFakeNetwork(filepath.Join(e.run, "netns"))
	e.be.SaveApp = func(id string, pid int, dir string) error {
		return os.WriteFile(filepath.Join(dir, "pstree.img"), []byte("images of "+id), 0o600)
	}
	var restored *stage1.AppRestore
	e.be.RestoreApp = func(r *stage1.AppRestore) (int, error) {
		restored = r
		return 0, errdefs.FailedPrecondition("criu said no")
	}
	b := e.broker(t)
	ctx := context.Background()
	pid, err := b.RunPod(ctx, podCfg("x"))
	if err != nil {
		t.Fatal(err)
	}
	cfg := ctrCfg("c")
	cfg.Command = []string{"sleep", "1000"}
	cid, err := b.CreateContainer(ctx, pid, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.StartContainer(ctx, cid); err != nil {
		t.Fatal(err)
	}
	orig, err := b.ContainerStatus(ctx, cid)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(orig.Dir, "upper", "tmp"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(orig.Dir, "upper", "tmp", "count"), []byte("42\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	archive := filepath.Join(dir, "c.tar")
	if err := b.CheckpointContainer(ctx, cid, archive); err != nil {
		t.Fatal(err)
	}

	ypid, err := b.RunPod(ctx, podCfg("y"))
	if err != nil {
		t.Fatal(err)
	}
	ctrs := func() int {
		ents, _ := os.ReadDir(b.containersDir())
		return len(ents)
	}
	before := ctrs()
	from := func(name, archive string) *ContainerConfig {
		return &ContainerConfig{Metadata: ContainerMetadata{Name: name}, Image: archive, LogPath: name + ".log", Labels: map[string]string{"l": name}}
	}
	rid, err := b.CreateContainer(ctx, ypid, from("r", archive))
	if err != nil {
		t.Fatal(err)
	}
	rec, err := b.ContainerStatus(ctx, rid)
	if err != nil {
		t.Fatal(err)
	}
	if rec.Config.Metadata.Name != "r" || rec.Config.Labels["l"] != "r" || rec.Config.LogPath != "r.log" ||
		!slices.Equal(rec.Config.Command, cfg.Command) || rec.ImageName != orig.ImageName || rec.Restore == nil || rec.Restore.Archive != archive {
		t.Errorf("restored container: %+v", rec)
	}
	if b, err := os.ReadFile(filepath.Join(rec.Dir, "upper", "tmp", "count")); err != nil || string(b) != "42\n" {
		t.Errorf("restored layer: %q %v", b, err)
	}
	err = b.StartContainer(ctx, rid)
	if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "criu said no") {
		t.Errorf("start of a container whose restore fails: %v", err)
	}
	if restored == nil || restored.Spec.ID != rid || restored.IO == nil || restored.Image.Stdio[1] != "pipe:[1]" {
		t.Fatalf("the stage1 was asked %+v", restored)
	}
	if b, err := os.ReadFile(filepath.Join(restored.Images, "pstree.img")); err != nil || string(b) != "images of "+cid {
		t.Errorf("images given to the stage1: %q %v", b, err)
	}
	if st, err := b.ContainerStatus(ctx, rid); err != nil || st.State != ContainerExited || !strings.Contains(st.Message, "criu said no") {
		t.Errorf("after a failed restore: %+v %v", st, err)
	}

	// Refused at create, leaving nothing.
	wantErr := func(err, class error, text string) {
		t.Helper()
		if !errors.Is(err, class) || !strings.Contains(err.Error(), text) {
			t.Errorf("err = %v, want class %v saying %q", err, class, text)
		}
	}
	_, err = b.CreateContainer(ctx, ypid, from("none", filepath.Join(dir, "none.tar")))
	wantErr(err, errdefs.ErrNotFound, "does not exist")
	junk := filepath.Join(dir, "junk.tar")
	if err := os.WriteFile(junk, []byte("not a tar"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err = b.CreateContainer(ctx, ypid, from("junk", junk))
	wantErr(err, errdefs.ErrInvalidArgument, "junk.tar")
	if n := ctrs(); n != before+1 {
		t.Errorf("refused restores left %d container directories", n-before-1)
	}
	vmCfg := podCfg("v")
	vmCfg.HostNetwork, vmCfg.RuntimeHandler = false, "vm"
	vpid, err := b.RunPod(ctx, vmCfg)
	if err != nil {
		t.Fatal(err)
	}
	_, err = b.CreateContainer(ctx, vpid, from("r", archive))
	wantErr(err, errdefs.ErrFailedPrecondition, "its state is a VM's")

	// The archive as a checkpoint image's one layer, as the kubelet
	// names it after pulling it: restored as from the archive.
	layer := t.TempDir()
	f, err := os.Open(archive)
	if err != nil {
		t.Fatal(err)
	}
	testutil.Untar(t, f, layer)
	f.Close()
	const ref = "registry.test/checkpoint:c"
	e.images.mu.Lock()
	e.images.checkpoints = map[string]string{ref: layer}
	e.images.mu.Unlock()
	iid, err := b.CreateContainer(ctx, ypid, from("i", ref))
	if err != nil {
		t.Fatal(err)
	}
	rec, err = b.ContainerStatus(ctx, iid)
	if err != nil {
		t.Fatal(err)
	}
	if rec.Restore == nil || rec.Restore.Archive != ref || rec.ImageName != orig.ImageName || !slices.Equal(rec.Config.Command, cfg.Command) {
		t.Errorf("container restored from an image: %+v", rec)
	}
	if b, err := os.ReadFile(filepath.Join(rec.Dir, "upper", "tmp", "count")); err != nil || string(b) != "42\n" {
		t.Errorf("layer restored from an image: %q %v", b, err)
	}
	if b, err := os.ReadFile(filepath.Join(rec.Restore.Images, "pstree.img")); err != nil || string(b) != "images of "+cid {
		t.Errorf("images from the image: %q %v", b, err)
	}
	if ents, err := os.ReadDir(layer); err != nil || len(ents) == 0 {
		t.Errorf("the image's layer changed: %v %v", ents, err)
	}
}

// A container restored where its image was never pulled gets it pulled,
// by the reference its author gave (the kubelet names images by ID); a
// checkpoint that names its image by ID alone is refused, saying so.
func TestRestorePullsCheckpointedImage(t *testing.T) {
	e := newEnv(t)
	e.criu = func(context.Context) (string, error) { return "criu", nil }
	e.net = newFakeNetwork(filepath.Join(e.run, "netns"))
	e.be.SaveApp = func(id string, pid int, dir string) error {
		return os.WriteFile(filepath.Join(dir, "pstree.img"), []byte("images of "+id), 0o600)
	}
	e.be.RestoreApp = func(*stage1.AppRestore) (int, error) { return 0, errdefs.FailedPrecondition("not started here") }
	b := e.broker(t)
	ctx := context.Background()
	pid, err := b.RunPod(ctx, podCfg("x"))
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	archives := map[string]string{}
	for name, user := range map[string]string{"named": fakeImage.RepoTags[0], "byid": ""} {
		cfg := ctrCfg(name)
		cfg.Image, cfg.UserImage = fakeImage.ID, user
		cid := startCheckpointable(t, b, pid, cfg)
		archives[name] = filepath.Join(dir, name+".tar")
		if err := b.CheckpointContainer(ctx, cid, archives[name]); err != nil {
			t.Fatal(err)
		}
	}
	ypid, err := b.RunPod(ctx, podCfg("y"))
	if err != nil {
		t.Fatal(err)
	}
	from := func(name string) *ContainerConfig {
		return &ContainerConfig{Metadata: ContainerMetadata{Name: name}, Image: archives[name], LogPath: name + ".log"}
	}
	e.images.mu.Lock()
	e.images.unpulled = true
	e.images.mu.Unlock()
	_, err = b.CreateContainer(ctx, ypid, from("byid"))
	if !errors.Is(err, errdefs.ErrNotFound) || !strings.Contains(err.Error(), "names no reference") {
		t.Errorf("restore of a container whose image has only an ID, not here: %v", err)
	}
	rid, err := b.CreateContainer(ctx, ypid, from("named"))
	if err != nil {
		t.Fatal(err)
	}
	rec, err := b.ContainerStatus(ctx, rid)
	if err != nil || rec.ImageID != fakeImage.ID {
		t.Errorf("restored container: %+v, %v", rec, err)
	}
	e.images.mu.Lock()
	pulls := slices.Clone(e.images.pulls)
	e.images.mu.Unlock()
	if !slices.Equal(pulls, []string{fakeImage.RepoTags[0]}) {
		t.Errorf("pulled %q, want the author's reference once", pulls)
	}
}

// A checkpoint that fills its file system is ResourceExhausted, with
// ENOSPC as its cause, and leaves nothing there.
func TestCheckpointOnAFullFileSystem(t *testing.T) {
	testutil.NeedRoot(t, "mounts a small tmpfs")
	dir := t.TempDir()
	if err := unix.Mount("tmpfs", dir, "tmpfs", 0, "size=256k"); err != nil {
		t.Skipf("tmpfs: %v", err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil {
			t.Errorf("unmount %s: %v", dir, err)
		}
	})
	e := newEnv(t)
	e.criu = func(context.Context) (string, error) { return "criu", nil }
	// Images that fit, beside an archive that cannot: it copies them.
	e.be.SaveApp = func(id string, pid int, dir string) error {
		return os.WriteFile(filepath.Join(dir, "pages-1.img"), make([]byte, 160<<10), 0o600)
	}
	b := e.broker(t)
	ctx := context.Background()
	pid, err := b.RunPod(ctx, podCfg("x"))
	if err != nil {
		t.Fatal(err)
	}
	cid, err := b.CreateContainer(ctx, pid, ctrCfg("c"))
	if err != nil {
		t.Fatal(err)
	}
	if err := b.StartContainer(ctx, cid); err != nil {
		t.Fatal(err)
	}
	rec, err := b.ContainerStatus(ctx, cid)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(rec.Dir, "upper"), 0o755); err != nil { // its writable layer
		t.Fatal(err)
	}
	err = b.CheckpointContainer(ctx, cid, filepath.Join(dir, "c.tar"))
	if !errors.Is(err, errdefs.ErrResourceExhausted) || !errors.Is(err, syscall.ENOSPC) {
		t.Errorf("%v: want ResourceExhausted, with ENOSPC as its cause", err)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 0 {
		t.Errorf("a failed checkpoint left %v", ents)
	}
}

// startCheckpointable creates and starts a container of pod pod with the
// writable layer a checkpoint archive carries (which the fake images do
// not make), and returns its ID.
func startCheckpointable(t *testing.T, b *Broker, pod string, cfg *ContainerConfig) string {
	t.Helper()
	ctx := context.Background()
	id, err := b.CreateContainer(ctx, pod, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.StartContainer(ctx, id); err != nil {
		t.Fatal(err)
	}
	st, err := b.ContainerStatus(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(st.Dir, "upper"), 0o755); err != nil {
		t.Fatal(err)
	}
	return id
}
