package supervisor_test

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stagelet/stagelet/agent/api"
)

// TestLocalWritableLayer: an app given a local writable layer writes
// into it, not into its rootfs; later execs see its writes and removals;
// Stats report what the layer holds; removal releases the layer.
func TestLocalWritableLayer(t *testing.T) {
	ta := startAgentAs(t, true)
	rootfs := makeRootfs(t)
	ta.run(&api.AppSpec{ID: "w", Rootfs: rootfs, Args: []string{"sleep", "1000"}, LocalUpper: true})
	if res := ta.exec("w", "sh", "-c", "dd if=/dev/zero of=/big bs=1k count=512 && rm /bin/cat && echo x >/etc/new"); res.ExitCode != 0 {
		t.Fatalf("write into the rootfs: %+v", res)
	}
	if res := ta.exec("w", "ls", "/bin/cat"); res.ExitCode == 0 {
		t.Errorf("a later exec still sees the removed /bin/cat: %+v", res)
	}
	if res := ta.exec("w", "sh", "-c", "read l </etc/new && echo $l"); string(res.Stdout) != "x\n" {
		t.Errorf("a later exec does not see /etc/new: %+v", res)
	}
	if _, err := os.Stat(filepath.Join(rootfs, "big")); err == nil {
		t.Error("the app's write reached its rootfs beneath the layer")
	}
	if _, err := os.Lstat(filepath.Join(rootfs, "bin", "cat")); err != nil {
		t.Errorf("the app's removal reached its rootfs beneath the layer: %v", err)
	}
	st, err := ta.c.Stats(ctx(t), "w")
	if err != nil {
		t.Fatal(err)
	}
	if !st.LocalLayer || st.WritableBytes < 512<<10 || st.WritableInodes < 3 {
		t.Errorf("stats: local layer %v, %d bytes, %d inodes; want it, at least 512 KiB and 3 inodes", st.LocalLayer, st.WritableBytes, st.WritableInodes)
	}
	if err := ta.c.Remove(ctx(t), "w"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(ta.state, "layers", "w")); !os.IsNotExist(err) {
		t.Errorf("the layer's directory is left after removal: %v", err)
	}
	if mountedOnHost(t, rootfs) {
		t.Error("the overlay over the rootfs is left after removal")
	}
	if err := ta.c.Remove(ctx(t), "w"); err != nil {
		t.Errorf("a second removal: %v", err)
	}
}
