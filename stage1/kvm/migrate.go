package kvm

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/stagelet/stagelet/errdefs"
)

// migration is how a finished outgoing migration went (query-migrate).
type migration struct {
	// Bytes is what the stream carried of the VM's memory.
	Bytes int64
	// Total is from the migration's start to its end; Downtime how long
	// the VM was stopped for the last round, as qemu measured it.
	Total, Downtime time.Duration
}

// migrateOut migrates the VM to uri (a qemu migration URI: "exec:CMD",
// "fd:NAME", "tcp:..."), with the VM running (pre-copy: qemu stops it for
// the last round), and waits for the end. The source VM is then stopped
// ("postmigrate"). Errors: qemu's refusal (FailedPrecondition: a device
// that blocks migration, as a mounted virtio-9p share), a failed or
// cancelled migration, ctx.
func (q *qmp) migrateOut(ctx context.Context, uri string) (migration, error) {
	if _, err := q.run(ctx, "migrate", map[string]any{"uri": uri}); err != nil {
		return migration{}, errdefs.FailedPrecondition("kvm: migrating the VM: %w", err)
	}
	for delay := time.Millisecond; ; delay = min(2*delay, 20*time.Millisecond) {
		r, err := q.run(ctx, "query-migrate", nil)
		if err != nil {
			return migration{}, err
		}
		var st struct {
			Status    string `json:"status"`
			Desc      string `json:"error-desc"`
			TotalTime int64  `json:"total-time"`
			Downtime  int64  `json:"downtime"`
			RAM       struct {
				Transferred int64 `json:"transferred"`
			} `json:"ram"`
		}
		if err := json.Unmarshal(r, &st); err != nil {
			return migration{}, fmt.Errorf("qmp query-migrate: %w", err)
		}
		switch st.Status {
		case "completed":
			return migration{Bytes: st.RAM.Transferred, Total: time.Duration(st.TotalTime) * time.Millisecond,
				Downtime: time.Duration(st.Downtime) * time.Millisecond}, nil
		case "failed", "cancelled":
			return migration{}, fmt.Errorf("kvm: migrating the VM: %s: %s", st.Status, st.Desc)
		}
		select {
		case <-ctx.Done():
			q.run(context.Background(), "migrate_cancel", nil)
			return migration{}, fmt.Errorf("kvm: migrating the VM: %w", ctx.Err())
		case <-time.After(delay): // polling qemu for the migration's end
		}
	}
}
