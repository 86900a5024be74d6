package host

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/stagelet/stagelet/stage1"

	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/internal/mountsafe"
	"github.com/stagelet/stagelet/internal/testutil"
)

// TestUnbindKeepsTheHostsMounts: on a host whose mounts are shared (systemd
// makes / shared), the daemon's bind of a volume is a peer of the volume's
// mount, and unmounting it must not unmount what the host mounted inside
// the volume (critest's read-only mount specs mount a tmpfs there).
func TestUnbindKeepsTheHostsMounts(t *testing.T) {
	testutil.NeedRoot(t, "mounts")
	base := t.TempDir()
	vol := filepath.Join(base, "volume")
	inner := filepath.Join(vol, "tmpfs")
	if err := os.MkdirAll(inner, 0o755); err != nil {
		t.Fatal(err)
	}
	// The volume's mount, shared as on a systemd host.
	if err := unix.Mount(vol, vol, "", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(vol, unix.MNT_DETACH) })
	if err := unix.Mount("", vol, "", unix.MS_SHARED, ""); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", inner, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(inner, unix.MNT_DETACH) })
	rootfs := filepath.Join(base, "rootfs")
	if err := os.Mkdir(rootfs, 0o755); err != nil {
		t.Fatal(err)
	}

	d := SharedDir{Host: filepath.Join(base, "mounts"), InPod: "/mnt/pod"}
	if err := d.Prepare(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Release() })
	notKnown := func(context.Context, string) (bool, error) { return false, nil }
	for _, id := range []string{"a", "b"} {
		spec := &stage1.ContainerSpec{AppSpec: api.AppSpec{ID: id, Rootfs: rootfs, Mounts: []api.Mount{{Source: vol, Destination: "/v"}}}}
		in, err := d.BindContainer(context.Background(), spec, notKnown)
		if err != nil {
			t.Fatal(err)
		}
		if ms, _ := mountsafe.MountsUnder(in.Mounts[0].Source); !slices.Contains(ms, filepath.Join(in.Mounts[0].Source, "tmpfs")) {
			t.Fatalf("the bind of the volume lacks the host's tmpfs inside it: %v", ms)
		}
	}
	if err := d.UnbindSources("a"); err != nil {
		t.Fatal(err)
	}
	if err := d.UnbindContainer("b"); err != nil {
		t.Fatal(err)
	}
	if err := d.Release(); err != nil {
		t.Fatal(err)
	}
	ms, err := mountsafe.MountsUnder(vol)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(ms, inner) {
		t.Errorf("the host's tmpfs inside the volume was unmounted with the daemon's binds; mounts under the volume: %v", ms)
	}
}

// A failed BindContainer whose directory cannot be removed says so: the
// error of the undoing joins the bind's.
func TestBindContainerReportsAFailedUndo(t *testing.T) {
	testutil.NeedRoot(t, "mounts, and an immutable file")
	base := t.TempDir()
	rootfs := filepath.Join(base, "rootfs")
	vol := filepath.Join(base, "volume")
	for _, dir := range []string{rootfs, vol} {
		if err := os.Mkdir(dir, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	var stuck string
	bindFailed := errors.New("bind refused")
	d := SharedDir{Host: filepath.Join(base, "mounts"), InPod: "/mnt/pod",
		// A file the undoing cannot remove, left beside the binds.
		BindShared: func(src, host string) error {
			f := filepath.Join(filepath.Dir(host), "stuck")
			if err := os.WriteFile(f, nil, 0o600); err != nil {
				return err
			}
			if !setImmutable(t, f, true) {
				t.Skip("the file system cannot make a file immutable")
			}
			stuck = f
			return bindFailed
		}}
	if err := d.Prepare(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := d.Release(); err != nil {
			t.Errorf("release: %v", err)
		}
	})
	t.Cleanup(func() { // before the release
		if stuck != "" {
			setImmutable(t, stuck, false)
		}
	})
	spec := &stage1.ContainerSpec{AppSpec: api.AppSpec{ID: "a", Rootfs: rootfs,
		Mounts: []api.Mount{{Source: vol, Destination: "/v", Propagation: "rshared"}}}}
	_, err := d.BindContainer(context.Background(), spec, func(context.Context, string) (bool, error) { return false, nil })
	if !errors.Is(err, bindFailed) {
		t.Fatalf("BindContainer: %v, want the bind's error", err)
	}
	if !errors.Is(err, unix.EPERM) {
		t.Errorf("BindContainer: %v: the undoing's failure is not told", err)
	}
}

// fsImmutable is the immutable attribute (FS_IMMUTABLE_FL, linux/fs.h),
// which x/sys/unix does not name.
const fsImmutable = 0x10

// setImmutable sets or clears path's immutable attribute; false when its
// file system has none.
func setImmutable(t *testing.T, path string, on bool) bool {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	flags, err := unix.IoctlGetInt(int(f.Fd()), unix.FS_IOC_GETFLAGS)
	if err != nil {
		return false
	}
	if on {
		flags |= fsImmutable
	} else {
		flags &^= fsImmutable
	}
	if err := unix.IoctlSetPointerInt(int(f.Fd()), unix.FS_IOC_SETFLAGS, flags); err != nil {
		if on {
			return false
		}
		t.Errorf("clearing the immutable attribute of %s: %v", path, err)
	}
	return true
}

// TestShareHostLog: the log directory of a container whose log the
// daemon writes (HostLog) is not bound into the pod, and its log path
// stays the host's; another's is.
func TestShareHostLog(t *testing.T) {
	testutil.NeedRoot(t, "mounts")
	base := t.TempDir()
	rootfs := filepath.Join(base, "rootfs")
	if err := os.Mkdir(rootfs, 0o755); err != nil {
		t.Fatal(err)
	}
	d := SharedDir{Host: filepath.Join(base, "mounts"), InPod: "/mnt/pod"}
	if err := d.Prepare(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Release() })
	notKnown := func(context.Context, string) (bool, error) { return false, nil }
	for _, hostLog := range []bool{true, false} {
		id := "file"
		if hostLog {
			id = "host"
		}
		logPath := filepath.Join(base, "logs", id, "0.log")
		spec := &stage1.ContainerSpec{AppSpec: api.AppSpec{ID: id, Rootfs: rootfs, LogPath: logPath, HostLog: hostLog}}
		in, err := d.Share(context.Background(), spec, notKnown)
		if err != nil {
			t.Fatal(err)
		}
		_, statErr := os.Stat(filepath.Join(d.Host, id, "log"))
		switch {
		case hostLog && (in.LogPath != logPath || statErr == nil):
			t.Errorf("HostLog: log path %q, log directory in the pod: %v", in.LogPath, statErr)
		case !hostLog && (in.LogPath != "/mnt/pod/file/log/0.log" || statErr != nil):
			t.Errorf("log path %q, log directory in the pod: %v", in.LogPath, statErr)
		}
		if err := d.Unshare(id); err != nil {
			t.Fatal(err)
		}
	}
}
