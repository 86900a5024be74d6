package testregistry

import (
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/remote"
)

func TestPushAndFetch(t *testing.T) {
	r := Start(t)
	ref := r.PushBusybox(t, "busybox", "latest")
	if want := r.Host + "/busybox:latest"; ref != want {
		t.Fatalf("ref = %q, want %q", ref, want)
	}
	img, err := remote.Image(mustRef(t, ref))
	if err != nil {
		t.Fatal(err)
	}
	got, _ := img.ConfigName()
	want, _ := BusyboxImage(t).ConfigName()
	if got != want {
		t.Fatalf("config digest %s, want %s", got, want)
	}
	if again, _ := buildBusybox(); again != nil {
		d, _ := again.Digest()
		d0, _ := BusyboxImage(t).Digest()
		if d != d0 {
			t.Fatalf("busybox image is not deterministic: %s vs %s", d, d0)
		}
	}
	idx := r.PushIndex(t, "multi", "v1")
	desc, err := remote.Get(mustRef(t, idx))
	if err != nil {
		t.Fatal(err)
	}
	if !desc.MediaType.IsIndex() {
		t.Fatalf("media type %s, want an index", desc.MediaType)
	}
	r.PushHostile(t, "hostile", "v1")
	if r.Requests() == 0 {
		t.Fatal("no requests counted")
	}
	cf, err := WithConfig(BusyboxImage(t), []string{"/bin/sh"}, []string{"-c", "true"}, "app").ConfigFile()
	if err != nil || cf.Config.User != "app" || cf.Config.Entrypoint[0] != "/bin/sh" {
		t.Fatalf("WithConfig: %v %+v", err, cf)
	}
}

func mustRef(t *testing.T, s string) name.Reference {
	t.Helper()
	r, err := name.ParseReference(s)
	if err != nil {
		t.Fatal(err)
	}
	return r
}
