package main

import (
	"log/slog"

	"github.com/stagelet/stagelet/stage1"
	"github.com/stagelet/stagelet/stage1/fly"
	"github.com/stagelet/stagelet/stage1/nspawn"
)

// builtinBackends are the stage1s this binary carries.
func builtinBackends(log *slog.Logger) stage1.Registry {
	r := stage1.Registry{}
	for _, be := range []stage1.Backend{
		fly.New(log.With("stage1", "fly")),
		nspawn.New(log.With("stage1", "nspawn")),
	} {
		r[be.Name()] = be
	}
	return r
}

// capabilitiesOf returns each backend's declared capability facts.
func capabilitiesOf(r stage1.Registry) map[string]stage1.Capabilities {
	caps := make(map[string]stage1.Capabilities, len(r))
	for n, be := range r {
		caps[n] = be.Capabilities()
	}
	return caps
}
