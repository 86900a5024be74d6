package main

import (
	"log/slog"
	"os"
	"path/filepath"

	"github.com/stagelet/stagelet/stage1/host"

	"github.com/stagelet/stagelet/config"
	"github.com/stagelet/stagelet/stage1"
	"github.com/stagelet/stagelet/stage1/fly"
	"github.com/stagelet/stagelet/stage1/kvm"
	"github.com/stagelet/stagelet/stage1/nspawn"
)

// builtinBackends are the stage1s this binary carries and this node can
// run: kvm only when its guest assets are there, unless anyAssets (for
// operator tools that reason about what the build offers). They start pod
// processes with l; nil means the plain launcher. runDir is the daemon's
// run directory, where kvm keeps its VM templates ("": none).
func builtinBackends(log *slog.Logger, cfg *config.Config, l host.Launcher, anyAssets bool, runDir string) stage1.Registry {
	r := stage1.Registry{}
	for _, be := range []stage1.Backend{
		fly.NewWithLauncher(log.With("stage1", "fly"), l),
		nspawn.NewWithLauncher(log.With("stage1", "nspawn"), l),
	} {
		r[be.Name()] = be
	}
	assets := kvmAssetsDir(cfg)
	if anyAssets || kvm.HasAssets(assets) {
		kc := kvm.Config{AssetsDir: assets, Accelerator: cfg.KVM.Accelerator, Machine: cfg.KVM.Machine, Launcher: l, BootTimeout: cfg.KVM.BootTimeoutDuration(),
			Placement: kvm.Placement(cfg.KVM.Placement), OverheadCgroup: cfg.KVM.OverheadCgroup, OverheadMemoryMax: cfg.KVM.OverheadMemoryMaxBytes()}
		if kc.OverheadCgroup == "" && cfg.CgroupDriver == config.CgroupDriverSystemd {
			kc.OverheadCgroup = kvm.DefaultOverheadSlice
		}
		if cfg.KVM.Templates() && runDir != "" {
			kc.TemplateDir = filepath.Join(runDir, "kvm-templates")
		}
		r[kvm.Name] = kvm.New(log.With("stage1", "kvm"), kc)
	} else {
		log.Warn("the kvm stage1 is not offered: no guest kernel and initramfs (make guest)", "assetsDir", assets)
	}
	return r
}

// packagedGuestDir is where the Debian package (make deb) installs the
// kvm guest assets.
const packagedGuestDir = "/usr/lib/stagelet/guest"

// kvmAssetsDir is the configured guest assets directory, else "guest"
// beside the stagelet binary (make guest, a hand install), else the
// packaged assets in packagedGuestDir.
func kvmAssetsDir(cfg *config.Config) string {
	if cfg.KVM.AssetsDir != "" {
		return cfg.KVM.AssetsDir
	}
	beside := "guest"
	if exe, err := os.Executable(); err == nil {
		beside = filepath.Join(filepath.Dir(exe), "guest")
	}
	return chooseAssetsDir(beside, packagedGuestDir)
}

// chooseAssetsDir is the first of dirs that holds guest assets, else the
// first of dirs (which the warning of a node without kvm then names).
func chooseAssetsDir(dirs ...string) string {
	for _, d := range dirs {
		if kvm.HasAssets(d) {
			return d
		}
	}
	return dirs[0]
}

// capabilitiesOf returns each backend's declared capability facts.
func capabilitiesOf(r stage1.Registry) map[string]stage1.Capabilities {
	caps := make(map[string]stage1.Capabilities, len(r))
	for n, be := range r {
		caps[n] = be.Capabilities()
	}
	return caps
}
