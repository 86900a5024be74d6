package image

import (
	"archive/tar"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path"
	"path/filepath"
	"strings"
	"time"

	securejoin "github.com/cyphar/filepath-securejoin"
	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/errdefs"
)

const (
	whiteoutPrefix = ".wh."
	whiteoutOpaque = ".wh..wh..opq"
	maxXattrSize   = 64 << 10
)

// unpackStats counts what an extraction did, for logs and tests.
type unpackStats struct {
	Entries int
	Bytes   int64
	Skipped int
}

// unpackLayer extracts the tar stream r into dir, which must exist and be
// empty. It enforces the rules in the package documentation; a refused entry
// fails the whole extraction with an ErrInvalidArgument naming the entry.
// The caller removes dir on failure.
func unpackLayer(ctx context.Context, r io.Reader, dir string, log *slog.Logger) (unpackStats, error) {
	var st unpackStats
	root := os.Geteuid() == 0
	tr := tar.NewReader(r)
	type dirTime struct {
		path string
		hdr  *tar.Header
	}
	var dirs []dirTime
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil && !errors.Is(err, tar.ErrInsecurePath) {
			return st, errdefs.InvalidArgument("read layer tar: %w", err)
		}
		if hdr == nil {
			return st, errdefs.InvalidArgument("read layer tar: %w", err)
		}
		st.Entries++
		switch hdr.Typeflag {
		case tar.TypeXGlobalHeader, tar.TypeXHeader:
			continue
		}
		rel, err := entryPath(hdr.Name)
		if err != nil {
			return st, err
		}
		base := path.Base(rel)
		parentRel := path.Dir(rel)

		// Whiteouts first: they are named by convention, not by type.
		if strings.HasPrefix(base, whiteoutPrefix) {
			if err := applyWhiteout(dir, parentRel, base, hdr.Name, root); err != nil {
				return st, err
			}
			continue
		}

		if rel == "." {
			// The layer root itself: only its metadata.
			if hdr.Typeflag == tar.TypeDir {
				dirs = append(dirs, dirTime{dir, hdr})
				if err := applyMeta(dir, hdr, root); err != nil {
					return st, entryErr(hdr.Name, err)
				}
			}
			continue
		}
		parent, err := mkdirParents(dir, parentRel)
		if err != nil {
			return st, entryErr(hdr.Name, err)
		}
		p := filepath.Join(parent, base)

		isDir, apply, err := writeEntry(ctx, p, dir, hdr, tr, &st, log)
		if err != nil {
			return st, err
		}
		if isDir {
			dirs = append(dirs, dirTime{p, hdr})
		}
		if !apply {
			continue
		}
		if err := applyMeta(p, hdr, root); err != nil {
			return st, entryErr(hdr.Name, err)
		}
	}
	// Directory mtimes last: creating their children changed them.
	for i := len(dirs) - 1; i >= 0; i-- {
		if err := setTimes(dirs[i].path, dirs[i].hdr); err != nil {
			return st, entryErr(dirs[i].hdr.Name, err)
		}
	}
	return st, nil
}

// applyWhiteout applies the whiteout entry name (base in parentRel): an
// opaque directory marker, or a whiteout of one entry, as overlayfs reads
// them. Both need root.
func applyWhiteout(dir, parentRel, base, name string, root bool) error {
	parent, err := mkdirParents(dir, parentRel)
	if err != nil {
		return entryErr(name, err)
	}
	if base == whiteoutOpaque {
		if !root {
			return errdefs.New(errdefs.ErrPermissionDenied, "layer entry %q: opaque directories need root", name)
		}
		if err := unix.Lsetxattr(parent, "trusted.overlay.opaque", []byte("y"), 0); err != nil {
			return entryErr(name, fmt.Errorf("set opaque: %w", err))
		}
		return nil
	}
	target := strings.TrimPrefix(base, whiteoutPrefix)
	if target == "" || target == "." || target == ".." || strings.Contains(target, "/") {
		return errdefs.InvalidArgument("layer entry %q: bad whiteout name", name)
	}
	if !root {
		return errdefs.New(errdefs.ErrPermissionDenied, "layer entry %q: whiteouts need root", name)
	}
	p := filepath.Join(parent, target)
	if err := removeExisting(p); err != nil {
		return entryErr(name, err)
	}
	if err := unix.Mknod(p, unix.S_IFCHR, 0); err != nil {
		return entryErr(name, fmt.Errorf("create whiteout: %w", err))
	}
	return nil
}

// writeEntry creates the layer entry hdr describes at p, its content read
// from tr. It says whether p is a directory (whose times are set once its
// children are in) and whether hdr's metadata is to be applied to p (not
// for hard links, which share their target's, nor skipped entries).
func writeEntry(ctx context.Context, p, dir string, hdr *tar.Header, tr io.Reader, st *unpackStats, log *slog.Logger) (isDir, apply bool, err error) {
	switch hdr.Typeflag {
	case tar.TypeDir:
		fi, err := os.Lstat(p)
		if err == nil && !fi.IsDir() {
			if err := removeExisting(p); err != nil {
				return false, false, entryErr(hdr.Name, err)
			}
			err = os.ErrNotExist
		}
		if err != nil {
			if err := os.Mkdir(p, 0o755); err != nil {
				return false, false, entryErr(hdr.Name, err)
			}
		}
		return true, true, nil
	//lint:ignore SA1019 old archives still carry TypeRegA
	case tar.TypeReg, tar.TypeRegA:
		if err := removeExisting(p); err != nil {
			return false, false, entryErr(hdr.Name, err)
		}
		f, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_EXCL|unix.O_NOFOLLOW, 0o600)
		if err != nil {
			return false, false, entryErr(hdr.Name, err)
		}
		n, err := io.Copy(f, tr)
		cerr := f.Close()
		if err != nil {
			return false, false, entryErr(hdr.Name, err)
		}
		if cerr != nil {
			return false, false, entryErr(hdr.Name, cerr)
		}
		st.Bytes += n
	case tar.TypeSymlink:
		if err := removeExisting(p); err != nil {
			return false, false, entryErr(hdr.Name, err)
		}
		// The target text is kept as is: it is interpreted inside the
		// container, and every later write resolves it inside dir.
		if err := os.Symlink(hdr.Linkname, p); err != nil {
			return false, false, entryErr(hdr.Name, err)
		}
	case tar.TypeLink:
		target, err := linkTarget(dir, hdr.Linkname)
		if err != nil {
			return false, false, entryErr(hdr.Name, err)
		}
		if target == p {
			return false, false, nil
		}
		if err := removeExisting(p); err != nil {
			return false, false, entryErr(hdr.Name, err)
		}
		if err := os.Link(target, p); err != nil {
			return false, false, entryErr(hdr.Name, err)
		}
		return false, false, nil // a hard link shares the target's metadata
	case tar.TypeFifo:
		if err := removeExisting(p); err != nil {
			return false, false, entryErr(hdr.Name, err)
		}
		if err := unix.Mkfifo(p, 0o600); err != nil {
			return false, false, entryErr(hdr.Name, err)
		}
	case tar.TypeChar, tar.TypeBlock:
		// /dev is provided by the runtime; device nodes from images are
		// never created.
		st.Skipped++
		log.DebugContext(ctx, "skipping device node in layer", "entry", hdr.Name)
		return false, false, nil
	default:
		st.Skipped++
		log.DebugContext(ctx, "skipping unsupported layer entry", "entry", hdr.Name, "type", string(hdr.Typeflag))
		return false, false, nil
	}
	return false, true, nil
}

// entryPath validates a tar entry name and returns it cleaned and relative
// ("." for the root).
func entryPath(name string) (string, error) {
	if name == "" {
		return "", errdefs.InvalidArgument("layer entry with an empty name")
	}
	if strings.HasPrefix(name, "/") {
		return "", errdefs.InvalidArgument("layer entry %q: absolute path", name)
	}
	if strings.ContainsRune(name, 0) {
		return "", errdefs.InvalidArgument("layer entry %q: NUL in name", name)
	}
	p := path.Clean(name)
	if p == ".." || strings.HasPrefix(p, "../") {
		return "", errdefs.InvalidArgument("layer entry %q: path escapes the layer root", name)
	}
	return p, nil
}

func entryErr(name string, err error) error {
	if errors.Is(err, errdefs.ErrInvalidArgument) {
		return err
	}
	return fmt.Errorf("layer entry %q: %w", name, err)
}

// mkdirParents resolves rel inside root as if root were "/" and creates it
// (and its parents) as directories; it returns the resolved host path.
func mkdirParents(root, rel string) (string, error) {
	if rel == "." {
		return root, nil
	}
	p, err := securejoin.SecureJoin(root, rel)
	if err != nil {
		return "", errdefs.InvalidArgument("resolve %q in layer: %w", rel, err)
	}
	if !within(root, p) {
		return "", errdefs.InvalidArgument("%q resolves outside the layer", rel)
	}
	if err := os.MkdirAll(p, 0o755); err != nil {
		return "", errdefs.InvalidArgument("create parent %q: %w", rel, err)
	}
	// MkdirAll follows symlinks; re-check that nothing was swapped in.
	again, err := securejoin.SecureJoin(root, rel)
	if err != nil || again != p {
		return "", errdefs.InvalidArgument("parent %q changed while unpacking", rel)
	}
	return p, nil
}

// linkTarget resolves a hard link target inside root. The final component
// is not followed (link(2) does not follow it either). The target must exist
// and must not be a directory.
func linkTarget(root, linkname string) (string, error) {
	rel, err := entryPath(strings.TrimLeft(linkname, "/"))
	if err != nil || rel == "." {
		return "", errdefs.InvalidArgument("hard link target %q is outside the layer", linkname)
	}
	parent, err := securejoin.SecureJoin(root, path.Dir(rel))
	if err != nil || !within(root, parent) {
		return "", errdefs.InvalidArgument("hard link target %q is outside the layer", linkname)
	}
	p := filepath.Join(parent, path.Base(rel))
	fi, err := os.Lstat(p)
	if err != nil {
		return "", errdefs.InvalidArgument("hard link target %q does not exist in the layer", linkname)
	}
	if fi.IsDir() {
		return "", errdefs.InvalidArgument("hard link target %q is a directory", linkname)
	}
	return p, nil
}

func within(root, p string) bool {
	return p == root || strings.HasPrefix(p, root+string(filepath.Separator))
}

// removeExisting removes whatever is at p, unless nothing is. A directory is
// removed with its contents (a later entry replaces an earlier one).
func removeExisting(p string) error {
	fi, err := os.Lstat(p)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	if fi.IsDir() {
		return os.RemoveAll(p)
	}
	return os.Remove(p)
}

// applyMeta sets ownership, mode, xattrs and times of p from hdr. Symlinks
// get ownership and times only.
func applyMeta(p string, hdr *tar.Header, root bool) error {
	if err := os.Lchown(p, hdr.Uid, hdr.Gid); err != nil && root {
		return fmt.Errorf("chown: %w", err)
	}
	if hdr.Typeflag != tar.TypeSymlink {
		// After chown: chown clears the setuid and setgid bits.
		if err := unix.Fchmodat(unix.AT_FDCWD, p, uint32(hdr.Mode&0o7777), 0); err != nil {
			return fmt.Errorf("chmod: %w", err)
		}
	}
	for k, v := range hdr.PAXRecords {
		name, ok := strings.CutPrefix(k, "SCHILY.xattr.")
		if !ok || len(v) > maxXattrSize {
			continue
		}
		// trusted.overlay.* would steer overlayfs (redirects, metacopy,
		// opaque): only whiteout entries may set those.
		if strings.HasPrefix(name, "trusted.overlay.") {
			continue
		}
		if !strings.HasPrefix(name, "user.") && !strings.HasPrefix(name, "trusted.") {
			continue
		}
		_ = unix.Lsetxattr(p, name, []byte(v), 0) // best effort, by design
	}
	if hdr.Typeflag != tar.TypeDir {
		return setTimes(p, hdr)
	}
	return nil
}

func setTimes(p string, hdr *tar.Header) error {
	atime := hdr.AccessTime
	if atime.IsZero() {
		atime = hdr.ModTime
	}
	ts := []unix.Timespec{timespec(atime), timespec(hdr.ModTime)}
	if err := unix.UtimesNanoAt(unix.AT_FDCWD, p, ts, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("set times: %w", err)
	}
	return nil
}

// timespec converts t, clamping times UnixNano cannot represent.
func timespec(t time.Time) unix.Timespec {
	if t.Before(time.Unix(0, 0)) {
		t = time.Unix(0, 0)
	}
	if t.After(time.Unix(1<<33, 0)) {
		t = time.Unix(1<<33, 0)
	}
	return unix.NsecToTimespec(t.UnixNano())
}
