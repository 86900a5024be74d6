package broker

import (
	"context"
	"errors"
	"slices"
	"strings"

	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/image"
	"github.com/stagelet/stagelet/trust"
)

// Results of an image verification, as Observer.ImageVerified gets them.
const (
	// VerifyAccepted: signatures the policy requires verified.
	VerifyAccepted = trust.Accepted
	// VerifyUnverified: the policy accepts the image without signatures.
	VerifyUnverified = trust.Unverified
	// VerifyRejected: refused (SignatureValidationFailed).
	VerifyRejected = trust.Rejected
	// VerifyError: the signatures could not be fetched.
	VerifyError = trust.FetchFailed
)

// Stages of an image verification.
const (
	VerifyAtPull   = "pull"
	VerifyAtCreate = "create"
)

// pullReference is ref as the policy sees it: a reference without tag or
// digest is pulled as ":latest", and so looked up.
func pullReference(ref string) (trust.Reference, error) {
	r, err := trust.ParseReference(ref)
	if err != nil {
		return r, err
	}
	if r.NameOnly() {
		r.Tag = "latest"
	}
	return r, nil
}

// pullVerifier is how a pull of ref for a pod in namespace is checked
// against the signature policy; nil when no policy is configured.
func (b *Broker) pullVerifier(ctx context.Context, namespace, ref string) (image.Verify, error) {
	if b.opts.Trust == nil {
		return nil, nil
	}
	r, err := pullReference(ref)
	if err != nil {
		// Never pulled unchecked: a reference the policy cannot place
		// is refused, as the store would refuse it.
		return nil, errdefs.InvalidArgument("pull %q: bad image reference: %w", ref, err)
	}
	dec, err := b.opts.Trust.Decide(ctx, namespace, r)
	if err != nil {
		b.obs.ImageVerified(VerifyAtPull, VerifyRejected)
		return nil, err
	}
	return func(ctx context.Context, digest string, kept []trust.Signature, fetch func() ([]trust.Signature, error)) ([]trust.Signature, error) {
		sigs, result, err := dec.Verify(trust.Image{Ref: r, Digest: digest}, kept, fetch)
		b.obs.ImageVerified(VerifyAtPull, result)
		if result == trust.Rejected {
			b.log.WarnContext(ctx, "image refused by the signature policy", "ref", ref, "digest", digest, "namespace", namespace, "scope", dec.Scope, "file", dec.File, "err", err)
		}
		return sigs, err
	}, nil
}

// checkImageTrust checks, at container creation, that the policy of the
// pod's namespace accepts img, from the signatures kept beside it at pull
// (no registry is asked). The image is looked up by named, the reference
// the pod's author gave (authorName; "" for every name img has), and its
// digest is always the one of the image that will run: an image pulled
// for a namespace whose policy accepts it is checked again for this one,
// and a tag that moved since cannot lend its signature. The error is a
// *trust.Rejection. Only admitImage calls it.
func (b *Broker) checkImageTrust(ctx context.Context, namespace, named string, img *image.Image) error {
	if b.opts.Trust == nil {
		return nil
	}
	dec, err := b.imageVerdict(ctx, namespace, named, img)
	if err != nil {
		b.obs.ImageVerified(VerifyAtCreate, VerifyRejected)
		b.log.WarnContext(ctx, "container image refused by the signature policy", "image", img.ID, "namespace", namespace, "err", err)
		return err
	}
	b.obs.ImageVerified(VerifyAtCreate, dec.Acceptance())
	return nil
}

// imageVerdict is what the policy of namespace ("" for the node's) says
// of img looked up by named: the decision that accepts it, or the first
// candidate's decision (nil when it has none) and its *trust.Rejection.
func (b *Broker) imageVerdict(ctx context.Context, namespace, named string, img *image.Image) (*trust.Decision, error) {
	var (
		firstDec *trust.Decision
		firstErr error
	)
	for _, c := range trustCandidates(named, img) {
		dec, err := b.opts.Trust.Decide(ctx, namespace, c.Ref)
		if err == nil {
			err = dec.Check(c, img.Signatures)
			if err == nil {
				return dec, nil
			}
		}
		if firstErr == nil {
			firstDec, firstErr = dec, err
		}
	}
	if firstErr == nil {
		firstErr = &trust.Rejection{Image: img.ID, Namespace: namespace, Reason: "the image has no name to look its policy up by"}
	}
	return firstDec, firstErr
}

// authorName is the reference by which the pod's author named a
// container's image: cfg.UserImage, else cfg.Image unless it is img's ID
// ("" then).
func authorName(cfg *ContainerConfig, img *image.Image) string {
	if cfg.UserImage != "" {
		return cfg.UserImage
	}
	if isImageID(cfg.Image, img.ID) {
		return ""
	}
	return cfg.Image
}

// trustCandidates are the (reference, digest) pairs img may be verified
// as: named (the name the container asks for) with each digest the image
// was pulled by from that repository; failing that (no name, or a name
// the image does not carry), every name the image has.
func trustCandidates(named string, img *image.Image) []trust.Image {
	digests := func(repo string) []string {
		var out []string
		for _, rd := range img.RepoDigests {
			if r, d, ok := strings.Cut(rd, "@"); ok && r == repo {
				out = append(out, d)
			}
		}
		return out
	}
	if r, err := pullReference(named); named != "" && err == nil {
		var out []trust.Image
		if r.Digest != "" {
			if slices.Contains(digests(r.Repo), r.Digest) {
				out = append(out, trust.Image{Ref: r, Digest: r.Digest})
			}
		} else {
			for _, d := range digests(r.Repo) {
				out = append(out, trust.Image{Ref: r, Digest: d})
			}
		}
		if len(out) > 0 {
			return out
		}
	}
	var out []trust.Image
	for _, t := range img.RepoTags {
		r, err := trust.ParseReference(t)
		if err != nil {
			continue
		}
		for _, d := range digests(r.Repo) {
			out = append(out, trust.Image{Ref: r, Digest: d})
		}
	}
	for _, rd := range img.RepoDigests {
		if r, err := trust.ParseReference(rd); err == nil {
			out = append(out, trust.Image{Ref: r, Digest: r.Digest})
		}
	}
	return out
}

// isImageID reports whether ref names the image with ID id by its ID (or
// a prefix of it), rather than by a name.
func isImageID(ref, id string) bool {
	hex := strings.TrimPrefix(ref, "sha256:")
	return len(hex) >= 12 && strings.HasPrefix(strings.TrimPrefix(id, "sha256:"), hex)
}

// TrustStatus is the signature policy's state, for verbose Status: its
// file and directory, and each file read so far; ok is false when no
// policy is configured.
func (b *Broker) TrustStatus(ctx context.Context) (file, dir string, files []trust.FileStatus, ok bool) {
	if b.opts.Trust == nil {
		return "", "", nil, false
	}
	file, dir = b.opts.Trust.Files()
	return file, dir, b.opts.Trust.Status(ctx), true
}

// ImageVerdict is what one policy says of one image.
type ImageVerdict struct {
	// Namespace is "" for the node's policy.
	Namespace string `json:"namespace,omitempty"`
	File      string `json:"file,omitempty"`
	Scope     string `json:"scope,omitempty"`
	Requires  string `json:"requires,omitempty"`
	// Result is VerifyAccepted, VerifyUnverified or VerifyRejected;
	// Reason why it is rejected.
	Result string `json:"result"`
	Reason string `json:"reason,omitempty"`
}

// ImageTrust says, for the node's policy and each namespace that has its
// own, which requirement applies to img and whether the signatures kept
// beside it satisfy it now, as a container creation would check it. A
// directory of namespace policies that cannot be listed is one verdict
// with that reason.
func (b *Broker) ImageTrust(ctx context.Context, img *image.Image) []ImageVerdict {
	if b.opts.Trust == nil {
		return nil
	}
	namespaces, err := b.opts.Trust.Namespaces()
	out := make([]ImageVerdict, 0, len(namespaces)+2)
	for _, ns := range append([]string{""}, namespaces...) {
		v := ImageVerdict{Namespace: ns, Result: VerifyRejected}
		dec, err := b.imageVerdict(ctx, ns, "", img)
		if dec != nil {
			v.File, v.Scope, v.Requires = dec.File, dec.Scope, dec.Requirements.Describe()
		}
		if err != nil {
			v.Reason = err.Error()
		} else {
			v.Result = dec.Acceptance()
		}
		out = append(out, v)
	}
	if err != nil {
		_, dir := b.opts.Trust.Files()
		out = append(out, ImageVerdict{File: dir, Result: VerifyRejected, Reason: err.Error()})
	}
	return out
}

// An admittedImage is an image the signature policy of a pod's namespace
// accepted for one use in one container creation. Only admitImage makes
// one, and everything that puts an image's files in a container (its
// rootfs, an image volume, a checkpoint image's layer) takes one: a new
// way in cannot skip the check without a new constructor.
type admittedImage struct {
	img *image.Image
}

// Image uses, as refusals name them.
const (
	useContainerImage  = ""
	useCheckpointedRan = "the checkpointed container's image"
)

func useVolume(containerPath string) string { return "volume " + containerPath }
func useCheckpointImage(ref string) string  { return "checkpoint image " + ref }

// admitImage is the one gate for image content: it checks img, named by
// the pod's author as named ("" when only by ID), against the policy of
// namespace (checkImageTrust), for use (useVolume, useCheckpointImage…;
// "" for the container's own image), which a refusal names: the error is
// then a *trust.Rejection, SignatureValidationFailed.
func (b *Broker) admitImage(ctx context.Context, namespace, use, named string, img *image.Image) (*admittedImage, error) {
	if err := b.checkImageTrust(ctx, namespace, named, img); err != nil {
		var rej *trust.Rejection
		if use != "" && errors.As(err, &rej) {
			r := *rej
			r.Use = use
			return nil, &r
		}
		return nil, err
	}
	return &admittedImage{img: img}, nil
}
