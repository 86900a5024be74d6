package main

import (
	"context"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"github.com/stagelet/stagelet/broker"
	"github.com/stagelet/stagelet/config"
	"github.com/stagelet/stagelet/policy"
	"github.com/stagelet/stagelet/stage1"
)

// loadPolicy reads the policy the node configuration names and validates
// it against this node's stage1s. Problems that only name stage1s the node
// lacks are logged: pods routed to them are refused when they come.
func loadPolicy(log *slog.Logger, cfg *config.Config, caps map[string]stage1.Capabilities) (*policy.Policy, error) {
	p, err := cfg.LoadPolicy()
	if err != nil {
		return nil, err
	}
	missing, errs := config.CheckPolicy(p, caps)
	if errs != nil {
		return nil, errs
	}
	for _, m := range missing {
		log.Warn("the policy names a stage1 this node does not have; pods routed to it will be refused", "problem", m)
	}
	return p, nil
}

// policyFiles are the files whose change triggers a reload.
func policyFiles(cfgPath string, cfg *config.Config) []string {
	var files []string
	if cfgPath != "" {
		files = append(files, cfgPath)
		if cfg.PolicyFile != "" {
			f := cfg.PolicyFile
			if !filepath.IsAbs(f) {
				f = filepath.Join(filepath.Dir(cfgPath), f)
			}
			files = append(files, f)
		}
	}
	return files
}

func modTimes(files []string) []time.Time {
	out := make([]time.Time, len(files))
	for i, f := range files {
		if st, err := os.Stat(f); err == nil {
			out[i] = st.ModTime()
		}
	}
	return out
}

func sameTimes(a, b []time.Time) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if !a[i].Equal(b[i]) {
			return false
		}
	}
	return true
}

// reloadPolicyOnChange reloads the policy on SIGHUP and when the config or
// policy file changes. A file that does not load is rejected with its
// problems logged, and the policy in force stays. Only the policy is
// reloaded; other settings need a restart. Running pods keep their
// recorded decision.
//
// hup must be registered for SIGHUP (notifyHUP) before the daemon serves,
// so that a SIGHUP arriving early does not end the daemon.
func reloadPolicyOnChange(ctx context.Context, log *slog.Logger, cfgPath string, cfg *config.Config, b *broker.Broker, hup <-chan os.Signal, interval time.Duration) {
	files := policyFiles(cfgPath, cfg)
	seen := modTimes(files)
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for {
		why := ""
		select {
		case <-ctx.Done():
			return
		case <-hup:
			why = "SIGHUP"
		case <-tick.C:
			now := modTimes(files)
			if sameTimes(now, seen) {
				continue
			}
			seen = now
			why = "file changed"
		}
		next := config.Default()
		if cfgPath != "" {
			var err error
			if next, err = config.Load(cfgPath); err != nil {
				log.Error("policy reload rejected; the previous policy stays in force", "trigger", why, "err", err)
				continue
			}
		}
		p, err := loadPolicy(log, next, b.Capabilities())
		if err != nil {
			log.Error("policy reload rejected; the previous policy stays in force", "trigger", why, "err", err)
			continue
		}
		b.SetPolicy(p)
		files = policyFiles(cfgPath, next)
		seen = modTimes(files)
		log.Info("policy reloaded", "trigger", why, "source", p.Source, "default", p.DefaultStage1, "handlers", b.Handlers())
	}
}

// notifyHUP registers for SIGHUP; without it, Go's default action for the
// signal ends the process.
func notifyHUP() chan os.Signal {
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	return hup
}
