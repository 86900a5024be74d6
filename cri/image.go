package cri

import (
	"context"
	"encoding/json"
	"strconv"
	"strings"
	"time"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/image"
)

func imageOf(img *image.Image) *runtimeapi.Image {
	out := &runtimeapi.Image{
		Id:          img.ID,
		RepoTags:    img.RepoTags,
		RepoDigests: img.RepoDigests,
		Size:        img.Size,
		Spec:        &runtimeapi.ImageSpec{Image: img.ID},
	}
	// The image's user, as the kubelet wants it for runAsNonRoot checks:
	// a numeric uid, or a name.
	user, _, _ := strings.Cut(img.Config.User, ":")
	if user != "" {
		if uid, err := strconv.ParseInt(user, 10, 64); err == nil {
			out.Uid = &runtimeapi.Int64Value{Value: uid}
		} else {
			out.Username = user
		}
	}
	return out
}

// PullImage pulls an image and returns its ID.
func (s *Server) PullImage(ctx context.Context, r *runtimeapi.PullImageRequest) (*runtimeapi.PullImageResponse, error) {
	if r.GetImage() == nil {
		return nil, badRequest("image")
	}
	var auth *image.Auth
	if a := r.GetAuth(); a != nil {
		auth = &image.Auth{
			Username:      a.GetUsername(),
			Password:      a.GetPassword(),
			Auth:          a.GetAuth(),
			IdentityToken: a.GetIdentityToken(),
			RegistryToken: a.GetRegistryToken(),
		}
	}
	// The policy of the namespace of the pod the image is pulled for
	// decides which signatures it needs.
	ns := r.GetSandboxConfig().GetMetadata().GetNamespace()
	img, err := s.b.PullImage(ctx, r.GetImage().GetImage(), auth, ns)
	if err != nil {
		return nil, err
	}
	return &runtimeapi.PullImageResponse{ImageRef: img.ID}, nil
}

// ImageStatus returns an image, or an empty response when it is absent.
func (s *Server) ImageStatus(ctx context.Context, r *runtimeapi.ImageStatusRequest) (*runtimeapi.ImageStatusResponse, error) {
	if r.GetImage() == nil {
		return nil, badRequest("image")
	}
	img, err := s.b.ImageStatus(r.GetImage().GetImage())
	if errdefs.IsNotFound(err) {
		return &runtimeapi.ImageStatusResponse{}, nil
	}
	if err != nil {
		return nil, err
	}
	resp := &runtimeapi.ImageStatusResponse{Image: imageOf(img)}
	if r.GetVerbose() {
		resp.Info = map[string]string{"layers": strconv.Itoa(len(img.Layers))}
		// Which signature requirement applies to the image in each
		// namespace with a policy of its own, and in the others.
		if v := s.b.ImageTrust(ctx, img); v != nil {
			b, _ := json.Marshal(v)
			resp.Info["signaturePolicy"] = string(b)
			// Where the signatures kept beside the image were found.
			src := make([]string, len(img.Signatures))
			for i, sig := range img.Signatures {
				src[i] = sig.Source
			}
			b, _ = json.Marshal(src)
			resp.Info["signatures"] = string(b)
		}
	}
	return resp, nil
}

// ListImages lists images; the filter keeps only the image it names.
func (s *Server) ListImages(ctx context.Context, r *runtimeapi.ListImagesRequest) (*runtimeapi.ListImagesResponse, error) {
	resp := &runtimeapi.ListImagesResponse{}
	for _, img := range s.b.ListImages(r.GetFilter().GetImage().GetImage()) {
		resp.Images = append(resp.Images, imageOf(img))
	}
	return resp, nil
}

// RemoveImage removes an image; idempotent.
func (s *Server) RemoveImage(ctx context.Context, r *runtimeapi.RemoveImageRequest) (*runtimeapi.RemoveImageResponse, error) {
	if r.GetImage() == nil {
		return nil, badRequest("image")
	}
	if err := s.b.RemoveImage(ctx, r.GetImage().GetImage()); err != nil {
		return nil, err
	}
	return &runtimeapi.RemoveImageResponse{}, nil
}

// ImageFsInfo reports the image store's usage.
func (s *Server) ImageFsInfo(ctx context.Context, r *runtimeapi.ImageFsInfoRequest) (*runtimeapi.ImageFsInfoResponse, error) {
	mp, bytes, inodes, err := s.b.ImageFsUsage()
	if err != nil {
		return nil, err
	}
	fs := &runtimeapi.FilesystemUsage{
		Timestamp:  time.Now().UnixNano(),
		FsId:       &runtimeapi.FilesystemIdentifier{Mountpoint: mp},
		UsedBytes:  u64(bytes),
		InodesUsed: u64(inodes),
	}
	return &runtimeapi.ImageFsInfoResponse{ImageFilesystems: []*runtimeapi.FilesystemUsage{fs}}, nil
}
