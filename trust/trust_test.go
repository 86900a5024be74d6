package trust

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	crierrors "k8s.io/cri-api/pkg/errors"

	"github.com/stagelet/stagelet/test/testregistry"
)

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// write replaces path with data as an operator's tools do: a new file
// renamed over the old one.
func write(t *testing.T, path, data string) string {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path+".new", []byte(data), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(path+".new", path); err != nil {
		t.Fatal(err)
	}
	return path
}

func sigstore(keyPath, identity string) string {
	return fmt.Sprintf(`[{"type": "sigstoreSigned", "keyPath": %q, "signedIdentity": {"type": %q}}]`, keyPath, identity)
}

func TestParseRefusesWhatItCannotHonour(t *testing.T) {
	dir := t.TempDir()
	key := testregistry.NewKey(t)
	for _, tc := range []struct {
		name, policy string
		want         []string // in the error
	}{
		{"not json", `{`, []string{"not a containers-policy.json(5) policy"}},
		{"no default", `{"transports": {}}`, []string{"default", "missing"}},
		{"empty list", `{"default": []}`, []string{"default", "empty list"}},
		{"unknown top key", `{"default": [{"type": "reject"}], "extra": 1}`, []string{"extra"}},
		{"gpg", `{"default": [{"type": "signedBy", "keyType": "GPGKeys", "keyPath": "/k"}]}`, []string{"default[0]", "type", "signedBy", "not implemented"}},
		{"unknown type", `{"default": [{"type": "trustMe"}]}`, []string{"default[0]", `unknown requirement "trustMe"`}},
		{"pki", `{"default": [{"type": "reject"}], "transports": {"docker": {"quay.io": [{"type": "sigstoreSigned", "pki": {"caRootsPath": "/r"}}]}}}`, []string{`transports.docker["quay.io"][0]`, "pki", "not implemented"}},
		{"stray key", `{"default": [{"type": "insecureAcceptAnything", "keyPath": "/k"}]}`, []string{"keyPath", "not a key of a insecureAcceptAnything requirement"}},
		{"no key", `{"default": [{"type": "sigstoreSigned"}]}`, []string{"exactly one of keyPath"}},
		{"two keys", fmt.Sprintf(`{"default": [{"type": "sigstoreSigned", "keyPath": %q, "keyData": "eA=="}]}`, key.PubPath), []string{"exactly one of keyPath"}},
		{"relative key", `{"default": [{"type": "sigstoreSigned", "keyPath": "k.pub"}]}`, []string{"keyPath k.pub", "absolute"}},
		{"missing key", `{"default": [{"type": "sigstoreSigned", "keyPath": "/nonexistent/k.pub"}]}`, []string{"keyPath /nonexistent/k.pub", "no such file"}},
		{"not a key", fmt.Sprintf(`{"default": [{"type": "sigstoreSigned", "keyPath": %q}]}`, write(t, filepath.Join(dir, "junk.pub"), "junk")), []string{"junk.pub", "not a PEM public key"}},
		{"bad identity", fmt.Sprintf(`{"default": [{"type": "sigstoreSigned", "keyPath": %q, "signedIdentity": {"type": "exactReference"}}]}`, key.PubPath), []string{"signedIdentity", "needs dockerReference"}},
		{"unnormalized scope", `{"default": [{"type": "reject"}], "transports": {"docker": {"docker.io/busybox": [{"type": "reject"}]}}}`, []string{`"docker.io/busybox"`, `write "docker.io/library/busybox"`}},
		{"bad wildcard", `{"default": [{"type": "reject"}], "transports": {"docker": {"quay.*.io": [{"type": "reject"}]}}}`, []string{"wildcard"}},
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

func TestLookupTakesTheMostSpecificScope(t *testing.T) {
	p, err := Parse("p.json", []byte(`{
		"default": [{"type": "reject"}],
		"transports": {
			"docker": {
				"reg.example.com:5000": [{"type": "insecureAcceptAnything"}],
				"reg.example.com:5000/team": [{"type": "reject"}],
				"reg.example.com:5000/team/app:v1": [{"type": "insecureAcceptAnything"}],
				"*.example.com": [{"type": "insecureAcceptAnything"}],
				"docker.io/library/busybox": [{"type": "insecureAcceptAnything"}]
			},
			"docker-daemon": {"": [{"type": "insecureAcceptAnything"}]}
		}
	}`), nil)
	if err != nil {
		t.Fatal(err)
	}
	for ref, want := range map[string]string{
		"reg.example.com:5000/team/app:v1":    "reg.example.com:5000/team/app:v1",
		"reg.example.com:5000/team/app:v2":    "reg.example.com:5000/team",
		"reg.example.com:5000/other/app:v1":   "reg.example.com:5000",
		"mirror.example.com/app:1":            "*.example.com",
		"busybox:1.36":                        "docker.io/library/busybox",
		"index.docker.io/library/busybox:1.0": "docker.io/library/busybox",
		"quay.io/app:1":                       "default",
	} {
		r, err := ParseReference(ref)
		if err != nil {
			t.Fatal(err)
		}
		if got, _ := p.Lookup(r); got != want {
			t.Errorf("%s: scope %q, want %q", ref, got, want)
		}
	}
}

// signed is a signature of digest in repo made with k, as cosign makes it.
func signed(t *testing.T, k *testregistry.Key, repo, digest string) Signature {
	p := testregistry.Payload(t, repo, digest)
	return Signature{Payload: p, Signature: k.SignPayload(t, p), Source: "test"}
}

func TestCheck(t *testing.T) {
	key, other := testregistry.NewKey(t), testregistry.NewKey(t)
	const repo = "reg.example.com/team/app"
	d1 := "sha256:" + strings.Repeat("1", 64)
	d2 := "sha256:" + strings.Repeat("2", 64)
	req := func(identity string) Requirements {
		p, err := Parse("p.json", []byte(`{"default": `+sigstore(key.PubPath, identity)+`}`), nil)
		if err != nil {
			t.Fatal(err)
		}
		return p.Default
	}
	byTag := Image{Ref: Reference{Repo: repo, Tag: "v1"}, Digest: d1}
	byDigest := Image{Ref: Reference{Repo: repo, Digest: d1}, Digest: d1}
	good := signed(t, key, repo, d1)
	for _, tc := range []struct {
		name     string
		identity string
		img      Image
		sigs     []Signature
		want     string // "" accepts
	}{
		{"signed", MatchRepository, byTag, []Signature{good}, ""},
		{"signed, by digest", MatchRepository, byDigest, []Signature{good}, ""},
		// cosign's payload names the repository only, never a tag: as in
		// containers/image, only matchRepository and exactRepository
		// accept it.
		{"digest needs a tagged identity", MatchRepoDigestOrExact, byDigest, []Signature{good}, "identity mismatch"},
		{"one good among bad ones", MatchRepository, byTag, []Signature{signed(t, other, repo, d1), good}, ""},
		{"unsigned", MatchRepository, byTag, nil, "no signature"},
		{"another key", MatchRepository, byTag, []Signature{signed(t, other, repo, d1)}, "wrong key"},
		{"another digest", MatchRepository, Image{Ref: byTag.Ref, Digest: d2}, []Signature{good}, "signature for another digest: it signs " + d1 + ", the image is " + d2},
		{"another repository", MatchRepository, byTag, []Signature{signed(t, key, "reg.example.com/team/other", d1)}, "identity mismatch"},
		{"tag needs exact identity", MatchRepoDigestOrExact, byTag, []Signature{good}, "identity mismatch"},
		{"tampered payload", MatchRepository, byTag, []Signature{{Payload: append(good.Payload, ' '), Signature: good.Signature}}, "wrong key"},
		{"not base64", MatchRepository, byTag, []Signature{{Payload: good.Payload, Signature: "!!"}}, "not base64"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := req(tc.identity).Check(tc.img, tc.sigs)
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

func TestIdentities(t *testing.T) {
	ref := func(s string) Reference {
		r, err := ParseReference(s)
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	d := "sha256:" + strings.Repeat("a", 64)
	for _, tc := range []struct {
		id               Identity
		intended, signed string
		want             bool
	}{
		{Identity{Type: MatchExact}, "r.io/a:1", "r.io/a:1", true},
		{Identity{Type: MatchExact}, "r.io/a:1", "r.io/a:2", false},
		{Identity{Type: MatchExact}, "r.io/a:1", "r.io/a", false},
		{Identity{Type: MatchRepoDigestOrExact}, "r.io/a@" + d, "r.io/a:9", true},
		{Identity{Type: MatchRepoDigestOrExact}, "r.io/a@" + d, "r.io/a", false},
		{Identity{Type: MatchRepository}, "r.io/a:1", "r.io/a", true},
		{Identity{Type: MatchRepository}, "r.io/a:1", "r.io/b", false},
		{Identity{Type: ExactReference, DockerReference: "r.io/a:stable"}, "m.io/x:1", "r.io/a:stable", true},
		{Identity{Type: ExactReference, DockerReference: "r.io/a:stable"}, "m.io/x:1", "r.io/a", false},
		{Identity{Type: ExactRepository, DockerRepository: "r.io/a"}, "m.io/x:1", "r.io/a", true},
		{Identity{Type: RemapIdentity, Prefix: "mirror.io/up", SignedPrefix: "r.io"}, "mirror.io/up/a:1", "r.io/a:1", true},
		{Identity{Type: RemapIdentity, Prefix: "mirror.io/up", SignedPrefix: "r.io"}, "mirror.io/upx/a:1", "r.io/a:1", false},
	} {
		if got := identityMatches(tc.id, ref(tc.intended), ref(tc.signed)); got != tc.want {
			t.Errorf("%s: intended %s, signed %s: %v, want %v", tc.id.Type, tc.intended, tc.signed, got, tc.want)
		}
	}
}

func TestRejectionIsWhatTheKubeletRecognizes(t *testing.T) {
	err := error(&Rejection{Image: "r.io/a:1", Digest: "sha256:" + strings.Repeat("1", 64), Namespace: "prod", File: "/etc/p.json", Scope: "r.io", Required: "sigstoreSigned", Reason: "no signature"})
	if !strings.HasPrefix(err.Error(), crierrors.ErrSignatureValidationFailed.Error()+":") {
		t.Errorf("%q does not start with the kubelet's reason", err)
	}
	if !errors.Is(fmt.Errorf("wrapped: %w", err), crierrors.ErrSignatureValidationFailed) {
		t.Error("errors.Is does not find ErrSignatureValidationFailed")
	}
	for _, w := range []string{"r.io/a:1", "prod", "/etc/p.json", "scope r.io", "no signature"} {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("%q lacks %q", err, w)
		}
	}
}

func TestSourceRereadsChangedFiles(t *testing.T) {
	dir := t.TempDir()
	key := testregistry.NewKey(t)
	file := write(t, filepath.Join(dir, "policy.json"), `{"default": [{"type": "insecureAcceptAnything"}]}`)
	nsDir := filepath.Join(dir, "policy.d")
	s, err := NewSource(file, nsDir, quiet)
	if err != nil {
		t.Fatal(err)
	}
	ref := Reference{Repo: "r.io/a", Tag: "1"}
	scopeOf := func(ns string) string {
		t.Helper()
		d, err := s.Decide(t.Context(), ns, ref)
		if err != nil {
			t.Fatalf("decide %s: %v", ns, err)
		}
		return d.Scope + " " + d.Requirements.Describe()
	}
	if got := scopeOf("prod"); got != "default insecureAcceptAnything" {
		t.Fatalf("prod: %s", got)
	}

	// A namespace file takes effect, with no restart.
	nsFile := write(t, filepath.Join(nsDir, "prod.json"), `{"default": [{"type": "reject"}], "transports": {"docker": {"r.io": `+sigstore(key.PubPath, MatchRepository)+`}}}`)
	if got := scopeOf("prod"); !strings.HasPrefix(got, "r.io sigstoreSigned (keys "+key.PubPath) {
		t.Fatalf("prod after its file appeared: %s", got)
	}
	if got := scopeOf("dev"); got != "default insecureAcceptAnything" {
		t.Fatalf("dev: %s", got)
	}

	// The node's file changes.
	write(t, file, `{"default": [{"type": "reject"}]}`)
	if got := scopeOf("dev"); got != "default reject" {
		t.Fatalf("dev after the node's policy changed: %s", got)
	}

	// A broken node file leaves the last good one in force, and says so.
	write(t, file, `{"default": [{"type": "signedBy"}]}`)
	if got := scopeOf("dev"); got != "default reject" {
		t.Fatalf("dev with a broken node policy: %s", got)
	}
	st := s.Status(context.Background())
	if len(st) != 2 || st[0].File != file || !strings.Contains(st[0].Error, "signedBy") || st[0].LoadedAt.IsZero() {
		t.Fatalf("status: %+v", st)
	}

	// A key file that changes is reread with its policy: here it breaks,
	// and the namespace's images are refused (no last good policy for a
	// namespace file).
	write(t, key.PubPath, "junk")
	if _, err := s.Decide(t.Context(), "prod", ref); !errors.Is(err, crierrors.ErrSignatureValidationFailed) || !strings.Contains(err.Error(), "not a PEM public key") {
		t.Fatalf("prod with a broken key file: %v", err)
	}
	if st := s.Status(context.Background()); !strings.Contains(st[1].Error, "not a PEM public key") {
		t.Fatalf("status after the key broke: %+v", st)
	}

	// A namespace file that never loaded refuses the namespace's images.
	write(t, filepath.Join(nsDir, "qa.json"), `{"default": [`)
	_, err = s.Decide(t.Context(), "qa", ref)
	if !errors.Is(err, crierrors.ErrSignatureValidationFailed) || !strings.Contains(err.Error(), "qa.json") {
		t.Fatalf("decide qa with a broken file: %v", err)
	}

	// Its removal gives the namespace back to the node's policy.
	if err := os.Remove(nsFile); err != nil {
		t.Fatal(err)
	}
	if got := scopeOf("prod"); got != "default reject" {
		t.Fatalf("prod after its file went: %s", got)
	}
	// A name that is no namespace never names a file.
	if got := scopeOf("../policy"); got != "default reject" {
		t.Fatalf("../policy: %s", got)
	}
}

// TestNamespaceFileFailsClosed: a namespace's entry in the directory that
// does not load refuses its images from the first decision on, whether it
// never loaded or loaded before, and Status and CheckFiles name it; only a
// namespace with no entry falls back to the node's policy.
func TestNamespaceFileFailsClosed(t *testing.T) {
	dir := t.TempDir()
	file := write(t, filepath.Join(dir, "policy.json"), `{"default": [{"type": "insecureAcceptAnything"}]}`)
	nsDir := filepath.Join(dir, "policy.d")
	if err := os.Mkdir(nsDir, 0o755); err != nil {
		t.Fatal(err)
	}
	s, err := NewSource(file, nsDir, quiet)
	if err != nil {
		t.Fatal(err)
	}
	ref := Reference{Repo: "r.io/a", Tag: "1"}
	good := `{"default": [{"type": "insecureAcceptAnything"}]}`
	refused := func(ns string, want ...string) {
		t.Helper()
		_, err := s.Decide(t.Context(), ns, ref)
		if !errors.Is(err, crierrors.ErrSignatureValidationFailed) {
			t.Fatalf("namespace %s: %v, want a refusal", ns, err)
		}
		for _, w := range want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("namespace %s: %q lacks %q", ns, err, w)
			}
		}
	}
	link := func(target, name string) string {
		p := filepath.Join(nsDir, name)
		if err := os.Symlink(target, p); err != nil {
			t.Fatal(err)
		}
		return p
	}
	dangling := link(filepath.Join(dir, "missing.json"), "dangling.json")
	refused("dangling", dangling, "a link to "+filepath.Join(dir, "missing.json")+", which does not exist")
	loop := link("loop.json", "loop.json")
	refused("loop", loop, "too many levels of symbolic links")
	if err := os.Mkdir(filepath.Join(nsDir, "adir.json"), 0o755); err != nil {
		t.Fatal(err)
	}
	refused("adir", "adir.json", "not a regular file")
	if err := syscall.Mkfifo(filepath.Join(nsDir, "fifo.json"), 0o644); err != nil {
		t.Fatal(err)
	}
	refused("fifo", "fifo.json", "not a regular file")

	// One that loaded, then breaks: refused, not its last good policy.
	p := write(t, filepath.Join(nsDir, "was.json"), good)
	if _, err := s.Decide(t.Context(), "was", ref); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(p); err != nil {
		t.Fatal(err)
	}
	link(filepath.Join(dir, "missing.json"), "was.json")
	refused("was", "was.json", "does not exist")
	// Made good again, it is in force again.
	write(t, filepath.Join(dir, "missing.json"), good)
	if _, err := s.Decide(t.Context(), "was", ref); err != nil {
		t.Fatalf("after the link's target appeared: %v", err)
	}
	if _, err := s.Decide(t.Context(), "dangling", ref); err != nil {
		t.Fatalf("dangling, after its target appeared: %v", err)
	}

	// Status names every broken file, asked for or not.
	write(t, filepath.Join(nsDir, "unasked.json"), `{"default": [`)
	errs := map[string]string{}
	for _, f := range s.Status(t.Context()) {
		errs[filepath.Base(f.File)] = f.Error
	}
	for _, f := range []string{"loop.json", "adir.json", "fifo.json", "unasked.json"} {
		if errs[f] == "" {
			t.Errorf("status: %s has no error: %v", f, errs)
		}
	}
	if _, bad := CheckFiles(file, nsDir); len(bad) != 4 {
		t.Errorf("CheckFiles: %v, want the 4 broken files", bad)
	}
}

func TestNewSourceRefusesABrokenPolicy(t *testing.T) {
	f := write(t, filepath.Join(t.TempDir(), "p.json"), `{"default": [{"type": "reject", "x": 1}]}`)
	if _, err := NewSource(f, "", quiet); err == nil || !strings.Contains(err.Error(), f) {
		t.Fatalf("NewSource: %v", err)
	}
}

func TestFetchFindsTagAndReferrerSignatures(t *testing.T) {
	reg := testregistry.Start(t)
	key := testregistry.NewKey(t)
	ref := reg.PushBusybox(t, "team/app", "v1")
	repoName := reg.Host + "/team/app"
	digest := testregistry.Digest(t, ref)
	repo, err := name.NewRepository(repoName, name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	sigs, err := Fetch(ctx, repo, digest)
	if err != nil || len(sigs) != 0 {
		t.Fatalf("unsigned: %v, %v", sigs, err)
	}
	reg.Sign(t, key, repoName, digest)
	reg.SignReferrer(t, key, repoName, digest)
	sigs, err = Fetch(ctx, repo, digest)
	if err != nil {
		t.Fatal(err)
	}
	if len(sigs) != 2 || !strings.HasSuffix(sigs[0].Source, SigTag(digest)) || !strings.HasSuffix(sigs[1].Source, "(referrer)") {
		t.Fatalf("signatures: %+v", sigs)
	}
	p, err := Parse("p.json", []byte(`{"default": `+sigstore(key.PubPath, MatchRepository)+`}`), nil)
	if err != nil {
		t.Fatal(err)
	}
	r, err := ParseReference(ref)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range sigs {
		if err := p.Default.Check(Image{Ref: r, Digest: digest}, []Signature{s}); err != nil {
			t.Errorf("%s: %v", s.Source, err)
		}
	}
	if _, err := base64.StdEncoding.DecodeString(sigs[0].Signature); err != nil {
		t.Error(err)
	}
}
