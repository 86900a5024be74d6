package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/stagelet/stagelet/broker"
	"github.com/stagelet/stagelet/cgroups"
	"github.com/stagelet/stagelet/config"
	"github.com/stagelet/stagelet/internal/logctx"
	"github.com/stagelet/stagelet/stage1/host"
)

// toolBroker opens the broker of a stopped daemon's state for an operator
// tool: the same stage1s, store and network, but no cgroup of its own (pod
// cgroups are found where the daemon recorded them).
func toolBroker(log *slog.Logger, cfg *config.Config, state, run string) (*broker.Broker, error) {
	systemd := cfg.CgroupDriver == config.CgroupDriverSystemd
	slice := ""
	if systemd {
		slice = cgroups.SliceOf(cfg.PodCgroupParent())
	}
	l, err := host.NewLauncher(log, systemd, slice)
	if err != nil {
		return nil, err
	}
	b, _, err := openBroker(log, cfg, state, run, l, "", nil)
	return b, err
}

func gcMain(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("stagelet gc", flag.ContinueOnError)
	fs.SetOutput(stderr)
	setAside := fs.Bool("set-aside", false, "release what set-aside records name (all of them, or the pod or container IDs given)")
	all := fs.Bool("all", false, "stop and remove every pod this node's state records (for a runtime being removed)")
	nf := addNodeFlags(fs)
	fs.Usage = func() {
		fmt.Fprintf(stderr, `usage: stagelet gc [flags] --set-aside [ID...]
       stagelet gc [flags] --all

Releases what the daemon no longer manages, with the daemon stopped (pods
keep running while it is: systemctl stop stagelet). It holds the state
directory's lock, and refuses while the daemon holds it.

  --set-aside [ID...]  the pods and containers of records recovery set
                       aside (stagelet doctor lists them): their processes,
                       cgroups, network, mounts and directories, unmounted
                       first and never deleted through a mount. Each record
                       is kept in quarantine/released for forensics.
  --all                every pod, stopped and removed as the kubelet would.

`)
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if *setAside == *all {
		fmt.Fprintln(stderr, "stagelet gc: give one of --set-aside or --all")
		fs.Usage()
		return 2
	}
	if *all && fs.NArg() > 0 {
		fmt.Fprintln(stderr, "stagelet gc: --all takes no IDs")
		return 2
	}
	cfg, state, run, err := nf.resolve()
	if err != nil {
		fmt.Fprintf(stderr, "stagelet gc: %v\n", err)
		return 1
	}
	if _, err := os.Stat(state); err != nil {
		fmt.Fprintf(stdout, "no state directory %s: nothing to release\n", state)
		return 0
	}
	lock, err := lockState(state)
	if err != nil {
		if errors.Is(err, errStateBusy) {
			fmt.Fprintf(stderr, "stagelet gc: %v: the daemon runs; stop it first (pods keep running)\n", err)
		} else {
			fmt.Fprintf(stderr, "stagelet gc: %v\n", err)
		}
		return 1
	}
	defer lock.Close()
	log := slog.New(logctx.NewHandler(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelWarn})))
	b, err := toolBroker(log, cfg, state, run)
	if err != nil {
		fmt.Fprintf(stderr, "stagelet gc: %v\n", err)
		return 1
	}
	defer b.Close()
	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer cancel()
	if *all {
		return gcAll(ctx, b, stdout, stderr)
	}
	return gcSetAside(ctx, b, fs.Args(), stdout, stderr)
}

func gcAll(ctx context.Context, b *broker.Broker, stdout, stderr io.Writer) int {
	if _, err := b.Recover(ctx); err != nil {
		fmt.Fprintf(stderr, "stagelet gc: recovery: %v\n", err)
		return 1
	}
	n, err := b.ReleaseAll(ctx)
	fmt.Fprintf(stdout, "released %d pods\n", n)
	if err != nil {
		fmt.Fprintf(stderr, "stagelet gc: %v\n", err)
		return 1
	}
	return 0
}

func gcSetAside(ctx context.Context, b *broker.Broker, ids []string, stdout, stderr io.Writer) int {
	if len(ids) == 0 {
		recs, err := b.SetAsideRecords(ctx)
		if err != nil {
			fmt.Fprintf(stderr, "stagelet gc: %v\n", err)
			return 1
		}
		seen := map[string]bool{}
		for _, r := range recs {
			// A container of a set-aside pod goes with its pod.
			if !seen[r.ID] && (r.Kind == "pod" || r.PodID == "" || !hasPod(recs, r.PodID)) {
				seen[r.ID] = true
				ids = append(ids, r.ID)
			}
		}
		if len(ids) == 0 {
			fmt.Fprintln(stdout, "no set-aside records")
			return 0
		}
	}
	rc := 0
	for _, id := range ids {
		held, err := b.ReleaseSetAside(ctx, id)
		if err != nil {
			fmt.Fprintf(stderr, "stagelet gc: %s: %v\n", id, err)
			rc = 1
			continue
		}
		fmt.Fprintf(stdout, "released %s: %s\n", id, held)
	}
	return rc
}

func hasPod(recs []broker.SetAsideRecord, id string) bool {
	for _, r := range recs {
		if r.Kind == "pod" && r.ID == id {
			return true
		}
	}
	return false
}
