package checkpoint

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/google/go-containerregistry/pkg/v1/mutate"

	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/testutil"
)

// A checkpoint image carries the archive's entries at its layer's root
// and the annotations that name the container; its unpacked layer reads
// as the archive does.
func TestImageReadDir(t *testing.T) {
	archive, c := writeTestArchive(t)
	img, err := Image(archive)
	if err != nil {
		t.Fatal(err)
	}
	m, err := img.Manifest()
	if err != nil {
		t.Fatal(err)
	}
	if name, ok := ImageContainer(m.Annotations); !ok || name != c.Name || m.Annotations[AnnotationCRIOName] != c.Name {
		t.Errorf("manifest annotations %v: name %q, %v", m.Annotations, name, ok)
	}
	if len(m.Layers) != 1 {
		t.Fatalf("%d layers, want 1", len(m.Layers))
	}
	cf, err := img.ConfigFile()
	if err != nil || cf.OS != "linux" || cf.Architecture == "" {
		t.Errorf("config %+v, %v", cf, err)
	}
	// Unpack the layer as an image store does.
	layerDir := t.TempDir()
	rc := mutate.Extract(img)
	testutil.Untar(t, rc, layerDir)
	rc.Close()
	fromArchive, fromLayer := t.TempDir(), t.TempDir()
	want, err := Read(archive, fromArchive)
	if err != nil {
		t.Fatal(err)
	}
	got, err := ReadDir(layerDir, fromLayer)
	if err != nil {
		t.Fatal(err)
	}
	if got.ID != want.ID || got.Name != want.Name || !slices.Equal(got.Args, want.Args) {
		t.Errorf("ReadDir %+v, Read %+v", got, want)
	}
	for _, n := range []string{RootfsDiff, DeletedFiles, StageletDump, "checkpoint/pstree.img", "checkpoint/pages-1.img"} {
		a, err1 := os.ReadFile(filepath.Join(fromArchive, n))
		b, err2 := os.ReadFile(filepath.Join(fromLayer, n))
		if err1 != nil || err2 != nil || string(a) != string(b) {
			t.Errorf("%s: from the archive %d bytes (%v), from the layer %d bytes (%v)", n, len(a), err1, len(b), err2)
		}
	}
	if _, ok := ImageContainer(map[string]string{"org.opencontainers.image.title": "x"}); ok {
		t.Error("an ordinary image taken for a checkpoint image")
	}
}

// ReadDir refuses a layer with anything but an archive's regular files.
func TestReadDirRefuses(t *testing.T) {
	src := t.TempDir()
	if err := os.Mkdir(filepath.Join(src, ImagesDir), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("/etc/passwd", filepath.Join(src, ImagesDir, "pages-1.img")); err != nil {
		t.Fatal(err)
	}
	if _, err := ReadDir(src, t.TempDir()); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("a symlink: %v, want InvalidArgument", err)
	}
	src = t.TempDir()
	if err := os.WriteFile(filepath.Join(src, "run.sh"), nil, 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := ReadDir(src, t.TempDir()); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("an unknown file: %v, want InvalidArgument", err)
	}
	// An ordinary image's layer: no stagelet record.
	if _, err := ReadDir(t.TempDir(), t.TempDir()); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("an empty layer: %v, want InvalidArgument", err)
	}
}
