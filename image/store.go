// Package image owns stagelet's image store, shared by every stage1: it
// pulls images from registries, keeps them on disk, and builds the writable
// per-container root filesystems. No backend pulls or unpacks on its own.
//
// # Layout
//
// Under the store root:
//
//	blobs/sha256/<hex>   manifests, indexes and image configs, by digest
//	layers/<diffid hex>/ one unpacked layer, shared by every image that has it
//	layers/.tmp-*        a layer being unpacked (removed on failure and at start)
//	images/<id hex>.json one image record: {"version":1,...}, written atomically
//	empty/               an empty lower directory for images without layers
//	disks/<id hex>.erofs an image's files as a read-only disk image (disk.go)
//
// Records are keyed by image ID (the config digest). A record carries the
// image's tags and repo digests; a tag names one image at a time. Pulling an
// image that is present costs one manifest request: its digest is compared
// with the records, and no layer is fetched or unpacked again.
//
// # Unpacking untrusted layers
//
// Layers are hostile input. Each one is extracted by this package's own tar
// reader into a temporary directory beside its final place and renamed into
// place only when the whole layer was extracted and its diff ID verified; on
// any failure the temporary directory is removed and nothing is left behind.
// The rules:
//
//   - Entry names are cleaned. An absolute name, or one whose cleaned form
//     escapes the root with "..", fails the pull with an ErrInvalidArgument
//     naming the entry.
//   - Every path is resolved inside the layer directory as if it were the root
//     (filepath-securejoin), so a write through a symlink, absolute or
//     relative, and through a symlinked parent directory, lands inside the
//     layer. The last component of an entry is never followed: a new entry
//     replaces whatever was there.
//   - A symlink's target text is stored as is: it is interpreted inside the
//     container.
//   - A hard link's target must resolve inside the layer, exist, and not be a
//     directory; otherwise the pull fails.
//   - Character and block device nodes are skipped (and logged): /dev is
//     provided by the runtime. Whiteouts are the exception (below). FIFOs are
//     created.
//   - Mode bits, including setuid, setgid and sticky, are kept (containers
//     run with no_new_privs unless privileged). Ownership (lchown for
//     symlinks) and modification times are applied.
//   - Extended attributes: only user.* and trusted.* are applied, best effort;
//     trusted.overlay.* from an archive is ignored so that a layer cannot
//     steer overlayfs.
//   - Whiteouts: ".wh.NAME" becomes an overlayfs whiteout (character device
//     0:0) at NAME; ".wh..wh..opq" gives its directory the xattr
//     trusted.overlay.opaque=y. Both need root; without root such a layer
//     fails with ErrPermissionDenied.
//
// # Root filesystems
//
// MountRootfs mounts overlayfs with the image's layers as lower directories
// (top first) and a per-container upper and work directory. Garbage
// collection never removes a layer that is a lower directory of a mounted
// overlay, even when no image record uses it any more.
package image

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/diskusage"
	"github.com/stagelet/stagelet/internal/lsm"
	"github.com/stagelet/stagelet/trust"
)

// RegistryHost is the operator's configuration for one registry host.
type RegistryHost struct {
	// Mirrors are tried in order instead of the host itself: "http://h:p"
	// (plain HTTP), "https://h:p" or "h:p". When mirrors are listed the
	// host itself is not contacted.
	Mirrors []string `yaml:"mirrors"`
	// Insecure allows plain HTTP to this host.
	Insecure bool `yaml:"insecure"`
}

// Config configures a Store.
type Config struct {
	// Registries is keyed by the registry host as written in references:
	// "registry.k8s.io", "127.0.0.1:5055", "docker.io".
	Registries map[string]RegistryHost
}

// Auth are registry credentials, as carried by the CRI AuthConfig.
type Auth struct {
	Username, Password, Auth, IdentityToken, RegistryToken string
}

// ImageConfig is the part of an image's config a runtime uses.
type ImageConfig struct {
	Entrypoint, Cmd, Env []string
	WorkingDir, User     string
	StopSignal           string
	Labels               map[string]string
}

// Image describes one stored image.
type Image struct {
	// ID is "sha256:<hex>" of the image's config.
	ID string
	// RepoTags are normalized: "docker.io/library/busybox:latest".
	RepoTags []string
	// RepoDigests are "repo@sha256:<hex>" of the manifest (or index) pulled.
	RepoDigests []string
	// Size is the sum of the compressed sizes of the layers as listed in the
	// manifest (what a registry transfers), as containerd reports it.
	Size   uint64
	Config ImageConfig
	// Layers are the diff IDs, bottom first.
	Layers []string
	// Signatures are the image's signatures fetched when a pull was
	// verified, kept to verify the image again at container creation
	// without the registry.
	Signatures []trust.Signature
}

const recordVersion = 1

// record is the persisted form of an image.
type record struct {
	Version     int         `json:"version"`
	ID          string      `json:"id"`
	RepoTags    []string    `json:"repoTags,omitempty"`
	RepoDigests []string    `json:"repoDigests,omitempty"`
	Size        uint64      `json:"size"`
	Config      ImageConfig `json:"config"`
	Layers      []string    `json:"layers"`
	// Manifest is the digest of the platform manifest.
	Manifest string `json:"manifest"`
	// Blobs are the digests kept under blobs/ for this image.
	Blobs []string `json:"blobs,omitempty"`
	// Signatures are kept beside the image (Image.Signatures).
	Signatures []trust.Signature `json:"signatures,omitempty"`
}

func (r *record) image() *Image {
	c := r.Config
	c.Entrypoint = slices.Clone(c.Entrypoint)
	c.Cmd = slices.Clone(c.Cmd)
	c.Env = slices.Clone(c.Env)
	if c.Labels != nil {
		l := make(map[string]string, len(c.Labels))
		for k, v := range c.Labels {
			l[k] = v
		}
		c.Labels = l
	}
	return &Image{
		ID:          r.ID,
		RepoTags:    slices.Clone(r.RepoTags),
		RepoDigests: slices.Clone(r.RepoDigests),
		Size:        r.Size,
		Config:      c,
		Layers:      slices.Clone(r.Layers),
		Signatures:  slices.Clone(r.Signatures),
	}
}

// Store is the image store. It is safe for concurrent use.
type Store struct {
	root string
	cfg  Config
	log  *slog.Logger

	// mu guards images and the record files.
	mu     sync.Mutex
	images map[string]*record // by ID

	// gcMu is held shared by pulls and mounts and exclusively by garbage
	// collection, so that a layer being pulled or mounted is not collected.
	gcMu sync.RWMutex

	layerLocks keyedMutex

	// unpacks counts layers unpacked since NewStore (for tests and logs).
	unpacks atomic.Int64
}

// NewStore opens (creating if needed) the store under root and loads its
// records. A corrupt record is logged and skipped, never fatal. Leftovers of
// interrupted unpacks are removed. Errors: I/O errors creating the layout.
func NewStore(root string, cfg Config, log *slog.Logger) (*Store, error) {
	if log == nil {
		log = slog.Default()
	}
	abs, err := filepath.Abs(root)
	if err != nil {
		return nil, errdefs.InvalidArgument("image store root %q: %w", root, err)
	}
	s := &Store{root: abs, cfg: cfg, log: log.With("component", "image"), images: map[string]*record{}}
	for _, d := range []string{s.blobDir(), s.layersDir(), s.imagesDir(), s.emptyDir()} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, fmt.Errorf("image store: %w", err)
		}
	}
	// Lower directories must be traversable by container users, and
	// readable by containers under SELinux.
	for _, d := range []string{s.root, s.layersDir(), s.emptyDir()} {
		if err := os.Chmod(d, 0o755); err != nil {
			return nil, fmt.Errorf("image store: %w", err)
		}
	}
	for _, d := range []string{s.layersDir(), s.emptyDir()} {
		if err := lsm.LabelReadOnly(d); err != nil {
			return nil, fmt.Errorf("image store: %w", err)
		}
	}
	ents, err := os.ReadDir(s.layersDir())
	if err != nil {
		return nil, fmt.Errorf("image store: %w", err)
	}
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), ".tmp-") {
			s.log.Info("removing interrupted layer unpack", "dir", e.Name())
			_ = os.RemoveAll(filepath.Join(s.layersDir(), e.Name()))
		}
	}
	s.removeDiskLeftovers()
	ents, err = os.ReadDir(s.imagesDir())
	if err != nil {
		return nil, fmt.Errorf("image store: %w", err)
	}
	for _, e := range ents {
		n := e.Name()
		if strings.HasPrefix(n, ".") {
			_ = os.Remove(filepath.Join(s.imagesDir(), n)) // an interrupted write
			continue
		}
		if !strings.HasSuffix(n, ".json") {
			continue
		}
		rec, err := loadRecord(filepath.Join(s.imagesDir(), n))
		if err != nil {
			s.log.Warn("skipping corrupt image record", "file", n, "err", err)
			continue
		}
		s.images[rec.ID] = rec
	}
	s.log.Debug("image store opened", "root", s.root, "images", len(s.images))
	return s, nil
}

func loadRecord(p string) (*record, error) {
	b, err := os.ReadFile(p)
	if err != nil {
		return nil, err
	}
	var rec record
	if err := json.Unmarshal(b, &rec); err != nil {
		return nil, err
	}
	if rec.Version != recordVersion {
		return nil, fmt.Errorf("unknown record version %d", rec.Version)
	}
	hex, ok := strings.CutPrefix(rec.ID, "sha256:")
	if !ok || !isHex(hex) || len(hex) != 64 || filepath.Base(p) != hex+".json" {
		return nil, fmt.Errorf("record id %q does not match its file", rec.ID)
	}
	for _, l := range rec.Layers {
		if h, ok := strings.CutPrefix(l, "sha256:"); !ok || len(h) != 64 || !isHex(h) {
			return nil, fmt.Errorf("bad layer %q", l)
		}
	}
	return &rec, nil
}

// Root returns the store's root directory.
func (s *Store) Root() string { return s.root }

func (s *Store) blobDir() string   { return filepath.Join(s.root, "blobs", "sha256") }
func (s *Store) layersDir() string { return filepath.Join(s.root, "layers") }
func (s *Store) imagesDir() string { return filepath.Join(s.root, "images") }
func (s *Store) emptyDir() string  { return filepath.Join(s.root, "empty") }

// layerPath is the unpacked directory of the layer with diff ID d.
func (s *Store) layerPath(d string) string {
	return filepath.Join(s.layersDir(), strings.TrimPrefix(d, "sha256:"))
}

func (s *Store) blobPath(d string) string {
	return filepath.Join(s.blobDir(), strings.TrimPrefix(d, "sha256:"))
}

// Get returns the image named by ref: an ID ("sha256:<hex>"), a unique
// prefix of at least 12 hex digits of an ID (with or without "sha256:"), a
// tag ("busybox" is docker.io/library/busybox:latest) or a digest reference
// ("repo@sha256:<hex>"). Errors: ErrNotFound when no image matches,
// ErrInvalidArgument for an ambiguous prefix.
func (s *Store) Get(ref string) (*Image, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	rec, err := s.lookupLocked(ref)
	if err != nil {
		return nil, err
	}
	return rec.image(), nil
}

func (s *Store) lookupLocked(ref string) (*record, error) {
	if rec, ok := s.images[ref]; ok {
		return rec, nil
	}
	hex := strings.TrimPrefix(ref, "sha256:")
	if len(hex) >= 12 && len(hex) <= 64 && isHex(hex) {
		var found *record
		n := 0
		for id, rec := range s.images {
			if strings.HasPrefix(id, "sha256:"+hex) {
				found = rec
				n++
			}
		}
		if n == 1 {
			return found, nil
		}
		if n > 1 {
			return nil, errdefs.InvalidArgument("image ID prefix %q is ambiguous", ref)
		}
		if strings.HasPrefix(ref, "sha256:") {
			return nil, errdefs.NotFound("image %q not found", ref)
		}
	}
	norm, err := normalize(ref)
	if err != nil {
		return nil, errdefs.NotFound("image %q not found", ref)
	}
	for _, rec := range s.images {
		if slices.Contains(rec.RepoTags, norm) || slices.Contains(rec.RepoDigests, norm) {
			return rec, nil
		}
	}
	return nil, errdefs.NotFound("image %q not found", ref)
}

// List returns every stored image, in no particular order.
func (s *Store) List() []*Image {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]*Image, 0, len(s.images))
	for _, rec := range s.images {
		out = append(out, rec.image())
	}
	return out
}

// Remove removes the image named by ref (any form Get accepts) with all its
// tags and digests, as CRI RemoveImage does, then garbage-collects layers
// and blobs no image uses any more (layers under a mounted rootfs are kept).
// Idempotent: a missing image is not an error. Errors: ErrInvalidArgument
// for an ambiguous ID prefix; I/O errors removing the record.
func (s *Store) Remove(ctx context.Context, ref string) error {
	s.mu.Lock()
	rec, err := s.lookupLocked(ref)
	if errdefs.IsNotFound(err) {
		s.mu.Unlock()
		return nil
	}
	if err != nil {
		s.mu.Unlock()
		return err
	}
	p := filepath.Join(s.imagesDir(), strings.TrimPrefix(rec.ID, "sha256:")+".json")
	if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
		s.mu.Unlock()
		return fmt.Errorf("remove image %s: %w", ref, err)
	}
	// The record is gone either way; a failed sync may bring it back
	// after a crash, which the caller hears of.
	serr := syncDir(s.imagesDir())
	delete(s.images, rec.ID)
	s.mu.Unlock()
	s.gc(ctx)
	if serr != nil {
		return fmt.Errorf("remove image %s: sync %s: %w", ref, s.imagesDir(), serr)
	}
	return nil
}

// gc removes layers and blobs no record references. Failures are logged.
func (s *Store) gc(ctx context.Context) {
	s.gcMu.Lock()
	defer s.gcMu.Unlock()
	used := map[string]bool{}
	ids := map[string]bool{}
	s.mu.Lock()
	for _, rec := range s.images {
		ids[strings.TrimPrefix(rec.ID, "sha256:")] = true
		for _, l := range rec.Layers {
			used[strings.TrimPrefix(l, "sha256:")] = true
		}
		for _, b := range rec.Blobs {
			used["blob:"+strings.TrimPrefix(b, "sha256:")] = true
		}
	}
	s.mu.Unlock()
	mounted := mountedLowerDirs()
	if ents, err := os.ReadDir(s.layersDir()); err == nil {
		for _, e := range ents {
			n := e.Name()
			if strings.HasPrefix(n, ".") || used[n] {
				continue
			}
			p := filepath.Join(s.layersDir(), n)
			if mounted[p] {
				s.log.DebugContext(ctx, "keeping unused layer: it is mounted", "layer", n)
				continue
			}
			if err := os.RemoveAll(p); err != nil {
				s.log.WarnContext(ctx, "garbage collection: remove layer", "layer", n, "err", err)
				continue
			}
			s.log.DebugContext(ctx, "garbage collection: layer removed", "layer", n)
		}
	}
	s.gcDisks(ctx, ids)
	if ents, err := os.ReadDir(s.blobDir()); err == nil {
		for _, e := range ents {
			if !used["blob:"+e.Name()] {
				_ = os.Remove(filepath.Join(s.blobDir(), e.Name()))
			}
		}
	}
}

// mountedLowerDirs returns every overlayfs lower directory currently mounted
// in this mount namespace.
func mountedLowerDirs() map[string]bool {
	out := map[string]bool{}
	for _, m := range readMountInfo() {
		if m.fstype != "overlay" {
			continue
		}
		for _, o := range strings.Split(m.superOpts, ",") {
			if v, ok := strings.CutPrefix(o, "lowerdir="); ok {
				for _, d := range strings.Split(v, ":") {
					out[filepath.Clean(d)] = true
				}
			}
		}
	}
	return out
}

type mountInfo struct {
	mountPoint, fstype, superOpts string
}

func readMountInfo() []mountInfo {
	ms, err := mountinfo.GetMounts(nil)
	if err != nil {
		return nil
	}
	out := make([]mountInfo, 0, len(ms))
	for _, m := range ms {
		out = append(out, mountInfo{mountPoint: m.Mountpoint, fstype: m.FSType, superOpts: m.VFSOptions})
	}
	return out
}

// Usage returns the bytes (allocated blocks) and inodes used under the
// store's root, for CRI ImageFsInfo. Hard-linked files count once.
func (s *Store) Usage() (bytes, inodes uint64, err error) {
	return diskusage.Of(s.root)
}

func syncDir(dir string) error {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	return unix.Fsync(fd)
}

func isHex(s string) bool {
	for _, c := range s {
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return s != ""
}

// keyedMutex is a set of mutexes by key; entries are dropped when unused.
type keyedMutex struct {
	mu    sync.Mutex
	locks map[string]*keyedEntry
}

type keyedEntry struct {
	mu   sync.Mutex
	refs int
}

func (k *keyedMutex) lock(key string) func() {
	k.mu.Lock()
	if k.locks == nil {
		k.locks = map[string]*keyedEntry{}
	}
	e := k.locks[key]
	if e == nil {
		e = &keyedEntry{}
		k.locks[key] = e
	}
	e.refs++
	k.mu.Unlock()
	e.mu.Lock()
	return func() {
		e.mu.Unlock()
		k.mu.Lock()
		e.refs--
		if e.refs == 0 {
			delete(k.locks, key)
		}
		k.mu.Unlock()
	}
}
