// Package testregistry provides test fixtures shared by the unit and
// end-to-end tests of stagelet: an in-process OCI registry (the real
// go-containerregistry registry, served over plain HTTP on a loopback
// address) and deterministic images built from Debian's busybox-static.
//
// Everything here is for tests: every function takes a testing.TB, fails the
// test on error and registers its cleanup with t.Cleanup.
package testregistry

import (
	"archive/tar"
	"bytes"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// BusyboxPath is the static busybox binary the busybox image is built from.
const BusyboxPath = "/bin/busybox"

// DefaultPath is the PATH of the busybox image's config.
const DefaultPath = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// epoch is the fixed modification time of every fixture entry, so that images
// built twice have the same digests.
var epoch = time.Date(2024, 1, 1, 0, 0, 0, 0, time.UTC)

// Registry is a running registry. Host is "127.0.0.1:PORT" (or the address
// given to StartAddr) and is how references name it.
type Registry struct {
	Host string

	blobGets     atomic.Int64
	manifestGets atomic.Int64
	requests     atomic.Int64
}

// Start starts a registry on 127.0.0.1 with a free port. It is stopped by
// t.Cleanup.
func Start(t testing.TB) *Registry {
	return StartAddr(t, "127.0.0.1:0")
}

// StartAddr starts a registry listening on addr (for example "127.0.0.2:0",
// a loopback address that go-containerregistry does not treat as plain-HTTP
// by default, to exercise insecure-registry settings). It is stopped by
// t.Cleanup.
func StartAddr(t testing.TB, addr string) *Registry {
	t.Helper()
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatalf("testregistry: listen on %s: %v", addr, err)
	}
	r := &Registry{Host: ln.Addr().String()}
	h := registry.New(registry.Logger(log.New(io.Discard, "", 0)), registry.WithReferrersSupport(true))
	srv := &httptest.Server{
		Listener: ln,
		Config: &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
			r.requests.Add(1)
			if req.Method == http.MethodGet {
				switch {
				case strings.Contains(req.URL.Path, "/blobs/"):
					r.blobGets.Add(1)
				case strings.Contains(req.URL.Path, "/manifests/"):
					r.manifestGets.Add(1)
				}
			}
			h.ServeHTTP(w, req)
		})},
	}
	srv.Start()
	t.Cleanup(srv.Close)
	return r
}

// Requests is the number of HTTP requests the registry has served.
func (r *Registry) Requests() int64 { return r.requests.Load() }

// BlobGets is the number of GET requests for blobs (layers and configs) the
// registry has served.
func (r *Registry) BlobGets() int64 { return r.blobGets.Load() }

// ManifestGets is the number of GET requests for manifests and indexes the
// registry has served.
func (r *Registry) ManifestGets() int64 { return r.manifestGets.Load() }

// Push writes img to repo:tag and returns the reference "HOST/repo:tag".
func (r *Registry) Push(t testing.TB, repo, tag string, img v1.Image) string {
	t.Helper()
	ref := r.Host + "/" + repo + ":" + tag
	tg, err := name.NewTag(ref, name.Insecure)
	if err != nil {
		t.Fatalf("testregistry: %s: %v", ref, err)
	}
	if err := remote.Write(tg, img); err != nil {
		t.Fatalf("testregistry: push %s: %v", ref, err)
	}
	return ref
}

// PushBusybox pushes BusyboxImage to repo:tag and returns "HOST/repo:tag".
func (r *Registry) PushBusybox(t testing.TB, repo, tag string) string {
	t.Helper()
	return r.Push(t, repo, tag, BusyboxImage(t))
}

// PushIndex pushes a multi-arch index to repo:tag: first a linux/arm64 entry
// (ArmImage, a tiny image whose only file is /arch containing "arm64"), then
// the linux/amd64 busybox image. It returns "HOST/repo:tag".
func (r *Registry) PushIndex(t testing.TB, repo, tag string) string {
	t.Helper()
	idx := mutate.IndexMediaType(empty.Index, types.OCIImageIndex)
	idx = mutate.AppendManifests(idx,
		mutate.IndexAddendum{Add: ArmImage(t), Descriptor: v1.Descriptor{
			Platform: &v1.Platform{OS: "linux", Architecture: "arm64"}}},
		mutate.IndexAddendum{Add: BusyboxImage(t), Descriptor: v1.Descriptor{
			Platform: &v1.Platform{OS: "linux", Architecture: "amd64"}}},
	)
	ref := r.Host + "/" + repo + ":" + tag
	tg, err := name.NewTag(ref, name.Insecure)
	if err != nil {
		t.Fatalf("testregistry: %s: %v", ref, err)
	}
	if err := remote.WriteIndex(tg, idx); err != nil {
		t.Fatalf("testregistry: push index %s: %v", ref, err)
	}
	return ref
}

// HostileEscapeName is the name of the file the hostile image tries to write
// two levels above the layer root.
const HostileEscapeName = "escaped-by-stagelet"

// PushHostile pushes the busybox image plus a hostile top layer, and returns
// "HOST/repo:tag". The hostile layer holds, in order: a symlink "rootlink"
// pointing to "/", a file "rootlink/tmp/escaped-by-stagelet-symlink" written
// through it, and a file "../../escaped-by-stagelet". A store must refuse the
// image and write nothing outside its layer directory.
func (r *Registry) PushHostile(t testing.TB, repo, tag string) string {
	t.Helper()
	entries := []tarEntry{
		{hdr: tar.Header{Typeflag: tar.TypeSymlink, Name: "rootlink", Linkname: "/", Mode: 0o777}},
		{hdr: tar.Header{Typeflag: tar.TypeReg, Name: "rootlink/tmp/" + HostileEscapeName + "-symlink", Mode: 0o644}, data: []byte("escaped\n")},
		{hdr: tar.Header{Typeflag: tar.TypeReg, Name: "../../" + HostileEscapeName, Mode: 0o644}, data: []byte("escaped\n")},
	}
	layer := layerFromEntries(t, entries)
	img, err := mutate.AppendLayers(BusyboxImage(t), layer)
	if err != nil {
		t.Fatalf("testregistry: hostile image: %v", err)
	}
	return r.Push(t, repo, tag, img)
}

// WithConfig returns img with its entrypoint, cmd and user replaced.
// It panics on error (img is a fixture built by this package).
func WithConfig(img v1.Image, entrypoint, cmd []string, user string) v1.Image {
	cf, err := img.ConfigFile()
	if err != nil {
		panic("testregistry: config file: " + err.Error())
	}
	c := *cf.Config.DeepCopy()
	c.Entrypoint = entrypoint
	c.Cmd = cmd
	c.User = user
	out, err := mutate.Config(img, c)
	if err != nil {
		panic("testregistry: mutate config: " + err.Error())
	}
	return out
}

var (
	busyboxOnce sync.Once
	busyboxImg  v1.Image
	busyboxErr  error
)

// BusyboxImage returns the busybox fixture image. It skips the test when
// /bin/busybox is missing.
//
// One layer: /bin/busybox with a symlink in /bin for every applet, /etc/passwd
// (root 0:0, nobody 65534:65534, app 1000:1000), /etc/group (root 0, app 1000,
// extra 2000 with member app, nogroup 65534), /tmp (1777), /root (0700) and
// /home/app owned by 1000:1000, and empty /dev, /proc, /sys, /run, /var. Config:
// Env PATH=..., Cmd ["sh"], WorkingDir "/", linux/amd64. Every entry has a
// fixed mtime, so the image ID is the same every time within a run.
func BusyboxImage(t testing.TB) v1.Image {
	t.Helper()
	if _, err := os.Stat(BusyboxPath); err != nil {
		t.Skipf("testregistry: %s is missing (install busybox-static): %v", BusyboxPath, err)
	}
	busyboxOnce.Do(func() { busyboxImg, busyboxErr = buildBusybox() })
	if busyboxErr != nil {
		t.Fatalf("testregistry: build busybox image: %v", busyboxErr)
	}
	return busyboxImg
}

func buildBusybox() (v1.Image, error) {
	bin, err := os.ReadFile(BusyboxPath)
	if err != nil {
		return nil, err
	}
	out, err := exec.Command(BusyboxPath, "--list").Output()
	if err != nil {
		return nil, err
	}
	applets := strings.Fields(string(out))
	sort.Strings(applets)

	dir := func(n string, mode int64, uid int) tarEntry {
		return tarEntry{hdr: tar.Header{Typeflag: tar.TypeDir, Name: n + "/", Mode: mode, Uid: uid, Gid: uid}}
	}
	file := func(n string, mode int64, data string) tarEntry {
		return tarEntry{hdr: tar.Header{Typeflag: tar.TypeReg, Name: n, Mode: mode}, data: []byte(data)}
	}
	entries := []tarEntry{
		dir("bin", 0o755, 0),
		{hdr: tar.Header{Typeflag: tar.TypeReg, Name: "bin/busybox", Mode: 0o755}, data: bin},
	}
	for _, a := range applets {
		if a == "busybox" || strings.Contains(a, "/") {
			continue
		}
		entries = append(entries, tarEntry{hdr: tar.Header{Typeflag: tar.TypeSymlink, Name: "bin/" + a, Linkname: "busybox", Mode: 0o777}})
	}
	entries = append(entries,
		dir("dev", 0o755, 0),
		dir("etc", 0o755, 0),
		file("etc/passwd", 0o644, "root:x:0:0:root:/root:/bin/sh\n"+
			"nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"+
			"app:x:1000:1000:app:/home/app:/bin/sh\n"),
		file("etc/group", 0o644, "root:x:0:\n"+
			"app:x:1000:\n"+
			"extra:x:2000:app\n"+
			"nogroup:x:65534:\n"),
		dir("home", 0o755, 0),
		dir("home/app", 0o755, 1000),
		dir("proc", 0o555, 0),
		dir("root", 0o700, 0),
		dir("run", 0o755, 0),
		dir("sys", 0o555, 0),
		dir("tmp", 0o1777, 0),
		dir("var", 0o755, 0),
	)
	layer, err := layerFromEntriesErr(entries)
	if err != nil {
		return nil, err
	}
	cfg := &v1.ConfigFile{
		Architecture: "amd64",
		OS:           "linux",
		Created:      v1.Time{Time: epoch},
		Config: v1.Config{
			Env:        []string{DefaultPath},
			Cmd:        []string{"sh"},
			WorkingDir: "/",
		},
		RootFS: v1.RootFS{Type: "layers"},
	}
	img, err := mutate.ConfigFile(empty.Image, cfg)
	if err != nil {
		return nil, err
	}
	return mutate.AppendLayers(img, layer)
}

// ArmImage is the linux/arm64 entry of PushIndex: one layer holding /arch
// with the text "arm64".
func ArmImage(t testing.TB) v1.Image {
	t.Helper()
	layer := layerFromEntries(t, []tarEntry{
		{hdr: tar.Header{Typeflag: tar.TypeReg, Name: "arch", Mode: 0o644}, data: []byte("arm64\n")},
	})
	cfg := &v1.ConfigFile{
		Architecture: "arm64",
		OS:           "linux",
		Created:      v1.Time{Time: epoch},
		Config:       v1.Config{Cmd: []string{"/arch"}},
		RootFS:       v1.RootFS{Type: "layers"},
	}
	img, err := mutate.ConfigFile(empty.Image, cfg)
	if err != nil {
		t.Fatalf("testregistry: arm64 image: %v", err)
	}
	img, err = mutate.AppendLayers(img, layer)
	if err != nil {
		t.Fatalf("testregistry: arm64 image: %v", err)
	}
	return img
}

// Layer builds an uncompressed-tar-backed layer from raw entries, for tests
// that need a layer with specific (possibly hostile) content. Entries are
// written in order; Data is the content of regular files.
func Layer(t testing.TB, entries ...Entry) v1.Layer {
	t.Helper()
	es := make([]tarEntry, len(entries))
	for i, e := range entries {
		es[i] = tarEntry{hdr: e.Header, data: e.Data}
	}
	return layerFromEntries(t, es)
}

// Entry is one tar entry for Layer.
type Entry struct {
	Header tar.Header
	Data   []byte
}

type tarEntry struct {
	hdr  tar.Header
	data []byte
}

func layerFromEntries(t testing.TB, entries []tarEntry) v1.Layer {
	t.Helper()
	l, err := layerFromEntriesErr(entries)
	if err != nil {
		t.Fatalf("testregistry: layer: %v", err)
	}
	return l
}

// TarBytes writes entries as a tar stream with fixed mtimes.
func TarBytes(entries ...Entry) ([]byte, error) {
	es := make([]tarEntry, len(entries))
	for i, e := range entries {
		es[i] = tarEntry{hdr: e.Header, data: e.Data}
	}
	return tarBytes(es)
}

func tarBytes(entries []tarEntry) ([]byte, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		h := e.hdr
		if h.ModTime.IsZero() {
			h.ModTime = epoch
		}
		if h.Format == tar.FormatUnknown {
			h.Format = tar.FormatPAX
		}
		if h.Typeflag == tar.TypeReg {
			h.Size = int64(len(e.data))
		}
		if err := tw.WriteHeader(&h); err != nil {
			return nil, err
		}
		if len(e.data) > 0 {
			if _, err := tw.Write(e.data); err != nil {
				return nil, err
			}
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

func layerFromEntriesErr(entries []tarEntry) (v1.Layer, error) {
	b, err := tarBytes(entries)
	if err != nil {
		return nil, err
	}
	return tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(b)), nil
	})
}
