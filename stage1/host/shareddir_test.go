package host

import (
	"context"
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
