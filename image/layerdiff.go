package image

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/errdefs"
)

// A container's writable layer, as a checkpoint keeps it (rootfs-diff.tar
// and deleted.files of the archive layout CRI-O and Podman write, which
// checkpointctl reads): an OCI layer tar of the overlay's upper directory,
// whose whiteouts say what the container deleted from its image.

// ExportLayer writes the writable layer of the container rootfs MountRootfs
// made in dir (dir/upper) to w as an OCI layer tar: a deleted entry as a
// ".wh.<name>" whiteout, a directory the container replaced as the
// directory with a ".wh..wh..opq" marker. It returns the paths the layer
// deletes from the image, absolute in the container and sorted, for the
// checkpoint's deleted.files. Entries keep their owners, modes, times,
// hard links and user.* and trusted.* extended attributes (those the
// layer unpacker applies); sockets are left out, as tar has no form for
// them. Reading the upper directory while its overlay is mounted and
// written sees a moving layer: the caller stops or freezes the container
// first.
func ExportLayer(dir string, w io.Writer) (deleted []string, err error) {
	upper := filepath.Join(dir, "upper")
	if fi, err := os.Lstat(upper); err != nil || !fi.IsDir() {
		return nil, errdefs.FailedPrecondition("container layer %s: no writable layer", dir)
	}
	x := &layerExport{upper: upper, tw: tar.NewWriter(w), links: map[[2]uint64]string{}}
	err = filepath.WalkDir(upper, x.add)
	if err != nil {
		return nil, fmt.Errorf("export container layer %s: %w", dir, err)
	}
	if err := x.tw.Close(); err != nil {
		return nil, fmt.Errorf("export container layer %s: %w", dir, err)
	}
	return x.deleted, nil
}

// layerExport is an ExportLayer under way: the tar it writes of the
// upper directory, and what it has seen so far.
type layerExport struct {
	upper   string
	tw      *tar.Writer
	links   map[[2]uint64]string // (dev, inode) of a multiply linked file -> its first name
	deleted []string             // the paths whited out, absolute in the container
}

// add writes the entry of p, in the upper directory, to the layer (a
// filepath.WalkDir callback): an overlay whiteout as a ".wh." marker, a
// socket as nothing, anything else as itself (entryHeader) with its
// content, and an opaque directory's marker after it.
func (x *layerExport) add(p string, d fs.DirEntry, err error) error {
	if err != nil {
		return err
	}
	rel, err := filepath.Rel(x.upper, p)
	if err != nil || rel == "." {
		return err
	}
	rel = filepath.ToSlash(rel)
	fi, err := d.Info()
	if err != nil {
		return err
	}
	st, err := statOf(p, fi)
	if err != nil {
		return err
	}
	mode := fi.Mode()
	switch {
	case mode&fs.ModeCharDevice != 0 && st.Rdev == 0:
		// An overlay whiteout: the image's entry is deleted.
		x.deleted = append(x.deleted, "/"+rel)
		return writeMarker(x.tw, path.Join(path.Dir(rel), whiteoutPrefix+path.Base(rel)), fi.ModTime())
	case mode&fs.ModeSocket != 0:
		return nil
	}
	hdr, err := x.entryHeader(p, rel, fi, st)
	if err != nil {
		return err
	}
	if err := x.tw.WriteHeader(hdr); err != nil {
		return err
	}
	if hdr.Typeflag == tar.TypeReg && hdr.Size > 0 {
		if err := copyFile(x.tw, p, hdr.Size); err != nil {
			return fmt.Errorf("%s: %w", rel, err)
		}
	}
	if mode.IsDir() {
		return x.opaqueMarker(p, rel, fi)
	}
	return nil
}

// statOf is the stat of p, whose file info is fi: fi's own, or lstat's
// when fi carries none.
func statOf(p string, fi fs.FileInfo) (*unix.Stat_t, error) {
	if st, ok := fi.Sys().(*unix.Stat_t); ok {
		return st, nil
	}
	st := &unix.Stat_t{}
	if err := unix.Lstat(p, st); err != nil {
		return nil, err
	}
	return st, nil
}

// entryHeader is the tar header of p (rel in the layer; fi and st its
// file info and stat): PAX, with p's numeric owner, its link target, its
// user.* and trusted.* extended attributes, and, for a multiply linked
// file seen before under another name, a hard link to that name.
func (x *layerExport) entryHeader(p, rel string, fi fs.FileInfo, st *unix.Stat_t) (*tar.Header, error) {
	mode := fi.Mode()
	var link string
	if mode&fs.ModeSymlink != 0 {
		var err error
		if link, err = os.Readlink(p); err != nil {
			return nil, err
		}
	}
	hdr, err := tar.FileInfoHeader(fi, link)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", rel, err)
	}
	hdr.Name, hdr.Uid, hdr.Gid, hdr.Uname, hdr.Gname = rel, int(st.Uid), int(st.Gid), "", ""
	hdr.Format = tar.FormatPAX
	if mode.IsDir() {
		hdr.Name += "/"
	}
	if mode.IsRegular() && st.Nlink > 1 {
		key := [2]uint64{st.Dev, st.Ino}
		if first, ok := x.links[key]; ok {
			hdr.Typeflag, hdr.Linkname, hdr.Size = tar.TypeLink, first, 0
		} else {
			x.links[key] = rel
		}
	}
	if hdr.PAXRecords, err = layerXattrs(p); err != nil {
		return nil, fmt.Errorf("%s: %w", rel, err)
	}
	return hdr, nil
}

// opaqueMarker writes the ".wh..wh..opq" marker of directory p (rel in
// the layer, fi its file info) when the container replaced the image's
// directory (its overlay marked it opaque).
func (x *layerExport) opaqueMarker(p, rel string, fi fs.FileInfo) error {
	v, err := getXattr(p, "trusted.overlay.opaque")
	if err != nil {
		return fmt.Errorf("%s: %w", rel, err)
	}
	if string(v) == "y" {
		return writeMarker(x.tw, rel+"/"+whiteoutOpaque, fi.ModTime())
	}
	return nil
}

// ImportLayer makes the writable layer of a container rootfs in dir from
// an ExportLayer tar, before MountRootfs mounts it: dir/upper must not
// exist yet, or be empty. The tar is checked as an image layer's is (no
// entry outside the layer, no device nodes). On failure dir/upper is
// removed again.
func ImportLayer(ctx context.Context, dir string, r io.Reader, log *slog.Logger) error {
	upper := filepath.Join(dir, "upper")
	if err := os.MkdirAll(upper, 0o755); err != nil {
		return fmt.Errorf("import container layer: %w", err)
	}
	f, err := os.Open(upper)
	if err != nil {
		return fmt.Errorf("import container layer: %w", err)
	}
	_, err = f.Readdirnames(1)
	f.Close()
	if err == nil {
		return errdefs.FailedPrecondition("import container layer: %s is not empty", upper)
	}
	if _, err := unpackLayer(ctx, r, upper, log); err != nil {
		if rerr := os.RemoveAll(upper); rerr != nil {
			log.WarnContext(ctx, "import container layer: remove partial layer", "dir", upper, "err", rerr)
		}
		return fmt.Errorf("import container layer: %w", err)
	}
	return nil
}

// writeMarker writes an empty whiteout or opaque marker entry.
func writeMarker(tw *tar.Writer, name string, mtime time.Time) error {
	return tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: 0o600, ModTime: mtime, Format: tar.FormatPAX})
}

// layerXattrs are p's user.* and trusted.* extended attributes but
// overlayfs' own, as PAX records.
func layerXattrs(p string) (map[string]string, error) {
	buf := make([]byte, 4096)
	n, err := unix.Llistxattr(p, buf)
	if errors.Is(err, unix.ERANGE) {
		if n, err = unix.Llistxattr(p, nil); err == nil {
			buf = make([]byte, n)
			n, err = unix.Llistxattr(p, buf)
		}
	}
	if errors.Is(err, unix.ENOTSUP) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("list xattrs: %w", err)
	}
	var recs map[string]string
	for _, name := range strings.Split(string(bytes.TrimRight(buf[:n], "\x00")), "\x00") {
		if name == "" || strings.HasPrefix(name, "trusted.overlay.") ||
			(!strings.HasPrefix(name, "user.") && !strings.HasPrefix(name, "trusted.")) {
			continue
		}
		v, err := getXattr(p, name)
		if err != nil {
			return nil, err
		}
		if recs == nil {
			recs = map[string]string{}
		}
		recs["SCHILY.xattr."+name] = string(v)
	}
	return recs, nil
}

// getXattr reads one extended attribute of p, nil when it has none.
func getXattr(p, name string) ([]byte, error) {
	buf := make([]byte, 256)
	for {
		n, err := unix.Lgetxattr(p, name, buf)
		switch {
		case errors.Is(err, unix.ENODATA), errors.Is(err, unix.ENOTSUP):
			return nil, nil
		case errors.Is(err, unix.ERANGE) && len(buf) < maxXattrSize:
			buf = make([]byte, maxXattrSize)
			continue
		case err != nil:
			return nil, fmt.Errorf("read xattr %s: %w", name, err)
		}
		return buf[:n], nil
	}
}

// copyFile copies size bytes of p to w: a file that changed size since it
// was stat'ed fails the export rather than write a bad tar.
func copyFile(w io.Writer, p string, size int64) error {
	f, err := os.Open(p)
	if err != nil {
		return err
	}
	defer f.Close()
	n, err := io.Copy(w, io.LimitReader(f, size))
	if err == nil && n != size {
		err = fmt.Errorf("changed size while being read (%d of %d bytes)", n, size)
	}
	return err
}
