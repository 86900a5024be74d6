package broker

import (
	"testing"

	"github.com/stagelet/stagelet/image"
)

func TestImageName(t *testing.T) {
	const id = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
	tagged := &image.Image{ID: id, RepoTags: []string{"127.0.0.1:5000/busybox:1.37", "127.0.0.1:5000/busybox:1.36"}}
	untagged := &image.Image{ID: id}
	for _, tc := range []struct {
		name string
		cfg  ContainerConfig
		img  *image.Image
		want string
	}{
		// The kubelet passes the ID it pulled and what the pod's spec says.
		{"user specified wins", ContainerConfig{Image: id, UserImage: "127.0.0.1:5000/busybox:1.36"}, tagged, "127.0.0.1:5000/busybox:1.36"},
		{"reference kept", ContainerConfig{Image: "127.0.0.1:5000/busybox:1.36"}, tagged, "127.0.0.1:5000/busybox:1.36"},
		{"ID: first tag", ContainerConfig{Image: id}, tagged, "127.0.0.1:5000/busybox:1.37"},
		{"ID without sha256: first tag", ContainerConfig{Image: id[len("sha256:"):]}, tagged, "127.0.0.1:5000/busybox:1.37"},
		{"short ID: first tag", ContainerConfig{Image: id[:19]}, tagged, "127.0.0.1:5000/busybox:1.37"},
		{"ID of an untagged image", ContainerConfig{Image: id}, untagged, id},
	} {
		if got := imageName(&tc.cfg, tc.img); got != tc.want {
			t.Errorf("%s: imageName = %q, want %q", tc.name, got, tc.want)
		}
	}
}
