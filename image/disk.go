package image

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/atomicfile"
	"github.com/stagelet/stagelet/internal/lsm"
)

// An image's disk is its merged files (its layers applied in order,
// whiteouts and opaque directories applied) as a read-only erofs file
// system image, for a VM stage1 to hand its guests as a block device
// instead of sharing the layers' directories. It is made once per image
// on first use, kept beside the image in the store as
//
//	disks/<id hex>.erofs         the file system image
//	disks/<id hex>.erofs.sha256  its SHA-256, computed when it was made
//	disks/.tmp-*                 a disk being made (removed on failure and at start)
//
// and removed with the image (Remove's garbage collection).
//
// Reproducible: two stores that pulled the same image independently make
// the same bytes, so that a VM's disk is found by content on another
// node. What would differ between them is fixed: the file system's UUID
// is derived from the image ID, its build time is zero, its root
// directory is root's, mode 0755, dated zero (the layers' own root
// directories carry the time they were unpacked), and no SELinux label
// of the store's files is copied (labels differ between hosts). Every
// other file keeps the mode, owner, modification time and extended
// attributes its layer gave it. mkfs.erofs orders a directory's entries
// by name, whatever order the host's file system lists them in. No
// compression: the guest reads it at disk speed.

// mkfsErofs is the mkfs.erofs program; a variable so that tests can
// point it elsewhere.
var mkfsErofs = "mkfs.erofs"

// unixEpoch is the time of the disk's root directory.
var unixEpoch = time.Unix(0, 0)

// Disk is an image's read-only erofs disk image.
type Disk struct {
	// Path is the disk image file in the store.
	Path string
	// SHA256 is the hex SHA-256 of the file.
	SHA256 string
	// Size is its size in bytes.
	Size int64
}

func (s *Store) disksDir() string { return filepath.Join(s.root, "disks") }

// diskPath is the disk image of image id.
func (s *Store) diskPath(id string) string {
	return filepath.Join(s.disksDir(), strings.TrimPrefix(id, "sha256:")+".erofs")
}

// Disk returns the read-only erofs disk image of image ref (any form Get
// accepts), making it first if the store has none: once per image, under
// a lock of its own, so that concurrent callers wait for one build.
// Needs root (it mounts the layers to read them merged).
//
// Errors: ErrNotFound for an unknown image; ErrFailedPrecondition when
// mkfs.erofs is not installed (package erofs-utils) or a layer is
// missing on disk; ErrPermissionDenied without the privilege to mount.
func (s *Store) Disk(ctx context.Context, ref string) (Disk, error) {
	img, err := s.Get(ref)
	if err != nil {
		return Disk{}, err
	}
	unlock := s.layerLocks.lock("disk:" + img.ID)
	defer unlock()
	s.gcMu.RLock()
	defer s.gcMu.RUnlock()
	// Removed while we waited: garbage collection would take its disk.
	if _, err := s.Get(img.ID); err != nil {
		return Disk{}, err
	}
	p := s.diskPath(img.ID)
	if d, err := readDisk(p); err == nil {
		return d, nil
	} else if !errors.Is(err, os.ErrNotExist) {
		s.log.WarnContext(ctx, "making an image's disk again", "image", img.ID, "err", err)
	}
	if err := s.makeDisk(ctx, img, p); err != nil {
		return Disk{}, err
	}
	return readDisk(p)
}

// readDisk returns the disk at p with its recorded SHA-256. ErrNotExist
// when either file is missing; an error when the record is malformed or
// does not match the file's size.
func readDisk(p string) (Disk, error) {
	fi, err := os.Stat(p)
	if err != nil {
		return Disk{}, err
	}
	b, err := os.ReadFile(p + ".sha256")
	if err != nil {
		return Disk{}, err
	}
	sum, sizeText, ok := strings.Cut(strings.TrimSpace(string(b)), " ")
	if !ok || len(sum) != 64 || !isHex(sum) || sizeText != fmt.Sprint(fi.Size()) {
		return Disk{}, fmt.Errorf("disk %s: bad checksum record %q", p, b)
	}
	return Disk{Path: p, SHA256: sum, Size: fi.Size()}, nil
}

// makeDisk makes img's disk at p: its layers mounted merged and
// read-only beneath a temporary directory of the store, mkfs.erofs over
// them into a temporary file, the build time cleared, the checksum
// recorded, the file renamed into place. Nothing is left on failure.
func (s *Store) makeDisk(ctx context.Context, img *Image, p string) (err error) {
	mkfs, err := exec.LookPath(mkfsErofs)
	if err != nil {
		return errdefs.FailedPrecondition("image %s: making its disk for a VM needs mkfs.erofs (install the erofs-utils package): %w", img.ID, err)
	}
	if err := os.MkdirAll(s.disksDir(), 0o700); err != nil {
		return fmt.Errorf("image disk: %w", err)
	}
	// A confined qemu reads the disk through the descriptor it is
	// handed; SELinux still checks the file's label.
	if err := lsm.LabelReadOnly(s.disksDir()); err != nil {
		return fmt.Errorf("image disk: %w", err)
	}
	tmp, err := os.MkdirTemp(s.disksDir(), ".tmp-"+strings.TrimPrefix(img.ID, "sha256:")[:12]+"-")
	if err != nil {
		return fmt.Errorf("image disk: %w", err)
	}
	merged := filepath.Join(tmp, "merged")
	defer func() {
		if uerr := unmountIfMounted(merged); uerr != nil {
			// Never remove files through a mount.
			err = errors.Join(err, uerr)
			return
		}
		if rerr := os.RemoveAll(tmp); rerr != nil && err == nil {
			err = fmt.Errorf("image disk: %w", rerr)
		}
	}()
	if err := s.mountMerged(img, tmp, merged); err != nil {
		return err
	}
	// No SELinux label of the store's files: contexts that label nothing.
	contexts := filepath.Join(tmp, "file_contexts")
	if err := os.WriteFile(contexts, []byte("/.* <<none>>\n"), 0o600); err != nil {
		return fmt.Errorf("image disk: %w", err)
	}
	out := filepath.Join(tmp, "disk.erofs")
	cmd := exec.CommandContext(ctx, mkfs, "--quiet", "--preserve-mtime", "-U"+diskUUID(img.ID), "--file-contexts="+contexts, out, merged)
	if b, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("image %s: mkfs.erofs: %w: %s", img.ID, err, strings.TrimSpace(string(b)))
	}
	if err := clearBuildTime(out); err != nil {
		return fmt.Errorf("image %s: disk: %w", img.ID, err)
	}
	sum, size, err := fileSHA256(out)
	if err != nil {
		return fmt.Errorf("image disk: %w", err)
	}
	if err := atomicfile.Write(p+".sha256", []byte(fmt.Sprintf("%s %d\n", sum, size)), 0o644); err != nil {
		return fmt.Errorf("image disk: %w", err)
	}
	if err := os.Rename(out, p); err != nil {
		return fmt.Errorf("image disk: %w", err)
	}
	if err := syncDir(s.disksDir()); err != nil {
		return fmt.Errorf("image disk: %w", err)
	}
	s.log.DebugContext(ctx, "image disk made", "image", img.ID, "bytes", size, "sha256", sum)
	return nil
}

// mountMerged mounts img's layers merged and read-only at merged, with a
// directory of tmp on top that gives the root its fixed attributes.
func (s *Store) mountMerged(img *Image, tmp, merged string) error {
	top := filepath.Join(tmp, "top")
	for _, d := range []string{top, merged} {
		if err := os.Mkdir(d, 0o755); err != nil {
			return fmt.Errorf("image disk: %w", err)
		}
	}
	if err := os.Chmod(top, 0o755); err != nil {
		return fmt.Errorf("image disk: %w", err)
	}
	if err := os.Chtimes(top, unixEpoch, unixEpoch); err != nil {
		return fmt.Errorf("image disk: %w", err)
	}
	lowers := []string{top}
	for i := len(img.Layers) - 1; i >= 0; i-- {
		l := s.layerPath(img.Layers[i])
		if _, err := os.Stat(l); err != nil {
			return errdefs.FailedPrecondition("image %s: layer %s is missing; pull the image again", img.ID, img.Layers[i])
		}
		lowers = append(lowers, l)
	}
	if len(lowers) < 2 {
		lowers = append(lowers, s.emptyDir())
	}
	data := "lowerdir=" + strings.Join(lowers, ":")
	if len(data) > maxMountData {
		return errdefs.FailedPrecondition("image %s: %d layers are too many for one overlay mount (%d bytes of options)", img.ID, len(img.Layers), len(data))
	}
	if err := unix.Mount("overlay", merged, "overlay", unix.MS_RDONLY, data); err != nil {
		if errors.Is(err, unix.EPERM) {
			return errdefs.New(errdefs.ErrPermissionDenied, "image %s: mount its layers to make its disk: %w", img.ID, err)
		}
		return fmt.Errorf("image %s: mount its layers to make its disk: %w", img.ID, err)
	}
	return nil
}

// diskUUID is the file system UUID of image id's disk: a version 4
// layout of bits taken from a hash of the ID, the same on every node.
func diskUUID(id string) string {
	h := sha256.Sum256([]byte("stagelet image disk " + id))
	u := h[:16]
	u[6] = u[6]&0x0f | 0x40
	u[8] = u[8]&0x3f | 0x80
	x := hex.EncodeToString(u)
	return x[:8] + "-" + x[8:12] + "-" + x[12:16] + "-" + x[16:20] + "-" + x[20:]
}

// The erofs superblock: at byte 1024, its checksum (crc32c of the rest
// of the block with the checksum field zero, when the feature says so),
// and the build time mkfs.erofs sets to its clock.
const (
	erofsSuperOffset   = 1024
	erofsBlockSize     = 4096
	erofsMagic         = 0xe0f5e1e2
	erofsFeatureSBCsum = 0x1
	erofsOffChecksum   = 4
	erofsOffFeature    = 8
	erofsOffBuildTime  = 24
	erofsOffBuildNsec  = 32
)

// clearBuildTime sets the build time in the erofs superblock of the file
// at p to zero and updates the superblock's checksum. Files whose
// modification time was the build time keep it (mkfs.erofs stores it
// with each, as it does every other time, under --preserve-mtime).
func clearBuildTime(p string) error {
	f, err := os.OpenFile(p, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	sb := make([]byte, erofsBlockSize-erofsSuperOffset)
	if _, err := f.ReadAt(sb, erofsSuperOffset); err != nil {
		return fmt.Errorf("read superblock: %w", err)
	}
	le := binary.LittleEndian
	if le.Uint32(sb) != erofsMagic {
		return errors.New("no erofs superblock")
	}
	feature := le.Uint32(sb[erofsOffFeature:])
	if feature&erofsFeatureSBCsum != 0 {
		// Check our reading of the checksum on mkfs.erofs's own first.
		if got, want := le.Uint32(sb[erofsOffChecksum:]), superblockCRC(sb); got != want {
			return fmt.Errorf("superblock checksum %#x, computed %#x", got, want)
		}
	}
	le.PutUint64(sb[erofsOffBuildTime:], 0)
	le.PutUint32(sb[erofsOffBuildNsec:], 0)
	if feature&erofsFeatureSBCsum != 0 {
		le.PutUint32(sb[erofsOffChecksum:], superblockCRC(sb))
	}
	if _, err := f.WriteAt(sb, erofsSuperOffset); err != nil {
		return fmt.Errorf("write superblock: %w", err)
	}
	return f.Sync()
}

// superblockCRC is the kernel's erofs superblock checksum of sb: crc32c
// seeded with ~0 and not inverted at the end, the checksum field zero.
func superblockCRC(sb []byte) uint32 {
	c := make([]byte, len(sb))
	copy(c, sb)
	binary.LittleEndian.PutUint32(c[erofsOffChecksum:], 0)
	return ^crc32.Checksum(c, crc32.MakeTable(crc32.Castagnoli))
}

// fileSHA256 is the hex SHA-256 and size of the file at p.
func fileSHA256(p string) (string, int64, error) {
	f, err := os.Open(p)
	if err != nil {
		return "", 0, err
	}
	defer f.Close()
	h := sha256.New()
	n, err := io.Copy(h, f)
	if err != nil {
		return "", 0, err
	}
	return hex.EncodeToString(h.Sum(nil)), n, nil
}

// unmountIfMounted unmounts p; a path that is no mount point or is gone
// is not an error.
func unmountIfMounted(p string) error {
	err := unix.Unmount(p, 0)
	if errors.Is(err, unix.EBUSY) {
		err = unix.Unmount(p, unix.MNT_DETACH)
	}
	if err == nil || errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOENT) {
		return nil
	}
	return fmt.Errorf("unmount %s: %w", p, err)
}

// gcDisks removes the disks (and leftovers of interrupted builds) of
// images no record names; keep holds the IDs' hex. The caller holds
// gcMu exclusively.
func (s *Store) gcDisks(ctx context.Context, keep map[string]bool) {
	ents, err := os.ReadDir(s.disksDir())
	if err != nil {
		return
	}
	for _, e := range ents {
		n := e.Name()
		p := filepath.Join(s.disksDir(), n)
		if strings.HasPrefix(n, ".tmp-") {
			removeDiskLeftover(p)
			continue
		}
		id, _, _ := strings.Cut(n, ".")
		if keep[id] {
			continue
		}
		if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
			s.log.WarnContext(ctx, "garbage collection: remove image disk", "file", n, "err", err)
			continue
		}
		s.log.DebugContext(ctx, "garbage collection: image disk removed", "file", n)
	}
}

// removeDiskLeftover removes what an interrupted disk build left at p:
// its merged layers unmounted first, and nothing removed while anything
// beneath p is still mounted.
func removeDiskLeftover(p string) {
	_ = unmountIfMounted(filepath.Join(p, "merged"))
	if len(mountsUnder(p)) > 0 {
		return
	}
	_ = os.RemoveAll(p)
}

// removeDiskLeftovers removes what interrupted disk builds left.
func (s *Store) removeDiskLeftovers() {
	ents, _ := os.ReadDir(s.disksDir())
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), ".tmp-") {
			s.log.Info("removing interrupted image disk build", "file", e.Name())
			removeDiskLeftover(filepath.Join(s.disksDir(), e.Name()))
		}
	}
}
