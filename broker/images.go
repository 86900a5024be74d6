package broker

import (
	"context"
	"slices"

	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/image"
)

// PullImage pulls ref for a pod in namespace ("" when the kubelet names
// no pod) and returns the image; the namespace's signature policy must
// accept it.
func (b *Broker) PullImage(ctx context.Context, ref string, auth *image.Auth, namespace string) (*image.Image, error) {
	if ref == "" {
		return nil, errdefs.InvalidArgument("image.image: must not be empty")
	}
	verify, err := b.pullVerifier(ctx, namespace, ref)
	if err != nil {
		return nil, err
	}
	img, err := b.opts.Images.Pull(ctx, ref, auth, verify)
	if err != nil {
		return nil, err
	}
	b.log.InfoContext(ctx, "image pulled", "ref", ref, "image", img.ID)
	return img, nil
}

// ImageStatus returns the image named by ref, or NotFound.
func (b *Broker) ImageStatus(ref string) (*image.Image, error) {
	if ref == "" {
		return nil, errdefs.InvalidArgument("image.image: must not be empty")
	}
	return b.opts.Images.Get(ref)
}

// ListImages lists the images; a non-empty ref keeps only the image it
// names.
func (b *Broker) ListImages(ref string) []*image.Image {
	if ref != "" {
		img, err := b.opts.Images.Get(ref)
		if err != nil {
			return nil
		}
		return []*image.Image{img}
	}
	return b.opts.Images.List()
}

// RemoveImage removes an image. Idempotent; refused with
// FailedPrecondition while a container uses it, as its image or as an
// image volume, or is being created from it (claimImages).
func (b *Broker) RemoveImage(ctx context.Context, ref string) error {
	if ref == "" {
		return errdefs.InvalidArgument("image.image: must not be empty")
	}
	b.imageMu.Lock()
	defer b.imageMu.Unlock()
	img, err := b.opts.Images.Get(ref)
	if errdefs.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return err
	}
	b.mu.Lock()
	for _, c := range b.ctrs {
		switch {
		case c.rec.ImageID == img.ID:
			id := c.rec.ID
			b.mu.Unlock()
			return errdefs.FailedPrecondition("image %s is used by container %s", img.ID, id)
		case slices.Contains(c.rec.VolumeImageIDs, img.ID):
			id := c.rec.ID
			b.mu.Unlock()
			return errdefs.FailedPrecondition("image %s is used by container %s as an image volume", img.ID, id)
		}
	}
	b.mu.Unlock()
	if err := b.opts.Images.Remove(ctx, ref); err != nil {
		return err
	}
	b.log.InfoContext(ctx, "image removed", "ref", ref, "image", img.ID)
	return nil
}

// ImageFsUsage reports the image store's disk usage.
func (b *Broker) ImageFsUsage() (mountpoint string, bytes, inodes uint64, err error) {
	bytes, inodes, err = b.opts.Images.Usage()
	return b.opts.Images.Root(), bytes, inodes, err
}
