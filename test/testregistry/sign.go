package testregistry

import (
	"bytes"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"encoding/base64"
	"os"
	"path/filepath"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/static"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/sigstore/sigstore/pkg/cryptoutils"
	"github.com/sigstore/sigstore/pkg/signature"
	"github.com/sigstore/sigstore/pkg/signature/payload"
)

// Cosign's names, as the cosign CLI writes them.
const (
	cosignPayloadType   = "application/vnd.dev.cosign.simplesigning.v1+json"
	cosignSigAnnotation = "dev.cosignproject.cosign/signature"
	cosignArtifactType  = "application/vnd.dev.cosign.artifact.sig.v1+json"
)

// Key is a signing key: ECDSA P-256 with SHA-256, what `cosign
// generate-key-pair` makes.
type Key struct {
	signer signature.SignerVerifier
	// PubPEM is the public key in PEM; PubPath a file holding it, in a
	// directory the test removes.
	PubPEM  []byte
	PubPath string
}

// NewKey generates a key and writes its public half to a file.
func NewKey(t testing.TB) *Key {
	t.Helper()
	priv, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	sv, err := signature.LoadECDSASignerVerifier(priv, crypto.SHA256)
	if err != nil {
		t.Fatal(err)
	}
	pub, err := cryptoutils.MarshalPublicKeyToPEM(priv.Public())
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(t.TempDir(), "key.pub")
	if err := os.WriteFile(p, pub, 0o644); err != nil {
		t.Fatal(err)
	}
	return &Key{signer: sv, PubPEM: pub, PubPath: p}
}

// Payload is cosign's payload for the image digest in repo: the
// repository as its identity, as cosign writes it.
func Payload(t testing.TB, repo, digest string) []byte {
	t.Helper()
	d, err := name.NewDigest(repo+"@"+digest, name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	b, err := payload.Cosign{Image: d}.MarshalJSON()
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// SignPayload returns the base64 signature of p, as cosign annotates it.
func (k *Key) SignPayload(t testing.TB, p []byte) string {
	t.Helper()
	sig, err := k.signer.SignMessage(bytes.NewReader(p))
	if err != nil {
		t.Fatal(err)
	}
	return base64.StdEncoding.EncodeToString(sig)
}

// SignatureImage is the artifact cosign pushes for one signature of p.
func (k *Key) SignatureImage(t testing.TB, p []byte) v1.Image {
	t.Helper()
	img := mutate.MediaType(empty.Image, types.OCIManifestSchema1)
	img = mutate.ConfigMediaType(img, types.OCIConfigJSON)
	img, err := mutate.Append(img, mutate.Addendum{
		Layer:       static.NewLayer(p, cosignPayloadType),
		Annotations: map[string]string{cosignSigAnnotation: k.SignPayload(t, p)},
	})
	if err != nil {
		t.Fatal(err)
	}
	return img
}

// Sign signs the image digest in repo ("HOST/path") as cosign does and
// stores the signature under the tag "sha256-<hex>.sig".
func (r *Registry) Sign(t testing.TB, k *Key, repo, digest string) {
	t.Helper()
	r.PushSignature(t, repo, digest, k.SignatureImage(t, Payload(t, repo, digest)))
}

// PushSignature stores sig as the signature of digest in repo, under the
// tag cosign uses.
func (r *Registry) PushSignature(t testing.TB, repo, digest string, sig v1.Image) {
	t.Helper()
	h, err := v1.NewHash(digest)
	if err != nil {
		t.Fatal(err)
	}
	tag, err := name.NewTag(repo+":"+h.Algorithm+"-"+h.Hex+".sig", name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.Write(tag, sig); err != nil {
		t.Fatalf("testregistry: push signature %s: %v", tag, err)
	}
}

// SignReferrer signs the image digest in repo and attaches the signature
// through the OCI 1.1 referrers API (cosign's
// --registry-referrers-mode=oci-1-1).
func (r *Registry) SignReferrer(t testing.TB, k *Key, repo, digest string) {
	t.Helper()
	h, err := v1.NewHash(digest)
	if err != nil {
		t.Fatal(err)
	}
	subj, err := remote.Head(mustDigest(t, repo, digest))
	if err != nil {
		t.Fatal(err)
	}
	sig := k.SignatureImage(t, Payload(t, repo, digest))
	// The artifact type is the config's media type; the subject comes
	// last, as mutations before it would drop it.
	sig = mutate.ConfigMediaType(sig, types.MediaType(cosignArtifactType))
	sig = mutate.Subject(sig, v1.Descriptor{MediaType: subj.MediaType, Digest: h, Size: subj.Size}).(v1.Image)
	sd, err := sig.Digest()
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.Write(mustDigest(t, repo, sd.String()), sig); err != nil {
		t.Fatalf("testregistry: push referrer of %s: %v", digest, err)
	}
}

func mustDigest(t testing.TB, repo, digest string) name.Digest {
	t.Helper()
	d, err := name.NewDigest(repo+"@"+digest, name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// Digest is the digest the registry serves for ref (a tag or digest
// reference).
func Digest(t testing.TB, ref string) string {
	t.Helper()
	r, err := name.ParseReference(ref, name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	d, err := remote.Head(r)
	if err != nil {
		t.Fatalf("testregistry: head %s: %v", ref, err)
	}
	return d.Digest.String()
}

// Fetch is the image the registry serves for ref.
func Fetch(t testing.TB, ref string) v1.Image {
	t.Helper()
	r, err := name.ParseReference(ref, name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	img, err := remote.Image(r)
	if err != nil {
		t.Fatalf("testregistry: fetch %s: %v", ref, err)
	}
	return img
}
