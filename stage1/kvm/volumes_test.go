package kvm

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"testing"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/errdefs"
)

func TestReadTree(t *testing.T) {
	dir := t.TempDir()
	ts := "..2026_11_28_20_00_00.123"
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.Mkdir(filepath.Join(dir, ts), 0o755))
	must(os.WriteFile(filepath.Join(dir, ts, "key"), []byte("value"), 0o600))
	must(os.Symlink(ts, filepath.Join(dir, "..data")))
	must(os.Symlink("..data/key", filepath.Join(dir, "key")))
	must(os.Symlink("/etc/passwd", filepath.Join(dir, "out")))
	tree, err := readTree("copy-x", dir)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for _, e := range tree.Entries {
		switch {
		case e.Mode.IsDir():
			got[e.Path] = "dir"
		case e.Mode&fs.ModeSymlink != 0:
			got[e.Path] = "-> " + e.Link
		default:
			got[e.Path] = string(e.Data)
			if e.Mode.Perm() != 0o600 {
				t.Errorf("%s: mode %v", e.Path, e.Mode)
			}
		}
	}
	want := map[string]string{".": "dir", ts: "dir", ts + "/key": "value", "..data": "-> " + ts, "key": "-> ..data/key", "out": "-> /etc/passwd"}
	if len(got) != len(want) {
		t.Fatalf("got %v, want %v", got, want)
	}
	for k, v := range want {
		if got[k] != v {
			t.Fatalf("%s: got %q, want %q (the link's target is not read)", k, got[k], v)
		}
	}
	if tree.Entries[0].Path != "." {
		t.Fatal("the root is not first")
	}

	// A fifo is not copied.
	must(syscall.Mkfifo(filepath.Join(dir, "fifo"), 0o644))
	if _, err := readTree("copy-x", dir); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("a fifo: got %v, want FailedPrecondition", err)
	}

	// A single file.
	f := filepath.Join(t.TempDir(), "etc-hosts")
	must(os.WriteFile(f, []byte("127.0.0.1 localhost\n"), 0o644))
	tree, err = readTree("copy-h", f)
	if err != nil || len(tree.Entries) != 1 || tree.Entries[0].Path != "." || string(tree.Entries[0].Data) != "127.0.0.1 localhost\n" {
		t.Fatalf("a file: %+v, %v", tree, err)
	}
}

func TestPodVolumesRecord(t *testing.T) {
	dir := t.TempDir()
	p := &Pod{st: &state{}, log: testLogger(t)}
	p.vols = newPodVolumes(dir, p.log, nil)
	mounts := []api.Mount{
		{Source: "/srv/data", Destination: "/data"},
		{Source: "/k/pods/u/volumes/kubernetes.io~empty-dir/c", Destination: "/cache"},
		{Source: "/k/pods/u/containers/app/1", Destination: "/dev/termination-log"},
	}
	ways := []mountWay{{Kind: api.MountPath}, {Kind: api.MountGuest}, {Kind: api.MountMessage, Source: "/k/pods/u/containers/app/1"}}
	p.recordContainer("c1", mounts, ways)
	p.recordContainer("c2", mounts[1:2], ways[1:2])
	want := []string{"c1: /srv/data on /data"}
	if got := p.SharedMounts(); !slices.Equal(got, want) {
		t.Fatalf("shared mounts: %v, want %v", got, want)
	}
	// A restarted daemon reads them back.
	q := &Pod{st: &state{}, log: p.log}
	q.vols = newPodVolumes(dir, p.log, nil)
	q.vols.load()
	if got := q.SharedMounts(); !slices.Equal(got, want) {
		t.Fatalf("shared mounts after a restart: %v, want %v", got, want)
	}
	if q.vols.rec.Messages["c1"] != "/k/pods/u/containers/app/1" {
		t.Fatalf("messages after a restart: %v", q.vols.rec.Messages)
	}
	q.forgetContainer("c1")
	if got := q.SharedMounts(); len(got) != 0 {
		t.Fatalf("shared mounts of a removed container: %v", got)
	}
}
