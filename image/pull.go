package image

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/remote/transport"
	"go.opentelemetry.io/otel/attribute"
	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/atomicfile"
	"github.com/stagelet/stagelet/tracing"
	"github.com/stagelet/stagelet/trust"
)

// platform is the platform picked from an index.
var platform = v1.Platform{OS: "linux", Architecture: runtime.GOARCH}

const dockerHub = "docker.io"

// parsed is a reference split into its normalized parts.
type parsed struct {
	ref  name.Reference
	host string // normalized: "docker.io", not "index.docker.io"
	repo string // normalized repository: "docker.io/library/busybox"
	tag  string // "" for a digest reference
	dig  string // "" for a tag reference
}

func parse(ref string, opts ...name.Option) (*parsed, error) {
	r, err := name.ParseReference(ref, opts...)
	if err != nil {
		return nil, err
	}
	host := r.Context().RegistryStr()
	if host == name.DefaultRegistry {
		host = dockerHub
	}
	p := &parsed{ref: r, host: host, repo: host + "/" + r.Context().RepositoryStr()}
	switch v := r.(type) {
	case name.Tag:
		p.tag = v.TagStr()
	case name.Digest:
		p.dig = v.DigestStr()
	}
	return p, nil
}

// normalize returns ref in the form used by RepoTags ("host/repo:tag") or
// RepoDigests ("host/repo@sha256:...").
func normalize(ref string) (string, error) {
	p, err := parse(ref)
	if err != nil {
		return "", err
	}
	if p.dig != "" {
		return p.repo + "@" + p.dig, nil
	}
	return p.repo + ":" + p.tag, nil
}

func (s *Store) hostConfig(host string) RegistryHost {
	if h, ok := s.cfg.Registries[host]; ok {
		return h
	}
	if host == dockerHub {
		return s.cfg.Registries[name.DefaultRegistry]
	}
	return RegistryHost{}
}

// endpoints returns the references to fetch from, in order: the mirrors of
// the reference's host if any are configured (the host itself is then not
// contacted), else the reference itself.
func (s *Store) endpoints(p *parsed) ([]name.Reference, error) {
	hc := s.hostConfig(p.host)
	if len(hc.Mirrors) == 0 {
		var opts []name.Option
		if hc.Insecure {
			opts = append(opts, name.Insecure)
		}
		r, err := name.ParseReference(p.ref.String(), opts...)
		if err != nil {
			return nil, err
		}
		return []name.Reference{r}, nil
	}
	var out []name.Reference
	for _, m := range hc.Mirrors {
		insecure := false
		hostPath := m
		if rest, ok := strings.CutPrefix(m, "http://"); ok {
			insecure, hostPath = true, rest
		} else if rest, ok := strings.CutPrefix(m, "https://"); ok {
			hostPath = rest
		}
		hostPath = strings.TrimSuffix(hostPath, "/")
		mhost, prefix, _ := strings.Cut(hostPath, "/")
		if s.hostConfig(mhost).Insecure {
			insecure = true
		}
		ms := mhost + "/"
		if prefix != "" {
			ms += prefix + "/"
		}
		ms += p.ref.Context().RepositoryStr()
		if p.dig != "" {
			ms += "@" + p.dig
		} else {
			ms += ":" + p.tag
		}
		var opts []name.Option
		if insecure {
			opts = append(opts, name.Insecure)
		}
		r, err := name.ParseReference(ms, opts...)
		if err != nil {
			return nil, errdefs.InvalidArgument("mirror %q for %s: %w", m, p.host, err)
		}
		out = append(out, r)
	}
	return out, nil
}

func keychainAuth(a *Auth) authn.Authenticator {
	if a == nil || *a == (Auth{}) {
		return authn.Anonymous
	}
	return authn.FromConfig(authn.AuthConfig{
		Username:      a.Username,
		Password:      a.Password,
		Auth:          a.Auth,
		IdentityToken: a.IdentityToken,
		RegistryToken: a.RegistryToken,
	})
}

// Verify decides whether an image may be pulled once its reference has
// resolved to digest (of the manifest or index the reference names), before
// anything else is fetched: digest is what gets pulled, so a tag that moves
// meanwhile cannot swap the image. kept are the signatures the store keeps
// for digest already (a pull of an image it has); fetch gets the
// signatures of digest from the registry (or mirror) that answered. Verify
// returns the signatures to keep beside the image, or why it is refused.
type Verify func(ctx context.Context, digest string, kept []trust.Signature, fetch func() ([]trust.Signature, error)) ([]trust.Signature, error)

// Pull fetches ref (with auth, or anonymously when auth is nil or empty),
// unpacks the layers it does not have yet, and records the image under the
// reference's normalized name (also when it came from a mirror). An index
// resolves to its linux/GOARCH entry. Pulling an image already present costs
// one manifest request. Safe for concurrent use, also for the same image.
// When the reference's host has mirrors, auth is sent to the mirrors (the
// operator vouches for them) and the host itself is never contacted.
//
// Errors (all naming ref): ErrInvalidArgument for a bad reference or a
// refused layer; ErrNotFound when the registry does not know the image or
// the index has no entry for this platform; ErrPermissionDenied when the
// registry refuses the credentials; ErrUnavailable for connection failures
// and server errors; ErrDeadlineExceeded when ctx expires; ErrUnimplemented
// for docker schema 1 manifests. A refusal of verify (nil: none) is
// returned as it is, and nothing is fetched or stored after it.
func (s *Store) Pull(ctx context.Context, ref string, auth *Auth, verify Verify) (*Image, error) {
	start := time.Now()
	p, err := parse(ref)
	if err != nil {
		return nil, errdefs.InvalidArgument("pull %q: bad image reference: %w", ref, err)
	}
	eps, err := s.endpoints(p)
	if err != nil {
		return nil, fmt.Errorf("pull %s: %w", ref, err)
	}
	opts := []remote.Option{
		remote.WithContext(ctx),
		remote.WithAuth(keychainAuth(auth)),
		remote.WithPlatform(platform),
		remote.WithUserAgent("stagelet"),
	}
	desc, src, err := s.resolve(ctx, ref, eps, opts)
	if err != nil {
		return nil, err
	}
	top := desc.Digest.String()
	sigs, err := s.verifyPull(ctx, ref, top, src, opts, verify)
	if err != nil {
		return nil, err
	}

	s.gcMu.RLock()
	defer s.gcMu.RUnlock()

	if img, ok := s.cached(ctx, p, top, sigs); ok {
		s.log.DebugContext(ctx, "pull: image present", "ref", ref, "id", img.ID, "took", time.Since(start))
		return img, nil
	}

	rec, err := s.fetchImage(ctx, ref, desc, src, opts)
	if err != nil {
		return nil, err
	}
	out, err := s.commit(rec, p, top, sigs)
	if err != nil {
		return nil, fmt.Errorf("pull %s: %w", ref, err)
	}
	s.log.InfoContext(ctx, "image pulled", "ref", ref, "from", src.Context().RegistryStr(), "id", out.ID, "layers", len(rec.Layers), "took", time.Since(start))
	return out, nil
}

// verifyPull asks verify (nil: none) whether ref, resolved to top (the
// digest of its manifest or index) at src, may be pulled, and returns the
// signatures to keep beside the image. The signatures verify asks for are
// fetched from src with opts.
func (s *Store) verifyPull(ctx context.Context, ref, top string, src name.Reference, opts []remote.Option, verify Verify) ([]trust.Signature, error) {
	if verify == nil {
		return nil, nil
	}
	fetch := func() ([]trust.Signature, error) {
		sigs, err := trust.Fetch(ctx, src.Context(), top, opts...)
		if err != nil {
			return nil, errdefs.New(classify(ctx, err), "pull %s: signatures: %w", ref, err)
		}
		return sigs, nil
	}
	return verify(ctx, top, s.keptSignatures(top), fetch)
}

// fetchImage fetches the image desc names at src (its linux/GOARCH entry
// when desc is an index): its manifest, its config and the layers the
// store lacks, which it unpacks, and it stores the image's blobs. It
// returns the image's record, not yet committed. The caller holds gcMu.
func (s *Store) fetchImage(ctx context.Context, ref string, desc *remote.Descriptor, src name.Reference, opts []remote.Option) (*record, error) {
	blobs := map[string][]byte{}
	img, err := platformImage(ctx, ref, desc, src, opts, blobs)
	if err != nil {
		return nil, err
	}
	manifestRaw, err := img.RawManifest()
	if err != nil {
		return nil, errdefs.New(classify(ctx, err), "pull %s: %w", ref, err)
	}
	mdig, err := img.Digest()
	if err != nil {
		return nil, errdefs.InvalidArgument("pull %s: %w", ref, err)
	}
	blobs[mdig.String()] = manifestRaw
	manifest, cfgDigest, cf, err := imageConfig(ctx, ref, img, blobs)
	if err != nil {
		return nil, err
	}
	layers, err := img.Layers()
	if err != nil {
		return nil, errdefs.New(classify(ctx, err), "pull %s: %w", ref, err)
	}
	if len(layers) != len(cf.RootFS.DiffIDs) || len(layers) != len(manifest.Layers) {
		return nil, errdefs.InvalidArgument("pull %s: manifest has %d layers, config %d diff IDs", ref, len(manifest.Layers), len(cf.RootFS.DiffIDs))
	}
	diffIDs, size, err := s.fetchLayers(ctx, ref, layers, cf.RootFS.DiffIDs, manifest.Layers)
	if err != nil {
		return nil, err
	}
	for d, b := range blobs {
		if err := s.putBlob(d, b); err != nil {
			return nil, fmt.Errorf("pull %s: store blob: %w", ref, err)
		}
	}
	return newRecord(cfgDigest, mdig.String(), size, diffIDs, cf, blobs), nil
}

// newRecord is the store's record of a pulled image.
func newRecord(id, manifest string, size uint64, diffIDs []string, cf *v1.ConfigFile, blobs map[string][]byte) *record {
	rec := &record{
		Version:  recordVersion,
		ID:       id,
		Size:     size,
		Layers:   diffIDs,
		Manifest: manifest,
		Config: ImageConfig{
			Entrypoint: cf.Config.Entrypoint,
			Cmd:        cf.Config.Cmd,
			Env:        cf.Config.Env,
			WorkingDir: cf.Config.WorkingDir,
			User:       cf.Config.User,
			StopSignal: cf.Config.StopSignal,
			Labels:     cf.Config.Labels,
		},
	}
	for d := range blobs {
		rec.Blobs = append(rec.Blobs, d)
	}
	slices.Sort(rec.Blobs)
	return rec
}

// imageConfig reads img's manifest and its config, checked against the
// manifest's digest of it (the config goes to blobs under that digest).
func imageConfig(ctx context.Context, ref string, img v1.Image, blobs map[string][]byte) (*v1.Manifest, string, *v1.ConfigFile, error) {
	manifest, err := img.Manifest()
	if err != nil {
		return nil, "", nil, errdefs.InvalidArgument("pull %s: bad manifest: %w", ref, err)
	}
	cfgRaw, err := img.RawConfigFile()
	if err != nil {
		return nil, "", nil, errdefs.New(classify(ctx, err), "pull %s: config: %w", ref, err)
	}
	cfgDigest := manifest.Config.Digest.String()
	if sum := sha256.Sum256(cfgRaw); "sha256:"+hex.EncodeToString(sum[:]) != cfgDigest {
		return nil, "", nil, errdefs.InvalidArgument("pull %s: config does not match its digest %s", ref, cfgDigest)
	}
	blobs[cfgDigest] = cfgRaw
	var cf v1.ConfigFile
	if err := json.Unmarshal(cfgRaw, &cf); err != nil {
		return nil, "", nil, errdefs.InvalidArgument("pull %s: bad image config: %w", ref, err)
	}
	return manifest, cfgDigest, &cf, nil
}

// resolve gets ref's descriptor from the first of its endpoints (mirrors,
// then the registry) that answers.
func (s *Store) resolve(ctx context.Context, ref string, eps []name.Reference, opts []remote.Option) (*remote.Descriptor, name.Reference, error) {
	var (
		lastErr error
		msgs    []string
	)
	for _, ep := range eps {
		d, err := remote.Get(ep, opts...)
		if err == nil {
			return d, ep, nil
		}
		lastErr = err
		msgs = append(msgs, fmt.Sprintf("%s: %v", ep.Context().RegistryStr(), err))
		s.log.DebugContext(ctx, "pull: endpoint failed", "ref", ref, "endpoint", ep.String(), "err", err)
	}
	return nil, nil, fmt.Errorf("pull %s: %w: %s", ref, classify(ctx, lastErr), strings.Join(msgs, "; "))
}

// platformImage is the image desc names for this machine's platform: the
// index's entry for it (the index's manifest goes to blobs), or desc's own
// image. Docker schema 1 images are refused.
func platformImage(ctx context.Context, ref string, desc *remote.Descriptor, src name.Reference, opts []remote.Option, blobs map[string][]byte) (v1.Image, error) {
	var img v1.Image
	var err error
	if desc.MediaType.IsIndex() {
		idx, err := desc.ImageIndex()
		if err != nil {
			return nil, errdefs.New(classify(ctx, err), "pull %s: %w", ref, err)
		}
		im, err := idx.IndexManifest()
		if err != nil {
			return nil, errdefs.InvalidArgument("pull %s: bad index: %w", ref, err)
		}
		var child *v1.Descriptor
		for i := range im.Manifests {
			m := &im.Manifests[i]
			if m.Platform != nil && m.Platform.OS == platform.OS && m.Platform.Architecture == platform.Architecture && m.MediaType.IsImage() {
				child = m
				break
			}
		}
		if child == nil {
			return nil, errdefs.NotFound("pull %s: the index has no image for %s/%s", ref, platform.OS, platform.Architecture)
		}
		blobs[desc.Digest.String()] = desc.Manifest
		img, err = remote.Image(src.Context().Digest(child.Digest.String()), opts...)
		if err != nil {
			return nil, errdefs.New(classify(ctx, err), "pull %s: %w", ref, err)
		}
	} else if desc.MediaType.IsSchema1() {
		return nil, errdefs.New(errdefs.ErrUnimplemented, "pull %s: docker schema 1 images are not supported", ref)
	} else {
		img, err = desc.Image()
		if err != nil {
			return nil, errdefs.New(classify(ctx, err), "pull %s: %w", ref, err)
		}
	}
	return img, nil
}

// fetchLayers unpacks the layers the store lacks and returns their diff
// IDs and the image's compressed size.
func (s *Store) fetchLayers(ctx context.Context, ref string, layers []v1.Layer, diffs []v1.Hash, descs []v1.Descriptor) ([]string, uint64, error) {
	var size uint64
	diffIDs := make([]string, len(layers))
	for i, l := range layers {
		d := diffs[i]
		if d.Algorithm != "sha256" || len(d.Hex) != 64 || !isHex(d.Hex) {
			return nil, 0, errdefs.InvalidArgument("pull %s: bad diff ID %q", ref, d.String())
		}
		diffIDs[i] = d.String()
		if descs[i].Size > 0 {
			size += uint64(descs[i].Size)
		}
		if err := s.ensureLayer(ctx, d.String(), l); err != nil {
			return nil, 0, fmt.Errorf("pull %s: layer %s: %w", ref, d.String(), err)
		}
	}
	return diffIDs, size, nil
}

// pulledAsLocked is the stored image whose manifest or pulled digest is
// top, or nil. s.mu is held.
func (s *Store) pulledAsLocked(top string) *record {
	for _, rec := range s.images {
		if rec.Manifest == top || slices.ContainsFunc(rec.RepoDigests, func(d string) bool { return strings.HasSuffix(d, "@"+top) }) {
			return rec
		}
	}
	return nil
}

// keptSignatures are the signatures of the stored image pulled as top.
func (s *Store) keptSignatures(top string) []trust.Signature {
	s.mu.Lock()
	defer s.mu.Unlock()
	if rec := s.pulledAsLocked(top); rec != nil {
		return slices.Clone(rec.Signatures)
	}
	return nil
}

// cached returns the stored image whose manifest or pulled digest is top,
// after tagging it with p and keeping sigs, if all its layers are present.
func (s *Store) cached(ctx context.Context, p *parsed, top string, sigs []trust.Signature) (*Image, bool) {
	s.mu.Lock()
	found := s.pulledAsLocked(top)
	s.mu.Unlock()
	if found == nil {
		return nil, false
	}
	for _, l := range found.Layers {
		if _, err := os.Stat(s.layerPath(l)); err != nil {
			return nil, false
		}
	}
	img, err := s.commit(found, p, top, sigs)
	if err != nil {
		s.log.WarnContext(ctx, "pull: record update failed", "id", found.ID, "err", err)
		return nil, false
	}
	return img, true
}

// commit merges rec (new or existing) with the tag and digest of p and the
// signatures sigs, moves the tag away from any other image, and persists
// what changed.
func (s *Store) commit(rec *record, p *parsed, top string, sigs []trust.Signature) (*Image, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	cur := s.images[rec.ID]
	if cur == nil {
		cur = rec
	} else {
		c := *cur
		c.RepoTags = slices.Clone(cur.RepoTags)
		c.RepoDigests = slices.Clone(cur.RepoDigests)
		c.Signatures = slices.Clone(cur.Signatures)
		if rec != cur {
			c.Blobs = mergeSorted(c.Blobs, rec.Blobs)
		}
		cur = &c
	}
	var tag string
	if p.tag != "" {
		tag = p.repo + ":" + p.tag
	}
	dig := p.repo + "@" + top
	if tag != "" && !slices.Contains(cur.RepoTags, tag) {
		cur.RepoTags = append(cur.RepoTags, tag)
	}
	if !slices.Contains(cur.RepoDigests, dig) {
		cur.RepoDigests = append(cur.RepoDigests, dig)
	}
	for _, sig := range sigs {
		if !slices.ContainsFunc(cur.Signatures, sig.Same) {
			cur.Signatures = append(cur.Signatures, sig)
		}
	}
	// A tag or digest names one image: take it away from the others.
	for id, other := range s.images {
		if id == cur.ID {
			continue
		}
		if !slices.Contains(other.RepoTags, tag) && !slices.Contains(other.RepoDigests, dig) {
			continue
		}
		o := *other
		o.RepoTags = slices.DeleteFunc(slices.Clone(o.RepoTags), func(t string) bool { return t == tag })
		o.RepoDigests = slices.DeleteFunc(slices.Clone(o.RepoDigests), func(d string) bool { return d == dig })
		if err := s.writeRecord(&o); err != nil {
			return nil, err
		}
		s.images[id] = &o
	}
	if old := s.images[cur.ID]; old == nil || !sameNames(old, cur) {
		if err := s.writeRecord(cur); err != nil {
			return nil, err
		}
	}
	s.images[cur.ID] = cur
	return cur.image(), nil
}

func sameNames(a, b *record) bool {
	return slices.Equal(a.RepoTags, b.RepoTags) && slices.Equal(a.RepoDigests, b.RepoDigests) && slices.Equal(a.Blobs, b.Blobs) && len(a.Signatures) == len(b.Signatures)
}

func mergeSorted(a, b []string) []string {
	out := slices.Concat(a, b)
	slices.Sort(out)
	return slices.Compact(out)
}

func (s *Store) writeRecord(rec *record) error {
	b, err := json.MarshalIndent(rec, "", "  ")
	if err != nil {
		return err
	}
	return atomicfile.Write(filepath.Join(s.imagesDir(), strings.TrimPrefix(rec.ID, "sha256:")+".json"), b, 0o600)
}

func (s *Store) putBlob(d string, b []byte) error {
	p := s.blobPath(d)
	if _, err := os.Stat(p); err == nil {
		return nil
	}
	return atomicfile.Write(p, b, 0o644)
}

// ensureLayer unpacks layer l (diff ID d) into layers/<hex> unless it is
// there already. Concurrent calls for one layer unpack it once.
func (s *Store) ensureLayer(ctx context.Context, d string, l v1.Layer) (err error) {
	ctx, span := tracing.Start(ctx, "image.layer", attribute.String("stagelet.layer", d))
	defer func() { tracing.End(span, err) }()
	unlock := s.layerLocks.lock(d)
	defer unlock()
	final := s.layerPath(d)
	if _, err := os.Stat(final); err == nil {
		return nil
	}
	hexd := strings.TrimPrefix(d, "sha256:")
	tmp, err := os.MkdirTemp(s.layersDir(), ".tmp-"+hexd[:12]+"-")
	if err != nil {
		return err
	}
	ok := false
	defer func() {
		if !ok {
			if err := os.RemoveAll(tmp); err != nil {
				s.log.WarnContext(ctx, "remove failed layer unpack", "dir", tmp, "err", err)
			}
		}
	}()
	if err := os.Chmod(tmp, 0o755); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return errdefs.New(classify(ctx, err), "%w", err)
	}
	rc, err := l.Uncompressed()
	if err != nil {
		return errdefs.New(classify(ctx, err), "%w", err)
	}
	defer rc.Close()
	h := sha256.New()
	src := &errReader{r: rc}
	tee := io.TeeReader(src, h)
	start := time.Now()
	st, err := unpackLayer(ctx, tee, tmp, s.log)
	if err != nil {
		if src.err != nil {
			// The download failed, not the archive.
			return errdefs.New(classify(ctx, src.err), "%w", src.err)
		}
		return err
	}
	// Read the archive's padding and let the compressed digest be verified.
	if _, err := io.Copy(io.Discard, tee); err != nil {
		return errdefs.New(classify(ctx, err), "%w", err)
	}
	if err := rc.Close(); err != nil {
		return errdefs.New(classify(ctx, err), "%w", err)
	}
	if got := hex.EncodeToString(h.Sum(nil)); got != hexd {
		return errdefs.InvalidArgument("layer content has diff ID sha256:%s, want %s", got, d)
	}
	// The layer is on disk before it takes its final name: a crash after
	// the rename must not leave a layer with holes.
	if err := syncFS(tmp); err != nil {
		return fmt.Errorf("layer %s: %w", d, err)
	}
	if err := os.Rename(tmp, final); err != nil {
		if _, serr := os.Stat(final); serr == nil {
			return nil // someone else won; the deferred cleanup removes tmp
		}
		return err
	}
	ok = true
	// The layer stays under its final name whatever the sync says; a
	// failed sync fails the pull, and the next one finds the layer there.
	if err := syncDir(s.layersDir()); err != nil {
		return fmt.Errorf("layer %s: sync %s: %w", d, s.layersDir(), err)
	}
	s.unpacks.Add(1)
	s.log.DebugContext(ctx, "layer unpacked", "layer", d, "entries", st.Entries, "bytes", st.Bytes, "skipped", st.Skipped, "took", time.Since(start))
	return nil
}

// classify returns the error class of a registry or network error, or
// context.Canceled when the caller went away.
func classify(ctx context.Context, err error) error {
	if err == nil {
		return errdefs.ErrUnavailable
	}
	if ctx != nil && errors.Is(ctx.Err(), context.Canceled) {
		return context.Canceled // the caller went away: not the registry's fault
	}
	if errors.Is(err, errdefs.ErrInvalidArgument) || errors.Is(err, errdefs.ErrNotFound) ||
		errors.Is(err, errdefs.ErrPermissionDenied) || errors.Is(err, errdefs.ErrUnavailable) {
		return unwrapClass(err)
	}
	if errors.Is(err, context.DeadlineExceeded) || (ctx != nil && errors.Is(ctx.Err(), context.DeadlineExceeded)) {
		return errdefs.ErrDeadlineExceeded
	}
	var te *transport.Error
	if errors.As(err, &te) {
		for _, d := range te.Errors {
			switch d.Code {
			case transport.ManifestUnknownErrorCode, transport.NameUnknownErrorCode, transport.BlobUnknownErrorCode:
				return errdefs.ErrNotFound
			case transport.UnauthorizedErrorCode, transport.DeniedErrorCode:
				return errdefs.ErrPermissionDenied
			case transport.NameInvalidErrorCode, transport.TagInvalidErrorCode, transport.DigestInvalidErrorCode, transport.ManifestInvalidErrorCode:
				return errdefs.ErrInvalidArgument
			}
		}
		switch te.StatusCode {
		case http.StatusNotFound:
			return errdefs.ErrNotFound
		case http.StatusUnauthorized, http.StatusForbidden:
			return errdefs.ErrPermissionDenied
		}
		return errdefs.ErrUnavailable
	}
	var ue *url.Error
	var ne net.Error
	if errors.As(err, &ue) || errors.As(err, &ne) {
		return errdefs.ErrUnavailable
	}
	return errdefs.ErrUnavailable
}

func unwrapClass(err error) error {
	for _, c := range []error{errdefs.ErrInvalidArgument, errdefs.ErrNotFound, errdefs.ErrPermissionDenied, errdefs.ErrUnavailable} {
		if errors.Is(err, c) {
			return c
		}
	}
	return errdefs.ErrUnavailable
}

// errReader remembers the first error of r other than io.EOF.
type errReader struct {
	r   io.Reader
	err error
}

func (e *errReader) Read(p []byte) (int, error) {
	n, err := e.r.Read(p)
	if err != nil && err != io.EOF && e.err == nil {
		e.err = err
	}
	return n, err
}

// syncFS flushes the file system holding dir (syncfs(2)).
func syncFS(dir string) error {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open %s to sync it: %w", dir, err)
	}
	defer unix.Close(fd)
	if err := unix.Syncfs(fd); err != nil {
		return fmt.Errorf("syncfs %s: %w", dir, err)
	}
	return nil
}
