package trust

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"strings"

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
)

// Signature is one sigstore signature as found in a registry, and as kept
// beside an image to check it again without the registry.
type Signature struct {
	// Payload is the signed blob: cosign's simple signing JSON.
	Payload []byte `json:"payload"`
	// Signature is the base64 signature of Payload.
	Signature string `json:"signature"`
	// Source is where it was found: "repo:sha256-<hex>.sig" or
	// "repo@sha256:<hex> (referrer)".
	Source string `json:"source"`
}

// Same reports whether s and o are one signature.
func (s Signature) Same(o Signature) bool {
	return s.Signature == o.Signature && bytes.Equal(s.Payload, o.Payload)
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
	verified := false
	for _, k := range r.Keys {
		if k.VerifySignature(bytes.NewReader(raw), bytes.NewReader(s.Payload)) == nil {
			verified = true
			break
		}
	}
	if !verified {
		return fmt.Errorf("wrong key: the signature does not verify with %s", strings.Join(r.KeyNames, ", "))
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

// SigTag is the tag cosign stores digest's signatures under.
func SigTag(digest string) string {
	return strings.Replace(digest, ":", "-", 1) + ".sig"
}

// Rejection is an image the policy refuses. Its message starts with
// SignatureValidationFailed, which the kubelet shows as the reason of a
// failed pull.
type Rejection struct {
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
	fmt.Fprintf(&b, "%s: image %s", crierrors.ErrSignatureValidationFailed, r.Image)
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
