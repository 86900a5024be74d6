package nri

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/containerd/nri/pkg/adaptation"
	"github.com/containerd/nri/pkg/adaptation/builtin"
	nriapi "github.com/containerd/nri/pkg/api"
	nrilog "github.com/containerd/nri/pkg/log"
)

// Defaults, as the NRI documentation gives them and containerd 2.x uses.
const (
	DefaultSocketPath          = adaptation.DefaultSocketPath
	DefaultPluginPath          = adaptation.DefaultPluginPath
	DefaultPluginConfigPath    = adaptation.DefaultPluginConfigPath
	DefaultRegistrationTimeout = adaptation.DefaultPluginRegistrationTimeout
	DefaultRequestTimeout      = adaptation.DefaultPluginRequestTimeout
)

// Config is how the daemon hosts NRI plugins.
type Config struct {
	// SocketPath is where plugins that start on their own (a
	// DaemonSet's) connect; "" is DefaultSocketPath.
	SocketPath string
	// PluginPath holds plugins the daemon starts ("NN-name"
	// executables); PluginConfigPath their configuration drop-ins.
	PluginPath, PluginConfigPath string
	// RegistrationTimeout and RequestTimeout bound a plugin's
	// registration and each of its answers: a plugin that takes longer
	// is disconnected and the call goes on without it.
	RegistrationTimeout, RequestTimeout time.Duration
	// DisableConnections accepts only the plugins the daemon starts.
	DisableConnections bool
}

// Runtime is what the host needs of the daemon: its pods and containers
// for a plugin's synchronization, and the updates plugins ask for on
// their own.
type Runtime interface {
	// NRIState is every pod and container the daemon has.
	NRIState(ctx context.Context) ([]*nriapi.PodSandbox, []*nriapi.Container)
	// NRIUpdate applies updates to running containers and returns those
	// it could not apply.
	NRIUpdate(ctx context.Context, updates []*nriapi.ContainerUpdate) ([]*nriapi.ContainerUpdate, error)
	// NRIEvict stops the containers plugins evict.
	NRIEvict(ctx context.Context, evictions []*nriapi.ContainerEviction) error
	// NRIValidate refuses an adjustment the pod's stage1 cannot honour
	// (CheckStage1), naming the plugin that asked for it.
	NRIValidate(ctx context.Context, req *nriapi.ValidateContainerAdjustmentRequest) error
}

// Host hosts NRI plugins for the daemon through containerd's adaptation
// library: it starts the plugins of its plugin directory, accepts those
// that connect to its socket, synchronizes each with the daemon's pods
// and containers, and relays the daemon's pod and container events to
// them. Its methods are safe for concurrent use; the library serializes
// the events.
type Host struct {
	cfg Config
	log *slog.Logger
	a   *adaptation.Adaptation

	mu      sync.Mutex
	rt      Runtime
	plugins map[string]*Plugin // connected, by "NN-name"
	count   int
}

// Plugin is one connected plugin, as doctor and verbose Status show it.
type Plugin struct {
	Name      string    `json:"name"`
	Connected time.Time `json:"connected"`
	// Calls counts the events it was sent; LastError is the last one
	// it failed.
	Calls     int    `json:"calls"`
	LastError string `json:"lastError,omitempty"`
}

// validatorName is the builtin plugin that refuses, per stage1, what a
// pod cannot be given.
const validatorName = "stagelet-stage1"

// New makes a host of cfg, not started. name and version are the runtime's
// as plugins see them.
func New(cfg Config, name, version string, log *slog.Logger) (*Host, error) {
	h := &Host{cfg: cfg, log: log, plugins: map[string]*Plugin{}}
	if cfg.RegistrationTimeout > 0 {
		adaptation.SetPluginRegistrationTimeout(cfg.RegistrationTimeout)
	}
	if cfg.RequestTimeout > 0 {
		adaptation.SetPluginRequestTimeout(cfg.RequestTimeout)
	}
	nrilog.Set(&logger{h: h})
	opts := []adaptation.Option{
		adaptation.WithMetrics(&metrics{h: h}),
		adaptation.WithBuiltinPlugins(&builtin.BuiltinPlugin{
			Base:  validatorName,
			Index: "00",
			Handlers: builtin.BuiltinHandlers{
				ValidateContainerAdjustment: h.validate,
			},
		}),
	}
	if cfg.SocketPath != "" {
		opts = append(opts, adaptation.WithSocketPath(cfg.SocketPath))
	}
	if cfg.PluginPath != "" {
		opts = append(opts, adaptation.WithPluginPath(cfg.PluginPath))
	}
	if cfg.PluginConfigPath != "" {
		opts = append(opts, adaptation.WithPluginConfigPath(cfg.PluginConfigPath))
	}
	if cfg.DisableConnections {
		opts = append(opts, adaptation.WithDisabledExternalConnections())
	}
	a, err := adaptation.New(name, version, h.sync, h.update, opts...)
	if err != nil {
		return nil, fmt.Errorf("NRI: %w", err)
	}
	h.a = a
	return h, nil
}

// Start starts the plugins of the plugin directory and opens the socket,
// with rt (the daemon, once it recovered its pods) to synchronize them
// with. A plugin that fails to start is logged and left out.
func (h *Host) Start(rt Runtime) error {
	h.mu.Lock()
	h.rt = rt
	h.mu.Unlock()
	if err := h.a.Start(); err != nil {
		return fmt.Errorf("NRI: %w", err)
	}
	return nil
}

// Stop stops the plugins the host started and closes the socket.
func (h *Host) Stop() { h.a.Stop() }

// Plugins are the connected plugins, by name (the builtin validator left
// out), and how many the library counts.
func (h *Host) Plugins() ([]Plugin, int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	out := make([]Plugin, 0, len(h.plugins))
	for _, p := range h.plugins {
		out = append(out, *p)
	}
	slices.SortFunc(out, func(a, b Plugin) int { return cmpString(a.Name, b.Name) })
	return out, max(h.count-1, 0)
}

// Socket is where plugins connect ("" when connections are off).
func (h *Host) Socket() string {
	if h.cfg.DisableConnections {
		return ""
	}
	if h.cfg.SocketPath == "" {
		return DefaultSocketPath
	}
	return h.cfg.SocketPath
}

func cmpString(a, b string) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

func (h *Host) runtime() Runtime {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.rt
}

// sync hands a connecting plugin the daemon's pods and containers; the
// updates it answers are applied as its own requests would be.
func (h *Host) sync(ctx context.Context, cb adaptation.SyncCB) error {
	rt := h.runtime()
	if rt == nil {
		return errors.New("the daemon has not recovered its pods yet")
	}
	pods, ctrs := rt.NRIState(ctx)
	updates, err := cb(ctx, pods, ctrs)
	if err != nil {
		return err
	}
	if len(updates) == 0 {
		return nil
	}
	failed, err := rt.NRIUpdate(ctx, updates)
	if err != nil || len(failed) > 0 {
		return fmt.Errorf("updates a plugin asked for at synchronization: %d failed: %w", len(failed), err)
	}
	return nil
}

// update applies the updates a plugin asks for on its own.
func (h *Host) update(ctx context.Context, updates []*nriapi.ContainerUpdate) ([]*nriapi.ContainerUpdate, error) {
	rt := h.runtime()
	if rt == nil {
		return updates, errors.New("the daemon has not recovered its pods yet")
	}
	return rt.NRIUpdate(ctx, updates)
}

func (h *Host) validate(ctx context.Context, req *nriapi.ValidateContainerAdjustmentRequest) error {
	rt := h.runtime()
	if rt == nil {
		return errors.New("the daemon has not recovered its pods yet")
	}
	return rt.NRIValidate(ctx, req)
}

// metrics learns from the library which plugins connected (a
// synchronization is the first call of each) and what each was asked.
type metrics struct{ h *Host }

func (m *metrics) RecordPluginInvocation(name, op string, err error) {
	if name == "00-"+validatorName {
		return
	}
	m.h.mu.Lock()
	defer m.h.mu.Unlock()
	p := m.h.plugins[name]
	if p == nil {
		if op != "Synchronize" || err != nil {
			return
		}
		p = &Plugin{Name: name, Connected: time.Now()}
		m.h.plugins[name] = p
		return
	}
	p.Calls++
	if err != nil {
		p.LastError = err.Error()
	}
}

func (m *metrics) RecordPluginLatency(string, string, time.Duration) {}

func (m *metrics) RecordPluginAdjustments(string, string, *adaptation.ContainerAdjustment, int, int) {
}

func (m *metrics) UpdatePluginCount(n int) {
	m.h.mu.Lock()
	m.h.count = n
	m.h.mu.Unlock()
}

// Formats of the library's messages that say a plugin went away, with
// its name as the first argument.
var goneFormats = []string{
	"connection to plugin %q closed",
	"closing plugin %s, failed to handle %s request: %v",
}

// logger routes the library's log to the daemon's, and forgets a plugin
// when the library says it went away (the library has no other way to
// say so).
type logger struct{ h *Host }

func (l *logger) gone(format string, args []any) {
	if !slices.Contains(goneFormats, format) || len(args) == 0 {
		return
	}
	name, ok := args[0].(string)
	if !ok {
		return
	}
	l.h.mu.Lock()
	delete(l.h.plugins, name)
	l.h.mu.Unlock()
}

func (l *logger) Debugf(ctx context.Context, format string, args ...any) {
	if l.h.log.Enabled(ctx, slog.LevelDebug) {
		l.h.log.DebugContext(ctx, "NRI: "+fmt.Sprintf(format, args...))
	}
}

func (l *logger) Infof(ctx context.Context, format string, args ...any) {
	l.gone(format, args)
	if l.h.log.Enabled(ctx, slog.LevelDebug) {
		l.h.log.DebugContext(ctx, "NRI: "+fmt.Sprintf(format, args...))
	}
}

func (l *logger) Warnf(ctx context.Context, format string, args ...any) {
	l.h.log.WarnContext(ctx, "NRI: "+fmt.Sprintf(format, args...))
}

func (l *logger) Errorf(ctx context.Context, format string, args ...any) {
	l.gone(format, args)
	l.h.log.ErrorContext(ctx, "NRI: "+fmt.Sprintf(format, args...))
}
