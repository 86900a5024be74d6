package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"k8s.io/klog/v2"

	"github.com/stagelet/stagelet/broker"
	"github.com/stagelet/stagelet/cgroups"
	"github.com/stagelet/stagelet/config"
	"github.com/stagelet/stagelet/cri"
	"github.com/stagelet/stagelet/devices"
	"github.com/stagelet/stagelet/image"
	"github.com/stagelet/stagelet/internal/logctx"
	"github.com/stagelet/stagelet/internal/rlimit"
	"github.com/stagelet/stagelet/internal/staticbin"
	"github.com/stagelet/stagelet/metrics"
	"github.com/stagelet/stagelet/network"
	"github.com/stagelet/stagelet/nri"
	"github.com/stagelet/stagelet/policy"
	"github.com/stagelet/stagelet/preflight"
	"github.com/stagelet/stagelet/stage1/host"
	"github.com/stagelet/stagelet/stage1/kvm"
	"github.com/stagelet/stagelet/tracing/otlp"
	"github.com/stagelet/stagelet/trust"
)

const (
	defaultSocket   = "/run/stagelet/stagelet.sock"
	defaultStateDir = "/var/lib/stagelet"
	defaultRunDir   = "/run/stagelet"
)

func parseLevel(s string) (slog.Level, error) {
	var l slog.Level
	err := l.UnmarshalText([]byte(s))
	return l, err
}

func serveMain(args []string) int {
	fs := flag.NewFlagSet("stagelet serve", flag.ContinueOnError)
	socket := fs.String("socket", "", "CRI socket path (default "+defaultSocket+")")
	nf := addNodeFlags(fs)
	logLevel := fs.String("log-level", "info", "log level: debug, info, warn, error")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	lvl, err := parseLevel(*logLevel)
	if err != nil {
		fmt.Fprintf(os.Stderr, "stagelet serve: --log-level: %v\n", err)
		return 2
	}
	// A CRI call's lines carry its request ID, pod and container (logctx).
	log := slog.New(logctx.NewHandler(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: lvl})))
	slog.SetDefault(log)

	cfg, state, run, err := nf.resolve()
	if err != nil {
		log.Error("invalid configuration", "err", err)
		return 1
	}
	sock := pick(*socket, cfg.Socket, defaultSocket)

	if err := serve(log, cfg, *nf.config, sock, state, run); err != nil {
		log.Error("stagelet serve failed", "err", err)
		return 1
	}
	return 0
}

// untilSignal recovers the pods, then serves until SIGTERM or SIGINT (or
// a server fails: errc), reloading the policy meanwhile (reload). Pods
// outlive the daemon: it stops serving and leaves them running.
func untilSignal(log *slog.Logger, b *broker.Broker, srv *cri.Server, g *grpc.Server, errc <-chan error, reload func(context.Context), preflight func(context.Context)) error {
	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer cancel()
	if _, err := b.Recover(ctx); err != nil {
		g.Stop()
		return fmt.Errorf("recovery: %w", err)
	}
	if h := b.NRI(); h != nil {
		// Plugins synchronize with the recovered pods.
		if err := h.Start(b); err != nil {
			g.Stop()
			return err
		}
		defer h.Stop()
		log.Info("NRI plugins hosted", "socket", h.Socket())
	}
	// Backends that probe the node (kvm's accelerator) do it now, not
	// when the first pod waits for it; what they find is logged.
	go b.BackendInfo(ctx)
	// The node's checks run commands (criu check, among others), which
	// must not outlive the daemon: it waits for them when it stops, and
	// after preflightGrace ends them. They get the grace first because
	// a criu killed within its check leaves its probe's directory in
	// /tmp.
	pctx, pcancel := context.WithCancel(context.WithoutCancel(ctx))
	pdone := make(chan struct{})
	go func() {
		defer close(pdone)
		preflight(pctx)
	}()
	stopPreflight := sync.OnceFunc(func() {
		t := time.NewTimer(preflightGrace)
		defer t.Stop()
		select {
		case <-pdone:
		case <-t.C:
			log.Warn("stopping the node's checks, still running", "after", preflightGrace)
		}
		pcancel()
		<-pdone
	})
	defer stopPreflight()
	go reload(ctx)
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	// Pods outlive the daemon: stop serving, leave them running.
	log.Info("stopping the CRI server; pods keep running")
	srv.Stop()
	g.GracefulStop()
	stopPreflight() // they ask the broker
	b.Close()
	return nil
}

// preflightGrace is how long a stopping daemon lets the node's checks
// finish before it ends them.
const preflightGrace = 5 * time.Second

// criServers makes the CRI gRPC server over b and its streaming server
// (exec, attach, port-forward), which logs through klog into log. m
// (nil: metrics off) counts the calls, first in the chain.
func criServers(log *slog.Logger, cfg *config.Config, b *broker.Broker, m *metrics.Metrics, tr *otlp.Tracing) (*cri.StreamServer, *cri.Server, *grpc.Server, error) {
	klog.SetSlogLogger(log.With("component", "streaming"))
	streams, err := cri.NewStreamServer(b, cfg.StreamingAddr(), log.With("component", "streaming"))
	if err != nil {
		return nil, nil, nil, err
	}
	srv := cri.New(b, cri.Options{Version: version, Log: log, SystemdCgroup: cfg.CgroupDriver == config.CgroupDriverSystemd, Stream: streams})
	unary, stream := srv.Interceptors()
	opts := append(interceptors(m, unary, stream), grpc.StatsHandler(srv.StatsHandler()),
		// Calls run on long-lived workers, whose stacks have grown
		// already, rather than each on a new goroutine that grows its
		// own: the kubelet's lists come every second. Beyond as many
		// calls at once as CPUs, gRPC starts goroutines as before.
		grpc.NumStreamWorkers(uint32(runtime.GOMAXPROCS(0))))
	if h := tr.ServerHandler(cri.StatusPath); h != nil {
		// First: the call's span exists before the interceptors run.
		opts = append([]grpc.ServerOption{grpc.StatsHandler(h)}, opts...)
	}
	g := grpc.NewServer(opts...)
	srv.Register(g)
	return streams, srv, g, nil
}

// agentBinary is this binary, which every pod runs as its agent, in roots
// that hold no C library: a dynamic build would fail every nspawn and kvm
// pod, so it must be static.
func agentBinary() (string, error) {
	self, err := os.Executable()
	if err != nil {
		return "", fmt.Errorf("finding the stagelet binary for pod agents: %w", err)
	}
	if err := staticbin.Check("/proc/self/exe"); err != nil {
		return "", fmt.Errorf("the stagelet binary %s cannot run as the pods' agent: %w; build it static (CGO_ENABLED=0, as make build does)", self, err)
	}
	return self, nil
}

// openNetwork sets up the pod network manager; a node without a usable
// CNI configuration yet is logged, not an error.
func openNetwork(log *slog.Logger, cfg *config.Config, state, run string) (*network.Manager, error) {
	netm, err := network.New(network.Config{
		ConfDir:    cfg.CNI.ConfDir,
		PluginDirs: cfg.CNI.PluginDirs,
		RunDir:     run,
		CacheDir:   filepath.Join(state, "cni"),
	}, log)
	if err != nil {
		return nil, fmt.Errorf("pod network: %w", err)
	}
	if ok, reason := netm.Status(); !ok {
		log.Warn("pod network not ready: only pods in the host network can run", "reason", reason)
	}
	return netm, nil
}

// openImages opens the image store under state with the configured
// registries.
func openImages(log *slog.Logger, cfg *config.Config, state string) (*image.Store, error) {
	regs := image.Config{Registries: map[string]image.RegistryHost{}}
	for host, r := range cfg.Registries {
		regs.Registries[host] = image.RegistryHost{Mirrors: r.Mirrors, Insecure: r.Insecure}
	}
	images, err := image.NewStore(filepath.Join(state, "images"), regs, log)
	if err != nil {
		return nil, fmt.Errorf("image store: %w", err)
	}
	return images, nil
}

// listenCRI listens on the unix socket sock, replacing a stale one, with
// mode 0660.
func listenCRI(sock string) (net.Listener, error) {
	if err := os.MkdirAll(filepath.Dir(sock), 0o700); err != nil {
		return nil, err
	}
	if err := os.Remove(sock); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}
	oldMask := syscall.Umask(0o117)
	lis, err := net.Listen("unix", sock)
	syscall.Umask(oldMask)
	if err != nil {
		return nil, err
	}
	if err := os.Chmod(sock, 0o660); err != nil {
		lis.Close()
		return nil, err
	}
	return lis, nil
}

func serve(log *slog.Logger, cfg *config.Config, cfgPath, sock, state, run string) error {
	hup := notifyHUP()
	defer signal.Stop(hup)
	for _, d := range []string{state, run} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return err
		}
	}
	lock, err := lockState(state)
	if err != nil {
		return err
	}
	defer lock.Close()
	loadAppArmorDefault(log, run)
	launcher, parent, err := placePods(log, cfg)
	if err != nil {
		return err
	}
	m := newMetrics(cfg)
	b, pol, err := openBroker(log, cfg, state, run, launcher, parent, m.BrokerObserver())
	if err != nil {
		return err
	}
	m.Watch(b)

	// Listen first, so a restarted daemon answers Unavailable while it
	// recovers instead of refusing connections.
	lis, err := listenCRI(sock)
	if err != nil {
		return err
	}
	tr, err := otlp.Setup(context.Background(), otlp.Config{
		Endpoint: cfg.Tracing.Endpoint, SamplingRatePerMillion: cfg.Tracing.SamplingRatePerMillion,
		ServiceName: cfg.Tracing.ServiceName, Version: version,
	})
	if err != nil {
		return err
	}
	defer func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := tr.Shutdown(ctx); err != nil {
			log.Warn("sending the last spans", "err", err)
		}
	}()
	streams, srv, g, err := criServers(log, cfg, b, m, tr)
	if err != nil {
		return err
	}
	defer streams.Close()

	errc := make(chan error, 3)
	stopMetrics, err := serveMetrics(log, cfg.Metrics.Address, m, errc)
	if err != nil {
		return err
	}
	defer stopMetrics()
	go func() { errc <- g.Serve(lis) }()
	go func() {
		if err := streams.Serve(); err != nil {
			errc <- fmt.Errorf("streaming server: %w", err)
		}
	}()
	log.Info("stagelet serving", "socket", sock, "streaming", streams.Addr(), "stateDir", state, "runDir", run, "config", cfg.Source,
		"stage1s", b.Stage1s(), "policy", pol.Source, "default", pol.DefaultStage1, "handlers", b.Handlers(), "tracing", cfg.Tracing.Endpoint, "version", version)

	return untilSignal(log, b, srv, g, errc, func(ctx context.Context) {
		reloadPolicyOnChange(ctx, log, cfgPath, cfg, b, hup, 2*time.Second)
	}, func(ctx context.Context) {
		// What stagelet doctor would say, for crictl info; failed
		// checks are logged once.
		rep := nodeReport(ctx, cfg, state, b)
		srv.SetNodeInfo(rep.Info())
		for _, c := range rep.Checks {
			if c.Status == "fail" || c.Status == "warn" {
				log.Warn("preflight: "+c.Name, "status", c.Status, "detail", c.Detail)
			}
		}
	})
}

// openBroker makes the broker over this node's stage1s, image store and
// pod network, with the policy the configuration names. Pods without a
// kubelet-given cgroup parent go to parent; l starts their processes.
func openBroker(log *slog.Logger, cfg *config.Config, state, run string, l host.Launcher, parent string, obs broker.Observer) (*broker.Broker, *policy.Policy, error) {
	self, err := agentBinary()
	if err != nil {
		return nil, nil, err
	}
	images, err := openImages(log, cfg, state)
	if err != nil {
		return nil, nil, err
	}
	if sl, ok := l.(*host.SystemdLauncher); ok {
		// Its units are this daemon's: after a restart it collects only
		// those of its pods that lost their record.
		sl.Owner = state
	}
	backends := builtinBackends(log, cfg, l, false, run)
	if kb, ok := backends[kvm.Name].(*kvm.Backend); ok && cfg.KVM.ImageDisksOn() {
		// VM pods' containers read their image from a disk of it.
		kb.UseImageDisks(func(ctx context.Context, id string) (string, string, error) {
			d, err := images.Disk(ctx, id)
			return d.Path, d.SHA256, err
		})
	}
	pol, err := loadPolicy(log, cfg, capabilitiesOf(backends))
	if err != nil {
		return nil, nil, fmt.Errorf("policy: %w", err)
	}
	netm, err := openNetwork(log, cfg, state, run)
	if err != nil {
		return nil, nil, err
	}
	var imageTrust *trust.Source
	if cfg.Images.SignaturePolicy != "" || cfg.Images.PolicyDir() != "" {
		imageTrust, err = trust.NewSource(cfg.Images.SignaturePolicy, cfg.Images.PolicyDir(), log)
		if err != nil {
			return nil, nil, err
		}
	}
	nriHost, err := openNRI(log, cfg)
	if err != nil {
		return nil, nil, err
	}
	limits, err := rlimit.Inherited()
	if err != nil {
		log.Warn("containers start with their agent's resource limits: the daemon's children's could not be read", "err", err)
	}
	b, err := broker.New(broker.Options{
		Rlimits:       limits,
		Trust:         imageTrust,
		NRI:           nriHost,
		Network:       netm,
		StateDir:      state,
		RunDir:        run,
		CgroupParent:  parent,
		SystemdCgroup: cfg.CgroupDriver == config.CgroupDriverSystemd,
		Policy:        pol,
		AgentBinary:   self,
		Backends:      backends,
		Images:        images,
		CDI:           devices.NewCDI(cfg.CDI.SpecDirs),
		Log:           log,
		Observer:      obs,
		CRIU:          criuFinder(log, cfg.Checkpoint.CRIU),
		LiveAddress:   cfg.Checkpoint.LiveAddress,
	})
	return b, pol, err
}

// openNRI makes the host of NRI plugins the configuration asks for (nil
// when it disables NRI); it starts once the pods are recovered.
func openNRI(log *slog.Logger, cfg *config.Config) (*nri.Host, error) {
	if cfg.NRI.Disable {
		return nil, nil
	}
	reg, req := cfg.NRI.Timeouts()
	return nri.New(nri.Config{
		SocketPath: cfg.NRI.SocketPath, PluginPath: cfg.NRI.PluginPath, PluginConfigPath: cfg.NRI.PluginConfigPath,
		RegistrationTimeout: reg, RequestTimeout: req, DisableConnections: cfg.NRI.DisableConnections,
	}, "stagelet", version, log.With("component", "nri"))
}

// criuFinder looks for a working criu (preflight.FindCRIU) at the first
// checkpoint or restore and keeps its answer for the daemon's life:
// installing CRIU, or a kernel that it supports, takes a restart.
func criuFinder(log *slog.Logger, configured string) func(context.Context) (string, error) {
	find := sync.OnceValues(func() (string, error) {
		path, ver, why, err := preflight.FindCRIU(context.Background(), configured)
		if err == nil {
			log.Info("checkpoints use criu", "path", path, "version", ver, "why", why)
		}
		return path, err
	})
	return func(context.Context) (string, error) { return find() }
}

// systemdServiceRoot returns the cgroup of the systemd service the daemon
// runs in the root of, on a pure cgroup v2 host where systemd is PID 1, and
// "" otherwise (no systemd, cgroup v1, or already in a leaf of the
// service, where systemd 254's DelegateSubgroup= starts it).
func systemdServiceRoot() string {
	if _, err := os.Stat("/run/systemd/system"); err != nil {
		return ""
	}
	self, err := cgroups.Self()
	if err != nil {
		return ""
	}
	if p := self.Path(); strings.HasSuffix(p, ".service") {
		return p
	}
	return ""
}

// placePods prepares where pods' host processes go, per the cgroup driver,
// and returns the launcher that starts them and the cgroup parent of pods
// the kubelet gives none. systemd: transient units in slices (systemd must
// answer). cgroupfs: the parent cgroup is created now, so that a layout
// cgroup v2 forbids is reported at start, naming the cgroup and the rule;
// a parent relative to the daemon's own cgroup first makes the daemon move
// into its leaf (cgroups.EnterLeaf), as systemd's delegation asks. The kvm
// stage1's overhead cgroup (cfg.KVM.OverheadCgroup, set here to the path
// it resolves) goes by the same rules as the parent; the stage1 makes it
// when a VM first needs it.
func placePods(log *slog.Logger, cfg *config.Config) (host.Launcher, string, error) {
	parent := cfg.PodCgroupParent()
	if cfg.CgroupDriver == config.CgroupDriverSystemd {
		l, err := host.NewLauncher(log, true, cgroups.SliceOf(parent))
		return l, parent, err
	}
	l, _ := host.NewLauncher(log, false, "")
	overhead := cfg.KVM.OverheadCgroup
	if overhead == "" {
		overhead = kvm.DefaultOverheadCgroup
	}
	if svc := systemdServiceRoot(); svc != "" {
		// Pods beside a supervisor leaf in this cgroup would need
		// controllers enabled in it, and then systemd could not place
		// the next daemon of a restart there: the service would fail
		// with status 219/CGROUP and leave its pods without a daemon.
		if !filepath.IsAbs(parent) {
			parent = "/" + parent
			log.Info("the daemon runs in the root of its systemd service's cgroup (no DelegateSubgroup=supervisor, which needs systemd 254): pods go beneath the cgroup root, as the kubelet's cgroupfs driver puts them", "service", svc, "cgroup_parent", parent)
		}
		if !filepath.IsAbs(overhead) {
			overhead = "/" + overhead
		}
	}
	cfg.KVM.OverheadCgroup = overhead
	if !filepath.IsAbs(parent) || !filepath.IsAbs(overhead) {
		base, err := cgroups.EnterLeaf(cgroups.LeafName)
		if err != nil {
			return nil, "", fmt.Errorf("cgroup parent %q, kvm.overhead_cgroup %q: %w", parent, overhead, err)
		}
		if self, err := cgroups.Self(); err == nil && self.String() != base.String() {
			log.Info("moved the daemon into a leaf of its cgroup, so that its cgroup can delegate controllers to pods", "leaf", self.String(), "pods", base.Child(parent).String())
		}
	}
	cg, err := cgroups.Resolve(parent)
	if err != nil {
		return nil, "", fmt.Errorf("cgroup parent %q: %w", parent, err)
	}
	if err := cg.Create(); err != nil {
		return nil, "", fmt.Errorf("cgroup parent %q: %w", parent, err)
	}
	return l, parent, nil
}
