package trust

import (
	"bytes"
	"crypto"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	"github.com/sigstore/sigstore/pkg/cryptoutils"
	"github.com/sigstore/sigstore/pkg/signature"
	crierrors "k8s.io/cri-api/pkg/errors"
)

// Cosign's names for what it stores in a registry.
const (
	// PayloadMediaType is the media type of a signature layer's blob.
	PayloadMediaType = "application/vnd.dev.cosign.simplesigning.v1+json"
	// SignatureAnnotation holds a signature layer's base64 signature.
	SignatureAnnotation = "dev.cosignproject.cosign/signature"
	// ArtifactType is the artifact type of a signature attached through
	// the OCI 1.1 referrers API.
	ArtifactType = "application/vnd.dev.cosign.artifact.sig.v1+json"
	// PayloadType is a payload's critical.type.
	PayloadType = "cosign container image signature"
	// CertificateAnnotation holds a keyless signature's PEM certificate,
	// issued by Fulcio.
	CertificateAnnotation = "dev.sigstore.cosign/certificate"
	// ChainAnnotation holds the PEM certificates between that
	// certificate and Fulcio's root, the root last.
	ChainAnnotation = "dev.sigstore.cosign/chain"
	// BundleAnnotation holds the JSON Rekor bundle of a signature: the
	// Rekor entry that logged it and the log's signed entry timestamp.
	BundleAnnotation = "dev.sigstore.cosign/bundle"
)

// Signature is one sigstore signature as found in a registry, and as kept
// beside an image to check it again without the registry.
type Signature struct {
	// Payload is the signed blob: cosign's simple signing JSON.
	Payload []byte `json:"payload"`
	// Signature is the base64 signature of Payload.
	Signature string `json:"signature"`
	// Certificate and Chain are the PEM Fulcio certificate of a keyless
	// signature and its intermediates; Bundle is the JSON Rekor bundle.
	// Each is empty when the signature has no such annotation.
	Certificate string `json:"certificate,omitempty"`
	Chain       string `json:"chain,omitempty"`
	Bundle      string `json:"bundle,omitempty"`
	// Source is where it was found: "repo:sha256-<hex>.sig" or
	// "repo@sha256:<hex> (referrer)".
	Source string `json:"source"`
}

// Same reports whether s and o are one signature.
func (s Signature) Same(o Signature) bool {
	return s.Signature == o.Signature && bytes.Equal(s.Payload, o.Payload) &&
		s.Certificate == o.Certificate && s.Chain == o.Chain && s.Bundle == o.Bundle
}

// payload is the part of cosign's payload that says what was signed.
// Unknown keys in "critical" are refused, as containers/image does: they
// may say something this verifier would ignore.
type payload struct {
	Critical struct {
		Identity struct {
			DockerReference string `json:"docker-reference"`
		} `json:"identity"`
		Image struct {
			DockerManifestDigest string `json:"docker-manifest-digest"`
		} `json:"image"`
		Type string `json:"type"`
	} `json:"critical"`
	Optional map[string]any `json:"optional"`
}

// Image is what a check is about: the reference the user asked for (by
// tag or digest) and the manifest digest it resolved to.
type Image struct {
	Ref    Reference
	Digest string
}

// Check returns nil when every requirement of rs accepts img given sigs;
// otherwise the reason the first refusing requirement gives.
func (rs Requirements) Check(img Image, sigs []Signature) error {
	for _, r := range rs {
		if err := r.check(img, sigs); err != nil {
			return err
		}
	}
	return nil
}

func (r *Requirement) check(img Image, sigs []Signature) error {
	switch r.Type {
	case TypeAccept:
		return nil
	case TypeReject:
		return errors.New("the policy rejects every image here")
	case TypeSigstore:
	default:
		return fmt.Errorf("requirement %q is not implemented", r.Type)
	}
	if len(sigs) == 0 {
		return errors.New("no signature: found neither the tag " + SigTag(img.Digest) + " nor an OCI referrer")
	}
	var reasons []string
	for i, s := range sigs {
		err := r.checkOne(img, s)
		if err == nil {
			return nil
		}
		reasons = append(reasons, err.Error())
		if len(sigs) > 1 {
			reasons[i] = fmt.Sprintf("signature %d (%s): %s", i+1, s.Source, reasons[i])
		}
	}
	return errors.New(strings.Join(reasons, "; "))
}

func (r *Requirement) checkOne(img Image, s Signature) error {
	raw, err := base64.StdEncoding.DecodeString(s.Signature)
	if err != nil {
		return fmt.Errorf("bad signature: not base64: %v", err)
	}
	if err := r.verifySignature(s, raw); err != nil {
		return err
	}
	// Only now is the payload trusted enough to be parsed.
	var p payload
	dec := json.NewDecoder(bytes.NewReader(s.Payload))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&p); err != nil {
		return fmt.Errorf("bad payload: %v", err)
	}
	if p.Critical.Type != PayloadType {
		return fmt.Errorf("bad payload: type %q, want %q", p.Critical.Type, PayloadType)
	}
	if p.Critical.Image.DockerManifestDigest != img.Digest {
		return fmt.Errorf("signature for another digest: it signs %s, the image is %s", p.Critical.Image.DockerManifestDigest, img.Digest)
	}
	signed, err := ParseReference(p.Critical.Identity.DockerReference)
	if err != nil {
		return fmt.Errorf("identity mismatch: the signature names %q: %v", p.Critical.Identity.DockerReference, err)
	}
	if !identityMatches(r.Identity, img.Ref, signed) {
		return fmt.Errorf("identity mismatch: the signature names %s, %s does not accept it for %s", signed, r.Identity.Type, img.Ref)
	}
	return nil
}

// verifySignature checks that raw, the signature of s.Payload, was made as
// r requires: with one of its keys, or keyless with a certificate of its
// Fulcio CA; and logged by Rekor, if r names Rekor keys.
func (r *Requirement) verifySignature(s Signature, raw []byte) error {
	if r.Fulcio != nil {
		return r.verifyKeyless(s, raw)
	}
	var key signature.Verifier
	for _, k := range r.Keys {
		if k.VerifySignature(bytes.NewReader(raw), bytes.NewReader(s.Payload)) == nil {
			key = k
			break
		}
	}
	if key == nil {
		return fmt.Errorf("wrong key: the signature does not verify with %s", strings.Join(r.KeyNames, ", "))
	}
	if len(r.Rekor) == 0 {
		return nil
	}
	pub, err := key.PublicKey()
	if err != nil {
		return err
	}
	der, err := cryptoutils.MarshalPublicKeyToDER(pub)
	if err != nil {
		return err
	}
	// A key's signature has no time to check: the SET proves it was
	// logged.
	_, err = verifySET(r.Rekor, s.Bundle, der, raw, s.Payload)
	return err
}

// verifyKeyless checks a keyless signature: its Rekor SET, its Fulcio
// certificate at the time the SET gives, and raw with the certificate's
// key.
func (r *Requirement) verifyKeyless(s Signature, raw []byte) error {
	if s.Certificate == "" {
		return fmt.Errorf("no Fulcio certificate: the signature has no %s annotation (signed with a key, not keyless?)", CertificateAnnotation)
	}
	leaf, err := parseLeaf(s.Certificate)
	if err != nil {
		return err
	}
	at, err := verifySET(r.Rekor, s.Bundle, leaf.Raw, raw, s.Payload)
	if err != nil {
		return err
	}
	if err := r.Fulcio.verify(leaf, s.Chain, at); err != nil {
		return err
	}
	v, err := signature.LoadVerifier(leaf.PublicKey, crypto.SHA256)
	if err != nil {
		return fmt.Errorf("unusable certificate key: %v", err)
	}
	if v.VerifySignature(bytes.NewReader(raw), bytes.NewReader(s.Payload)) != nil {
		return errors.New("the signature does not verify with its certificate's key")
	}
	return nil
}

// SigTag is the tag cosign stores digest's signatures under.
func SigTag(digest string) string {
	return strings.Replace(digest, ":", "-", 1) + ".sig"
}

// Rejection is an image the policy refuses. Its message starts with
// SignatureValidationFailed, which the kubelet shows as the reason of a
// failed pull.
type Rejection struct {
	// Use is what the image was for, when not a container's own image
	// ("volume /data", "checkpoint image …").
	Use       string
	Image     string // the reference as asked
	Digest    string // the manifest digest, if known
	Namespace string
	File      string // the policy file ("" for the built-in one)
	Scope     string
	Required  string // Requirements.Describe
	Reason    string
}

func (r *Rejection) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s: ", crierrors.ErrSignatureValidationFailed)
	if r.Use != "" {
		fmt.Fprintf(&b, "%s: ", r.Use)
	}
	fmt.Fprintf(&b, "image %s", r.Image)
	if r.Digest != "" && !strings.Contains(r.Image, r.Digest) {
		fmt.Fprintf(&b, " (%s)", r.Digest)
	}
	if r.Namespace != "" {
		fmt.Fprintf(&b, " in namespace %s", r.Namespace)
	}
	b.WriteString(": ")
	if r.Scope != "" {
		fmt.Fprintf(&b, "scope %s of %s requires %s: ", r.Scope, fileName(r.File), r.Required)
	}
	b.WriteString(r.Reason)
	return b.String()
}

// Is makes errors.Is(err, crierrors.ErrSignatureValidationFailed) hold.
func (r *Rejection) Is(target error) bool { return target == crierrors.ErrSignatureValidationFailed }

func fileName(f string) string {
	if f == "" {
		return "the built-in policy"
	}
	return f
}
