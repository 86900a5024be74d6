package broker

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/image"
)

func TestTrustCandidates(t *testing.T) {
	d1 := "sha256:" + strings.Repeat("1", 64)
	d2 := "sha256:" + strings.Repeat("2", 64)
	img := &image.Image{
		ID:          "sha256:" + strings.Repeat("f", 64),
		RepoTags:    []string{"r.io/a:v1", "m.io/b:v2"},
		RepoDigests: []string{"r.io/a@" + d1, "m.io/b@" + d2},
	}
	for _, tc := range []struct {
		name string
		cfg  ContainerConfig
		want []string // ref digest
	}{
		// The kubelet: the image's ID, and the name the pod's author gave.
		{"user image by tag", ContainerConfig{Image: img.ID, UserImage: "r.io/a:v1"}, []string{"r.io/a:v1 " + d1}},
		// A tag that moved to another image since: the image that runs
		// is still checked by its own digest.
		{"moved tag", ContainerConfig{Image: img.ID, UserImage: "r.io/a:v0"}, []string{"r.io/a:v0 " + d1}},
		{"user image by digest", ContainerConfig{Image: img.ID, UserImage: "m.io/b@" + d2}, []string{"m.io/b@" + d2 + " " + d2}},
		{"no tag is latest", ContainerConfig{Image: "r.io/a"}, []string{"r.io/a:latest " + d1}},
		// A digest this image was not pulled by proves nothing: every
		// name it has is tried instead.
		{"foreign digest", ContainerConfig{Image: img.ID, UserImage: "r.io/a@" + d2}, []string{"r.io/a:v1 " + d1, "m.io/b:v2 " + d2, "r.io/a@" + d1 + " " + d1, "m.io/b@" + d2 + " " + d2}},
		{"by ID only", ContainerConfig{Image: img.ID[:19]}, []string{"r.io/a:v1 " + d1, "m.io/b:v2 " + d2, "r.io/a@" + d1 + " " + d1, "m.io/b@" + d2 + " " + d2}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var got []string
			for _, c := range trustCandidates(&tc.cfg, img) {
				got = append(got, c.Ref.String()+" "+c.Digest)
			}
			if strings.Join(got, "\n") != strings.Join(tc.want, "\n") {
				t.Errorf("candidates:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(tc.want, "\n"))
			}
		})
	}
}

// An image a container being created uses is never removed: either the
// creation fails because the image went first, or the removal is refused
// because the container uses it.
func TestRemoveImageWhileAContainerIsCreated(t *testing.T) {
	e := newEnv(t)
	b := e.broker(t)
	ctx := context.Background()
	pid, err := b.RunPod(ctx, podCfg("p"))
	if err != nil {
		t.Fatal(err)
	}

	// The image is removed right after the creation found it.
	found := make(chan struct{})
	removed := make(chan struct{})
	var once sync.Once
	e.images.mu.Lock()
	e.images.afterGet = func(ref string, ok bool) {
		if ref == fakeImage.RepoTags[0] && ok {
			once.Do(func() {
				close(found)
				<-removed
			})
		}
	}
	e.images.mu.Unlock()
	createErr := make(chan error, 1)
	go func() {
		_, err := b.CreateContainer(ctx, pid, ctrCfg("late"))
		createErr <- err
	}()
	<-found
	if err := b.RemoveImage(fakeImage.ID); err != nil {
		t.Fatalf("remove of an image no container has claimed yet: %v", err)
	}
	close(removed)
	if err := <-createErr; !errdefs.IsNotFound(err) {
		t.Fatalf("creation from an image removed meanwhile: %v, want NotFound", err)
	}
	e.images.mu.Lock()
	e.images.afterGet = nil
	e.images.mu.Unlock()

	// Both at once, for the race detector.
	for i := range 20 {
		if _, err := b.PullImage(ctx, fakeImage.RepoTags[0], nil, ""); err != nil {
			t.Fatal(err)
		}
		var (
			wg                   sync.WaitGroup
			createErr, removeErr error
		)
		wg.Add(2)
		go func() {
			defer wg.Done()
			_, createErr = b.CreateContainer(ctx, pid, ctrCfg(fmt.Sprintf("c%d", i)))
		}()
		go func() {
			defer wg.Done()
			removeErr = b.RemoveImage(fakeImage.ID)
		}()
		wg.Wait()
		switch {
		case createErr == nil && removeErr == nil:
			t.Fatalf("round %d: the image was removed while a container was created from it", i)
		case createErr != nil && !errdefs.IsNotFound(createErr):
			t.Fatalf("round %d: create: %v", i, createErr)
		case removeErr != nil && !errors.Is(removeErr, errdefs.ErrFailedPrecondition):
			t.Fatalf("round %d: remove: %v", i, removeErr)
		}
		for _, c := range b.ListContainers(ctx, ContainerFilter{PodID: pid}) {
			if err := b.RemoveContainer(ctx, c.ID); err != nil {
				t.Fatal(err)
			}
		}
	}
}
