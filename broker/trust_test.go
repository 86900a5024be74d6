package broker

import (
	"context"
	"encoding/json"
	"os"
	"slices"
	"strings"
	"testing"

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
			for _, c := range trustCandidates(authorName(&tc.cfg, img), img) {
				got = append(got, c.Ref.String()+" "+c.Digest)
			}
			if strings.Join(got, "\n") != strings.Join(tc.want, "\n") {
				t.Errorf("candidates:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(tc.want, "\n"))
			}
		})
	}
}

// TestImageVolumesInUseAcrossRestart: the images a container's image
// volumes mount are recorded in use, and a record written before they
// were (no volumeImageIds) gets them back from its mounts at recovery.
func TestImageVolumesInUseAcrossRestart(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	b := e.broker(t)
	pod, err := b.RunPod(ctx, podCfg("p"))
	if err != nil {
		t.Fatal(err)
	}
	cfg := ctrCfg("c")
	cfg.Mounts = []Mount{{ContainerPath: "/vol", Image: fakeImage.RepoTags[0]}}
	id, err := b.CreateContainer(ctx, pod, cfg)
	if err != nil {
		t.Fatal(err)
	}
	volumes := func(b *Broker) []string {
		t.Helper()
		rec, err := b.ContainerStatus(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		return rec.VolumeImageIDs
	}
	if got := volumes(b); !slices.Equal(got, []string{fakeImage.ID}) {
		t.Fatalf("volume images: %v", got)
	}
	b.Close()

	// The record as an older stagelet wrote it.
	path := (&records{dir: e.state}).containerPath(id)
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var rec map[string]any
	if err := json.Unmarshal(data, &rec); err != nil {
		t.Fatal(err)
	}
	delete(rec, "volumeImageIds")
	if data, err = json.Marshal(rec); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
	if got := volumes(e.broker(t)); !slices.Equal(got, []string{fakeImage.ID}) {
		t.Fatalf("volume images after recovering an older record: %v", got)
	}
}
