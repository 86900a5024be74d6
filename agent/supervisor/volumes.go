package supervisor

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/errdefs"
)

// Guest volumes are the agent's side of mounts whose source is not a
// path it is given (api.Mount.Kind): directories and copied trees in
// <state dir>/../volumes, on the agent's own storage (a VM guest's
// memory), one per name for the whole pod, gone with it.

// volumesMu serialises the writes of guest volumes (OpPutFiles, the
// directories apps' creations make).
var volumesMu sync.Mutex

// volumesDir is where the agent keeps its guest volumes.
func (a *Agent) volumesDir() string { return filepath.Join(filepath.Dir(a.dir), "volumes") }

// resolveGuestMounts gives spec's guest mounts (kinds other than
// api.MountPath) the paths of their volumes, made as their kind says:
// a MountGuest directory when missing, a MountMessage file; a MountCopy
// tree must have been put (FailedPrecondition), and a directory one be
// mounted read-only. InvalidArgument: a bad kind or volume name, a
// writable copied directory.
func (a *Agent) resolveGuestMounts(spec *api.AppSpec) error {
	volumesMu.Lock()
	defer volumesMu.Unlock()
	for i := range spec.Mounts {
		m := &spec.Mounts[i]
		if m.Kind == api.MountPath {
			continue
		}
		if !api.ValidVolumeName(m.Source) {
			return errdefs.InvalidArgument("app %s: mount %s: bad guest volume name %q", spec.ID, m.Destination, m.Source)
		}
		if err := os.MkdirAll(a.volumesDir(), 0o711); err != nil {
			return fmt.Errorf("app %s: guest volumes: %w", spec.ID, err)
		}
		p := filepath.Join(a.volumesDir(), m.Source)
		var err error
		switch m.Kind {
		case api.MountGuest:
			err = makeGuestDir(p, m.Mode, m.UID, m.GID)
		case api.MountCopy:
			// The daemon writes a copied tree: a container that could
			// write it could swap its entries for links the next copy
			// follows. A copied file is written in place.
			if st, serr := os.Lstat(p); serr != nil {
				err = errdefs.FailedPrecondition("the copied volume is not there: %w", serr)
			} else if st.IsDir() && !m.Readonly {
				err = errdefs.InvalidArgument("a copied directory is mounted read-only")
			}
		case api.MountMessage:
			err = makeMessageFile(p, m.Mode, m.UID, m.GID)
		default:
			return errdefs.InvalidArgument("app %s: mount %s: unknown kind %q", spec.ID, m.Destination, m.Kind)
		}
		if err != nil {
			return fmt.Errorf("app %s: mount %s: %w", spec.ID, m.Destination, err)
		}
		m.Source = p
	}
	return nil
}

// makeGuestDir makes directory p, with mode (permission, setgid and
// sticky bits; 0 is 0777, as the kubelet makes an emptyDir) and owner,
// unless it is there already.
func makeGuestDir(p string, mode, uid, gid uint32) error {
	if err := os.Mkdir(p, 0o700); errors.Is(err, fs.ErrExist) {
		return nil
	} else if err != nil {
		return err
	}
	if mode == 0 {
		mode = 0o777
	}
	return ownAndMode(p, uid, gid, mode&0o7777)
}

// makeMessageFile makes the empty file p (mode 0 is 0666) unless it is
// there already.
func makeMessageFile(p string, mode, uid, gid uint32) error {
	f, err := os.OpenFile(p, os.O_CREATE|os.O_EXCL|os.O_WRONLY|unix.O_NOFOLLOW, 0o600)
	if errors.Is(err, fs.ErrExist) {
		return nil
	} else if err != nil {
		return err
	}
	f.Close()
	if mode == 0 {
		mode = 0o666
	}
	return ownAndMode(p, uid, gid, mode&0o777)
}

func ownAndMode(p string, uid, gid, mode uint32) error {
	if err := unix.Lchown(p, int(uid), int(gid)); err != nil {
		return err
	}
	// After chown, which clears the set-ID bits.
	return unix.Chmod(p, mode)
}

// terminationMessage is the end (api.MaxTerminationMessage bytes) of app
// id's termination message file. NotFound: no such app; an app without
// a MountMessage mount has none (empty).
func (a *Agent) terminationMessage(id string) ([]byte, error) {
	ap, err := a.get(id)
	if err != nil {
		return nil, err
	}
	if ap.spec == nil {
		return nil, nil
	}
	for _, m := range ap.spec.Mounts {
		if m.Kind == api.MountMessage {
			return readTail(m.Source, api.MaxTerminationMessage)
		}
	}
	return nil, nil
}

// readTail reads the last max bytes of regular file p; a missing file is
// empty.
func readTail(p string, max int64) ([]byte, error) {
	f, err := os.OpenFile(p, os.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK, 0)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	} else if err != nil {
		return nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if !st.Mode().IsRegular() {
		return nil, errdefs.FailedPrecondition("termination message %s is not a regular file", p)
	}
	if off := st.Size() - max; off > 0 {
		if _, err := f.Seek(off, io.SeekStart); err != nil {
			return nil, err
		}
	}
	return io.ReadAll(io.LimitReader(f, max))
}

// putFiles writes tree t as guest volume t.Name (api.OpPutFiles).
// InvalidArgument: t fails its checks (paths escaping it among them).
//
// A directory volume is the directory an app binds, so it stays, and
// what is in it is replaced in the order the kubelet's atomic writer
// follows, each step a rename a reader sees whole: its directories that
// changed (written beside it, then exchanged), then its "..data" link,
// then its other links and files, and last what t no longer has. A file
// volume, which apps bind too, is rewritten in place.
func (a *Agent) putFiles(t *api.FileTree) error {
	if err := t.Check(); err != nil {
		return errdefs.InvalidArgument("put files: %w", err)
	}
	volumesMu.Lock()
	defer volumesMu.Unlock()
	if err := os.MkdirAll(a.volumesDir(), 0o711); err != nil {
		return fmt.Errorf("guest volumes: %w", err)
	}
	top := filepath.Join(a.volumesDir(), t.Name)
	root := t.Entries[0]
	if root.Mode.IsRegular() {
		return putFile(a.volumesDir(), top, root)
	}
	return putDir(top, t.Entries)
}

// putFile writes e as file p: a new one is written beside it and renamed
// there; one there already is rewritten in place when it differs.
func putFile(dir, p string, e api.FileEntry) error {
	old, err := os.Lstat(p)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		tmp := filepath.Join(dir, tempName())
		if err := writeEntry(tmp, e); err != nil {
			os.Remove(tmp)
			return err
		}
		return os.Rename(tmp, p)
	case err != nil:
		return err
	case !old.Mode().IsRegular():
		return errdefs.FailedPrecondition("guest volume %s is not a file", filepath.Base(p))
	}
	f, err := os.OpenFile(p, os.O_RDWR|unix.O_NOFOLLOW, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	cur, err := io.ReadAll(f)
	if err != nil {
		return err
	}
	if !bytes.Equal(cur, e.Data) {
		// Written over, then cut: a reader sees the old file or the new
		// one's beginning, never an empty file.
		if _, err := f.WriteAt(e.Data, 0); err != nil {
			return err
		}
		if err := f.Truncate(int64(len(e.Data))); err != nil {
			return err
		}
	}
	return ownAndMode(p, e.UID, e.GID, uint32(unixMode(e.Mode)))
}

// putDir replaces the contents of directory top with entries (checked:
// entries[0] is the root).
func putDir(top string, entries []api.FileEntry) error {
	if st, err := os.Lstat(top); errors.Is(err, fs.ErrNotExist) {
		if err := os.Mkdir(top, 0o700); err != nil {
			return err
		}
	} else if err != nil {
		return err
	} else if !st.IsDir() {
		return errdefs.FailedPrecondition("guest volume %s is not a directory", filepath.Base(top))
	}
	if err := ownAndMode(top, entries[0].UID, entries[0].GID, uint32(unixMode(entries[0].Mode))); err != nil {
		return err
	}
	// The tree's top-level entries, each with what is beneath it.
	var names []string
	sub := map[string][]api.FileEntry{}
	for _, e := range entries[1:] {
		n, _, _ := strings.Cut(e.Path, "/")
		if _, ok := sub[n]; !ok {
			names = append(names, n)
		}
		sub[n] = append(sub[n], e)
	}
	for _, n := range names {
		if sub[n][0].Mode.IsDir() {
			if err := replaceDir(top, n, sub[n]); err != nil {
				return err
			}
		}
	}
	others := make([]string, 0, len(names))
	for _, n := range names {
		if !sub[n][0].Mode.IsDir() {
			if n == "..data" {
				others = append([]string{n}, others...)
			} else {
				others = append(others, n)
			}
		}
	}
	for _, n := range others {
		if err := replaceEntry(top, n, sub[n][0]); err != nil {
			return err
		}
	}
	return removeOthers(top, sub)
}

// replaceDir makes top/n the directory entries describe (entries[0] is
// n itself), unless it is that already: it is written beside, then
// exchanged with the old one (or renamed there), and the old one
// removed.
func replaceDir(top, n string, entries []api.FileEntry) error {
	p := filepath.Join(top, n)
	if same, err := sameTree(p, n, entries); err != nil {
		return err
	} else if same {
		return nil
	}
	tmp := filepath.Join(top, tempName())
	for _, e := range entries {
		if err := writeEntry(filepath.Join(tmp, strings.TrimPrefix(e.Path, n)), e); err != nil {
			os.RemoveAll(tmp)
			return err
		}
	}
	old, err := os.Lstat(p)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return os.Rename(tmp, p)
	case err != nil:
		os.RemoveAll(tmp)
		return err
	case !old.IsDir():
		if err := os.Remove(p); err != nil {
			os.RemoveAll(tmp)
			return err
		}
		return os.Rename(tmp, p)
	}
	if err := unix.Renameat2(unix.AT_FDCWD, tmp, unix.AT_FDCWD, p, unix.RENAME_EXCHANGE); err != nil {
		os.RemoveAll(tmp)
		return fmt.Errorf("swap %s: %w", n, err)
	}
	return os.RemoveAll(tmp)
}

// replaceEntry makes top/n the link or file e describes, unless it is
// that already, by a rename over it.
func replaceEntry(top, n string, e api.FileEntry) error {
	p := filepath.Join(top, n)
	if same, err := sameTree(p, n, []api.FileEntry{e}); err != nil {
		return err
	} else if same {
		return nil
	}
	if st, err := os.Lstat(p); err == nil && st.IsDir() {
		if err := os.RemoveAll(p); err != nil {
			return err
		}
	}
	tmp := filepath.Join(top, tempName())
	if err := writeEntry(tmp, e); err != nil {
		os.Remove(tmp)
		return err
	}
	return os.Rename(tmp, p)
}

// removeOthers removes what top holds beyond keep's names.
func removeOthers(top string, keep map[string][]api.FileEntry) error {
	ents, err := os.ReadDir(top)
	if err != nil {
		return err
	}
	for _, d := range ents {
		if _, ok := keep[d.Name()]; !ok {
			if err := os.RemoveAll(filepath.Join(top, d.Name())); err != nil {
				return err
			}
		}
	}
	return nil
}

// writeEntry makes e at p, which does not exist and whose parent is a
// directory of the agent's making.
func writeEntry(p string, e api.FileEntry) error {
	switch {
	case e.Mode.IsDir():
		if err := os.Mkdir(p, 0o700); err != nil {
			return err
		}
	case e.Mode&fs.ModeSymlink != 0:
		if err := os.Symlink(e.Link, p); err != nil {
			return err
		}
		return unix.Lchown(p, int(e.UID), int(e.GID))
	default:
		f, err := os.OpenFile(p, os.O_CREATE|os.O_EXCL|os.O_WRONLY|unix.O_NOFOLLOW, 0o600)
		if err != nil {
			return err
		}
		_, err = f.Write(e.Data)
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return err
		}
	}
	return ownAndMode(p, e.UID, e.GID, uint32(unixMode(e.Mode)))
}

// sameTree tells whether p (named n in the tree) is what entries
// describe (entries[0] is p itself; a directory's entries are all of
// what is beneath it): types, modes, owners, contents and link
// targets, and nothing more.
func sameTree(p, n string, entries []api.FileEntry) (bool, error) {
	want := map[string]api.FileEntry{}
	for _, e := range entries {
		want[strings.TrimPrefix(strings.TrimPrefix(e.Path, n), "/")] = e
	}
	seen := 0
	err := filepath.WalkDir(p, func(q string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(p, q)
		if rel == "." {
			rel = ""
		}
		e, ok := want[rel]
		if !ok || !sameEntry(q, e) {
			return errDiffers
		}
		seen++
		return nil
	})
	switch {
	case errors.Is(err, errDiffers), errors.Is(err, fs.ErrNotExist):
		return false, nil
	case err != nil:
		return false, err
	}
	return seen == len(want), nil
}

var errDiffers = errors.New("differs")

// sameEntry tells whether the file at q is e.
func sameEntry(q string, e api.FileEntry) bool {
	var st unix.Stat_t
	if err := unix.Lstat(q, &st); err != nil {
		return false
	}
	if st.Uid != e.UID || st.Gid != e.GID {
		return false
	}
	switch {
	case e.Mode.IsDir():
		return st.Mode&unix.S_IFMT == unix.S_IFDIR && st.Mode&0o7777 == unixMode(e.Mode)
	case e.Mode&fs.ModeSymlink != 0:
		l, err := os.Readlink(q)
		return st.Mode&unix.S_IFMT == unix.S_IFLNK && err == nil && l == e.Link
	default:
		if st.Mode&unix.S_IFMT != unix.S_IFREG || st.Mode&0o7777 != unixMode(e.Mode) || st.Size != int64(len(e.Data)) {
			return false
		}
		b, err := os.ReadFile(q)
		return err == nil && bytes.Equal(b, e.Data)
	}
}

// unixMode is m's permission, set-ID and sticky bits as chmod takes them.
func unixMode(m fs.FileMode) uint32 {
	u := uint32(m.Perm())
	if m&fs.ModeSetuid != 0 {
		u |= unix.S_ISUID
	}
	if m&fs.ModeSetgid != 0 {
		u |= unix.S_ISGID
	}
	if m&fs.ModeSticky != 0 {
		u |= unix.S_ISVTX
	}
	return u
}

// tempName names an entry being written beside the one it replaces.
func tempName() string {
	b := make([]byte, 8)
	rand.Read(b)
	return ".stagelet-" + hex.EncodeToString(b)
}
