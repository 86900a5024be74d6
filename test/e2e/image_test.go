package e2e

import (
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/test/testregistry"
)

func (e *env) imageStatus(ref string) *runtimeapi.Image {
	e.t.Helper()
	resp, err := e.is().ImageStatus(e.ctx(), &runtimeapi.ImageStatusRequest{Image: &runtimeapi.ImageSpec{Image: ref}})
	if err != nil {
		e.t.Fatalf("ImageStatus %s: %v", ref, err)
	}
	return resp.Image
}

func (e *env) listImages() []*runtimeapi.Image {
	e.t.Helper()
	resp, err := e.is().ListImages(e.ctx(), &runtimeapi.ListImagesRequest{})
	if err != nil {
		e.t.Fatalf("ListImages: %v", err)
	}
	return resp.Images
}

func listed(images []*runtimeapi.Image, ref string) bool {
	for _, img := range images {
		if img.Id == ref || slices.Contains(img.RepoTags, ref) || slices.Contains(img.RepoDigests, ref) {
			return true
		}
	}
	return false
}

func TestPullImageStatusListRemove(t *testing.T) {
	e := newEnvNoPull(t)
	ref := e.image
	imageRef := e.pull(ref)

	img := e.imageStatus(ref)
	if img == nil {
		t.Fatalf("ImageStatus %s after pull: no image", ref)
	}
	if img.Id == "" || img.Size == 0 {
		t.Errorf("ImageStatus %s: id %q size %d, want both set", ref, img.Id, img.Size)
	}
	if !slices.Contains(img.RepoTags, ref) {
		t.Errorf("ImageStatus %s: repo_tags %v do not hold the pulled reference", ref, img.RepoTags)
	}
	if len(img.RepoDigests) == 0 || !strings.Contains(img.RepoDigests[0], "@sha256:") {
		t.Errorf("ImageStatus %s: repo_digests %v, want HOST/REPO@sha256:...", ref, img.RepoDigests)
	}
	if imageRef != img.Id && !slices.Contains(img.RepoDigests, imageRef) {
		t.Errorf("PullImage returned image_ref %q, which is neither the image id %q nor one of its digests %v", imageRef, img.Id, img.RepoDigests)
	}
	byID := e.imageStatus(img.Id)
	if byID == nil || byID.Id != img.Id {
		t.Errorf("ImageStatus by id %s = %v, want the same image", img.Id, byID)
	}
	if !listed(e.listImages(), ref) {
		t.Errorf("ListImages does not list %s", ref)
	}
	if again := e.pull(ref); again != imageRef {
		t.Errorf("second PullImage returned %q, first %q", again, imageRef)
	}
	if n := len(e.listImages()); n != 1 {
		t.Errorf("ListImages after two pulls of one image: %d images, want 1", n)
	}

	if _, err := e.is().RemoveImage(e.ctx(), &runtimeapi.RemoveImageRequest{Image: &runtimeapi.ImageSpec{Image: ref}}); err != nil {
		t.Fatalf("RemoveImage %s: %v", ref, err)
	}
	if img := e.imageStatus(ref); img != nil {
		t.Errorf("ImageStatus after RemoveImage: %v, want no image", img)
	}
	if listed(e.listImages(), ref) {
		t.Errorf("ListImages still lists %s after RemoveImage", ref)
	}
	if _, err := e.is().RemoveImage(e.ctx(), &runtimeapi.RemoveImageRequest{Image: &runtimeapi.ImageSpec{Image: ref}}); err != nil {
		t.Errorf("second RemoveImage %s: %v, want success (idempotent)", ref, err)
	}
}

// ImageStatus of an image that is not there is an empty answer, not an error.
func TestImageStatusOfMissingImage(t *testing.T) {
	e := newEnvNoPull(t)
	for _, ref := range []string{e.reg.Host + "/e2e/never-pulled:latest", e.image} {
		resp, err := e.is().ImageStatus(e.ctx(), &runtimeapi.ImageStatusRequest{Image: &runtimeapi.ImageSpec{Image: ref}})
		if err != nil {
			t.Errorf("ImageStatus %s: %v, want no error", ref, err)
			continue
		}
		if resp.Image != nil {
			t.Errorf("ImageStatus %s: %v, want no image", ref, resp.Image)
		}
	}
}

func TestPullMissingImageFails(t *testing.T) {
	e := newEnvNoPull(t)
	ref := e.reg.Host + "/e2e/does-not-exist:latest"
	_, err := e.is().PullImage(e.ctx(), &runtimeapi.PullImageRequest{Image: &runtimeapi.ImageSpec{Image: ref}})
	if err == nil {
		t.Fatalf("PullImage %s succeeded", ref)
	}
	if s, _ := status.FromError(err); s.Code() == codes.Unknown || s.Code() == codes.OK {
		t.Errorf("PullImage %s: %v; want a classified gRPC code (NotFound), not %s", ref, err, s.Code())
	}
}

// A multi-arch index resolves to this machine's platform.
func TestPullMultiArchIndex(t *testing.T) {
	if runtime.GOARCH != "amd64" {
		t.Skipf("the index fixture has an amd64 busybox entry; this machine is %s", runtime.GOARCH)
	}
	e := newEnvNoPull(t)
	ref := e.reg.PushIndex(t, "e2e/multiarch", "v1")
	e.pull(ref)
	if img := e.imageStatus(ref); img == nil {
		t.Fatalf("ImageStatus %s after pull: no image", ref)
	}
	cfg := e.containerConfig("multi", "sleep", "3600")
	cfg.Image.Image = ref
	_, ctr, _ := e.runOne("multiarch", cfg)
	e.waitContainerState(ctr, runtimeapi.ContainerState_CONTAINER_RUNNING, stateTimeout)
	// The arm64 entry holds only /arch; the amd64 one is busybox.
	if r := e.execSync(ctr, "test", "-e", "/arch"); r.ExitCode == 0 {
		t.Errorf("/arch exists: the arm64 entry of the index was unpacked")
	}
	if out := e.execOK(ctr, "uname", "-m"); strings.TrimSpace(out) != "x86_64" {
		t.Errorf("uname -m = %q", out)
	}
}

// An image whose layer escapes its root (.. entries, writes through a
// symlink to /) is refused as a whole and writes nothing outside.
func TestHostileImageRefused(t *testing.T) {
	e := newEnvNoPull(t)
	ref := e.reg.PushHostile(t, "e2e/hostile", "v1")
	outside := []string{
		"/" + testregistry.HostileEscapeName,
		"/tmp/" + testregistry.HostileEscapeName,
		"/tmp/" + testregistry.HostileEscapeName + "-symlink",
		filepath.Join(filepath.Dir(e.d.Root), testregistry.HostileEscapeName),
	}
	var preexisting []string
	for _, p := range outside {
		if _, err := os.Lstat(p); err == nil {
			preexisting = append(preexisting, p)
		}
	}

	_, err := e.is().PullImage(e.ctx(), &runtimeapi.PullImageRequest{Image: &runtimeapi.ImageSpec{Image: ref}})
	if err == nil {
		t.Fatalf("PullImage of the hostile image %s succeeded", ref)
	}
	s, _ := status.FromError(err)
	if s.Code() == codes.OK || s.Code() == codes.Unknown {
		t.Errorf("PullImage hostile: code %s, want a classified refusal (e.g. InvalidArgument)", s.Code())
	}
	if !strings.Contains(s.Message(), testregistry.HostileEscapeName) {
		t.Errorf("PullImage hostile: message %q does not name the offending entry (%s...)", s.Message(), testregistry.HostileEscapeName)
	}

	if listed(e.listImages(), ref) {
		t.Errorf("ListImages lists the refused image %s", ref)
	}
	if img := e.imageStatus(ref); img != nil {
		t.Errorf("ImageStatus of the refused image: %v, want no image", img)
	}
	for _, p := range outside {
		if _, err := os.Lstat(p); err == nil && !slices.Contains(preexisting, p) {
			t.Errorf("the hostile layer wrote %s", p)
			os.Remove(p)
		}
	}
	// Nothing named after the escape anywhere in the daemon's directories
	// either: the layer was refused as a whole.
	filepath.WalkDir(e.d.Root, func(p string, d fs.DirEntry, err error) error {
		if err == nil && strings.HasPrefix(d.Name(), testregistry.HostileEscapeName) {
			t.Errorf("refused layer left %s behind", p)
		}
		return nil
	})
}

func TestImageFsInfo(t *testing.T) {
	e := newEnv(t)
	resp, err := e.is().ImageFsInfo(e.ctx(), &runtimeapi.ImageFsInfoRequest{})
	if err != nil {
		t.Fatalf("ImageFsInfo: %v", err)
	}
	if len(resp.ImageFilesystems) == 0 {
		t.Fatalf("ImageFsInfo: no image filesystems")
	}
	for _, fsu := range resp.ImageFilesystems {
		if fsu.GetFsId().GetMountpoint() == "" {
			t.Errorf("image filesystem without a mountpoint: %v", fsu)
		}
		if fsu.GetUsedBytes().GetValue() == 0 || fsu.GetInodesUsed().GetValue() == 0 {
			t.Errorf("image filesystem %s: used bytes %d, inodes %d after a pull; want both non-zero",
				fsu.GetFsId().GetMountpoint(), fsu.GetUsedBytes().GetValue(), fsu.GetInodesUsed().GetValue())
		}
		if fsu.Timestamp == 0 {
			t.Errorf("image filesystem %s: no timestamp", fsu.GetFsId().GetMountpoint())
		}
	}
}
