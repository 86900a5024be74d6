package supervisor_test

import (
	"errors"
	"testing"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/errdefs"
)

// An app renamed keeps running under its new ID: status, stop and remove
// find it there, not under the old one.
func TestRename(t *testing.T) {
	ta := startAgent(t)
	rootfs := makeRootfs(t)
	before := ta.run(&api.AppSpec{ID: "old", Rootfs: rootfs, Args: []string{"sleep", "1000"}})
	ta.run(&api.AppSpec{ID: "other", Rootfs: rootfs, Args: []string{"sleep", "1000"}})
	if err := ta.c.Rename(ctx(t), "old", "other"); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Errorf("rename onto an existing app: %v", err)
	}
	if err := ta.c.Rename(ctx(t), "gone", "x"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("rename an unknown app: %v", err)
	}
	if err := ta.c.Rename(ctx(t), "old", "new"); err != nil {
		t.Fatal(err)
	}
	st, err := ta.c.Status(ctx(t), "new")
	if err != nil || st.State != api.StateRunning || st.PID != before.PID {
		t.Fatalf("status after the rename: %+v, %v; before %+v", st, err, before)
	}
	if _, err := ta.c.Status(ctx(t), "old"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("status under the old ID: %v", err)
	}
	if st, err := ta.c.Stop(ctx(t), "new", 0); err != nil || st.State != api.StateExited {
		t.Errorf("stop under the new ID: %+v, %v", st, err)
	}
	if err := ta.c.Remove(ctx(t), "new"); err != nil {
		t.Errorf("remove under the new ID: %v", err)
	}
}
