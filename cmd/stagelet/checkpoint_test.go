package main

import (
	"bytes"
	"encoding/json"
	"io"
	"log"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	"github.com/google/go-containerregistry/pkg/v1/remote"

	"github.com/stagelet/stagelet/checkpoint"
)

// `stagelet checkpoint image` pushes an archive as a checkpoint image: the
// annotations name the container, the one layer holds the archive.
func TestCheckpointImagePush(t *testing.T) {
	srv := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	defer srv.Close()
	dir := t.TempDir()
	layer, images := filepath.Join(dir, "layer"), filepath.Join(dir, "images")
	for _, d := range []string{filepath.Join(layer, "upper"), images} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(images, "pstree.img"), []byte("tree"), 0o600); err != nil {
		t.Fatal(err)
	}
	archive := filepath.Join(dir, "counter.tar")
	c := &checkpoint.Container{ID: "abc", Name: "counter", Image: "registry.test/app:1", Stage1: "nspawn", Config: json.RawMessage(`{}`)}
	if _, err := checkpoint.Write(archive, c, layer, images); err != nil {
		t.Fatal(err)
	}
	ref := strings.TrimPrefix(srv.URL, "http://") + "/checkpoints/counter:1"
	var out, errOut bytes.Buffer
	if rc := checkpointMain([]string{"image", archive, ref}, &out, &errOut); rc != 0 {
		t.Fatalf("exit %d: %s", rc, errOut.String())
	}
	if !strings.Contains(out.String(), "/checkpoints/counter@sha256:") {
		t.Errorf("printed %q, want the pushed digest", out.String())
	}
	r, err := name.ParseReference(ref)
	if err != nil {
		t.Fatal(err)
	}
	img, err := remote.Image(r)
	if err != nil {
		t.Fatal(err)
	}
	m, err := img.Manifest()
	if err != nil {
		t.Fatal(err)
	}
	if n, ok := checkpoint.ImageContainer(m.Annotations); !ok || n != "counter" || len(m.Layers) != 1 {
		t.Errorf("pushed manifest: annotations %v, %d layers", m.Annotations, len(m.Layers))
	}
	layers, err := img.Layers()
	if err != nil {
		t.Fatal(err)
	}
	rc, err := layers[0].Uncompressed()
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	got, err := io.ReadAll(rc)
	want, _ := os.ReadFile(archive)
	if err != nil || !bytes.Equal(got, want) {
		t.Errorf("the layer is %d bytes (%v), not the archive's %d", len(got), err, len(want))
	}

	// Bad input: usage, or a clear error.
	if rc := checkpointMain([]string{"image", archive}, &out, &errOut); rc != 2 {
		t.Errorf("one argument: exit %d, want 2", rc)
	}
	errOut.Reset()
	if rc := checkpointMain([]string{"image", filepath.Join(dir, "none.tar"), ref}, &out, &errOut); rc != 1 || !strings.Contains(errOut.String(), "does not exist") {
		t.Errorf("a missing archive: exit %d, %q", rc, errOut.String())
	}
	if rc := checkpointMain([]string{"restore-pod", dir}, &out, &errOut); rc != 2 {
		t.Errorf("restore-pod without -config: exit %d, want 2", rc)
	}
}
