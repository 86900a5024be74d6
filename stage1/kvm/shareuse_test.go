package kvm

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/agent/client"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/stage1"
)

func TestShareNeed(t *testing.T) {
	spec := func(rootfs, log string, mounts ...api.Mount) *stage1.ContainerSpec {
		return &stage1.ContainerSpec{AppSpec: api.AppSpec{ID: "c1", Name: "app", Rootfs: rootfs, LogPath: log, Mounts: mounts}}
	}
	in := spec("/var/lib/img/rootfs", "/var/log/pods/x/0.log", api.Mount{Source: "/data", Destination: "/srv"})
	for _, tc := range []struct {
		name string
		out  *stage1.ContainerSpec
		want *shareUse
	}{
		{"everything on the share", spec("/mnt/stagelet/c1/rootfs", "/mnt/stagelet/c1/log/0.log", api.Mount{Source: "/mnt/stagelet/c1/m0", Destination: "/srv"}),
			&shareUse{Container: "c1", Name: "app", HostPath: "/data", CtrPath: "/srv"}},
		{"rootfs only", spec("/mnt/stagelet/c1/rootfs", "/dev/vdb/0.log", api.Mount{Source: "/run/vol/x", Destination: "/srv"}),
			&shareUse{Container: "c1", Name: "app", HostPath: "/var/lib/img/rootfs", CtrPath: "/"}},
		{"log only", spec("/run/disk/c1", "/mnt/stagelet/c1/log/0.log"),
			&shareUse{Container: "c1", Name: "app", HostPath: "/var/log/pods/x/0.log", CtrPath: "its CRI log"}},
		{"nothing on the share", spec("/run/disk/c1", "", api.Mount{Source: "/mnt/stagelet-not/x", Destination: "/srv"}), nil},
		{"no log", spec("/run/disk/c1", ""), nil},
	} {
		got := shareNeed(in, tc.out)
		if (got == nil) != (tc.want == nil) || got != nil && *got != *tc.want {
			t.Errorf("%s: shareNeed = %+v, want %+v", tc.name, got, tc.want)
		}
	}
}

// TestShareOnDemand: a pod's guest mounts the 9p share only once a
// container needs it; until then its VM migrates, and then moveBlocker
// names the container and path, and qemu refuses.
func TestShareOnDemand(t *testing.T) {
	b := testBackend(t)
	vp := startVM(t, b, "", nil)
	kp := vp.pod.Pod.(*Pod)
	if err := kp.moveBlocker(); err != nil {
		t.Fatalf("moveBlocker of a pod without containers: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	q, err := kp.dialQMP(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer q.Close()
	m, err := q.migrateOut(ctx, "exec:cat >/dev/null")
	if err != nil {
		t.Fatalf("migrating the VM of a pod without a 9p mount: %v", err)
	}
	t.Logf("migrated: %d bytes in %s, downtime %s", m.Bytes, m.Total, m.Downtime)
	if _, err := q.run(ctx, "cont", nil); err != nil {
		t.Fatal(err)
	}
	if _, err := client.NewClient(kp.dial).Info(ctx); err != nil {
		t.Fatalf("the agent after the migration: %v", err)
	}

	vp.run(t, "c", "/bin/sleep", "1000")
	err = kp.moveBlocker()
	if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "container c (c) mounts") || !strings.Contains(err.Error(), "at / over the VM's 9p share") {
		t.Errorf("moveBlocker with a container over 9p: %v", err)
	}
	if _, err := os.Stat(filepath.Join(kp.st.dir(), shareUseName)); err != nil {
		t.Errorf("the share's use is not recorded: %v", err)
	}
	// A second Pod value of the VM (a recovered pod) reads the record.
	if err := b.newPod(vp.spec, kp.st).moveBlocker(); err == nil {
		t.Error("moveBlocker of a recovered pod value: nil")
	}
	if _, err := q.migrateOut(ctx, "exec:cat >/dev/null"); err == nil || !strings.Contains(err.Error(), "VirtFS") {
		t.Errorf("migrating with the share mounted: %v; want qemu's refusal", err)
	}
	if out, code := vp.exec(t, "c", "echo", "alive"); code != 0 || strings.TrimSpace(out) != "alive" {
		t.Errorf("exec after the refused migration: %q, %d", out, code)
	}
}
