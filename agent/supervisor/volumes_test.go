package supervisor

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/errdefs"
)

// volumeAgent is an agent with only what its guest volumes need.
func volumeAgent(t *testing.T) *Agent {
	dir := t.TempDir()
	return &Agent{dir: filepath.Join(dir, "state"), apps: map[string]*app{}}
}

// atomicWriterTree is a volume as the kubelet's atomic writer lays it
// out: ..<ts>/<key>, ..data -> ..<ts>, <key> -> ..data/<key>.
func atomicWriterTree(name, ts string, kv map[string]string) *api.FileTree {
	uid, gid := uint32(os.Getuid()), uint32(os.Getgid())
	t := &api.FileTree{Name: name, Entries: []api.FileEntry{
		{Path: ".", Mode: fs.ModeDir | fs.ModeSticky | 0o777, UID: uid, GID: gid},
		{Path: ts, Mode: fs.ModeDir | 0o755, UID: uid, GID: gid},
	}}
	for k, v := range kv {
		t.Entries = append(t.Entries, api.FileEntry{Path: ts + "/" + k, Mode: 0o640, UID: uid, GID: gid, Data: []byte(v)})
	}
	t.Entries = append(t.Entries, api.FileEntry{Path: "..data", Mode: fs.ModeSymlink | 0o777, UID: uid, GID: gid, Link: ts})
	for k := range kv {
		t.Entries = append(t.Entries, api.FileEntry{Path: k, Mode: fs.ModeSymlink | 0o777, UID: uid, GID: gid, Link: "..data/" + k})
	}
	return t
}

func readKey(t *testing.T, dir, key string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, key))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestPutFilesAtomicWriterLayout(t *testing.T) {
	a := volumeAgent(t)
	if err := a.putFiles(atomicWriterTree("copy-1", "..2026_11_28_20_00_00.1", map[string]string{"a": "one", "b": "bee"})); err != nil {
		t.Fatal(err)
	}
	top := filepath.Join(a.volumesDir(), "copy-1")
	if got := readKey(t, top, "a"); got != "one" {
		t.Fatalf("a = %q", got)
	}
	if l, _ := os.Readlink(filepath.Join(top, "a")); l != "..data/a" {
		t.Fatalf("a links to %q", l)
	}
	st, err := os.Stat(filepath.Join(top, "..data", "a"))
	if err != nil || st.Mode().Perm() != 0o640 {
		t.Fatalf("mode of a: %v, %v", st.Mode(), err)
	}
	if st, err := os.Stat(top); err != nil || st.Mode()&fs.ModeSticky == 0 || st.Mode().Perm() != 0o777 {
		t.Fatalf("mode of the volume: %v, %v", st.Mode(), err)
	}

	// The kubelet's update: a new timestamped directory, ..data swapped,
	// key b gone, key c new.
	topStat, _ := os.Stat(top)
	if err := a.putFiles(atomicWriterTree("copy-1", "..2026_11_28_20_01_00.2", map[string]string{"a": "two", "c": "sea"})); err != nil {
		t.Fatal(err)
	}
	if got := readKey(t, top, "a"); got != "two" {
		t.Fatalf("a = %q after the update", got)
	}
	if got := readKey(t, top, "c"); got != "sea" {
		t.Fatalf("c = %q after the update", got)
	}
	ents, _ := os.ReadDir(top)
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	if want := "..2026_11_28_20_01_00.2 ..data a c"; strings.Join(names, " ") != want {
		t.Fatalf("the volume holds %v, want %s", names, want)
	}
	// The directory apps bind stays the same one.
	if now, _ := os.Stat(top); !os.SameFile(topStat, now) {
		t.Fatal("the volume's directory was replaced")
	}
}

func TestPutFilesNeverHalfDone(t *testing.T) {
	a := volumeAgent(t)
	tree := func(i int) *api.FileTree {
		v := strings.Repeat(string(rune('a'+i%2)), 1000)
		return atomicWriterTree("copy-2", "..ts"+string(rune('0'+i%10)), map[string]string{"k": v, "l": v})
	}
	if err := a.putFiles(tree(0)); err != nil {
		t.Fatal(err)
	}
	top := filepath.Join(a.volumesDir(), "copy-2")
	var stop atomic.Bool
	var wg sync.WaitGroup
	var bad atomic.Value
	wg.Add(1)
	go func() {
		defer wg.Done()
		for !stop.Load() {
			// Both keys through one ..data: the same version.
			d, err := os.Readlink(filepath.Join(top, "..data"))
			if err != nil {
				bad.Store(err.Error())
				return
			}
			k, err1 := os.ReadFile(filepath.Join(top, d, "k"))
			l, err2 := os.ReadFile(filepath.Join(top, d, "l"))
			if err1 == nil && err2 == nil && (len(k) != 1000 || string(k) != string(l)) {
				bad.Store("k and l differ")
				return
			}
			if b, err := os.ReadFile(filepath.Join(top, "k")); err == nil && len(b) != 1000 {
				bad.Store("a short k")
				return
			}
		}
	}()
	for i := 1; i < 50; i++ {
		if err := a.putFiles(tree(i)); err != nil {
			t.Fatal(err)
		}
	}
	stop.Store(true)
	wg.Wait()
	if b := bad.Load(); b != nil {
		t.Fatal(b)
	}
}

func TestPutFilesRefusesEscapes(t *testing.T) {
	a := volumeAgent(t)
	outside := filepath.Join(filepath.Dir(a.dir), "outside")
	for _, tree := range []*api.FileTree{
		{Name: "../outside", Entries: []api.FileEntry{{Path: ".", Mode: fs.ModeDir | 0o755}}},
		{Name: "v", Entries: []api.FileEntry{{Path: ".", Mode: fs.ModeDir | 0o755}, {Path: "../outside", Mode: 0o644}}},
		{Name: "v", Entries: []api.FileEntry{{Path: ".", Mode: fs.ModeDir | 0o755}, {Path: "l", Mode: fs.ModeSymlink, Link: outside}, {Path: "l/x", Mode: 0o644}}},
		nil,
	} {
		if err := a.putFiles(tree); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Fatalf("%+v: got %v, want InvalidArgument", tree, err)
		}
	}
	if _, err := os.Lstat(outside); err == nil {
		t.Fatal("a file was written outside the volumes")
	}
}

func TestPutFilesFileVolume(t *testing.T) {
	a := volumeAgent(t)
	put := func(s string) {
		t.Helper()
		if err := a.putFiles(&api.FileTree{Name: "hosts", Entries: []api.FileEntry{{Path: ".", Mode: 0o644, UID: uint32(os.Getuid()), GID: uint32(os.Getgid()), Data: []byte(s)}}}); err != nil {
			t.Fatal(err)
		}
	}
	put("127.0.0.1 localhost\n10.0.0.1 a-long-name\n")
	p := filepath.Join(a.volumesDir(), "hosts")
	before, _ := os.Stat(p)
	put("127.0.0.1 localhost\n")
	if b, _ := os.ReadFile(p); string(b) != "127.0.0.1 localhost\n" {
		t.Fatalf("hosts = %q", b)
	}
	// Apps bind the file itself: it is the same file.
	if now, _ := os.Stat(p); !os.SameFile(before, now) {
		t.Fatal("the file was replaced")
	}
}

func TestResolveGuestMounts(t *testing.T) {
	a := volumeAgent(t)
	spec := &api.AppSpec{ID: "c1", Mounts: []api.Mount{
		{Source: "/host/path", Destination: "/p"},
		{Kind: api.MountGuest, Source: "guest-1", Destination: "/cache", Mode: 0o2777, GID: uint32(os.Getgid()), UID: uint32(os.Getuid())},
		{Kind: api.MountMessage, Source: "message-1", Destination: "/dev/termination-log"},
	}}
	if err := a.resolveGuestMounts(spec); err != nil {
		t.Fatal(err)
	}
	if spec.Mounts[0].Source != "/host/path" {
		t.Fatalf("a path mount moved: %s", spec.Mounts[0].Source)
	}
	st, err := os.Stat(spec.Mounts[1].Source)
	if err != nil || !st.IsDir() || st.Mode().Perm() != 0o777 || st.Mode()&fs.ModeSetgid == 0 {
		t.Fatalf("the guest directory: %v, %v", st, err)
	}
	if err := os.WriteFile(spec.Mounts[2].Source, []byte(strings.Repeat("x", api.MaxTerminationMessage)+"the end"), 0o644); err != nil {
		t.Fatal(err)
	}
	a.apps["c1"] = &app{id: "c1", spec: spec}
	msg, err := a.terminationMessage("c1")
	if err != nil || len(msg) != api.MaxTerminationMessage || !strings.HasSuffix(string(msg), "the end") {
		t.Fatalf("termination message: %d bytes, %v", len(msg), err)
	}
	// The same guest directory for a second app.
	spec2 := &api.AppSpec{ID: "c2", Mounts: []api.Mount{{Kind: api.MountGuest, Source: "guest-1", Destination: "/cache"}}}
	if err := a.resolveGuestMounts(spec2); err != nil || spec2.Mounts[0].Source != spec.Mounts[1].Source {
		t.Fatalf("second app: %v, %s", err, spec2.Mounts[0].Source)
	}
	// A copied directory is mounted read-only only.
	if err := a.putFiles(atomicWriterTree("copy-3", "..ts", map[string]string{"k": "v"})); err != nil {
		t.Fatal(err)
	}
	if err := a.resolveGuestMounts(&api.AppSpec{ID: "c4", Mounts: []api.Mount{{Kind: api.MountCopy, Source: "copy-3", Destination: "/c", Readonly: true}}}); err != nil {
		t.Fatal(err)
	}
	for _, m := range []api.Mount{
		{Kind: api.MountCopy, Source: "copy-3", Destination: "/c"},
		{Kind: api.MountCopy, Source: "not-put", Destination: "/c"},
		{Kind: api.MountGuest, Source: "../x", Destination: "/c"},
		{Kind: "other", Source: "x", Destination: "/c"},
	} {
		err := a.resolveGuestMounts(&api.AppSpec{ID: "c3", Mounts: []api.Mount{m}})
		if !errors.Is(err, errdefs.ErrFailedPrecondition) && !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Fatalf("%+v: got %v", m, err)
		}
	}
}
