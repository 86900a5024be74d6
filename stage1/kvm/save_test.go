package kvm

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/agent/client"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/stage1/host"
)

// TestSaveAndRestorePod: a running kvm pod's VM is saved and runs on; a
// second pod takes it in place of its own VM: the app started in the
// first keeps its PID and start time and answers exec, the guest's agent
// is the first one's, and the guest answers on the second pod's IP. A pod
// whose guest mounted the 9p share is refused, naming the container.
func TestSaveAndRestorePod(t *testing.T) {
	b := testBackend(t)
	tn := newTestNet(t)
	nsA, resA := tn.podNet(t, fmt.Sprintf("sava%d", os.Getpid()))
	nsB, resB := tn.podNet(t, fmt.Sprintf("savb%d", os.Getpid()))
	a := startVM(t, b, nsA, nil)
	vb := startVM(t, b, nsB, nil)
	pa, pb := a.pod.Pod.(*Pod), vb.pod.Pod.(*Pod)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()

	ca := client.NewClient(pa.dial)
	app, before := startMovableApp(ctx, t, ca)
	infoA, err := ca.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}

	dir := t.TempDir()
	saved, err := pa.SavePod(ctx, dir)
	if err != nil {
		t.Fatalf("SavePod: %v", err)
	}
	if st, err := ca.Status(ctx, app.ID); err != nil || st.State != api.StateRunning {
		t.Errorf("the saved pod's app after the save: %+v, %v; want it running", st, err)
	}

	loaded, err := pb.RestorePod(ctx, dir)
	if err != nil {
		t.Fatalf("RestorePod: %v", err)
	}
	t.Logf("256 MiB VM moved through a file: %d bytes, save %s (guest paused %s), load to the agent's answer with the new network %s",
		saved.Bytes, saved.Total, saved.Downtime, loaded.Load)
	cb := client.NewClient(pb.dial)
	infoB, err := cb.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !infoB.StartedAt.Equal(infoA.StartedAt) {
		t.Errorf("the restored guest's agent started at %s; the saved one at %s", infoB.StartedAt, infoA.StartedAt)
	}
	after, err := cb.Status(ctx, app.ID)
	if err != nil {
		t.Fatalf("the app in the restored pod: %v", err)
	}
	if after.State != api.StateRunning || after.PID != before.PID || !after.StartedAt.Equal(before.StartedAt) {
		t.Errorf("the app after the move: %+v; before: %+v", after, before)
	}
	res, err := cb.Exec(ctx, app.ID, []string{"/init", "version"}, 30*time.Second)
	if err != nil || res.ExitCode != 0 {
		t.Errorf("exec in the moved app: %+v, %v", res, err)
	}
	// The guest answers on B's address (a refused connection is an
	// answer); A's goes on answering on its own.
	for _, ip := range []string{resB.IPs[0], resA.IPs[0]} {
		if err := answers(ctx, ip); err != nil {
			t.Errorf("%s: %v", ip, err)
		}
	}
	if pb.st.VM.MAC != resB.MAC {
		t.Errorf("the restored pod's MAC %s, want B's %s", pb.st.VM.MAC, resB.MAC)
	}
	// The restored pod's state names its new qemu, and it stops.
	if _, err := parseState(pb.State()); err != nil {
		t.Fatal(err)
	}

	// A pod whose guest mounted the share cannot be saved.
	a.run(t, "c", "/bin/sleep", "1000")
	if _, err := pa.SavePod(ctx, t.TempDir()); !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "container c (c)") {
		t.Errorf("SavePod with the share mounted: %v", err)
	}
}

// startMovableApp starts, through c, an app whose files are the guest's
// own, not the 9p share's (an empty root and the guest's stagelet
// binary), so that its VM can move: a second agent serving a socket
// named by a random token.
func startMovableApp(ctx context.Context, t *testing.T, c *client.Client) (*api.AppSpec, *api.AppStatus) {
	t.Helper()
	raw := make([]byte, 6)
	rand.Read(raw)
	token := hex.EncodeToString(raw)
	app := &api.AppSpec{ID: "sleeper", Name: "sleeper", Rootfs: "/tmp", LocalUpper: true,
		Mounts: []api.Mount{{Source: "/init", Destination: "/init", Readonly: true}},
		Args:   []string{"/init", "agent", "--socket", "/tmp/" + token + ".sock", "--state-dir", "/tmp/" + token}}
	if _, err := c.Create(ctx, app); err != nil {
		t.Fatalf("create an app on the guest's root: %v", err)
	}
	st, err := c.Start(ctx, app.ID)
	if err != nil {
		t.Fatal(err)
	}
	return app, st
}

// answers waits until something answers TCP at ip (port 1: a refusal is
// an answer).
func answers(ctx context.Context, ip string) error {
	for {
		c, err := (&net.Dialer{Timeout: 2 * time.Second}).DialContext(ctx, "tcp", net.JoinHostPort(ip, "1"))
		if err == nil {
			c.Close()
			return nil
		}
		if strings.Contains(err.Error(), "connection refused") {
			return nil
		}
		if ctx.Err() != nil {
			return fmt.Errorf("no answer: %w", err)
		}
		time.Sleep(100 * time.Millisecond) // polling the guest's stack
	}
}

// localDisks finds the saved VM's disks in this node's store by image
// ID, refusing other bytes and an account whose IDs do not agree.
func TestLocalDisks(t *testing.T) {
	dir := t.TempDir()
	st := &state{}
	st.Record(host.Resource{Kind: host.KindDir, Role: roleDir, Path: dir})
	b := &Backend{cfg: Config{}}
	p := &Pod{st: st, b: b, log: slog.New(slog.DiscardHandler), disks: &diskPlugs{}}
	const sum = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
	node, dev := diskIDs(3)
	saved := PluggedDisk{ImageID: "sha256:img", SHA256: sum, Path: "/elsewhere/disk.erofs", Target: 3, Serial: diskSerial(sum), Node: node, Device: dev, Users: []string{"old"}}
	ctx := context.Background()
	if _, err := p.localDisks(ctx, []PluggedDisk{saved}); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Errorf("a node without image disks: %v", err)
	}
	local := sum
	b.cfg.ImageDisks = func(_ context.Context, id string) (string, string, error) {
		if id != "sha256:img" {
			return "", "", errdefs.NotFound("no image %s", id)
		}
		return "/here/disk.erofs", local, nil
	}
	if err := p.saveDisks(&diskRecord{Version: disksVersion, Disks: []PluggedDisk{{ImageID: "sha256:img", Target: 0, Users: []string{"new"}}}}); err != nil {
		t.Fatal(err)
	}
	r, err := p.localDisks(ctx, []PluggedDisk{saved})
	if err != nil {
		t.Fatal(err)
	}
	if d := r.Disks[0]; len(r.Disks) != 1 || d.Path != "/here/disk.erofs" || d.Target != 3 || strings.Join(d.Users, ",") != "old,new" || r.Next != 4 {
		t.Errorf("localDisks = %+v", r)
	}
	local = strings.Repeat("f", 64)
	if _, err := p.localDisks(ctx, []PluggedDisk{saved}); !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "SHA-256") {
		t.Errorf("other bytes: %v", err)
	}
	bad := saved
	bad.Device = "scsi0"
	if _, err := p.localDisks(ctx, []PluggedDisk{bad}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("IDs that do not agree: %v", err)
	}
}
