package trust

import (
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/asn1"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"math/big"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/static"
	"github.com/sigstore/sigstore/pkg/cryptoutils"

	"github.com/stagelet/stagelet/test/testregistry"
)

const (
	testIssuer = "https://token.actions.example.com"
	testEmail  = "release@example.com"
	testRepo   = "reg.example.com/team/app"
)

var testDigest = "sha256:" + strings.Repeat("1", 64)

func newECKey(t *testing.T) *ecdsa.PrivateKey {
	t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func pemOf(t *testing.T, v any) []byte {
	t.Helper()
	var b []byte
	var err error
	switch v := v.(type) {
	case *x509.Certificate:
		b, err = cryptoutils.MarshalCertificateToPEM(v)
	default:
		b, err = cryptoutils.MarshalPublicKeyToPEM(v)
	}
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// fakeFulcio is a Fulcio CA: a root and the intermediate that issues
// signing certificates.
type fakeFulcio struct {
	rootPEM, chainPEM []byte // the root; the intermediate then the root
	inter             *x509.Certificate
	interKey          *ecdsa.PrivateKey
}

func createCert(t *testing.T, tmpl, parent *x509.Certificate, pub, signer any) *x509.Certificate {
	t.Helper()
	der, err := x509.CreateCertificate(rand.Reader, tmpl, parent, pub, signer)
	if err != nil {
		t.Fatal(err)
	}
	c, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func newFulcio(t *testing.T) *fakeFulcio {
	rootKey, interKey := newECKey(t), newECKey(t)
	now := time.Now()
	rootTmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{Organization: []string{"test"}, CommonName: "sigstore"},
		NotBefore: now.AddDate(-1, 0, 0), NotAfter: now.AddDate(10, 0, 0),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	root := createCert(t, rootTmpl, rootTmpl, rootKey.Public(), rootKey)
	inter := createCert(t, &x509.Certificate{
		SerialNumber: big.NewInt(2), Subject: pkix.Name{Organization: []string{"test"}, CommonName: "sigstore-intermediate"},
		NotBefore: now.AddDate(-1, 0, 0), NotAfter: now.AddDate(10, 0, 0),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageCodeSigning},
	}, root, interKey.Public(), rootKey)
	rootPEM := pemOf(t, root)
	return &fakeFulcio{rootPEM: rootPEM, chainPEM: append(pemOf(t, inter), rootPEM...), inter: inter, interKey: interKey}
}

// leafOpts is what a Fulcio certificate says; zero values are the good
// ones.
type leafOpts struct {
	issuer, email string
	noIssuerV2    bool
	usage         x509.ExtKeyUsage
	notBefore     time.Time
}

// issue is a certificate, as Fulcio issues one for 10 minutes, of the
// signer's ephemeral key.
func (f *fakeFulcio) issue(t *testing.T, key *ecdsa.PrivateKey, o leafOpts) *x509.Certificate {
	t.Helper()
	if o.issuer == "" {
		o.issuer = testIssuer
	}
	if o.email == "" {
		o.email = testEmail
	}
	if o.usage == 0 {
		o.usage = x509.ExtKeyUsageCodeSigning
	}
	exts := []pkix.Extension{{Id: oidIssuerV1, Value: []byte(o.issuer)}}
	if !o.noIssuerV2 {
		v2, err := asn1.MarshalWithParams(o.issuer, "utf8")
		if err != nil {
			t.Fatal(err)
		}
		exts = append(exts, pkix.Extension{Id: oidIssuerV2, Value: v2})
	}
	return createCert(t, &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano()),
		NotBefore:    o.notBefore, NotAfter: o.notBefore.Add(10 * time.Minute),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{o.usage},
		EmailAddresses: []string{o.email}, ExtraExtensions: exts,
	}, f.inter, key.Public(), f.interKey)
}

// fakeRekor is a Rekor log: its key, and the bundles of what it logs.
type fakeRekor struct {
	key    *ecdsa.PrivateKey
	pubPEM []byte
	logID  string
}

func newRekor(t *testing.T) *fakeRekor {
	k := newECKey(t)
	der, err := cryptoutils.MarshalPublicKeyToDER(k.Public())
	if err != nil {
		t.Fatal(err)
	}
	id := sha256.Sum256(der)
	return &fakeRekor{key: k, pubPEM: pemOf(t, k.Public()), logID: hex.EncodeToString(id[:])}
}

// rekordEntry is the hashedrekord body Rekor logs for sig of payload by
// signerPEM (a certificate or a public key).
func rekordEntry(signerPEM, sig, payload []byte) []byte {
	h := sha256.Sum256(payload)
	body, _ := json.Marshal(map[string]any{
		"apiVersion": "0.0.1",
		"kind":       "hashedrekord",
		"spec": map[string]any{
			"data":      map[string]any{"hash": map[string]any{"algorithm": "sha256", "value": hex.EncodeToString(h[:])}},
			"signature": map[string]any{"content": sig, "publicKey": map[string]any{"content": signerPEM}},
		},
	})
	return body
}

// bundle is cosign's bundle annotation of body, logged at at: the
// canonical JSON of its payload signed with the log's key.
func (r *fakeRekor) bundle(t *testing.T, body []byte, at time.Time) string {
	t.Helper()
	canonical := fmt.Sprintf(`{"body":%q,"integratedTime":%d,"logID":%q,"logIndex":%d}`,
		base64.StdEncoding.EncodeToString(body), at.Unix(), r.logID, 42)
	h := sha256.Sum256([]byte(canonical))
	set, err := ecdsa.SignASN1(rand.Reader, r.key, h[:])
	if err != nil {
		t.Fatal(err)
	}
	// cosign writes the payload's keys in its struct's order.
	b, err := json.Marshal(map[string]any{
		"SignedEntryTimestamp": set,
		"Payload": json.RawMessage(fmt.Sprintf(`{"body":%q,"integratedTime":%d,"logIndex":%d,"logID":%q}`,
			base64.StdEncoding.EncodeToString(body), at.Unix(), 42, r.logID)),
	})
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func signRaw(t *testing.T, key *ecdsa.PrivateKey, payload []byte) []byte {
	t.Helper()
	h := sha256.Sum256(payload)
	sig, err := ecdsa.SignASN1(rand.Reader, key, h[:])
	if err != nil {
		t.Fatal(err)
	}
	return sig
}

// keylessWorld is a Fulcio and a Rekor trusted by a policy, and others
// that are not.
type keylessWorld struct {
	fulcio, otherFulcio *fakeFulcio
	rekor, otherRekor   *fakeRekor
	dir                 string
}

func newKeylessWorld(t *testing.T) *keylessWorld {
	return &keylessWorld{fulcio: newFulcio(t), otherFulcio: newFulcio(t), rekor: newRekor(t), otherRekor: newRekor(t), dir: t.TempDir()}
}

// policy is a fulcio requirement with the world's CA and Rekor key in
// files.
func (w *keylessWorld) policy(t *testing.T) Requirements {
	t.Helper()
	ca := write(t, filepath.Join(w.dir, "fulcio.pem"), string(w.fulcio.rootPEM))
	rk := write(t, filepath.Join(w.dir, "rekor.pub"), string(w.rekor.pubPEM))
	p, err := Parse("p.json", []byte(fmt.Sprintf(`{"default": [{"type": "sigstoreSigned",
		"fulcio": {"caPath": %q, "oidcIssuer": %q, "subjectEmail": %q},
		"rekorPublicKeyPath": %q, "signedIdentity": {"type": "matchRepository"}}]}`, ca, testIssuer, testEmail, rk)), nil)
	if err != nil {
		t.Fatal(err)
	}
	return p.Default
}

// keylessOpts says how a keyless signature is made; zero values make a
// good one.
type keylessOpts struct {
	leaf     leafOpts
	ca       *fakeFulcio
	rekor    *fakeRekor
	loggedAt time.Duration // after the certificate's NotBefore; 1m if 0
	noChain  bool
	// entry, if set, is the body Rekor logs instead of the signature's.
	entry func(certPEM, sig, payload []byte) []byte
	// signer, if set, signs the payload instead of the certificate's key.
	signer *ecdsa.PrivateKey
}

// sign signs a payload for testRepo@testDigest keyless, as `cosign sign`
// with Fulcio and Rekor does.
func (w *keylessWorld) sign(t *testing.T, o keylessOpts) Signature {
	t.Helper()
	if o.ca == nil {
		o.ca = w.fulcio
	}
	if o.rekor == nil {
		o.rekor = w.rekor
	}
	if o.loggedAt == 0 {
		o.loggedAt = time.Minute
	}
	if o.leaf.notBefore.IsZero() {
		// Long expired now: only the time of the SET matters.
		o.leaf.notBefore = time.Now().Add(-48 * time.Hour).Truncate(time.Second)
	}
	key := newECKey(t)
	cert := o.ca.issue(t, key, o.leaf)
	certPEM := pemOf(t, cert)
	payload := testregistry.Payload(t, testRepo, testDigest)
	signer := key
	if o.signer != nil {
		signer = o.signer
	}
	sig := signRaw(t, signer, payload)
	body := rekordEntry(certPEM, sig, payload)
	if o.entry != nil {
		body = o.entry(certPEM, sig, payload)
	}
	s := Signature{
		Payload:     payload,
		Signature:   base64.StdEncoding.EncodeToString(sig),
		Certificate: string(certPEM),
		Chain:       string(o.ca.chainPEM),
		Bundle:      o.rekor.bundle(t, body, o.leaf.notBefore.Add(o.loggedAt)),
		Source:      "test",
	}
	if o.noChain {
		s.Chain = ""
	}
	return s
}

// editBundle rewrites the JSON of s's bundle with edit.
func editBundle(t *testing.T, s Signature, edit func(b map[string]any)) Signature {
	t.Helper()
	var b map[string]any
	if err := json.Unmarshal([]byte(s.Bundle), &b); err != nil {
		t.Fatal(err)
	}
	edit(b)
	out, err := json.Marshal(b)
	if err != nil {
		t.Fatal(err)
	}
	s.Bundle = string(out)
	return s
}

func TestKeyless(t *testing.T) {
	w := newKeylessWorld(t)
	rs := w.policy(t)
	img := Image{Ref: Reference{Repo: testRepo, Tag: "v1"}, Digest: testDigest}
	good := w.sign(t, keylessOpts{})
	for _, tc := range []struct {
		name string
		sig  Signature
		img  Image
		want string // "" accepts
	}{
		{"signed", good, img, ""},
		{"issuer v1 extension only", w.sign(t, keylessOpts{leaf: leafOpts{noIssuerV2: true}}), img, ""},
		{"another digest", good, Image{Ref: img.Ref, Digest: "sha256:" + strings.Repeat("2", 64)}, "signature for another digest"},
		{"another CA", w.sign(t, keylessOpts{ca: w.otherFulcio}), img, "certificate not issued by the Fulcio CA " + filepath.Join(w.dir, "fulcio.pem")},
		{"no intermediates", w.sign(t, keylessOpts{noChain: true}), img, "certificate not issued by the Fulcio CA"},
		{"another issuer", w.sign(t, keylessOpts{leaf: leafOpts{issuer: "https://accounts.example.org"}}), img, "OIDC issuer https://accounts.example.org, want " + testIssuer},
		{"another email", w.sign(t, keylessOpts{leaf: leafOpts{email: "mallory@example.com"}}), img, "certificate email mallory@example.com, want " + testEmail},
		{"not for code signing", w.sign(t, keylessOpts{leaf: leafOpts{usage: x509.ExtKeyUsageServerAuth}}), img, "certificate not for code signing"},
		{"expired when logged", w.sign(t, keylessOpts{loggedAt: 11 * time.Minute}), img, "certificate not valid when Rekor logged the signature"},
		{"logged before issued", w.sign(t, keylessOpts{loggedAt: -time.Minute}), img, "certificate not valid when Rekor logged the signature"},
		{"signed with another key", w.sign(t, keylessOpts{signer: newECKey(t)}), img, "the signature does not verify with its certificate's key"},
		{"no bundle", func() Signature { s := good; s.Bundle = ""; return s }(), img, "no Rekor bundle"},
		{"no certificate", func() Signature { s := good; s.Certificate = ""; return s }(), img, "no Fulcio certificate"},
		{"bundle not JSON", func() Signature { s := good; s.Bundle = "{"; return s }(), img, "bad Rekor bundle"},
		{"another log", w.sign(t, keylessOpts{rekor: w.otherRekor}), img, "Rekor SET is of another log"},
		{"tampered SET", editBundle(t, good, func(b map[string]any) {
			set, _ := base64.StdEncoding.DecodeString(b["SignedEntryTimestamp"].(string))
			set[len(set)-1] ^= 1
			b["SignedEntryTimestamp"] = set
		}), img, "Rekor SET does not verify with the Rekor key " + filepath.Join(w.dir, "rekor.pub")},
		{"tampered time", editBundle(t, good, func(b map[string]any) {
			b["Payload"].(map[string]any)["integratedTime"] = time.Now().Unix()
		}), img, "Rekor SET does not verify"},
		{"SET by another key under the log's ID", w.sign(t, keylessOpts{rekor: &fakeRekor{key: newECKey(t), logID: w.rekor.logID}}), img, "Rekor SET does not verify"},
		{"entry for another signature", w.sign(t, keylessOpts{entry: func(c, _, p []byte) []byte { return rekordEntry(c, signRaw(t, newECKey(t), p), p) }}), img, "Rekor entry is for another signature"},
		{"entry for another payload", w.sign(t, keylessOpts{entry: func(c, s, _ []byte) []byte { return rekordEntry(c, s, []byte("other")) }}), img, "Rekor entry is for another payload"},
		{"entry for another certificate", w.sign(t, keylessOpts{entry: func(_, s, p []byte) []byte { return rekordEntry(pemOf(t, newECKey(t).Public()), s, p) }}), img, "Rekor entry is for another certificate or public key"},
		{"entry of another kind", w.sign(t, keylessOpts{entry: func([]byte, []byte, []byte) []byte { return []byte(`{"apiVersion":"0.0.1","kind":"intoto","spec":{}}`) }}), img, `Rekor entry is of kind "intoto"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := rs.Check(tc.img, []Signature{tc.sig})
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("refused: %v", err)
			case tc.want != "" && err == nil:
				t.Fatalf("accepted, want %q", tc.want)
			case tc.want != "" && !strings.Contains(err.Error(), tc.want):
				t.Fatalf("error %q, want it to contain %q", err, tc.want)
			}
		})
	}
}

// TestKeyWithRekor: a key's signature must also carry a Rekor SET when
// the policy names Rekor keys.
func TestKeyWithRekor(t *testing.T) {
	key, other := testregistry.NewKey(t), testregistry.NewKey(t)
	rekor := newRekor(t)
	p, err := Parse("p.json", []byte(fmt.Sprintf(`{"default": [{"type": "sigstoreSigned", "keyPath": %q,
		"rekorPublicKeyDatas": [%q], "signedIdentity": {"type": "matchRepository"}}]}`,
		key.PubPath, base64.StdEncoding.EncodeToString(rekor.pubPEM))), nil)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := p.Default.Describe(), "sigstoreSigned (keys "+key.PubPath+"; Rekor keys rekorPublicKeyData[0]; identity matchRepository)"; got != want {
		t.Errorf("Describe: %s, want %s", got, want)
	}
	img := Image{Ref: Reference{Repo: testRepo, Tag: "v1"}, Digest: testDigest}
	logged := func(k *testregistry.Key, signerPEM []byte) Signature {
		s := signed(t, k, testRepo, testDigest)
		sig, err := base64.StdEncoding.DecodeString(s.Signature)
		if err != nil {
			t.Fatal(err)
		}
		s.Bundle = rekor.bundle(t, rekordEntry(signerPEM, sig, s.Payload), time.Now())
		return s
	}
	for _, tc := range []struct {
		name string
		sig  Signature
		want string
	}{
		{"signed and logged", logged(key, key.PubPEM), ""},
		{"not logged", signed(t, key, testRepo, testDigest), "no Rekor bundle"},
		{"another key", logged(other, other.PubPEM), "wrong key"},
		{"logged for another key", logged(key, other.PubPEM), "Rekor entry is for another certificate or public key"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := p.Default.Check(img, []Signature{tc.sig})
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("refused: %v", err)
			case tc.want != "" && err == nil:
				t.Fatalf("accepted, want %q", tc.want)
			case tc.want != "" && !strings.Contains(err.Error(), tc.want):
				t.Fatalf("error %q, want it to contain %q", err, tc.want)
			}
		})
	}
}

func TestParseKeyless(t *testing.T) {
	dir := t.TempDir()
	w := newKeylessWorld(t)
	key := testregistry.NewKey(t)
	ca := write(t, filepath.Join(dir, "fulcio.pem"), string(w.fulcio.rootPEM))
	rk := write(t, filepath.Join(dir, "rekor.pub"), string(w.rekor.pubPEM))
	caData := base64.StdEncoding.EncodeToString(w.fulcio.rootPEM)
	edPub, _, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	edKey := write(t, filepath.Join(dir, "ed.pub"), string(pemOf(t, edPub)))
	junk := write(t, filepath.Join(dir, "junk.pem"), "junk")
	fulcio := func(f string) string { return `"fulcio": {` + f + `}` }
	good := fmt.Sprintf(`"caPath": %q, "oidcIssuer": %q, "subjectEmail": %q`, ca, testIssuer, testEmail)
	policy := func(fields ...string) string {
		return `{"default": [{"type": "sigstoreSigned", ` + strings.Join(fields, ", ") + `}]}`
	}
	rekorPath := fmt.Sprintf(`"rekorPublicKeyPath": %q`, rk)

	t.Run("loads", func(t *testing.T) {
		for _, tc := range []struct{ policy, describe string }{
			{policy(fulcio(good), rekorPath), fmt.Sprintf("sigstoreSigned (Fulcio CA %s, issuer %s, email %s; Rekor keys %s; identity matchRepoDigestOrExact)", ca, testIssuer, testEmail, rk)},
			{policy(fulcio(fmt.Sprintf(`"caData": %q, "oidcIssuer": "i", "subjectEmail": "e"`, caData)), fmt.Sprintf(`"rekorPublicKeyPaths": [%q, %q]`, rk, rk)), fmt.Sprintf("sigstoreSigned (Fulcio CA fulcio.caData, issuer i, email e; Rekor keys %s, %s; identity matchRepoDigestOrExact)", rk, rk)},
		} {
			f := write(t, filepath.Join(dir, "policy.json"), tc.policy)
			var seen []string
			p, err := Load(f, func(s string) { seen = append(seen, s) })
			if err != nil {
				t.Fatal(err)
			}
			if got := p.Default.Describe(); got != tc.describe {
				t.Errorf("Describe: %s, want %s", got, tc.describe)
			}
			// A changed CA or Rekor key file reloads the policy.
			if !slices.Contains(seen, rk) || strings.Contains(tc.policy, "caPath") && !slices.Contains(seen, ca) {
				t.Errorf("seen %v lacks the key files", seen)
			}
		}
	})

	for _, tc := range []struct {
		name, policy string
		want         []string
	}{
		{"fulcio without rekor", policy(fulcio(good)), []string{"default[0]", "fulcio", "needs a Rekor public key"}},
		{"fulcio without issuer", policy(fulcio(fmt.Sprintf(`"caPath": %q, "subjectEmail": "e"`, ca)), rekorPath), []string{"fulcio.oidcIssuer", "missing"}},
		{"fulcio without email", policy(fulcio(fmt.Sprintf(`"caPath": %q, "oidcIssuer": "i"`, ca)), rekorPath), []string{"fulcio.subjectEmail", "missing"}},
		{"fulcio without CA", policy(fulcio(`"oidcIssuer": "i", "subjectEmail": "e"`), rekorPath), []string{"fulcio", "exactly one of caPath and caData"}},
		{"fulcio with two CAs", policy(fulcio(good+fmt.Sprintf(`, "caData": %q`, caData)), rekorPath), []string{"fulcio", "exactly one of caPath and caData"}},
		{"fulcio unknown key", policy(fulcio(good+`, "subjectURI": "u"`), rekorPath), []string{"fulcio", "subjectURI"}},
		{"fulcio relative CA", policy(fulcio(`"caPath": "ca.pem", "oidcIssuer": "i", "subjectEmail": "e"`), rekorPath), []string{"fulcio.caPath ca.pem", "absolute"}},
		{"fulcio CA not PEM", policy(fulcio(fmt.Sprintf(`"caPath": %q, "oidcIssuer": "i", "subjectEmail": "e"`, junk)), rekorPath), []string{"fulcio.caPath " + junk, "not PEM certificates"}},
		{"fulcio and a key", policy(fulcio(good), rekorPath, fmt.Sprintf(`"keyPath": %q`, key.PubPath)), []string{"exactly one of keyPath, keyPaths, keyData, keyDatas and fulcio", "(2 are)"}},
		{"two rekor sources", policy(fulcio(good), rekorPath, fmt.Sprintf(`"rekorPublicKeyData": %q`, caData)), []string{"rekorPublicKeyPath", "at most one of"}},
		{"rekor key not ECDSA", policy(fulcio(good), fmt.Sprintf(`"rekorPublicKeyPath": %q`, edKey)), []string{"rekorPublicKeyPath " + edKey, "not an ECDSA key"}},
		{"rekor key missing", policy(fulcio(good), `"rekorPublicKeyPath": "/nonexistent/rekor.pub"`), []string{"rekorPublicKeyPath /nonexistent/rekor.pub", "no such file"}},
		{"rekor data not base64", policy(fulcio(good), `"rekorPublicKeyDatas": ["!!"]`), []string{"rekorPublicKeyData[0]", "not base64"}},
		{"pki", policy(`"pki": {"caRootsPath": "/r", "subjectEmail": "e"}`), []string{"pki", "not implemented by stagelet"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := write(t, filepath.Join(dir, "policy.json"), tc.policy)
			_, err := Load(f, nil)
			if err == nil {
				t.Fatalf("loaded %s", tc.policy)
			}
			for _, w := range append(tc.want, f) {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not contain %q", err, w)
				}
			}
		})
	}
}

// TestKeylessAnnotationsAreKept: the certificate, chain and bundle travel
// from the signature layer's annotations to the JSON kept beside an
// image, and only when there are some.
func TestKeylessAnnotationsAreKept(t *testing.T) {
	w := newKeylessWorld(t)
	want := w.sign(t, keylessOpts{})
	img, err := mutate.Append(empty.Image, mutate.Addendum{
		Layer: static.NewLayer(want.Payload, PayloadMediaType),
		Annotations: map[string]string{
			SignatureAnnotation:   want.Signature,
			CertificateAnnotation: want.Certificate,
			ChainAnnotation:       want.Chain,
			BundleAnnotation:      want.Bundle,
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	sigs, err := fromManifest(img, "test")
	if err != nil {
		t.Fatal(err)
	}
	if len(sigs) != 1 || !sigs[0].Same(want) {
		t.Fatalf("signatures %+v, want %+v", sigs, want)
	}
	b, err := json.Marshal(sigs[0])
	if err != nil {
		t.Fatal(err)
	}
	var back Signature
	if err := json.Unmarshal(b, &back); err != nil || !back.Same(want) {
		t.Fatalf("round trip: %v, %+v", err, back)
	}
	if err := w.policy(t).Check(Image{Ref: Reference{Repo: testRepo}, Digest: testDigest}, []Signature{back}); err != nil {
		t.Fatalf("kept signature refused: %v", err)
	}
	b, err = json.Marshal(Signature{Payload: want.Payload, Signature: want.Signature})
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"certificate", "chain", "bundle"} {
		if strings.Contains(string(b), `"`+k+`"`) {
			t.Errorf("a key's signature is kept with %q: %s", k, b)
		}
	}
	other := want
	other.Bundle = ""
	if other.Same(want) {
		t.Error("signatures that differ in their bundle are the same")
	}
}
