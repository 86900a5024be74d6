// Package checkpoint writes and reads container checkpoint archives, in
// the layout CRI-O, containerd and Podman share and checkpointctl reads:
//
//	config.dump      the container's ID, name, image and times (checkpointctl's ContainerConfig)
//	spec.dump        an OCI runtime spec: the process, and the CRI names as containerd's annotations
//	stagelet.dump    stagelet's own record of the container, what a restore starts from
//	rootfs-diff.tar  the container's writable layer (image.ExportLayer)
//	deleted.files    what the layer deletes from the image, as a JSON list
//	checkpoint/      CRIU's images of the container's processes
//	dump.log         CRIU's log of the dump
//
// A stage1 that saves processes fills checkpoint/; this package only
// moves files in and out of the archive, and refuses an archive holding
// anything else.
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

	rspec "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/image"
)

// The archive's entries.
const (
	ConfigDump   = "config.dump"
	SpecDump     = "spec.dump"
	StageletDump = "stagelet.dump"
	RootfsDiff   = "rootfs-diff.tar"
	DeletedFiles = "deleted.files"
	ImagesDir    = "checkpoint"
	DumpLog      = "dump.log"
)

// Container describes a checkpointed container.
type Container struct {
	ID   string `json:"id"`
	Name string `json:"name"`
	// Pod and Namespace are the CRI names of its pod.
	Pod       string `json:"pod"`
	Namespace string `json:"namespace"`
	// Image is the reference it was created from, ImageID the image's ID.
	Image   string `json:"image"`
	ImageID string `json:"imageId"`
	// Stage1 ran it.
	Stage1 string `json:"stage1"`
	// Args, Env and Cwd are its process's.
	Args []string `json:"args,omitempty"`
	Env  []string `json:"env,omitempty"`
	Cwd  string   `json:"cwd,omitempty"`
	// Created is when it was created, Checkpointed when this archive was
	// written (set by Write).
	Created      time.Time `json:"created"`
	Checkpointed time.Time `json:"checkpointed"`
	// Config is the broker's record of the container, opaque here.
	Config json.RawMessage `json:"config,omitempty"`
	// Processes is the stage1's account of what CRIU's images leave out,
	// for their restore; opaque here.
	Processes json.RawMessage `json:"processes,omitempty"`
	// SavedPod, from a stage1 that saves whole pods, is its account of the
	// pod saved with the container (whose image is then in checkpoint/
	// instead of CRIU's); opaque here.
	SavedPod json.RawMessage `json:"savedPod,omitempty"`
}

// configDump is checkpointctl's ContainerConfig, the config.dump of
// Podman, CRI-O and containerd.
type configDump struct {
	ID              string    `json:"id"`
	Name            string    `json:"name"`
	RootfsImage     string    `json:"rootfsImage,omitempty"`
	RootfsImageRef  string    `json:"rootfsImageRef,omitempty"`
	RootfsImageName string    `json:"rootfsImageName,omitempty"`
	OCIRuntime      string    `json:"runtime,omitempty"`
	CreatedTime     time.Time `json:"createdTime"`
	CheckpointedAt  time.Time `json:"checkpointedTime"`
	RestoredAt      time.Time `json:"restoredTime"`
	Restored        bool      `json:"restored"`
}

// Write writes the archive at path for container c: its metadata, the
// writable layer of the container rootfs in layerDir (as MountRootfs made
// it) and the CRIU images in imagesDir (regular files; CRIU's log there,
// dump.log, goes beside them). The archive
// appears whole or not at all: it is written beside path, then renamed.
// It returns the archive's size. The container must not change its layer
// meanwhile (the caller has it stopped or frozen).
func Write(path string, c *Container, layerDir, imagesDir string) (size int64, err error) {
	c.Checkpointed = time.Now().UTC()
	dir := filepath.Dir(path)
	layer, err := os.CreateTemp(dir, ".stagelet-layer-*")
	if err != nil {
		return 0, fmt.Errorf("checkpoint archive: %w", err)
	}
	defer func() {
		layer.Close()
		os.Remove(layer.Name())
	}()
	deleted, err := image.ExportLayer(layerDir, layer)
	if err != nil {
		return 0, fmt.Errorf("checkpoint archive: %w", err)
	}
	if deleted == nil {
		deleted = []string{}
	}
	out, err := os.CreateTemp(dir, ".stagelet-checkpoint-*")
	if err != nil {
		return 0, fmt.Errorf("checkpoint archive: %w", err)
	}
	defer func() {
		if err != nil {
			out.Close()
			os.Remove(out.Name())
		}
	}()
	tw := tar.NewWriter(out)
	now := c.Checkpointed
	for _, f := range []struct {
		name string
		v    any
	}{
		{ConfigDump, configDump{ID: c.ID, Name: c.Name, RootfsImage: c.ImageID, RootfsImageRef: c.ImageID,
			RootfsImageName: c.Image, OCIRuntime: "stagelet-" + c.Stage1, CreatedTime: c.Created, CheckpointedAt: now}},
		{SpecDump, specOf(c)},
		{StageletDump, c},
		{DeletedFiles, deleted},
	} {
		b, err := json.MarshalIndent(f.v, "", "  ")
		if err != nil {
			return 0, fmt.Errorf("checkpoint archive: %s: %w", f.name, err)
		}
		if err := writeEntry(tw, f.name, int64(len(b)), now, strings.NewReader(string(b))); err != nil {
			return 0, err
		}
	}
	if err := writeFile(tw, RootfsDiff, layer, now); err != nil {
		return 0, err
	}
	if err := writeImages(tw, imagesDir, now); err != nil {
		return 0, err
	}
	if err := tw.Close(); err != nil {
		return 0, fmt.Errorf("checkpoint archive: %w", err)
	}
	if err := out.Sync(); err != nil {
		return 0, fmt.Errorf("checkpoint archive: %w", err)
	}
	fi, err := out.Stat()
	if err != nil {
		return 0, fmt.Errorf("checkpoint archive: %w", err)
	}
	if err := out.Close(); err != nil {
		return 0, fmt.Errorf("checkpoint archive: %w", err)
	}
	if err := os.Rename(out.Name(), path); err != nil {
		return 0, fmt.Errorf("checkpoint archive: %w", err)
	}
	return fi.Size(), nil
}

// specOf is the spec.dump of c: its process and root, and the CRI names
// as containerd's annotations, which checkpointctl shows.
func specOf(c *Container) *rspec.Spec {
	return &rspec.Spec{
		Version: rspec.Version,
		Process: &rspec.Process{Args: c.Args, Env: c.Env, Cwd: c.Cwd},
		Root:    &rspec.Root{Path: "rootfs"},
		Annotations: map[string]string{
			"io.kubernetes.cri.container-name":    c.Name,
			"io.kubernetes.cri.sandbox-name":      c.Pod,
			"io.kubernetes.cri.sandbox-namespace": c.Namespace,
			"io.kubernetes.cri.image-name":        c.Image,
		},
	}
}

func writeEntry(tw *tar.Writer, name string, size int64, mtime time.Time, r io.Reader) error {
	if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: name, Size: size, Mode: 0o600, ModTime: mtime}); err != nil {
		return fmt.Errorf("checkpoint archive: %s: %w", name, err)
	}
	n, err := io.Copy(tw, r)
	if err == nil && n != size {
		err = io.ErrUnexpectedEOF // the file shrank
	}
	if err != nil {
		// %w: a full file system (ENOSPC) stays one to errors.Is.
		return fmt.Errorf("checkpoint archive: %s: wrote %d of %d bytes: %w", name, n, size, err)
	}
	return nil
}

// writeFile writes the open file f, from its start, as entry name.
func writeFile(tw *tar.Writer, name string, f *os.File, mtime time.Time) error {
	fi, err := f.Stat()
	if err != nil {
		return fmt.Errorf("checkpoint archive: %s: %w", name, err)
	}
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		return fmt.Errorf("checkpoint archive: %s: %w", name, err)
	}
	return writeEntry(tw, name, fi.Size(), mtime, f)
}

// writeImages writes the regular files of dir under checkpoint/, but
// CRIU's log, which goes beside it as dump.log.
func writeImages(tw *tar.Writer, dir string, mtime time.Time) error {
	if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: ImagesDir + "/", Mode: 0o700, ModTime: mtime}); err != nil {
		return fmt.Errorf("checkpoint archive: %w", err)
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		return fmt.Errorf("checkpoint archive: CRIU images: %w", err)
	}
	for _, e := range ents {
		if !e.Type().IsRegular() {
			return fmt.Errorf("checkpoint archive: CRIU images: %s is not a regular file", e.Name())
		}
		f, err := os.Open(filepath.Join(dir, e.Name()))
		if err != nil {
			return fmt.Errorf("checkpoint archive: CRIU images: %w", err)
		}
		name := ImagesDir + "/" + e.Name()
		if e.Name() == DumpLog {
			name = DumpLog
		}
		err = writeFile(tw, name, f, mtime)
		f.Close()
		if err != nil {
			return err
		}
	}
	return nil
}

// Read extracts the archive at path into dir, which must exist and be
// empty: the layer stays a tar at dir/rootfs-diff.tar (for
// image.ImportLayer), the CRIU images go to dir/checkpoint. It returns
// the container's description. An archive holding anything but the
// entries above (links, devices, other names, paths out of dir) is
// refused with InvalidArgument; a missing archive is NotFound.
func Read(archive, dir string) (*Container, error) {
	f, err := os.Open(archive)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, errdefs.NotFound("checkpoint archive %s does not exist", archive)
	}
	if err != nil {
		return nil, fmt.Errorf("checkpoint archive: %w", err)
	}
	defer f.Close()
	if err := os.Mkdir(filepath.Join(dir, ImagesDir), 0o700); err != nil {
		return nil, fmt.Errorf("checkpoint archive: %w", err)
	}
	seen := map[string]bool{}
	tr := tar.NewReader(f)
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, errdefs.InvalidArgument("checkpoint archive %s: %w", archive, err)
		}
		name := path.Clean(hdr.Name)
		if hdr.Typeflag == tar.TypeDir && name == ImagesDir {
			continue
		}
		if !allowed(name) || hdr.Typeflag != tar.TypeReg || seen[name] {
			return nil, errdefs.InvalidArgument("checkpoint archive %s: unexpected entry %q", archive, hdr.Name)
		}
		seen[name] = true
		out, err := os.OpenFile(filepath.Join(dir, filepath.FromSlash(name)), os.O_WRONLY|os.O_CREATE|os.O_EXCL|unix.O_NOFOLLOW, 0o600)
		if err != nil {
			return nil, fmt.Errorf("checkpoint archive: %w", err)
		}
		_, err = io.Copy(out, tr)
		if cerr := out.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return nil, fmt.Errorf("checkpoint archive: %s: %w", name, err)
		}
	}
	return describe(archive, dir, seen)
}

// describe checks that seen, the entries read into dir from src (an
// archive, a checkpoint image's layer), are those of a stagelet archive
// and returns the container's description.
func describe(src, dir string, seen map[string]bool) (*Container, error) {
	for _, need := range []string{StageletDump, RootfsDiff, DeletedFiles} {
		if !seen[need] {
			return nil, errdefs.InvalidArgument("checkpoint %s has no %s: not one stagelet wrote", src, need)
		}
	}
	b, err := os.ReadFile(filepath.Join(dir, StageletDump))
	if err != nil {
		return nil, fmt.Errorf("checkpoint: %w", err)
	}
	var c Container
	if err := json.Unmarshal(b, &c); err != nil {
		return nil, errdefs.InvalidArgument("checkpoint %s: %s: %w", src, StageletDump, err)
	}
	return &c, nil
}

// ReadDir reads the checkpoint laid out in the directory src (a checkpoint
// image's unpacked layer: an archive's entries at its root) into the
// directory dir, as Read reads an archive; src is only read. Entries that
// are not an archive's regular files (links, devices, other names) are
// refused with InvalidArgument.
func ReadDir(src, dir string) (*Container, error) {
	if err := os.Mkdir(filepath.Join(dir, ImagesDir), 0o700); err != nil {
		return nil, fmt.Errorf("checkpoint: %w", err)
	}
	seen := map[string]bool{}
	err := filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(src, p)
		if err != nil {
			return err
		}
		name := filepath.ToSlash(rel)
		if name == "." || d.IsDir() && name == ImagesDir {
			return nil
		}
		if !allowed(name) || !d.Type().IsRegular() {
			return errdefs.InvalidArgument("checkpoint %s: unexpected entry %q", src, name)
		}
		seen[name] = true
		return copyFile(p, filepath.Join(dir, rel))
	})
	if err != nil {
		return nil, err
	}
	return describe(src, dir, seen)
}

// copyFile copies the regular file src to the new file dst.
func copyFile(src, dst string) error {
	in, err := os.OpenFile(src, os.O_RDONLY|unix.O_NOFOLLOW, 0)
	if err != nil {
		return fmt.Errorf("checkpoint: %w", err)
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL|unix.O_NOFOLLOW, 0o600)
	if err != nil {
		return fmt.Errorf("checkpoint: %w", err)
	}
	_, err = io.Copy(out, in)
	if cerr := out.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("checkpoint: %s: %w", dst, err)
	}
	return nil
}

// allowed says whether name (cleaned) may be in an archive: one of the
// files above, or a file directly under checkpoint/.
func allowed(name string) bool {
	switch name {
	case ConfigDump, SpecDump, StageletDump, RootfsDiff, DeletedFiles, DumpLog:
		return true
	}
	d, base := path.Split(name)
	return d == ImagesDir+"/" && base != "" && base != "." && base != ".."
}
