package api

import (
	"fmt"
	"io/fs"
	"path"
	"strings"
)

// Kinds of a Mount's source (Mount.Kind).
const (
	// MountPath: Source is a path the agent sees (a VM's shared
	// directory, the host's own files).
	MountPath = ""
	// MountGuest: Source names a directory of the agent's side (a VM
	// guest's memory), made empty, with Mount's mode and owner, by the
	// first app that mounts it and shared by every app of the pod that
	// names it; it goes with the pod (a kubelet emptyDir).
	MountGuest = "guest"
	// MountCopy: Source names a tree OpPutFiles put (a kubelet
	// configMap, secret, projected or downwardAPI volume, a file the
	// daemon gives the pod's containers); the daemon keeps it current.
	MountCopy = "copy"
	// MountMessage: Source names a file of the agent's side the app
	// writes its termination message into, made empty (with Mount's mode
	// and owner) when the app is created; OpTermination reads it.
	MountMessage = "message"
)

// FeatureGuestVolumes (Info.Features): the agent takes the mount kinds
// other than MountPath, OpPutFiles and OpTermination.
const FeatureGuestVolumes = "guestVolumes"

// Bounds of OpPutFiles and OpTermination.
const (
	// MaxFileTreeBytes bounds the contents of one FileTree's files
	// together (a Secret or ConfigMap holds at most 1 MiB; a projected
	// volume may join several).
	MaxFileTreeBytes = 8 << 20
	// MaxFileTreeEntries bounds one FileTree's entries.
	MaxFileTreeEntries = 4096
	// MaxTerminationMessage is how much of a termination message file
	// is read, its end: the kubelet reads at most 4 KiB of one
	// container's and 12 KiB for a pod's containers together.
	MaxTerminationMessage = 12 << 10
)

// FileTree is a tree of files (OpPutFiles): a directory, whose entries
// are listed parents before children, or a single file (one entry ".").
type FileTree struct {
	// Name is the guest volume's name (ValidVolumeName).
	Name    string      `json:"name"`
	Entries []FileEntry `json:"entries"`
}

// FileEntry is one file, directory or symbolic link of a FileTree.
type FileEntry struct {
	// Path is relative to the tree's root, clean, without "..": "." is
	// the root itself.
	Path string `json:"path"`
	// Mode is the file's mode and type (fs.FileMode: fs.ModeDir,
	// fs.ModeSymlink, or none for a regular file).
	Mode fs.FileMode `json:"mode"`
	UID  uint32      `json:"uid"`
	GID  uint32      `json:"gid"`
	// Data is a regular file's contents; Link a symbolic link's target.
	Data []byte `json:"data,omitempty"`
	Link string `json:"link,omitempty"`
}

// ValidVolumeName tells whether name may name a guest volume: a single
// path element of letters, digits, '-', '_' and '.', not starting with
// '.', at most 128 bytes.
func ValidVolumeName(name string) bool {
	if name == "" || len(name) > 128 || name[0] == '.' {
		return false
	}
	for _, r := range name {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_' || r == '.') {
			return false
		}
	}
	return true
}

// Check validates t: its name, bounds, and that every entry's path is
// clean and relative, stays inside the tree, appears once and has as
// parent a directory of the tree listed before it (so that writing the
// entries in order never goes through a link). The root is the first
// entry, a directory or a regular file. An error names the entry.
func (t *FileTree) Check() error {
	if t == nil {
		return fmt.Errorf("no file tree")
	}
	if !ValidVolumeName(t.Name) {
		return fmt.Errorf("bad volume name %q", t.Name)
	}
	if len(t.Entries) == 0 || len(t.Entries) > MaxFileTreeEntries {
		return fmt.Errorf("volume %s: %d entries (1 to %d)", t.Name, len(t.Entries), MaxFileTreeEntries)
	}
	root := t.Entries[0]
	if root.Path != "." || !(root.Mode.IsDir() || root.Mode.IsRegular()) {
		return fmt.Errorf("volume %s: the first entry is not the root (\".\", a directory or a file)", t.Name)
	}
	if root.Mode.IsRegular() && len(t.Entries) > 1 {
		return fmt.Errorf("volume %s: a file has no entries beneath it", t.Name)
	}
	dirs := map[string]bool{".": root.Mode.IsDir()}
	size := 0
	for _, e := range t.Entries[1:] {
		p := e.Path
		if p == "" || p == "." || path.IsAbs(p) || path.Clean(p) != p || p == ".." || strings.HasPrefix(p, "../") || strings.ContainsRune(p, 0) {
			return fmt.Errorf("volume %s: bad path %q", t.Name, p)
		}
		if _, dup := dirs[p]; dup {
			return fmt.Errorf("volume %s: %s listed twice", t.Name, p)
		}
		if !dirs[path.Dir(p)] {
			return fmt.Errorf("volume %s: %s: its parent is not a directory listed before it", t.Name, p)
		}
		switch {
		case e.Mode.IsDir():
		case e.Mode&fs.ModeSymlink != 0:
			if e.Link == "" || len(e.Link) > 4096 || strings.ContainsRune(e.Link, 0) {
				return fmt.Errorf("volume %s: %s: bad link target", t.Name, p)
			}
		case e.Mode.IsRegular():
		default:
			return fmt.Errorf("volume %s: %s: not a file, directory or link (%v)", t.Name, p, e.Mode.Type())
		}
		dirs[p] = e.Mode.IsDir()
		size += len(e.Data)
	}
	if size += len(root.Data); size > MaxFileTreeBytes {
		return fmt.Errorf("volume %s: %d bytes of files, more than %d", t.Name, size, MaxFileTreeBytes)
	}
	return nil
}
