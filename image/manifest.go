package image

import (
	"encoding/json"
	"fmt"
	"os"

	v1 "github.com/google/go-containerregistry/pkg/v1"
)

// Annotations are the annotations of image ref's manifest, as pulled (a
// checkpoint image names its container there). Errors as Get's.
func (s *Store) Annotations(ref string) (map[string]string, error) {
	s.mu.Lock()
	rec, err := s.lookupLocked(ref)
	s.mu.Unlock()
	if err != nil {
		return nil, err
	}
	b, err := os.ReadFile(s.blobPath(rec.Manifest))
	if err != nil {
		return nil, fmt.Errorf("image %s: its manifest: %w", rec.ID, err)
	}
	var m v1.Manifest
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, fmt.Errorf("image %s: its manifest: %w", rec.ID, err)
	}
	return m.Annotations, nil
}

// LayerDirs are the unpacked directories of image ref's layers, bottom
// first: the store's, to be read and never written. Errors as Get's.
func (s *Store) LayerDirs(ref string) ([]string, error) {
	s.mu.Lock()
	rec, err := s.lookupLocked(ref)
	s.mu.Unlock()
	if err != nil {
		return nil, err
	}
	out := make([]string, len(rec.Layers))
	for i, d := range rec.Layers {
		out[i] = s.layerPath(d)
	}
	return out, nil
}
