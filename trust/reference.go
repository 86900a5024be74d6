package trust

import (
	"errors"
	"fmt"
	"strings"

	"github.com/google/go-containerregistry/pkg/name"
)

// Reference is a normalized docker reference: Repo is
// "docker.io/library/busybox" or "127.0.0.1:5000/app"; Tag and Digest may
// both be empty (a name-only reference, as cosign writes into its payloads).
type Reference struct {
	Repo, Tag, Digest string
}

// NameOnly reports whether the reference has neither tag nor digest.
func (r Reference) NameOnly() bool { return r.Tag == "" && r.Digest == "" }

func (r Reference) String() string {
	s := r.Repo
	if r.Tag != "" {
		s += ":" + r.Tag
	}
	if r.Digest != "" {
		s += "@" + r.Digest
	}
	return s
}

// ParseReference parses and normalizes a docker reference. Unlike an image
// pull, a missing tag is not taken as "latest": the reference stays
// name-only.
func ParseReference(s string) (Reference, error) {
	var r Reference
	rest, dig, hasDig := strings.Cut(s, "@")
	if hasDig {
		d, err := name.NewDigest("example.com/x@"+dig, name.StrictValidation)
		if err != nil {
			return r, fmt.Errorf("%q: bad digest: %w", s, err)
		}
		r.Digest = d.DigestStr()
	}
	if i := strings.LastIndexByte(rest, ':'); i > strings.LastIndexByte(rest, '/') {
		r.Tag = rest[i+1:]
		rest = rest[:i]
		if _, err := name.NewTag("example.com/x:"+r.Tag, name.StrictValidation); err != nil {
			return r, fmt.Errorf("%q: bad tag: %w", s, err)
		}
	}
	repo, err := name.NewRepository(rest)
	if err != nil {
		return r, fmt.Errorf("%q: %w", s, err)
	}
	host := repo.RegistryStr()
	if host == name.DefaultRegistry {
		host = "docker.io"
	}
	r.Repo = host + "/" + repo.RepositoryStr()
	return r, nil
}

// Scopes are the docker transport's scopes that may apply to r, most
// specific first (the order of containers-policy.json(5)).
func (r Reference) Scopes() []string {
	var out []string
	if !r.NameOnly() {
		out = append(out, r.String())
	}
	n := r.Repo
	for {
		out = append(out, n)
		i := strings.LastIndexByte(n, '/')
		if i < 0 {
			break
		}
		n = n[:i]
	}
	// n is the host; wildcards match host names, without the port.
	if i := strings.IndexByte(n, ':'); i >= 0 {
		n = n[:i]
	}
	for {
		i := strings.IndexByte(n, '.')
		if i < 0 {
			break
		}
		n = n[i+1:]
		out = append(out, "*."+n)
	}
	return out
}

// validScope checks a docker transport scope: "", "*.domain", a host, or a
// normalized repository or reference beneath one.
func validScope(s string) error {
	if s == "" {
		return nil
	}
	if rest, ok := strings.CutPrefix(s, "*."); ok {
		if rest == "" || strings.ContainsAny(rest, "*/:@") {
			return fmt.Errorf("a wildcard scope is \"*.\" and a domain, as *.example.com")
		}
		return nil
	}
	if strings.Contains(s, "*") {
		return errors.New("a wildcard is allowed only as the first label of a host, as *.example.com")
	}
	host, _, _ := strings.Cut(s, "/")
	if !strings.ContainsAny(host, ".:") && host != "localhost" {
		return fmt.Errorf("a scope starts with a registry host, as docker.io/library/busybox or registry.example.com")
	}
	if !strings.Contains(s, "/") {
		if _, err := name.NewRegistry(s, name.StrictValidation); err != nil {
			return err
		}
		return nil
	}
	r, err := ParseReference(s)
	if err != nil {
		return err
	}
	if r.String() != s {
		return fmt.Errorf("not in normalized form: write %q", r.String())
	}
	return nil
}

// Lookup returns the requirements that apply to r and the scope they are
// listed under: a docker transport scope, or "default".
func (p *Policy) Lookup(r Reference) (string, Requirements) {
	for _, s := range r.Scopes() {
		if rs, ok := p.Docker[s]; ok {
			return s, rs
		}
	}
	if rs, ok := p.Docker[""]; ok {
		return `""`, rs
	}
	return "default", p.Default
}

// identityMatches reports whether a signature naming sig is good for the
// image the user asked for as intended, under id.
func identityMatches(id Identity, intended, sig Reference) bool {
	switch id.Type {
	case MatchExact:
		return !sig.NameOnly() && sig.String() == intended.String()
	case MatchRepoDigestOrExact:
		return repoDigestOrExact(intended, sig)
	case MatchRepository:
		return sig.Repo == intended.Repo
	case ExactReference:
		want, err := ParseReference(id.DockerReference)
		return err == nil && !sig.NameOnly() && sig.String() == want.String()
	case ExactRepository:
		want, err := ParseReference(id.DockerRepository)
		return err == nil && sig.Repo == want.Repo
	case RemapIdentity:
		if rest, ok := strings.CutPrefix(intended.Repo, id.Prefix); ok && (rest == "" || strings.HasPrefix(rest, "/")) {
			remapped, err := ParseReference(id.SignedPrefix + rest)
			if err != nil {
				return false
			}
			remapped.Tag, remapped.Digest = intended.Tag, intended.Digest
			intended = remapped
		}
		return repoDigestOrExact(intended, sig)
	}
	return false
}

// repoDigestOrExact: a reference by tag needs a signature of that exact
// tag; a reference by digest needs one of the same repository (the digest
// itself is compared with the payload's).
func repoDigestOrExact(intended, sig Reference) bool {
	if sig.NameOnly() {
		return false
	}
	if intended.Tag != "" {
		return sig.String() == intended.String()
	}
	return sig.Repo == intended.Repo
}
