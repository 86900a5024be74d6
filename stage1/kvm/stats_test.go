package kvm

import (
	"context"
	"log/slog"
	"testing"

	"github.com/stagelet/stagelet/stage1"
)

// TestVMStatsAccelerator: VMStats names no accelerator before one is
// chosen (it never probes), and the chosen one after.
func TestVMStatsAccelerator(t *testing.T) {
	b := New(slog.New(slog.DiscardHandler), Config{Accelerator: "tcg"})
	if got := b.VMStats(); got != (stage1.VMStats{}) {
		t.Fatalf("before any pod: %+v", got)
	}
	b.accelerator(context.Background(), nil) // configured: no probe, no tools
	if got := b.VMStats().Accelerator; got != "tcg" {
		t.Fatalf("accelerator %q, want tcg", got)
	}
}
