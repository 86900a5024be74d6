package image

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/bindmount"
	"github.com/stagelet/stagelet/internal/testutil"
	"github.com/stagelet/stagelet/test/testregistry"
)

func requireRoot(t testing.TB) {
	t.Helper()
	testutil.NeedRoot(t, "mounts overlayfs")
}

func TestMountRootfs(t *testing.T) {
	requireRoot(t)
	r := testregistry.Start(t)
	ref := r.PushBusybox(t, "busybox", "latest")
	s := newStore(t, Config{})
	img, err := s.Pull(pullCtx(t), ref, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(t.TempDir(), "ctr1")
	t.Cleanup(func() { _ = s.UnmountRootfs(context.Background(), dir) })
	rootfs, err := s.MountRootfs(t.Context(), img.ID, dir, nil, "")
	if err != nil {
		t.Fatal(err)
	}
	if rootfs != filepath.Join(dir, "rootfs") {
		t.Errorf("rootfs = %s", rootfs)
	}
	// Volatile where the kernel has it (5.10 and later): no sync of the
	// host's file system when it is unmounted.
	if kernelAtLeast(t, 5, 10) {
		var opts string
		for _, m := range readMountInfo() {
			if m.mountPoint == rootfs {
				opts = m.superOpts
			}
		}
		// Later kernels show it as fsync=volatile.
		if o := strings.Split(opts, ","); !slices.Contains(o, "volatile") && !slices.Contains(o, "fsync=volatile") {
			t.Errorf("rootfs overlay options %q lack volatile", opts)
		}
	}
	if _, err := os.Stat(filepath.Join(rootfs, "bin/busybox")); err != nil {
		t.Fatalf("image file not visible: %v", err)
	}
	if err := os.WriteFile(filepath.Join(rootfs, "etc/new"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(rootfs, "etc/group")); err != nil {
		t.Fatal(err)
	}
	layer := s.layerPath(img.Layers[0])
	if _, err := os.Stat(filepath.Join(dir, "upper/etc/new")); err != nil {
		t.Errorf("write did not land in upper: %v", err)
	}
	if _, err := os.Stat(filepath.Join(layer, "etc/new")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("write reached the layer: %v", err)
	}
	if _, err := os.Stat(filepath.Join(layer, "etc/group")); err != nil {
		t.Errorf("delete reached the layer: %v", err)
	}
	// Idempotent: no second mount.
	again, err := s.MountRootfs(t.Context(), img.ID, dir, nil, "")
	if err != nil || again != rootfs {
		t.Fatalf("second mount: %s, %v", again, err)
	}
	if m := mountsUnder(dir); len(m) != 1 {
		t.Errorf("mounts under dir: %v", m)
	}
	// Removing the image keeps the mounted layer.
	if err := s.Remove(t.Context(), img.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(layer, "bin/busybox")); err != nil {
		t.Errorf("mounted layer was collected: %v", err)
	}
	if err := s.UnmountRootfs(context.Background(), dir); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("dir left: %v", err)
	}
	if err := s.UnmountRootfs(context.Background(), dir); err != nil {
		t.Errorf("second UnmountRootfs: %v", err)
	}
	if _, err := s.MountRootfs(t.Context(), img.ID, dir, nil, ""); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("mount of a removed image: %v", err)
	}
}

func TestUnmountRootfsMissing(t *testing.T) {
	s := newStore(t, Config{})
	if err := s.UnmountRootfs(context.Background(), filepath.Join(t.TempDir(), "nope")); err != nil {
		t.Fatal(err)
	}
}

func BenchmarkMountRootfs(b *testing.B) {
	requireRoot(b)
	r := testregistry.Start(b)
	ref := r.PushBusybox(b, "busybox", "latest")
	s := newStore(b, Config{})
	img, err := s.Pull(pullCtx(b), ref, nil, nil)
	if err != nil {
		b.Fatal(err)
	}
	base := b.TempDir()
	for b.Loop() {
		dir := filepath.Join(base, "c")
		if _, err := s.MountRootfs(b.Context(), img.ID, dir, nil, ""); err != nil {
			b.Fatal(err)
		}
		if err := s.UnmountRootfs(context.Background(), dir); err != nil {
			b.Fatal(err)
		}
	}
}

func TestResolveUser(t *testing.T) {
	rootfs := t.TempDir()
	outside := t.TempDir()
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.MkdirAll(filepath.Join(rootfs, "etc"), 0o755))
	must(os.WriteFile(filepath.Join(rootfs, "etc/passwd"), []byte("root:x:0:0:root:/root:/bin/sh\n"+
		"nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n# comment\nbroken line\n"+
		"app:x:1000:1000:app:/home/app:/bin/sh\n"), 0o644))
	must(os.WriteFile(filepath.Join(rootfs, "etc/group"), []byte("root:x:0:\napp:x:1000:\n"+
		"extra:x:2000:app\nmore:x:3000:nobody, app\nnogroup:x:65534:\n"), 0o644))
	type res struct {
		uid, gid uint32
		extra    []uint32
		home     string
	}
	for _, tc := range []struct {
		user string
		want res
		err  bool
	}{
		{"", res{0, 0, nil, "/root"}, false},
		{"root", res{0, 0, nil, "/root"}, false},
		{"0", res{0, 0, nil, "/root"}, false},
		{"app", res{1000, 1000, []uint32{2000, 3000}, "/home/app"}, false},
		{"1000", res{1000, 1000, []uint32{2000, 3000}, "/home/app"}, false},
		{"nobody", res{65534, 65534, []uint32{3000}, "/nonexistent"}, false},
		{"4242", res{4242, 0, nil, "/"}, false},
		{"4242:77", res{4242, 77, nil, "/"}, false},
		{"app:extra", res{1000, 2000, []uint32{2000, 3000}, "/home/app"}, false},
		{"app:5", res{1000, 5, []uint32{2000, 3000}, "/home/app"}, false},
		{"1000:nogroup", res{1000, 65534, []uint32{2000, 3000}, "/home/app"}, false},
		{"ghost", res{}, true},
		{"app:ghosts", res{}, true},
		{"app:", res{}, true},
		{":1", res{}, true},
	} {
		u, err := ResolveUser(rootfs, tc.user)
		uid, gid, extra := u.UID, u.GID, u.AdditionalGIDs
		if tc.err {
			if !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Errorf("ResolveUser(%q) err = %v, want ErrInvalidArgument", tc.user, err)
			}
			continue
		}
		if err != nil || uid != tc.want.uid || gid != tc.want.gid || !slices.Equal(extra, tc.want.extra) || u.Home != tc.want.home {
			t.Errorf("ResolveUser(%q) = %+v, %v; want %+v", tc.user, u, err, tc.want)
		}
	}

	// A symlinked /etc/passwd is resolved inside the rootfs.
	must(os.WriteFile(filepath.Join(outside, "passwd"), []byte("evil:x:0:0::/:/bin/sh\n"), 0o644))
	must(os.Remove(filepath.Join(rootfs, "etc/passwd")))
	must(os.Symlink(filepath.Join(outside, "passwd"), filepath.Join(rootfs, "etc/passwd")))
	if _, err := ResolveUser(rootfs, "evil"); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("user from a file outside the rootfs: err = %v", err)
	}
	must(os.Remove(filepath.Join(rootfs, "etc/passwd")))
	must(os.Symlink("../../../../../../"+outside+"/passwd", filepath.Join(rootfs, "etc/passwd")))
	if _, err := ResolveUser(rootfs, "evil"); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("user from a file outside the rootfs (relative): err = %v", err)
	}
	// Numeric users work without any passwd file.
	if u, err := ResolveUser(rootfs, "12:34"); err != nil || u.UID != 12 || u.GID != 34 || u.Home != "/" {
		t.Errorf("numeric without passwd: %+v %v", u, err)
	}
}

// TestMountRootfsIDMapped: with a user namespace, the image's files are
// the namespace's root's (shown as its first host ID), its root writes
// into the writable layer, the layers stay as they are, and everything is
// detached with the rootfs.
func TestMountRootfsIDMapped(t *testing.T) {
	requireRoot(t)
	r := testregistry.Start(t)
	ref := r.PushBusybox(t, "busybox", "latest")
	s := newStore(t, Config{})
	img, err := s.Pull(pullCtx(t), ref, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	const base = 1 << 30
	ns, err := bindmount.UserNSFile(base, 65536)
	if err != nil {
		t.Fatal(err)
	}
	defer ns.Close()
	dir := filepath.Join(t.TempDir(), "ctr")
	t.Cleanup(func() { _ = s.UnmountRootfs(context.Background(), dir) })
	rootfs, err := s.MountRootfs(t.Context(), img.ID, dir, &UserNS{File: ns, UID: base, GID: base}, "")
	if err != nil {
		t.Fatal(err)
	}
	var st unix.Stat_t
	if err := unix.Stat(filepath.Join(rootfs, "bin/busybox"), &st); err != nil || st.Uid != base || st.Gid != base {
		t.Errorf("an image file: uid %d gid %d (%v), want %d", st.Uid, st.Gid, err, base)
	}
	// The namespace's root (the host's base) writes a file: its own on
	// disk, in the writable layer.
	// setfsuid is the calling thread's, and the test's directories above
	// the rootfs are root's alone: the file is made from a descriptor.
	root, err := unix.Open(rootfs, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(root)
	runtime.LockOSThread()
	_ = unix.Setfsuid(base)
	fd, err := unix.Openat(root, "new", unix.O_CREAT|unix.O_WRONLY|unix.O_CLOEXEC, 0o644)
	_ = unix.Setfsuid(0)
	runtime.UnlockOSThread()
	if err == nil {
		unix.Close(fd)
	}
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Stat(filepath.Join(dir, "upper/new"), &st); err != nil || st.Uid != base {
		t.Errorf("the written file on disk: uid %d (%v), want %d", st.Uid, err, base)
	}
	if err := unix.Stat(filepath.Join(s.layerPath(img.Layers[0]), "bin/busybox"), &st); err != nil || st.Uid != 0 {
		t.Errorf("the layer itself: uid %d (%v), want 0", st.Uid, err)
	}
	if err := s.UnmountRootfs(context.Background(), dir); err != nil {
		t.Fatal(err)
	}
	if m := mountsUnder(filepath.Dir(dir)); len(m) != 0 {
		t.Errorf("mounts left: %v", m)
	}
}

// TestMountImageVolume: an image's root filesystem, read-only, at a
// directory UnmountRootfs of its container takes away; a sub path of it;
// errors for an image the store lacks and a sub path it does not hold.
func TestMountImageVolume(t *testing.T) {
	requireRoot(t)
	r := testregistry.Start(t)
	ref := r.PushBusybox(t, "busybox", "latest")
	s := newStore(t, Config{})
	img, err := s.Pull(pullCtx(t), ref, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctr := filepath.Join(t.TempDir(), "ctr")
	t.Cleanup(func() { _ = s.UnmountRootfs(context.Background(), ctr) })
	root, err := s.MountImageVolume(ref, filepath.Join(ctr, "ivol", "0"), "")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(root, "bin/busybox")); err != nil {
		t.Errorf("the image's files: %v", err)
	}
	if err := os.WriteFile(filepath.Join(root, "new"), nil, 0o644); !errors.Is(err, unix.EROFS) {
		t.Errorf("writing into an image volume: %v, want EROFS", err)
	}
	again, err := s.MountImageVolume(img.ID, filepath.Join(ctr, "ivol", "0"), "")
	if err != nil || again != root || len(mountsUnder(ctr)) != 1 {
		t.Errorf("mounted again: %s %v, mounts %v", again, err, mountsUnder(ctr))
	}
	sub, err := s.MountImageVolume(ref, filepath.Join(ctr, "ivol", "1"), "bin")
	if err != nil || sub != filepath.Join(ctr, "ivol", "1", "root", "bin") {
		t.Errorf("sub path bin: %s %v", sub, err)
	}
	for _, p := range []string{"no/such/dir", "../etc", "/bin"} {
		if _, err := s.MountImageVolume(ref, filepath.Join(ctr, "ivol", "2"), p); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("sub path %q: %v, want InvalidArgument", p, err)
		}
	}
	if _, err := s.MountImageVolume("example.test/missing:1", filepath.Join(ctr, "ivol", "3"), ""); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("an image the store lacks: %v, want NotFound", err)
	}
	if err := s.UnmountRootfs(context.Background(), ctr); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(ctr); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the container's directory is left: %v", err)
	}
}

// kernelAtLeast reports whether the running kernel is major.minor or later.
func kernelAtLeast(t *testing.T, major, minor int) bool {
	t.Helper()
	var u unix.Utsname
	if err := unix.Uname(&u); err != nil {
		t.Fatal(err)
	}
	var ma, mi int
	if _, err := fmt.Sscanf(unix.ByteSliceToString(u.Release[:]), "%d.%d", &ma, &mi); err != nil {
		t.Fatalf("kernel release %q: %v", u.Release, err)
	}
	return ma > major || ma == major && mi >= minor
}
