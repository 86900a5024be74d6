// Package trust decides which images may run: it reads signature policies
// in the containers-policy.json(5) format that CRI-O and Podman read, finds
// the cosign (sigstore) signatures of an image in its registry, and verifies
// them against the keys the policy names.
//
// # Policy
//
// A policy has a "default" list of requirements and, under
// "transports"."docker", lists keyed by scope. The scope that applies to an
// image reference is the most specific of: the reference itself
// ("host/ns/repo:tag" or "host/ns/repo@sha256:…"), its repository, each of
// its parent namespaces, its host, wildcard hosts ("*.example.com"), the
// transport's "" entry, and last the default. Every requirement of the
// list that applies must accept the image.
//
// Requirements stagelet implements: insecureAcceptAnything, reject and
// sigstoreSigned with a signedIdentity (matchRepoDigestOrExact, the
// default; matchExact; matchRepository; exactReference; exactRepository;
// remapIdentity) and exactly one of: public keys (keyPath, keyPaths,
// keyData, keyDatas), or a Fulcio CA with the OIDC issuer and the email a
// certificate must name (fulcio: caPath or caData, oidcIssuer,
// subjectEmail). Rekor public keys (rekorPublicKeyPath,
// rekorPublicKeyPaths, rekorPublicKeyData, rekorPublicKeyDatas) are
// required with fulcio and allowed with keys: a signature must then carry a
// Rekor signed entry timestamp (SET) by one of them. Any other requirement
// or key (signedBy's GPG keys, signedBaseLayer, pki's certificates) makes
// the policy refuse to load, with the file, the scope and the key named: a
// policy stagelet cannot honour whole is never half applied. Other
// transports than "docker" are read and checked but never apply: a CRI
// runtime pulls only from registries.
//
// # Signatures
//
// A sigstore signature, as cosign stores it, is a layer of an OCI artifact
// in the image's repository, tagged "sha256-<hex of the signed digest>.sig"
// or attached through the OCI 1.1 referrers API. The layer's blob is a JSON
// payload naming the manifest digest and the docker reference that was
// signed; its annotation dev.cosignproject.cosign/signature is the base64
// signature of that blob. A signature accepts an image when it verifies
// with one of the requirement's keys, its payload is a cosign container
// image signature, its digest is the image's manifest digest (the one the
// reference resolved to: an index's own digest for a multi-platform image),
// and its docker reference satisfies the signedIdentity.
//
// A keyless signature (fulcio) is verified with the key of the certificate
// in the layer's dev.sigstore.cosign/certificate annotation, which must
// chain to the Fulcio CA (through the intermediates of the
// dev.sigstore.cosign/chain annotation), be for code signing, and name the
// policy's OIDC issuer and email. Fulcio certificates live minutes, so the
// certificate must be valid not now but at the time Rekor logged the
// signature: the integratedTime of the dev.sigstore.cosign/bundle
// annotation, whose SET must verify with one of the Rekor keys and whose
// entry must be a hashedrekord of this very signature, payload and
// certificate (or public key, when keys and Rekor are combined). All of it
// is checked offline: neither Fulcio nor Rekor is ever asked, and a
// certificate's SCT is not checked (containers/image does not either: the
// Rekor SET already proves the signature was logged).
package trust

import (
	"bytes"
	"crypto"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"syscall"

	"github.com/sigstore/sigstore/pkg/cryptoutils"
	"github.com/sigstore/sigstore/pkg/signature"
)

// Requirement types.
const (
	TypeAccept   = "insecureAcceptAnything"
	TypeReject   = "reject"
	TypeSigstore = "sigstoreSigned"
)

// Identity types of a sigstoreSigned requirement's signedIdentity.
const (
	MatchExact             = "matchExact"
	MatchRepoDigestOrExact = "matchRepoDigestOrExact"
	MatchRepository        = "matchRepository"
	ExactReference         = "exactReference"
	ExactRepository        = "exactRepository"
	RemapIdentity          = "remapIdentity"
)

// Policy is one loaded policy file.
type Policy struct {
	// File is where the policy came from ("" for the built-in default).
	File string
	// Default applies when no scope of the docker transport does.
	Default Requirements
	// Docker is the docker transport's requirements by scope; "" is the
	// transport's default.
	Docker map[string]Requirements
}

// Requirements is a list of requirements that must all accept an image.
type Requirements []*Requirement

// Requirement is one requirement of a scope.
type Requirement struct {
	Type string
	// Keys verify a sigstoreSigned requirement's signatures; KeyNames
	// say where each came from (a file, or "keyData[i]"). None when
	// Fulcio is set.
	Keys     []signature.Verifier
	KeyNames []string
	// Fulcio, when set, verifies keyless signatures by their
	// certificates instead of keys.
	Fulcio *Fulcio
	// Rekor, when not empty, requires each signature to carry a Rekor
	// SET signed by one of these keys (always set with Fulcio).
	Rekor    []RekorKey
	Identity Identity
}

// Identity is a sigstoreSigned requirement's signedIdentity.
type Identity struct {
	Type             string
	DockerReference  string // exactReference
	DockerRepository string // exactRepository
	Prefix           string // remapIdentity
	SignedPrefix     string // remapIdentity
}

// Describe is the requirement in a line: "sigstoreSigned (keys
// /etc/k.pub; identity matchRepository)".
func (r *Requirement) Describe() string {
	if r.Type != TypeSigstore {
		return r.Type
	}
	id := r.Identity.Type
	switch r.Identity.Type {
	case ExactReference:
		id += " " + r.Identity.DockerReference
	case ExactRepository:
		id += " " + r.Identity.DockerRepository
	case RemapIdentity:
		id += " " + r.Identity.Prefix + " → " + r.Identity.SignedPrefix
	}
	signers := "keys " + strings.Join(r.KeyNames, ", ")
	if f := r.Fulcio; f != nil {
		signers = fmt.Sprintf("Fulcio CA %s, issuer %s, email %s", f.CAName, f.OIDCIssuer, f.SubjectEmail)
	}
	if len(r.Rekor) > 0 {
		names := make([]string, len(r.Rekor))
		for i, k := range r.Rekor {
			names[i] = k.Name
		}
		signers += "; Rekor keys " + strings.Join(names, ", ")
	}
	return fmt.Sprintf("%s (%s; identity %s)", r.Type, signers, id)
}

// Describe lists the requirements, joined by " and ".
func (rs Requirements) Describe() string {
	out := make([]string, len(rs))
	for i, r := range rs {
		out[i] = r.Describe()
	}
	return strings.Join(out, " and ")
}

// NeedsSignatures reports whether some requirement looks at signatures.
func (rs Requirements) NeedsSignatures() bool {
	return slices.ContainsFunc(rs, func(r *Requirement) bool { return r.Type == TypeSigstore })
}

// AcceptAnything is the policy used when no file is configured.
var AcceptAnything = &Policy{Default: Requirements{{Type: TypeAccept}}}

// LoadError is a policy that could not be loaded: the file, and where in it.
type LoadError struct {
	File  string
	Scope string // "" for the file as a whole; "default", or transport/scope
	Key   string // the offending key, if one is
	Err   error
}

func (e *LoadError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "signature policy %s", e.File)
	if e.Scope != "" {
		fmt.Fprintf(&b, ": %s", e.Scope)
	}
	if e.Key != "" {
		fmt.Fprintf(&b, ": %s", e.Key)
	}
	fmt.Fprintf(&b, ": %v", e.Err)
	return b.String()
}

func (e *LoadError) Unwrap() error { return e.Err }

// maxPolicySize bounds a policy file and a key file.
const maxPolicySize = 4 << 20

// Load reads and parses the policy file at path. Every file read (the
// policy and the key files it names) is reported to seen (may be nil), so
// that a change to a key file can be noticed too.
func Load(path string, seen func(string)) (*Policy, error) {
	data, err := readLimited(path)
	if err != nil {
		return nil, &LoadError{File: path, Err: err}
	}
	if seen != nil {
		seen(path)
	}
	return Parse(path, data, seen)
}

// readLimited reads the policy file at path: a regular file (a link is
// followed) of at most maxPolicySize bytes. A FIFO or a device is refused
// without being read: opening it does not wait for a writer.
func readLimited(path string) ([]byte, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK|syscall.O_CLOEXEC, 0)
	if errors.Is(err, os.ErrNotExist) {
		if target, lerr := os.Readlink(path); lerr == nil {
			return nil, fmt.Errorf("a link to %s, which does not exist", target)
		}
	}
	if err != nil {
		return nil, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("not a regular file (%s)", fi.Mode().Type())
	}
	b, err := io.ReadAll(io.LimitReader(f, maxPolicySize+1))
	if err != nil {
		return nil, err
	}
	if len(b) > maxPolicySize {
		return nil, fmt.Errorf("larger than %d bytes", maxPolicySize)
	}
	return b, nil
}

func decodeBase64(s string) ([]byte, error) { return base64.StdEncoding.DecodeString(s) }

// Parse parses a policy; file names it in errors and is the base of
// relative key paths.
func Parse(file string, data []byte, seen func(string)) (*Policy, error) {
	var raw struct {
		Default    json.RawMessage                       `json:"default"`
		Transports map[string]map[string]json.RawMessage `json:"transports"`
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&raw); err != nil {
		return nil, &LoadError{File: file, Err: fmt.Errorf("not a containers-policy.json(5) policy: %w", err)}
	}
	if raw.Default == nil {
		return nil, &LoadError{File: file, Key: "default", Err: errors.New("missing: the policy must say what applies when no scope does")}
	}
	p := &Policy{File: file, Docker: map[string]Requirements{}}
	var err error
	if p.Default, err = parseRequirements(file, "default", raw.Default, seen); err != nil {
		return nil, err
	}
	transports := make([]string, 0, len(raw.Transports))
	for t := range raw.Transports {
		transports = append(transports, t)
	}
	sort.Strings(transports)
	for _, t := range transports {
		scopes := raw.Transports[t]
		for scope, rs := range scopes {
			where := fmt.Sprintf("transports.%s[%q]", t, scope)
			if t == "docker" {
				if err := validScope(scope); err != nil {
					return nil, &LoadError{File: file, Scope: where, Err: err}
				}
			}
			reqs, err := parseRequirements(file, where, rs, seen)
			if err != nil {
				return nil, err
			}
			if t == "docker" {
				p.Docker[scope] = reqs
			}
		}
	}
	return p, nil
}

func parseRequirements(file, where string, data json.RawMessage, seen func(string)) (Requirements, error) {
	var list []map[string]json.RawMessage
	if err := json.Unmarshal(data, &list); err != nil {
		return nil, &LoadError{File: file, Scope: where, Err: fmt.Errorf("not a list of requirements: %w", err)}
	}
	if len(list) == 0 {
		return nil, &LoadError{File: file, Scope: where, Err: errors.New("an empty list of requirements: say insecureAcceptAnything or reject")}
	}
	out := make(Requirements, 0, len(list))
	for i, m := range list {
		at := fmt.Sprintf("%s[%d]", where, i)
		r, err := parseRequirement(file, at, m, seen)
		if err != nil {
			return nil, err
		}
		out = append(out, r)
	}
	return out, nil
}

// sigstoreKeys are the keys of a sigstoreSigned requirement stagelet
// implements.
var sigstoreKeys = []string{"type", "keyPath", "keyPaths", "keyData", "keyDatas", "fulcio",
	"rekorPublicKeyPath", "rekorPublicKeyPaths", "rekorPublicKeyData", "rekorPublicKeyDatas", "signedIdentity"}

// failFunc makes the *LoadError of one requirement, naming key.
type failFunc func(key, format string, args ...any) error

func parseRequirement(file, at string, m map[string]json.RawMessage, seen func(string)) (*Requirement, error) {
	fail := func(key string, format string, args ...any) error {
		return &LoadError{File: file, Scope: at, Key: key, Err: fmt.Errorf(format, args...)}
	}
	var typ string
	if err := json.Unmarshal(m["type"], &typ); err != nil || typ == "" {
		return nil, fail("type", "missing or not a string")
	}
	allowed := map[string][]string{
		TypeAccept:   {"type"},
		TypeReject:   {"type"},
		TypeSigstore: sigstoreKeys,
	}
	keys, ok := allowed[typ]
	if !ok {
		switch typ {
		case "signedBy", "signedBaseLayer":
			return nil, fail("type", "requirement %q is not implemented by stagelet (it verifies sigstore signatures: use sigstoreSigned)", typ)
		}
		return nil, fail("type", "unknown requirement %q", typ)
	}
	for _, k := range sortedKeys(m) {
		if slices.Contains(keys, k) {
			continue
		}
		if k == "pki" && typ == TypeSigstore {
			return nil, fail(k, "not implemented by stagelet: public keys (keyPath, keyPaths, keyData, keyDatas) or fulcio verify signatures")
		}
		return nil, fail(k, "not a key of a %s requirement", typ)
	}
	r := &Requirement{Type: typ}
	if typ != TypeSigstore {
		return r, nil
	}
	if err := r.loadKeys(m, fail, seen); err != nil {
		return nil, err
	}
	id, err := parseIdentity(m["signedIdentity"])
	if err != nil {
		return nil, fail("signedIdentity", "%v", err)
	}
	r.Identity = id
	return r, nil
}

// loadKeys reads what verifies a sigstoreSigned requirement m's
// signatures: its public keys or its Fulcio CA, and its Rekor keys.
func (r *Requirement) loadKeys(m map[string]json.RawMessage, fail failFunc, seen func(string)) error {
	keys, nKeys, err := pemSources(m, "key", fail)
	if err != nil {
		return err
	}
	rekor, nRekor, err := pemSources(m, "rekorPublicKey", fail)
	if err != nil {
		return err
	}
	_, hasFulcio := m["fulcio"]
	if hasFulcio {
		nKeys++
	}
	switch {
	case nKeys != 1:
		return fail("keyPath", "exactly one of keyPath, keyPaths, keyData, keyDatas and fulcio must be set (%d are)", nKeys)
	case nRekor > 1:
		return fail("rekorPublicKeyPath", "at most one of rekorPublicKeyPath, rekorPublicKeyPaths, rekorPublicKeyData and rekorPublicKeyDatas may be set (%d are)", nRekor)
	case hasFulcio && nRekor == 0:
		return fail("fulcio", "needs a Rekor public key (rekorPublicKeyPath, rekorPublicKeyPaths, rekorPublicKeyData or rekorPublicKeyDatas): a Fulcio certificate is valid only at the time a Rekor SET proves")
	}
	for _, src := range keys {
		b, err := src.read(fail, seen)
		if err != nil {
			return err
		}
		v, err := verifier(b)
		if err != nil {
			return fail(src.key, "%v", err)
		}
		r.Keys = append(r.Keys, v)
		r.KeyNames = append(r.KeyNames, src.name)
	}
	for _, src := range rekor {
		b, err := src.read(fail, seen)
		if err != nil {
			return err
		}
		k, err := parseRekorKey(src.name, b)
		if err != nil {
			return fail(src.key, "%v", err)
		}
		r.Rekor = append(r.Rekor, k)
	}
	if hasFulcio {
		f, err := parseFulcio(m["fulcio"], fail, seen)
		if err != nil {
			return err
		}
		r.Fulcio = f
	}
	return nil
}

// pemSource is one PEM file or inline base64 PEM a policy names.
type pemSource struct {
	key  string // in errors: "keyPath /etc/k.pub", "keyData[0]"
	name string // in descriptions: "/etc/k.pub", "keyData[0]"
	path string // or
	data string // base64 of the PEM
}

// pemSources are the PEMs that the keys <prefix>Path, <prefix>Paths,
// <prefix>Data and <prefix>Datas of m name, and how many of those keys are
// set.
func pemSources(m map[string]json.RawMessage, prefix string, fail failFunc) ([]pemSource, int, error) {
	var out []pemSource
	set := 0
	for _, k := range []string{prefix + "Path", prefix + "Paths", prefix + "Data", prefix + "Datas"} {
		v, ok := m[k]
		if !ok {
			continue
		}
		set++
		var list []string
		if plural := strings.HasSuffix(k, "s"); plural {
			if err := json.Unmarshal(v, &list); err != nil || len(list) == 0 || slices.Contains(list, "") {
				return nil, set, fail(k, "must be a non-empty list of non-empty strings")
			}
		} else {
			var s string
			if err := json.Unmarshal(v, &s); err != nil || s == "" {
				return nil, set, fail(k, "must be a non-empty string")
			}
			list = []string{s}
		}
		dataKey := prefix + "Data"
		for i, s := range list {
			if strings.HasPrefix(k, dataKey) {
				name := fmt.Sprintf("%s[%d]", dataKey, i)
				out = append(out, pemSource{key: name, name: name, data: s})
			} else {
				out = append(out, pemSource{key: prefix + "Path " + s, name: s, path: s})
			}
		}
	}
	return out, set, nil
}

// read is the PEM of src: a file's content (reported to seen) or the
// decoded inline data.
func (src pemSource) read(fail failFunc, seen func(string)) ([]byte, error) {
	if src.path == "" {
		// Data is base64 of the PEM, as in containers-policy.json(5).
		b, err := decodeBase64(src.data)
		if err != nil {
			return nil, fail(src.key, "not base64: %v", err)
		}
		return b, nil
	}
	if !filepath.IsAbs(src.path) {
		return nil, fail(src.key, "must be an absolute path")
	}
	b, err := readLimited(src.path)
	if err != nil {
		return nil, fail(src.key, "%v", err)
	}
	if seen != nil {
		seen(src.path)
	}
	return b, nil
}

func sortedKeys(m map[string]json.RawMessage) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// verifier is the signature verifier of a PEM public key: ECDSA (what
// cosign generates), RSA or Ed25519, with SHA-256 as cosign uses.
func verifier(pemBytes []byte) (signature.Verifier, error) {
	pub, err := cryptoutils.UnmarshalPEMToPublicKey(pemBytes)
	if err != nil {
		return nil, fmt.Errorf("not a PEM public key: %w", err)
	}
	v, err := signature.LoadVerifier(pub, crypto.SHA256)
	if err != nil {
		return nil, fmt.Errorf("unusable public key: %w", err)
	}
	return v, nil
}

func parseIdentity(data json.RawMessage) (Identity, error) {
	if data == nil {
		return Identity{Type: MatchRepoDigestOrExact}, nil
	}
	var raw struct {
		Type             string `json:"type"`
		DockerReference  string `json:"dockerReference"`
		DockerRepository string `json:"dockerRepository"`
		Prefix           string `json:"prefix"`
		SignedPrefix     string `json:"signedPrefix"`
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&raw); err != nil {
		return Identity{}, err
	}
	id := Identity{Type: raw.Type, DockerReference: raw.DockerReference, DockerRepository: raw.DockerRepository, Prefix: raw.Prefix, SignedPrefix: raw.SignedPrefix}
	only := func(fields ...string) error {
		have := map[string]bool{"dockerReference": raw.DockerReference != "", "dockerRepository": raw.DockerRepository != "", "prefix": raw.Prefix != "", "signedPrefix": raw.SignedPrefix != ""}
		for f, set := range have {
			if set && !slices.Contains(fields, f) {
				return fmt.Errorf("%s does not take %s", raw.Type, f)
			}
		}
		for _, f := range fields {
			if !have[f] {
				return fmt.Errorf("%s needs %s", raw.Type, f)
			}
		}
		return nil
	}
	switch raw.Type {
	case MatchExact, MatchRepoDigestOrExact, MatchRepository:
		return id, only()
	case ExactReference:
		if err := only("dockerReference"); err != nil {
			return id, err
		}
		r, err := ParseReference(raw.DockerReference)
		if err != nil || r.NameOnly() {
			return id, fmt.Errorf("dockerReference %q: not a reference with a tag or digest", raw.DockerReference)
		}
	case ExactRepository:
		if err := only("dockerRepository"); err != nil {
			return id, err
		}
		r, err := ParseReference(raw.DockerRepository)
		if err != nil || !r.NameOnly() {
			return id, fmt.Errorf("dockerRepository %q: not a repository", raw.DockerRepository)
		}
	case RemapIdentity:
		if err := only("prefix", "signedPrefix"); err != nil {
			return id, err
		}
		for _, p := range []string{raw.Prefix, raw.SignedPrefix} {
			if err := validScope(p); err != nil || strings.ContainsAny(p, "@*") {
				return id, fmt.Errorf("prefix %q: not a host or repository prefix", p)
			}
		}
	case "":
		return id, errors.New("type missing")
	default:
		return id, fmt.Errorf("unknown type %q", raw.Type)
	}
	return id, nil
}
