package image

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stagelet/stagelet/test/testregistry"
	"github.com/stagelet/stagelet/trust"
)

// verifier is what the broker gives a pull: the requirements of a policy
// that wants ref signed by key, checked on the digest the pull resolved.
func verifier(t testing.TB, key *testregistry.Key, ref string) Verify {
	t.Helper()
	p, err := trust.Parse("policy.json", []byte(fmt.Sprintf(`{"default": [{"type": "sigstoreSigned", "keyPath": %q, "signedIdentity": {"type": "matchRepository"}}]}`, key.PubPath)), nil)
	if err != nil {
		t.Fatal(err)
	}
	r, err := trust.ParseReference(ref)
	if err != nil {
		t.Fatal(err)
	}
	d := &trust.Decision{File: "policy.json", Scope: "default", Requirements: p.Default}
	return func(ctx context.Context, digest string, kept []trust.Signature, fetch func() ([]trust.Signature, error)) ([]trust.Signature, error) {
		sigs, _, err := d.Verify(trust.Image{Ref: r, Digest: digest}, kept, fetch)
		return sigs, err
	}
}

func TestPullVerify(t *testing.T) {
	requireRoot(t)
	reg := testregistry.Start(t)
	key := testregistry.NewKey(t)
	signed := reg.PushBusybox(t, "team/signed", "v1")
	reg.Sign(t, key, reg.Host+"/team/signed", testregistry.Digest(t, signed))
	unsigned := reg.Push(t, "team/unsigned", "v1", testregistry.WithConfig(testregistry.BusyboxImage(t), nil, []string{"true"}, ""))
	root := filepath.Join(t.TempDir(), "images")
	s, err := NewStore(root, Config{}, discard)
	if err != nil {
		t.Fatal(err)
	}

	before := reg.BlobGets()
	_, err = s.Pull(pullCtx(t), unsigned, nil, verifier(t, key, unsigned))
	if err == nil || !strings.Contains(err.Error(), "no signature") {
		t.Fatalf("pull of an unsigned image: %v, want the verifier's refusal", err)
	}
	if got := reg.BlobGets() - before; got != 0 {
		t.Errorf("a refused pull fetched %d blobs", got)
	}
	if imgs := s.List(); len(imgs) != 0 {
		t.Errorf("a refused pull stored %d images", len(imgs))
	}
	if layers, _ := os.ReadDir(filepath.Join(root, "layers")); len(layers) != 0 {
		t.Errorf("a refused pull left %d layers", len(layers))
	}

	img, err := s.Pull(pullCtx(t), signed, nil, verifier(t, key, signed))
	if err != nil {
		t.Fatal(err)
	}
	if len(img.Signatures) != 1 {
		t.Fatalf("signatures kept: %+v", img.Signatures)
	}
	// Kept beside the image across a restart, once even when pulled again.
	if _, err := s.Pull(pullCtx(t), signed, nil, verifier(t, key, signed)); err != nil {
		t.Fatal(err)
	}
	s2, err := NewStore(root, Config{}, discard)
	if err != nil {
		t.Fatal(err)
	}
	again, err := s2.Get(signed)
	if err != nil {
		t.Fatal(err)
	}
	if len(again.Signatures) != 1 || !again.Signatures[0].Same(img.Signatures[0]) {
		t.Errorf("signatures after reopening the store: %+v", again.Signatures)
	}
}

// BenchmarkPullVerified pulls a signed image into an empty store, with and
// without the signature check, alternately, and reports the verified
// pull's time as a multiple of the unverified one's (x-unverified).
func BenchmarkPullVerified(b *testing.B) {
	ref, verify := signedImage(b)
	base := b.TempDir()
	pull := func(v Verify) time.Duration {
		root := filepath.Join(base, "images")
		s, err := NewStore(root, Config{}, discard)
		if err != nil {
			b.Fatal(err)
		}
		start := time.Now()
		if _, err := s.Pull(pullCtx(b), ref, nil, v); err != nil {
			b.Fatal(err)
		}
		took := time.Since(start)
		if err := os.RemoveAll(root); err != nil {
			b.Fatal(err)
		}
		return took
	}
	var plain, verified time.Duration
	for b.Loop() {
		plain += pull(nil)
		verified += pull(verify)
	}
	reportRatio(b, plain, verified)
}

// BenchmarkPullPresentVerified pulls a signed image the store has (the
// kubelet's imagePullPolicy: Always), with and without the signature
// check, alternately, and reports the verified pull's time as a multiple
// of the unverified one's: the signatures kept at the first pull answer,
// the registry is asked for the manifest only.
func BenchmarkPullPresentVerified(b *testing.B) {
	ref, verify := signedImage(b)
	s := newStore(b, Config{})
	if _, err := s.Pull(pullCtx(b), ref, nil, verify); err != nil {
		b.Fatal(err)
	}
	pull := func(v Verify) time.Duration {
		start := time.Now()
		if _, err := s.Pull(pullCtx(b), ref, nil, v); err != nil {
			b.Fatal(err)
		}
		return time.Since(start)
	}
	var plain, verified time.Duration
	for b.Loop() {
		plain += pull(nil)
		verified += pull(verify)
	}
	reportRatio(b, plain, verified)
}

// signedImage pushes busybox to a registry of its own, signs it as cosign
// does, and returns its reference and the verifier of a policy that wants
// it signed with that key.
func signedImage(b *testing.B) (string, Verify) {
	b.Helper()
	requireRoot(b)
	reg := testregistry.Start(b)
	key := testregistry.NewKey(b)
	ref := reg.PushBusybox(b, "team/signed", "v1")
	reg.Sign(b, key, reg.Host+"/team/signed", testregistry.Digest(b, ref))
	return ref, verifier(b, key, ref)
}

// reportRatio reports the mean unverified and verified pull times and the
// verified one as a multiple of the other (x-unverified).
func reportRatio(b *testing.B, plain, verified time.Duration) {
	b.ReportMetric(float64(plain.Microseconds())/float64(b.N)/1000, "ms-unverified")
	b.ReportMetric(float64(verified.Microseconds())/float64(b.N)/1000, "ms-verified")
	b.ReportMetric(float64(verified)/float64(plain), "x-unverified")
}
