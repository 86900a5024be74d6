package checkpoint

import (
	"archive/tar"
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stagelet/stagelet/errdefs"
)

// checkpointctlVersion is the checkpointctl whose `show` must read the
// archives Write makes (go run fetches it through the module proxy).
const checkpointctlVersion = "github.com/checkpoint-restore/checkpointctl@v1.4.0"

func testContainer() *Container {
	return &Container{
		ID: "0123456789abcdef0123", Name: "counter", Pod: "web", Namespace: "shop",
		Image: "registry.test/busybox:latest", ImageID: "sha256:feed", Stage1: "nspawn",
		Args: []string{"sh", "-c", "i=0; while :; do i=$((i+1)); sleep 1; done"}, Env: []string{"PATH=/bin"}, Cwd: "/",
		Created: time.Date(2026, 11, 26, 1, 2, 3, 0, time.UTC), Config: json.RawMessage(`{"metadata":{"name":"counter"}}`),
	}
}

// writeTestArchive writes an archive of a container whose layer adds
// /etc/motd and whose CRIU images are two files.
func writeTestArchive(t *testing.T) (string, *Container) {
	t.Helper()
	dir := t.TempDir()
	layer := filepath.Join(dir, "ctr")
	if err := os.MkdirAll(filepath.Join(layer, "upper", "etc"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(layer, "upper", "etc", "motd"), []byte("hello\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	images := filepath.Join(dir, "images")
	if err := os.Mkdir(images, 0o700); err != nil {
		t.Fatal(err)
	}
	for _, n := range []string{"pstree.img", "pages-1.img", "dump.log"} {
		if err := os.WriteFile(filepath.Join(images, n), []byte("image "+n), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	c := testContainer()
	archive := filepath.Join(dir, "out", "counter.tar")
	if err := os.Mkdir(filepath.Dir(archive), 0o755); err != nil {
		t.Fatal(err)
	}
	size, err := Write(archive, c, layer, images)
	if err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(archive); err != nil || fi.Size() != size {
		t.Fatalf("archive: %v, size %d, Write said %d", err, fi.Size(), size)
	}
	if ents, _ := os.ReadDir(filepath.Dir(archive)); len(ents) != 1 {
		t.Errorf("Write left files beside the archive: %v", ents)
	}
	return archive, c
}

func TestWriteRead(t *testing.T) {
	archive, c := writeTestArchive(t)
	dir := t.TempDir()
	got, err := Read(archive, dir)
	if err != nil {
		t.Fatal(err)
	}
	var config bytes.Buffer
	if err := json.Compact(&config, got.Config); err != nil {
		t.Fatal(err)
	}
	if got.ID != c.ID || got.Name != c.Name || got.Stage1 != c.Stage1 || !slices.Equal(got.Args, c.Args) ||
		!got.Created.Equal(c.Created) || got.Checkpointed.IsZero() || config.String() != string(c.Config) {
		t.Errorf("read back %+v, wrote %+v", got, c)
	}
	for n, want := range map[string]string{"checkpoint/pstree.img": "image pstree.img", "checkpoint/pages-1.img": "image pages-1.img", DumpLog: "image dump.log", DeletedFiles: "[]"} {
		if b, err := os.ReadFile(filepath.Join(dir, n)); err != nil || string(b) != want {
			t.Errorf("%s: %q, %v; want %q", n, b, err, want)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, ImagesDir, DumpLog)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("criu's log among the images: %v", err)
	}
	// The layer is an OCI layer holding the container's file.
	f, err := os.Open(filepath.Join(dir, RootfsDiff))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var names []string
	tr := tar.NewReader(f)
	for {
		hdr, err := tr.Next()
		if err != nil {
			break
		}
		names = append(names, hdr.Name)
	}
	if !slices.Equal(names, []string{"etc/", "etc/motd"}) {
		t.Errorf("layer entries %q", names)
	}
	var spec struct {
		Annotations map[string]string `json:"annotations"`
	}
	b, _ := os.ReadFile(filepath.Join(dir, SpecDump))
	if err := json.Unmarshal(b, &spec); err != nil || spec.Annotations["io.kubernetes.cri.sandbox-name"] != "web" {
		t.Errorf("spec.dump: %s, %v", b, err)
	}
}

// checkpointctl, the tool CRI-O and containerd users inspect checkpoints
// with, reads the archive.
func TestCheckpointctlShow(t *testing.T) {
	archive, c := writeTestArchive(t)
	gobin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("needs the go command to run checkpointctl")
	}
	cmd := exec.Command(gobin, "run", checkpointctlVersion, "show", archive)
	cmd.Dir = t.TempDir()
	cmd.Env = append(os.Environ(), "TMPDIR="+t.TempDir())
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("checkpointctl show: %v\n%s", err, out)
	}
	t.Logf("checkpointctl show:\n%s", out)
	for _, want := range []string{c.Name, c.Image, c.ID[:12], "stagelet-nspawn", "2026-11-26T01:02:03Z"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("checkpointctl show lacks %q:\n%s", want, out)
		}
	}
}

// An archive with anything but its own entries is refused, and nothing
// is written out of the directory.
func TestReadRefuses(t *testing.T) {
	for name, entry := range map[string]tar.Header{
		"escape":   {Typeflag: tar.TypeReg, Name: "../escape", Mode: 0o644},
		"nested":   {Typeflag: tar.TypeReg, Name: "checkpoint/a/b", Mode: 0o644},
		"symlink":  {Typeflag: tar.TypeSymlink, Name: "checkpoint/link", Linkname: "/etc/passwd"},
		"unknown":  {Typeflag: tar.TypeReg, Name: "run.sh", Mode: 0o755},
		"absolute": {Typeflag: tar.TypeReg, Name: "/etc/cron.d/x", Mode: 0o644},
	} {
		t.Run(name, func(t *testing.T) {
			var buf bytes.Buffer
			tw := tar.NewWriter(&buf)
			if err := tw.WriteHeader(&entry); err != nil {
				t.Fatal(err)
			}
			tw.Close()
			top := t.TempDir()
			archive := filepath.Join(top, "a.tar")
			if err := os.WriteFile(archive, buf.Bytes(), 0o600); err != nil {
				t.Fatal(err)
			}
			dir := filepath.Join(top, "x")
			if err := os.Mkdir(dir, 0o700); err != nil {
				t.Fatal(err)
			}
			if _, err := Read(archive, dir); !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Errorf("Read: %v, want InvalidArgument", err)
			}
			if _, err := os.Lstat(filepath.Join(top, "escape")); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("written outside: %v", err)
			}
		})
	}
	if _, err := Read(filepath.Join(t.TempDir(), "none.tar"), t.TempDir()); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("missing archive: %v", err)
	}
	// An archive of another runtime, without stagelet's record.
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: ConfigDump, Size: 2, Mode: 0o644})
	tw.Write([]byte("{}"))
	tw.Close()
	archive := filepath.Join(t.TempDir(), "other.tar")
	os.WriteFile(archive, buf.Bytes(), 0o600)
	if _, err := Read(archive, t.TempDir()); !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "stagelet.dump") {
		t.Errorf("foreign archive: %v", err)
	}
}

// fullDisk takes room bytes, then fails every write with ENOSPC.
type fullDisk struct{ room int }

func (d *fullDisk) Write(b []byte) (int, error) {
	if len(b) <= d.room {
		d.room -= len(b)
		return len(b), nil
	}
	n := d.room
	d.room = 0
	return n, syscall.ENOSPC
}

// An entry that meets a full file system says so to errors.Is, for the
// CRI to answer ResourceExhausted (errdefs.Storage).
func TestWriteEntryKeepsENOSPC(t *testing.T) {
	tw := tar.NewWriter(&fullDisk{room: 512}) // the header's block
	body := strings.Repeat("x", 4096)
	err := writeEntry(tw, "big", int64(len(body)), time.Now(), strings.NewReader(body))
	if !errors.Is(err, syscall.ENOSPC) {
		t.Errorf("%v: ENOSPC lost", err)
	}
	// A file that shrank while it was read is an error too.
	tw = tar.NewWriter(&bytes.Buffer{})
	err = writeEntry(tw, "shrank", 10, time.Now(), strings.NewReader("short"))
	if err == nil || !strings.Contains(err.Error(), "wrote 5 of 10 bytes") {
		t.Errorf("a short entry: %v", err)
	}
}
