package broker

import (
	"context"
	"crypto/sha256"
	"fmt"
	"os"
	"path/filepath"
	"sync"

	"github.com/stagelet/stagelet/checkpoint"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/image"
	"github.com/stagelet/stagelet/network"
)

// fakeImages is an image store with one image whose rootfs is a plain
// directory holding /etc/passwd and /etc/group.
type fakeImages struct {
	mu      sync.Mutex
	mounted map[string]bool
	// hold, when set, keeps UnmountRootfs from finishing until closed.
	hold chan struct{}
	// checkpoints are checkpoint images, by reference: their one
	// layer's directory.
	checkpoints map[string]string
	// unpulled hides the image until a Pull, whose references go to
	// pulls.
	unpulled bool
	pulls    []string
	// removed: Remove took the image away (until a Pull).
	removed bool
	// afterGet, when set, is called by Get with the reference and
	// whether it found the image, before Get returns.
	afterGet func(ref string, found bool)
}

func (f *fakeImages) mountedDirs() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.mounted)
}

var fakeImage = &image.Image{
	ID:       "sha256:" + fmt.Sprintf("%064d", 1),
	RepoTags: []string{"example.test/busybox:latest"},
	Config:   image.ImageConfig{Entrypoint: []string{"/bin/sh"}, Cmd: []string{"-c", "sleep 1000"}, Env: []string{"PATH=/bin", "A=1"}, User: "app"},
}

func (f *fakeImages) Pull(ctx context.Context, ref string, auth *image.Auth, verify image.Verify) (*image.Image, error) {
	f.mu.Lock()
	f.unpulled, f.removed = false, false
	f.pulls = append(f.pulls, ref)
	f.mu.Unlock()
	return f.Get(ref)
}
func (f *fakeImages) Get(ref string) (*image.Image, error) {
	f.mu.Lock()
	unpulled := f.unpulled || f.removed
	f.mu.Unlock()
	if unpulled {
		return nil, errdefs.NotFound("image %q (not pulled here)", ref)
	}
	if img := f.checkpointImage(ref); img != nil {
		return img, nil
	}
	found := ref == fakeImage.ID || ref == fakeImage.RepoTags[0]
	f.mu.Lock()
	after := f.afterGet
	f.mu.Unlock()
	if after != nil {
		after(ref, found)
	}
	if found {
		return fakeImage, nil
	}
	return nil, errdefs.NotFound("image %q", ref)
}

// checkpointImage is the checkpoint image ref names (its reference or
// its ID), nil for none.
func (f *fakeImages) checkpointImage(ref string) *image.Image {
	f.mu.Lock()
	defer f.mu.Unlock()
	for r := range f.checkpoints {
		id := fmt.Sprintf("sha256:%x", sha256.Sum256([]byte(r)))
		if ref == r || ref == id {
			return &image.Image{ID: id, RepoTags: []string{r}}
		}
	}
	return nil
}

func (f *fakeImages) List() []*image.Image { return []*image.Image{fakeImage} }
func (f *fakeImages) Remove(_ context.Context, ref string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.removed = true
	return nil
}
func (f *fakeImages) Usage() (uint64, uint64, error) { return 1, 1, nil }
func (f *fakeImages) Root() string                   { return "/fake" }
func (f *fakeImages) MountRootfs(_ context.Context, id, dir string, userns *image.UserNS, _ string) (string, error) {
	rootfs := filepath.Join(dir, "rootfs")
	if err := os.MkdirAll(filepath.Join(rootfs, "etc"), 0o755); err != nil {
		return "", err
	}
	os.WriteFile(filepath.Join(rootfs, "etc/passwd"), []byte("root:x:0:0::/root:/bin/sh\napp:x:1000:1000::/home/app:/bin/sh\n"), 0o644)
	os.WriteFile(filepath.Join(rootfs, "etc/group"), []byte("root:x:0:\napp:x:1000:\nextra:x:2000:app\n"), 0o644)
	f.mu.Lock()
	if f.mounted == nil {
		f.mounted = map[string]bool{}
	}
	f.mounted[dir] = true
	f.mu.Unlock()
	return rootfs, nil
}
func (f *fakeImages) MountImageVolume(ref, dir, subPath string) (string, error) {
	if _, err := f.Get(ref); err != nil {
		return "", err
	}
	p := filepath.Join(dir, "root", subPath)
	return p, os.MkdirAll(p, 0o755)
}
func (f *fakeImages) Annotations(ref string) (map[string]string, error) {
	f.mu.Lock()
	_, ok := f.checkpoints[ref]
	f.mu.Unlock()
	if ok {
		return map[string]string{checkpoint.AnnotationCRIOName: "c"}, nil
	}
	// Not through Get: afterGet watches the creation's lookup only.
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.unpulled || f.removed || (ref != fakeImage.ID && ref != fakeImage.RepoTags[0]) {
		return nil, errdefs.NotFound("image %q", ref)
	}
	return nil, nil
}
func (f *fakeImages) LayerDirs(ref string) ([]string, error) {
	if img := f.checkpointImage(ref); img != nil {
		f.mu.Lock()
		defer f.mu.Unlock()
		return []string{f.checkpoints[img.RepoTags[0]]}, nil
	}
	if _, err := f.Get(ref); err != nil {
		return nil, err
	}
	return []string{"/fake/layer"}, nil
}
func (f *fakeImages) UnmountRootfs(_ context.Context, dir string) error {
	f.mu.Lock()
	hold := f.hold
	f.mu.Unlock()
	if hold != nil {
		<-hold
	}
	f.mu.Lock()
	delete(f.mounted, dir)
	f.mu.Unlock()
	return os.RemoveAll(dir)
}

// fakeNetwork hands out one IP per pod and tracks attachments; a netns is
// a plain file.
type fakeNetwork struct {
	mu       sync.Mutex
	dir      string
	netns    map[string]string
	attached map[string]*network.PodNetwork
	dels     map[string]int // Teardown calls by pod
	// setup, when set, runs first in Setup (CNI ADD); its error is
	// Setup's.
	setup func(ctx context.Context, podID string) error
	// unready, when set, is why Status says pod networking is not ready.
	unready string
}

func newFakeNetwork(dir string) *fakeNetwork {
	os.MkdirAll(dir, 0o700)
	return &fakeNetwork{dir: dir, netns: map[string]string{}, attached: map[string]*network.PodNetwork{}, dels: map[string]int{}}
}

func (n *fakeNetwork) Status() (bool, string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.unready == "", n.unready
}
func (n *fakeNetwork) NetNSPath(id string) string { return filepath.Join(n.dir, id) }
func (n *fakeNetwork) NewNetNS(_ context.Context, id string) (string, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	p := n.NetNSPath(id)
	n.netns[id] = p
	return p, os.WriteFile(p, nil, 0o600)
}
func (n *fakeNetwork) RemoveNetNS(_ context.Context, p string) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	delete(n.netns, filepath.Base(p))
	return removeIfExists(p)
}
func (n *fakeNetwork) NetNSPods() ([]string, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	var ids []string
	for id := range n.netns {
		ids = append(ids, id)
	}
	return ids, nil
}
func (n *fakeNetwork) Setup(ctx context.Context, pn network.PodNetwork) (*network.Result, error) {
	if n.setup != nil {
		if err := n.setup(ctx, pn.PodID); err != nil {
			return nil, err
		}
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	n.attached[pn.PodID] = &pn
	return &network.Result{IPs: []string{"10.213.0.2"}, Interface: "eth0"}, nil
}
func (n *fakeNetwork) Teardown(ctx context.Context, pn network.PodNetwork) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	delete(n.attached, pn.PodID)
	n.dels[pn.PodID]++
	return nil
}
