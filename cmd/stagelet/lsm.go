package main

import (
	"context"
	"log/slog"
	"path/filepath"
	"time"

	"github.com/stagelet/stagelet/internal/lsm"
)

// loadAppArmorDefault loads the default container profile where AppArmor
// is enabled, as containerd and CRI-O do at start: unchanged when the
// kernel holds this text already. A failure is logged, not fatal: the
// containers that would run under the profile are refused, saying so,
// and stagelet doctor reports it.
func loadAppArmorDefault(log *slog.Logger, run string) {
	if !lsm.AppArmorEnabled() {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	name := lsm.DefaultAppArmorName
	stamp := filepath.Join(run, "apparmor", name+".sha256")
	loaded, err := lsm.EnsureAppArmorProfile(ctx, name, lsm.DefaultAppArmorProfile(name), stamp)
	switch {
	case err != nil:
		log.Error("the default AppArmor profile could not be loaded: containers that would run under it are refused", "profile", name, "err", err)
	case loaded:
		log.Info("loaded the default AppArmor profile", "profile", name)
	default:
		log.Info("the default AppArmor profile is loaded already", "profile", name)
	}
}
