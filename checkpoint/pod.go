package checkpoint

import (
	"archive/tar"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"
	"time"

	"github.com/stagelet/stagelet/errdefs"
)

// A pod checkpoint is a directory (CheckpointPod's output, RestorePod's
// input) holding PodDump, the pod's description, and one container
// archive (Write's) per checkpointed container, named in it.

// PodDump is the pod checkpoint's description, in its directory.
const PodDump = "pod.dump"

// podVersion is the version of PodDump this stagelet writes and reads.
const podVersion = 1

// Pod describes a checkpointed pod.
type Pod struct {
	Version int `json:"version"`
	// ID is the checkpointed pod's; Name and Namespace its CRI names.
	ID        string `json:"id"`
	Name      string `json:"name"`
	Namespace string `json:"namespace"`
	// Stage1 ran it: a restore must be given the same.
	Stage1 string `json:"stage1"`
	// Config is the broker's record of the pod's configuration, opaque
	// here.
	Config json.RawMessage `json:"config,omitempty"`
	// Containers are its checkpointed containers.
	Containers   []PodContainer `json:"containers"`
	Checkpointed time.Time      `json:"checkpointed"`
}

// PodContainer is one container of a pod checkpoint.
type PodContainer struct {
	// Name is its CRI metadata name, which a restore matches; ID the
	// checkpointed container's.
	Name string `json:"name"`
	ID   string `json:"id"`
	// Archive is its archive's file name in the checkpoint directory.
	Archive string `json:"archive"`
}

// ArchiveName is the file name of the archive of container name in a pod
// checkpoint.
func ArchiveName(name string) string { return "container-" + name + ".tar" }

// WritePod writes p's description into the pod checkpoint directory dir,
// beside its containers' archives: it appears whole or not at all.
func WritePod(dir string, p *Pod) error {
	p.Version = podVersion
	p.Checkpointed = time.Now().UTC()
	b, err := json.MarshalIndent(p, "", "  ")
	if err != nil {
		return fmt.Errorf("pod checkpoint: %w", err)
	}
	f, err := os.CreateTemp(dir, ".stagelet-pod-*")
	if err != nil {
		return fmt.Errorf("pod checkpoint: %w", err)
	}
	_, err = f.Write(b)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(f.Name(), filepath.Join(dir, PodDump))
	}
	if err != nil {
		os.Remove(f.Name())
		return fmt.Errorf("pod checkpoint: %w", err)
	}
	return nil
}

// ReadPod reads the description of the pod checkpoint in dir, and checks
// that each container's archive is there. NotFound: dir holds no pod
// checkpoint; InvalidArgument: not one this stagelet reads.
func ReadPod(dir string) (*Pod, error) {
	b, err := os.ReadFile(filepath.Join(dir, PodDump))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, errdefs.NotFound("%s holds no pod checkpoint (no %s)", dir, PodDump)
	}
	if err != nil {
		return nil, fmt.Errorf("pod checkpoint: %w", err)
	}
	var p Pod
	if err := json.Unmarshal(b, &p); err != nil {
		return nil, errdefs.InvalidArgument("pod checkpoint %s: %s: %w", dir, PodDump, err)
	}
	if p.Version != podVersion {
		return nil, errdefs.InvalidArgument("pod checkpoint %s: version %d, this stagelet reads %d", dir, p.Version, podVersion)
	}
	if len(p.Containers) == 0 {
		return nil, errdefs.InvalidArgument("pod checkpoint %s: no containers", dir)
	}
	seen := map[string]bool{}
	for _, c := range p.Containers {
		if c.Name == "" || seen[c.Name] || c.Archive != ArchiveName(c.Name) || strings.ContainsRune(c.Name, '/') {
			return nil, errdefs.InvalidArgument("pod checkpoint %s: bad container entry %+v", dir, c)
		}
		seen[c.Name] = true
		if fi, err := os.Lstat(filepath.Join(dir, c.Archive)); err != nil || !fi.Mode().IsRegular() {
			return nil, errdefs.InvalidArgument("pod checkpoint %s: container %s has no archive %s", dir, c.Name, c.Archive)
		}
	}
	return &p, nil
}

// ReadMeta reads only the description of a container archive (its
// StageletDump), without unpacking it.
func ReadMeta(archive string) (*Container, error) {
	f, err := os.Open(archive)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, errdefs.NotFound("checkpoint archive %s does not exist", archive)
	}
	if err != nil {
		return nil, fmt.Errorf("checkpoint archive: %w", err)
	}
	defer f.Close()
	tr := tar.NewReader(f)
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			return nil, errdefs.InvalidArgument("checkpoint archive %s has no %s: not one stagelet wrote", archive, StageletDump)
		}
		if err != nil {
			return nil, errdefs.InvalidArgument("checkpoint archive %s: %w", archive, err)
		}
		if path.Clean(hdr.Name) != StageletDump || hdr.Typeflag != tar.TypeReg {
			continue
		}
		var c Container
		if err := json.NewDecoder(io.LimitReader(tr, 16<<20)).Decode(&c); err != nil {
			return nil, errdefs.InvalidArgument("checkpoint archive %s: %s: %w", archive, StageletDump, err)
		}
		return &c, nil
	}
}
