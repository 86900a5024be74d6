package image

import (
	"context"
	"errors"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"

	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/test/testregistry"
)

func newStore(t testing.TB, cfg Config) *Store {
	t.Helper()
	s, err := NewStore(filepath.Join(t.TempDir(), "images"), cfg, discard)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func pullCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

func ids(t testing.TB, img v1.Image) (id, manifest string) {
	t.Helper()
	c, err := img.ConfigName()
	if err != nil {
		t.Fatal(err)
	}
	m, err := img.Digest()
	if err != nil {
		t.Fatal(err)
	}
	return c.String(), m.String()
}

func TestPullAndGet(t *testing.T) {
	r := testregistry.Start(t)
	ref := r.PushBusybox(t, "busybox", "latest")
	s := newStore(t, Config{})
	img, err := s.Pull(pullCtx(t), ref, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	wantID, wantManifest := ids(t, testregistry.BusyboxImage(t))
	if img.ID != wantID {
		t.Fatalf("ID = %s, want %s", img.ID, wantID)
	}
	if want := []string{r.Host + "/busybox:latest"}; !slices.Equal(img.RepoTags, want) {
		t.Errorf("RepoTags = %v, want %v", img.RepoTags, want)
	}
	digestRef := r.Host + "/busybox@" + wantManifest
	if want := []string{digestRef}; !slices.Equal(img.RepoDigests, want) {
		t.Errorf("RepoDigests = %v, want %v", img.RepoDigests, want)
	}
	if img.Size == 0 || len(img.Layers) != 1 {
		t.Errorf("Size %d, layers %v", img.Size, img.Layers)
	}
	if !slices.Equal(img.Config.Cmd, []string{"sh"}) || img.Config.WorkingDir != "/" || !slices.Equal(img.Config.Env, []string{testregistry.DefaultPath}) {
		t.Errorf("config = %+v", img.Config)
	}
	hex := strings.TrimPrefix(wantID, "sha256:")
	for _, q := range []string{wantID, hex, hex[:12], "sha256:" + hex[:12], ref, digestRef} {
		got, err := s.Get(q)
		if err != nil || got.ID != wantID {
			t.Errorf("Get(%q) = %v, %v", q, got, err)
		}
	}
	for _, q := range []string{"busybox", "sha256:" + strings.Repeat("0", 64), hex[:11], r.Host + "/busybox:other", "::bad::"} {
		if _, err := s.Get(q); !errors.Is(err, errdefs.ErrNotFound) {
			t.Errorf("Get(%q) error = %v, want ErrNotFound", q, err)
		}
	}
	layer := s.layerPath(img.Layers[0])
	if fi, err := os.Stat(filepath.Join(layer, "bin/busybox")); err != nil || fi.Mode().Perm() != 0o755 {
		t.Errorf("bin/busybox: %v %v", fi, err)
	}
	if target, err := os.Readlink(filepath.Join(layer, "bin/sh")); err != nil || target != "busybox" {
		t.Errorf("bin/sh -> %q, %v", target, err)
	}
	if l := s.List(); len(l) != 1 || l[0].ID != wantID {
		t.Errorf("List = %v", l)
	}
	if b, n, err := s.Usage(); err != nil || b < 1<<20 || n < 100 {
		t.Errorf("Usage = %d bytes, %d inodes, %v", b, n, err)
	}

	// The records survive a restart, and a corrupt record does not stop it.
	if err := os.WriteFile(filepath.Join(s.imagesDir(), strings.Repeat("a", 64)+".json"), []byte("{garbage"), 0o600); err != nil {
		t.Fatal(err)
	}
	s2, err := NewStore(s.Root(), Config{}, discard)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := s2.Get(ref); err != nil || got.ID != wantID || !slices.Equal(got.RepoDigests, img.RepoDigests) {
		t.Errorf("after reload Get = %+v, %v", got, err)
	}
}

func TestNormalize(t *testing.T) {
	for in, want := range map[string]string{
		"busybox":                             "docker.io/library/busybox:latest",
		"busybox:1.36":                        "docker.io/library/busybox:1.36",
		"docker.io/library/busybox":           "docker.io/library/busybox:latest",
		"index.docker.io/foo/bar:v1":          "docker.io/foo/bar:v1",
		"registry.k8s.io/pause:3.10":          "registry.k8s.io/pause:3.10",
		"127.0.0.1:5000/busybox":              "127.0.0.1:5000/busybox:latest",
		"127.0.0.1:5000/a/b@sha256:" + hex64a: "127.0.0.1:5000/a/b@sha256:" + hex64a,
	} {
		got, err := normalize(in)
		if err != nil || got != want {
			t.Errorf("normalize(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
}

var hex64a = strings.Repeat("a", 64)

func TestPullTwiceIsCheap(t *testing.T) {
	r := testregistry.Start(t)
	ref := r.PushBusybox(t, "busybox", "latest")
	s := newStore(t, Config{})
	first, err := s.Pull(pullCtx(t), ref, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	unpacks, blobs := s.unpacks.Load(), r.BlobGets()
	if unpacks != 1 {
		t.Fatalf("unpacks = %d, want 1", unpacks)
	}
	second, err := s.Pull(pullCtx(t), ref, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if second.ID != first.ID || s.unpacks.Load() != unpacks || r.BlobGets() != blobs {
		t.Errorf("second pull: id %s, unpacks %d→%d, blob GETs %d→%d", second.ID, unpacks, s.unpacks.Load(), blobs, r.BlobGets())
	}
	// The same image under another tag is recorded without a download.
	ref2 := r.PushBusybox(t, "busybox", "v2")
	blobs = r.BlobGets()
	third, err := s.Pull(pullCtx(t), ref2, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if third.ID != first.ID || len(third.RepoTags) != 2 || r.BlobGets() != blobs {
		t.Errorf("other tag: %+v, blob GETs %d→%d", third, blobs, r.BlobGets())
	}
}

func TestPullIndexPicksPlatform(t *testing.T) {
	r := testregistry.Start(t)
	ref := r.PushIndex(t, "multi", "latest")
	s := newStore(t, Config{})
	img, err := s.Pull(pullCtx(t), ref, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	want := testregistry.BusyboxImage(t)
	if platform.Architecture == "arm64" {
		want = testregistry.ArmImage(t)
	}
	id, _ := ids(t, want)
	if img.ID != id {
		t.Fatalf("ID = %s, want %s (%s)", img.ID, id, platform.Architecture)
	}
	// The repo digest is the index's, so pulling by it finds the image.
	if len(img.RepoDigests) != 1 {
		t.Fatalf("RepoDigests = %v", img.RepoDigests)
	}
	if got, err := s.Get(img.RepoDigests[0]); err != nil || got.ID != id {
		t.Errorf("Get(%s) = %v, %v", img.RepoDigests[0], got, err)
	}
	byDigest, err := s.Pull(pullCtx(t), img.RepoDigests[0], nil, nil)
	if err != nil || byDigest.ID != id || s.unpacks.Load() != 1 {
		t.Errorf("pull by index digest: %v, %v, unpacks %d", byDigest, err, s.unpacks.Load())
	}
}

func TestPullThroughMirror(t *testing.T) {
	mirror := testregistry.Start(t)
	mirror.PushBusybox(t, "team/busybox", "1")
	upstream := testregistry.Start(t)
	upstream.PushBusybox(t, "team/busybox", "1")

	t.Run("unreachable upstream", func(t *testing.T) {
		s := newStore(t, Config{Registries: map[string]RegistryHost{
			"upstream.invalid": {Mirrors: []string{"127.0.0.1:1", "http://" + mirror.Host + "/"}},
		}})
		img, err := s.Pull(pullCtx(t), "upstream.invalid/team/busybox:1", nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		if want := []string{"upstream.invalid/team/busybox:1"}; !slices.Equal(img.RepoTags, want) {
			t.Errorf("RepoTags = %v, want %v", img.RepoTags, want)
		}
		if _, err := s.Get("upstream.invalid/team/busybox:1"); err != nil {
			t.Error(err)
		}
	})
	t.Run("upstream not contacted", func(t *testing.T) {
		s := newStore(t, Config{Registries: map[string]RegistryHost{
			upstream.Host: {Mirrors: []string{mirror.Host}},
		}})
		before, mirrorBefore := upstream.Requests(), mirror.Requests()
		if _, err := s.Pull(pullCtx(t), upstream.Host+"/team/busybox:1", nil, nil); err != nil {
			t.Fatal(err)
		}
		if upstream.Requests() != before || mirror.Requests() == mirrorBefore {
			t.Errorf("upstream requests %d→%d, mirror %d→%d", before, upstream.Requests(), mirrorBefore, mirror.Requests())
		}
	})
	t.Run("all mirrors fail", func(t *testing.T) {
		s := newStore(t, Config{Registries: map[string]RegistryHost{
			"upstream.invalid": {Mirrors: []string{"http://" + mirror.Host}},
		}})
		_, err := s.Pull(pullCtx(t), "upstream.invalid/team/missing:1", nil, nil)
		if !errors.Is(err, errdefs.ErrNotFound) || !strings.Contains(err.Error(), "upstream.invalid/team/missing:1") {
			t.Errorf("err = %v, want ErrNotFound naming the ref", err)
		}
	})
}

func TestPullInsecure(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.2:0")
	if err != nil {
		t.Skipf("cannot listen on 127.0.0.2: %v", err)
	}
	ln.Close()
	r := testregistry.StartAddr(t, "127.0.0.2:0")
	ref := r.PushBusybox(t, "busybox", "latest")

	_, err = newStore(t, Config{}).Pull(pullCtx(t), ref, nil, nil)
	if !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("pull over HTTPS from an HTTP registry: err = %v, want ErrUnavailable", err)
	}
	s := newStore(t, Config{Registries: map[string]RegistryHost{r.Host: {Insecure: true}}})
	if _, err := s.Pull(pullCtx(t), ref, nil, nil); err != nil {
		t.Fatalf("insecure pull: %v", err)
	}
}

func TestPullErrors(t *testing.T) {
	r := testregistry.Start(t)
	r.PushBusybox(t, "busybox", "latest")
	s := newStore(t, Config{})
	for _, tc := range []struct {
		ref  string
		want error
	}{
		{"UPPER::bad", errdefs.ErrInvalidArgument},
		{r.Host + "/busybox:missing", errdefs.ErrNotFound},
		{r.Host + "/nothing:latest", errdefs.ErrNotFound},
		{"127.0.0.1:1/busybox:latest", errdefs.ErrUnavailable},
	} {
		_, err := s.Pull(pullCtx(t), tc.ref, nil, nil)
		if !errors.Is(err, tc.want) || !strings.Contains(err.Error(), tc.ref) {
			t.Errorf("Pull(%q) = %v, want class %v naming the ref", tc.ref, err, tc.want)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := s.Pull(ctx, r.Host+"/busybox:latest", nil, nil)
	if !errors.Is(err, context.Canceled) || errors.Is(err, errdefs.ErrUnavailable) || errors.Is(err, errdefs.ErrDeadlineExceeded) {
		t.Errorf("pull with a canceled context = %v, want context.Canceled and no class", err)
	}
}

func TestPullHostile(t *testing.T) {
	r := testregistry.Start(t)
	ref := r.PushHostile(t, "hostile", "v1")
	base := t.TempDir()
	s, err := NewStore(filepath.Join(base, "store"), Config{}, discard)
	if err != nil {
		t.Fatal(err)
	}
	_, err = s.Pull(pullCtx(t), ref, nil, nil)
	if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), testregistry.HostileEscapeName) || !strings.Contains(err.Error(), ref) {
		t.Fatalf("err = %v, want ErrInvalidArgument naming the entry and the ref", err)
	}
	// "../../x" from layers/.tmp-* is the store root; from the root's
	// parent, the test's temp dir.
	for _, p := range []string{
		filepath.Join(s.Root(), testregistry.HostileEscapeName),
		filepath.Join(base, testregistry.HostileEscapeName),
		"/tmp/" + testregistry.HostileEscapeName + "-symlink",
	} {
		if _, err := os.Lstat(p); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s exists (err %v)", p, err)
		}
	}
	ents, _ := os.ReadDir(s.layersDir())
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), ".") {
			t.Errorf("left behind: %s", e.Name())
		}
	}
	if len(s.List()) != 0 {
		t.Errorf("a hostile image was recorded: %v", s.List())
	}
}

func TestRemoveAndGC(t *testing.T) {
	r := testregistry.Start(t)
	refA := r.PushBusybox(t, "busybox", "a")
	refB := r.Push(t, "other", "b", testregistry.WithConfig(testregistry.BusyboxImage(t), []string{"/bin/sh"}, []string{"-c", "true"}, "app"))
	s := newStore(t, Config{})
	a, err := s.Pull(pullCtx(t), refA, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	b, err := s.Pull(pullCtx(t), refB, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if a.ID == b.ID || !slices.Equal(a.Layers, b.Layers) || s.unpacks.Load() != 1 {
		t.Fatalf("a %s b %s layers %v %v unpacks %d", a.ID, b.ID, a.Layers, b.Layers, s.unpacks.Load())
	}
	if b.Config.User != "app" {
		t.Errorf("user = %q", b.Config.User)
	}
	layer := s.layerPath(a.Layers[0])
	if err := s.Remove(t.Context(), refA); err != nil {
		t.Fatal(err)
	}
	if err := s.Remove(t.Context(), refA); err != nil {
		t.Fatalf("second Remove: %v", err)
	}
	if err := s.Remove(t.Context(), a.ID); err != nil {
		t.Fatalf("Remove by ID of a removed image: %v", err)
	}
	if _, err := s.Get(refA); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("Get after Remove: %v", err)
	}
	if _, err := os.Stat(layer); err != nil {
		t.Fatalf("shared layer collected while in use: %v", err)
	}
	if err := s.Remove(t.Context(), b.ID[:19]); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(layer); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("unused layer not collected: %v", err)
	}
	if ents, _ := os.ReadDir(s.blobDir()); len(ents) != 0 {
		t.Errorf("unused blobs left: %d", len(ents))
	}
	if ents, _ := os.ReadDir(s.imagesDir()); len(ents) != 0 {
		t.Errorf("records left: %d", len(ents))
	}
}

func TestConcurrentPull(t *testing.T) {
	r := testregistry.Start(t)
	ref := r.PushBusybox(t, "busybox", "latest")
	s := newStore(t, Config{})
	var wg sync.WaitGroup
	errs := make([]error, 4)
	got := make([]*Image, 4)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			got[i], errs[i] = s.Pull(pullCtx(t), ref, nil, nil)
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("pull %d: %v", i, err)
		}
		if got[i].ID != got[0].ID {
			t.Fatalf("different IDs")
		}
	}
	if n := s.unpacks.Load(); n != 1 {
		t.Errorf("layer unpacked %d times", n)
	}
	if l := s.List(); len(l) != 1 || len(l[0].RepoTags) != 1 {
		t.Errorf("List = %+v", l)
	}
}

func BenchmarkPullCached(b *testing.B) {
	r := testregistry.Start(b)
	ref := r.PushBusybox(b, "busybox", "latest")
	s := newStore(b, Config{})
	ctx := context.Background()
	if _, err := s.Pull(ctx, ref, nil, nil); err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	for b.Loop() {
		if _, err := s.Pull(ctx, ref, nil, nil); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkPullFresh(b *testing.B) {
	r := testregistry.Start(b)
	ref := r.PushBusybox(b, "busybox", "latest")
	ctx := context.Background()
	for b.Loop() {
		s := newStore(b, Config{})
		if _, err := s.Pull(ctx, ref, nil, nil); err != nil {
			b.Fatal(err)
		}
	}
}
