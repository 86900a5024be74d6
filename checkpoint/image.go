package checkpoint

import (
	"fmt"
	"runtime"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// A checkpoint image is an OCI image whose one layer holds a checkpoint
// archive's entries at its root, and whose manifest names the
// checkpointed container in an annotation: the image CRI-O, containerd
// and Podman restore a container from when a pod names it (made by hand
// with `buildah from scratch; buildah add ARCHIVE /; buildah config
// --annotation KEY=NAME`).

// Manifest annotations that mark a checkpoint image, each naming the
// checkpointed container: checkpointctl's (containerd's), CRI-O's and
// Podman's.
const (
	AnnotationName     = "org.criu.checkpoint.container.name"
	AnnotationCRIOName = "io.kubernetes.cri-o.annotations.checkpoint.name"
	AnnotationPodman   = "io.podman.annotations.checkpoint.name"
	// AnnotationEngine names the engine that wrote the checkpoint.
	AnnotationEngine = "org.criu.checkpoint.engine.name"
)

// ImageContainer is the container a checkpoint image's manifest
// annotations name; ok is false when they mark no checkpoint image.
func ImageContainer(annotations map[string]string) (name string, ok bool) {
	for _, k := range []string{AnnotationName, AnnotationCRIOName, AnnotationPodman} {
		if v, ok := annotations[k]; ok {
			return v, true
		}
	}
	return "", false
}

// Image is the checkpoint image of archive (Write's): one layer (the
// archive, gzipped once and kept in memory for its digest and its push)
// holding the archive's entries, the annotations CRI-O, containerd and
// Podman look for, for this machine's platform.
func Image(archive string) (v1.Image, error) {
	c, err := ReadMeta(archive)
	if err != nil {
		return nil, err
	}
	layer, err := tarball.LayerFromFile(archive, tarball.WithMediaType(types.OCILayer), tarball.WithCompressedCaching)
	if err != nil {
		return nil, fmt.Errorf("checkpoint image: %w", err)
	}
	img, err := mutate.AppendLayers(mutate.MediaType(empty.Image, types.OCIManifestSchema1), layer)
	if err != nil {
		return nil, fmt.Errorf("checkpoint image: %w", err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, fmt.Errorf("checkpoint image: %w", err)
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", runtime.GOARCH
	cf.Created = v1.Time{Time: c.Checkpointed}
	img, err = mutate.ConfigFile(img, cf)
	if err != nil {
		return nil, fmt.Errorf("checkpoint image: %w", err)
	}
	img = mutate.ConfigMediaType(img, types.OCIConfigJSON)
	return mutate.Annotations(img, map[string]string{
		AnnotationName:     c.Name,
		AnnotationCRIOName: c.Name,
		AnnotationEngine:   "stagelet",
	}).(v1.Image), nil
}
