package main

import (
	"cmp"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"path/filepath"
	"time"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/broker"
	"github.com/stagelet/stagelet/config"
	"github.com/stagelet/stagelet/devices"
	"github.com/stagelet/stagelet/network"
	"github.com/stagelet/stagelet/nri"
	"github.com/stagelet/stagelet/preflight"
	"github.com/stagelet/stagelet/stage1"
	"github.com/stagelet/stagelet/stage1/kvm"
)

// doctorMain prints what this node can run and why not; it exits 1 when
// the default stage1 cannot run, 2 on bad usage.
func doctorMain(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("stagelet doctor", flag.ContinueOnError)
	fs.SetOutput(stderr)
	output := fs.String("o", "text", "output: text, or json for tools")
	socket := fs.String("socket", "", "the serving daemon's CRI socket, asked which NRI plugins are connected (default: the configuration's, else "+defaultSocket+")")
	nf := addNodeFlags(fs)
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if *output != "text" && *output != "json" {
		fmt.Fprintf(stderr, "stagelet doctor: -o %q: want text or json\n", *output)
		return 2
	}
	cfg, state, run, err := nf.resolve()
	if err != nil {
		fmt.Fprintf(stderr, "stagelet doctor: %v\n", err)
		return 1
	}
	// What the checks log (the kvm probe's verdict) is in the report.
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	backends := builtinBackends(log, cfg, nil, false, "")
	pol, err := loadPolicy(log, cfg, capabilitiesOf(backends))
	if err != nil {
		fmt.Fprintf(stderr, "stagelet doctor: policy: %v\n", err)
		return 1
	}
	netm, err := network.New(network.Config{ConfDir: cfg.CNI.ConfDir, PluginDirs: cfg.CNI.PluginDirs, RunDir: run, CacheDir: filepath.Join(state, "cni"), Inspect: true}, log)
	if err != nil {
		fmt.Fprintf(stderr, "stagelet doctor: pod network: %v\n", err)
		return 1
	}
	// A broker over the state, to read the set-aside records: it runs
	// nothing, changes nothing, and the daemon may be serving meanwhile.
	b, err := broker.New(broker.Options{Network: netm, StateDir: state, RunDir: run, Policy: pol, Backends: backends, Log: log, Inspect: true})
	if err != nil {
		fmt.Fprintf(stderr, "stagelet doctor: %v\n", err)
		return 1
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if *socket != "" {
		cfg.Socket = *socket
	}
	rep := nodeReport(ctx, cfg, state, b)
	if *output == "json" {
		rep.WriteJSON(stdout)
	} else {
		rep.WriteText(stdout)
	}
	if !rep.CanRunDefault() {
		return 1
	}
	return 0
}

// nodeReport runs every preflight check of this node: the daemon after
// recovery (for crictl info) and stagelet doctor alike.
func nodeReport(ctx context.Context, cfg *config.Config, state string, b *broker.Broker) *preflight.Report {
	var kvmInfo preflight.KVMInfo
	if be, ok := b.Backend(kvm.Name); ok {
		if ni, ok := be.(stage1.NodeInformer); ok {
			kvmInfo = ni.NodeInfo
		}
	}
	names := b.Stage1s()
	if kvmInfo == nil {
		names = append(names, kvm.Name)
	}
	cdi := devices.NewCDI(cfg.CDI.SpecDirs)
	probes := []preflight.Prober{
		preflight.Cgroups(b.NodeCgroup()),
		preflight.Systemd(cfg.CgroupDriver == config.CgroupDriverSystemd),
		preflight.Tool("nspawn", "systemd-nspawn", "systemd-container", []string{"nspawn"}, "--version"),
		preflight.Tool("qemu", "qemu-system-x86_64", "qemu-system-x86", []string{kvm.Name}, "--version"),
		preflight.KVM(kvmInfo),
		preflight.CNI(b.NetworkStatus, b.NetworkDescription, cfg.CNI.ConfDir, cfg.CNI.PluginDirs),
		preflight.UserNamespaces(),
		preflight.LSM(),
		preflight.CDI(cdi.SpecDirs(), cdi.Devices),
		preflight.CRIU(cfg.Checkpoint.CRIU),
		preflight.SignaturePolicy(cfg.Images.SignaturePolicy, cfg.Images.PolicyDir()),
		preflight.NRI(cfg.NRI.Disable, cmp.Or(cfg.NRI.SocketPath, nri.DefaultSocketPath), cmp.Or(cfg.NRI.PluginPath, nri.DefaultPluginPath),
			func(ctx context.Context) ([]string, error) { return nriPlugins(ctx, cfg, b) }),
		preflight.Disk(state),
		preflight.SetAside(func(ctx context.Context) ([]string, error) {
			recs, err := b.SetAsideRecords(ctx)
			var lines []string
			for _, r := range recs {
				line := fmt.Sprintf("%s %s (%s; %s) holds %s", r.Kind, r.ID, r.Path, r.Reason, r.Holds)
				if r.PodID != "" {
					line += ", of pod " + r.PodID
				}
				lines = append(lines, line+holdsDetail(r.Holds))
			}
			return lines, err
		}),
	}
	return preflight.Run(ctx, names, b.Policy().DefaultStage1, probes)
}

// nriPlugins are the NRI plugins connected to the daemon: b's, in the
// daemon; else, in stagelet doctor, what the serving daemon says in its
// verbose Status.
func nriPlugins(ctx context.Context, cfg *config.Config, b *broker.Broker) ([]string, error) {
	var plugins []nri.Plugin
	if h := b.NRI(); h != nil {
		plugins, _ = h.Plugins()
	} else {
		rt, closeConn, err := criClient(cmp.Or(cfg.Socket, defaultSocket))
		if err != nil {
			return nil, err
		}
		defer closeConn()
		ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		resp, err := rt.Status(ctx, &runtimeapi.StatusRequest{Verbose: true})
		if err != nil {
			return nil, fmt.Errorf("the daemon does not answer: %w", err)
		}
		var st struct{ Plugins []nri.Plugin }
		if err := json.Unmarshal([]byte(resp.GetInfo()["nri"]), &st); err != nil {
			return nil, fmt.Errorf("the daemon's verbose Status: nri: %w", err)
		}
		plugins = st.Plugins
	}
	names := make([]string, len(plugins))
	for i, p := range plugins {
		names[i] = p.Name
		if p.LastError != "" {
			names[i] += " (last error: " + p.LastError + ")"
		}
	}
	return names, nil
}

// holdsDetail lists what a set-aside record's pod holds.
func holdsDetail(h broker.Holdings) string {
	s := ""
	add := func(what string, v any) { s += fmt.Sprintf(" %s=%v", what, v) }
	if len(h.Processes) > 0 {
		add("pids", h.Processes)
	}
	if h.NetNS != "" {
		add("netns", h.NetNS)
	}
	if len(h.Addresses) > 0 {
		add("addresses", h.Addresses)
	}
	if len(h.Cgroups) > 0 {
		add("cgroups", h.Cgroups)
	}
	if len(h.Mounts) > 0 {
		add("mounts", h.Mounts)
	}
	if len(h.Containers) > 0 {
		add("containers", h.Containers)
	}
	if s == "" {
		return ""
	}
	return ":" + s
}
