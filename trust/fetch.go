package trust

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/remote/transport"
)

// Bounds on what a registry can make a verifier read.
const (
	maxSignatures  = 64
	maxPayloadSize = 4 << 20
)

// Fetch returns the cosign signatures of digest stored in repo: the layers
// of the "sha256-<hex>.sig" tag's manifest, and of the signature artifacts
// the registry's referrers API lists for the digest. Neither being there
// is no error (no signatures); a registry that fails is.
func Fetch(ctx context.Context, repo name.Repository, digest string, opts ...remote.Option) ([]Signature, error) {
	h, err := v1.NewHash(digest)
	if err != nil {
		return nil, fmt.Errorf("digest %q: %w", digest, err)
	}
	opts = append(opts, remote.WithContext(ctx))
	var out []Signature
	add := func(img v1.Image, source string) error {
		sigs, err := fromManifest(img, source)
		if err != nil {
			return err
		}
		for _, s := range sigs {
			if len(out) == maxSignatures {
				return fmt.Errorf("more than %d signatures", maxSignatures)
			}
			dup := false
			for _, o := range out {
				dup = dup || o.Same(s)
			}
			if !dup {
				out = append(out, s)
			}
		}
		return nil
	}

	tag := repo.Tag(SigTag(digest))
	img, err := remote.Image(tag, opts...)
	switch {
	case err == nil:
		if err := add(img, tag.String()); err != nil {
			return nil, fmt.Errorf("%s: %w", tag, err)
		}
	case !notFound(err):
		return nil, fmt.Errorf("%s: %w", tag, err)
	}

	idx, err := remote.Referrers(repo.Digest(h.String()), append(opts, remote.WithFilter("artifactType", ArtifactType))...)
	if err != nil {
		if notFound(err) {
			return out, nil
		}
		return nil, fmt.Errorf("referrers of %s: %w", digest, err)
	}
	im, err := idx.IndexManifest()
	if err != nil {
		return nil, fmt.Errorf("referrers of %s: %w", digest, err)
	}
	for _, d := range im.Manifests {
		if d.ArtifactType != ArtifactType {
			continue
		}
		ref := repo.Digest(d.Digest.String())
		img, err := remote.Image(ref, opts...)
		if err != nil {
			return nil, fmt.Errorf("referrer %s: %w", ref, err)
		}
		if err := add(img, ref.String()+" (referrer)"); err != nil {
			return nil, fmt.Errorf("referrer %s: %w", ref, err)
		}
	}
	return out, nil
}

func fromManifest(img v1.Image, source string) ([]Signature, error) {
	m, err := img.Manifest()
	if err != nil {
		return nil, err
	}
	layers, err := img.Layers()
	if err != nil {
		return nil, err
	}
	var out []Signature
	for i, l := range m.Layers {
		if l.MediaType != PayloadMediaType {
			continue
		}
		sig, ok := l.Annotations[SignatureAnnotation]
		if !ok {
			continue
		}
		if l.Size > maxPayloadSize {
			return nil, fmt.Errorf("signature payload of %d bytes", l.Size)
		}
		rc, err := layers[i].Compressed()
		if err != nil {
			return nil, err
		}
		// go-containerregistry checks the blob against its digest as it
		// reads to the end.
		b, err := io.ReadAll(io.LimitReader(rc, maxPayloadSize+1))
		cerr := rc.Close()
		if err != nil {
			return nil, err
		}
		if cerr != nil {
			return nil, cerr
		}
		if len(b) > maxPayloadSize {
			return nil, fmt.Errorf("signature payload larger than %d bytes", maxPayloadSize)
		}
		out = append(out, Signature{
			Payload: b, Signature: sig, Source: source,
			Certificate: l.Annotations[CertificateAnnotation],
			Chain:       l.Annotations[ChainAnnotation],
			Bundle:      l.Annotations[BundleAnnotation],
		})
	}
	return out, nil
}

func notFound(err error) bool {
	var te *transport.Error
	if !errors.As(err, &te) {
		return false
	}
	if te.StatusCode == http.StatusNotFound {
		return true
	}
	for _, d := range te.Errors {
		switch d.Code {
		case transport.ManifestUnknownErrorCode, transport.NameUnknownErrorCode:
			return true
		}
	}
	return false
}
