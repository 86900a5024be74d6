// Package harness runs the real stagelet daemon for end-to-end tests and
// benchmarks: it builds the binary, starts `stagelet serve` on temporary
// directories with its own configuration, talks CRI to it over its unix
// socket, kills and restarts it, and tears down everything it and its pods
// took (pods through CRI first, then leftover processes, mounts and cgroups
// found beneath the daemon's unique directories).
//
// It does not import package testing, so that commands (stagelet-bench) use
// it as well as tests; failures are returned as errors.
package harness

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// Build compiles cmd/stagelet as a static binary (CGO off) into dir and
// returns its path. The module root is found from this source file's place
// in the tree.
func Build(ctx context.Context, dir string) (string, error) {
	root, err := ModuleRoot()
	if err != nil {
		return "", err
	}
	out := filepath.Join(dir, "stagelet")
	// The build tags of the Makefile's build.
	cmd := exec.CommandContext(ctx, "go", "build", "-tags", "nri_no_wasm", "-o", out, "./cmd/stagelet")
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build ./cmd/stagelet: %v\n%s", err, b)
	}
	return out, nil
}

// ModuleRoot is the directory holding stagelet's go.mod.
func ModuleRoot() (string, error) {
	_, file, _, ok := runtime.Caller(0)
	if ok {
		root := filepath.Clean(filepath.Join(filepath.Dir(file), "..", "..", ".."))
		if _, err := os.Stat(filepath.Join(root, "go.mod")); err == nil {
			return root, nil
		}
	}
	out, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		return "", fmt.Errorf("find module root: %w", err)
	}
	gomod := strings.TrimSpace(string(out))
	if gomod == "" || gomod == os.DevNull {
		return "", errors.New("find module root: not inside the stagelet module")
	}
	return filepath.Dir(gomod), nil
}

// Options configure a Daemon.
type Options struct {
	// Bin is the stagelet binary (see Build). Required.
	Bin string
	// InsecureRegistries are registry hosts ("127.0.0.1:PORT") reached over
	// plain HTTP.
	InsecureRegistries []string
	// DefaultStage1 is the default stage1 of the policy the harness writes
	// when Policy is empty; "fly" when empty. Every stage1 is also a
	// handler of that name.
	DefaultStage1 string
	// Policy, when set, is the node policy as YAML (the body of the
	// config's policy: section, unindented).
	Policy string
	// GuestAssets is the kvm stage1's guest kernel and initramfs directory
	// (make guest); empty means $STAGELET_GUEST_ASSETS. Without assets the
	// daemon offers no kvm stage1.
	GuestAssets string
	// KVMNoTemplate: kvm pods' VMs boot their kernel instead of being
	// restored from a template (kvm.template: false).
	KVMNoTemplate bool
	// KVMPlacement is kvm.placement (auto, pod, overhead); empty: the
	// default.
	KVMPlacement string
	// KVMNoImageDisks: kvm pods' containers read their image over 9p
	// instead of from a disk of it (kvm.image_disks: false).
	KVMNoImageDisks bool
	// MetricsAddress enables the metrics endpoint (metrics.address, such
	// as "127.0.0.1:0"); empty: off. MetricsURL says where it listens.
	MetricsAddress string
	// LiveAddress is checkpoint.live_address: where the daemon offers
	// pods moving live (such as "127.0.0.1"); empty: not set.
	LiveAddress string
	// TracingEndpoint is tracing.endpoint (an OTLP/gRPC host:port) and
	// TracingRate tracing.sampling_rate_per_million; empty: no tracing.
	TracingEndpoint string
	TracingRate     int
	// SignaturePolicy and SignaturePolicyDir are images.signature_policy
	// and images.signature_policy_dir; empty: not set.
	SignaturePolicy, SignaturePolicyDir string
	// StateTmpfs, when set (a tmpfs size such as "32m"), puts StateDir on
	// a tmpfs of that size of its own, for tests of a full file system;
	// Teardown unmounts it once the daemon stopped.
	StateTmpfs string
	// LogLevel is the daemon's --log-level; "debug" when empty.
	LogLevel string
	// NoNRI turns NRI off (nri.disable); NRIRequestTimeout is
	// nri.request_timeout ("": the default). The daemon's NRI socket
	// and plugin directories are its own (Daemon.NRISocket, NRIPluginDir,
	// NRIConfDir), never the node's.
	NoNRI             bool
	NRIRequestTimeout string
	// NRIPlugins are plugins the daemon starts from its plugin
	// directory: "NN-name" → the plugin's binary.
	NRIPlugins map[string]string
	// Logger receives the harness's own messages; discarded when nil.
	Logger *slog.Logger
}

// Daemon is one `stagelet serve` with its own directories under Root:
// state/, run/ (holding the socket), logs/ (for pod log directories and
// test files), the config file and the daemon's stderr in daemon.log.
//
// A Daemon is used by one goroutine at a time.
type Daemon struct {
	Root         string
	StateDir     string
	RunDir       string
	LogsDir      string
	Socket       string
	ConfigPath   string
	LogPath      string
	CgroupParent string
	// OverheadCgroup is where kvm pods' qemu runs when not in the pod's
	// cgroup (kvm.overhead_cgroup), beside CgroupParent.
	OverheadCgroup string
	// CNIConfDir holds this daemon's own CNI configuration: a bridge named
	// Bridge on Subnet, with host-local addresses kept under Root, so that
	// tests never touch the host's networks.
	CNIConfDir string
	Bridge     string
	Subnet     string
	// CDIDir is the daemon's only CDI spec directory.
	CDIDir string
	// NRISocket is where NRI plugins connect to the daemon; NRIPluginDir
	// holds the plugins it starts, NRIConfDir their configuration.
	NRISocket, NRIPluginDir, NRIConfDir string

	opts Options
	log  *slog.Logger

	mu      sync.Mutex
	cmd     *exec.Cmd
	exited  chan struct{}
	waitErr error
	conn    *grpc.ClientConn
	rt      runtimeapi.RuntimeServiceClient
	img     runtimeapi.ImageServiceClient
	// cgroupDirs are the directories of the daemon's own cgroups in every
	// hierarchy, read from /proc/PID/cgroup when it started.
	cgroupDirs map[string]bool
	starts     int
	// savedLog is the daemon's log, read by Teardown before it removes Root.
	savedLog []byte
	// stateTmpfs: StateDir is a tmpfs New mounted (Options.StateTmpfs).
	stateTmpfs bool
}

// LiveAddress is where the daemon offers pods moving live
// (Options.LiveAddress); "": nowhere.
func (d *Daemon) LiveAddress() string { return d.opts.LiveAddress }

// New creates the daemon's directories (a short path under the system
// temporary directory, so that unix socket paths beneath it stay within the
// kernel's limit) and writes its configuration. It does not start it.
func New(opts Options) (*Daemon, error) {
	if opts.Bin == "" {
		return nil, errors.New("harness: Options.Bin is required")
	}
	if opts.DefaultStage1 == "" {
		opts.DefaultStage1 = "fly"
	}
	if opts.LogLevel == "" {
		opts.LogLevel = "debug"
	}
	lg := opts.Logger
	if lg == nil {
		lg = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	root, err := os.MkdirTemp("", "se2e-")
	if err != nil {
		return nil, err
	}
	var suffix [4]byte
	if _, err := rand.Read(suffix[:]); err != nil {
		return nil, err
	}
	d := &Daemon{
		Root:         root,
		StateDir:     filepath.Join(root, "state"),
		RunDir:       filepath.Join(root, "run"),
		LogsDir:      filepath.Join(root, "logs"),
		Socket:       filepath.Join(root, "run", "cri.sock"),
		ConfigPath:   filepath.Join(root, "config.yaml"),
		LogPath:      filepath.Join(root, "daemon.log"),
		CgroupParent: "stagelet-e2e-" + hex.EncodeToString(suffix[:]),
		// The daemons of a test share its cgroup: each has an overhead
		// cgroup of its own, torn down with it.
		OverheadCgroup: "stagelet-e2e-" + hex.EncodeToString(suffix[:]) + "-vmm",
		CNIConfDir:     filepath.Join(root, "cni"),
		CDIDir:         filepath.Join(root, "cdi"),
		NRISocket:      filepath.Join(root, "run", "nri.sock"),
		NRIPluginDir:   filepath.Join(root, "nri", "plugins"),
		NRIConfDir:     filepath.Join(root, "nri", "conf.d"),
		Bridge:         "se2e" + hex.EncodeToString(suffix[:]),
		Subnet:         fmt.Sprintf("10.213.%d.0/24", suffix[0]),
		opts:           opts,
		log:            lg.With("daemon", filepath.Base(root)),
		cgroupDirs:     map[string]bool{},
	}
	for _, dir := range []string{d.StateDir, d.RunDir, d.LogsDir} {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			os.RemoveAll(root)
			return nil, err
		}
	}
	if opts.StateTmpfs != "" {
		if err := unix.Mount("tmpfs", d.StateDir, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "size="+opts.StateTmpfs+",mode=0755"); err != nil {
			os.RemoveAll(root)
			return nil, fmt.Errorf("harness: tmpfs at %s: %w", d.StateDir, err)
		}
		d.stateTmpfs = true
	}
	if err := os.MkdirAll(d.CDIDir, 0o755); err != nil {
		d.unmountState()
		os.RemoveAll(root)
		return nil, err
	}
	if err := d.writeNetworkAndPlugins(); err != nil {
		os.RemoveAll(root)
		return nil, err
	}
	if err := os.WriteFile(d.ConfigPath, []byte(d.configYAML()), 0o644); err != nil {
		os.RemoveAll(root)
		return nil, err
	}
	return d, nil
}

// writeNetworkAndPlugins writes the daemon's CNI configuration and
// links its NRI plugins.
func (d *Daemon) writeNetworkAndPlugins() error {
	if err := os.MkdirAll(d.CNIConfDir, 0o755); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(d.CNIConfDir, "10-e2e.conflist"), []byte(d.cniConflist()), 0o644); err != nil {
		return err
	}
	return d.linkNRIPlugins()
}

// linkNRIPlugins puts Options.NRIPlugins in the daemon's NRI plugin
// directory.
func (d *Daemon) linkNRIPlugins() error {
	if len(d.opts.NRIPlugins) == 0 {
		return nil
	}
	if err := os.MkdirAll(d.NRIPluginDir, 0o755); err != nil {
		return err
	}
	for name, bin := range d.opts.NRIPlugins {
		if err := os.Symlink(bin, filepath.Join(d.NRIPluginDir, name)); err != nil {
			return err
		}
	}
	return nil
}

func (d *Daemon) configYAML() string {
	var b strings.Builder
	b.WriteString("version: 1\n")
	fmt.Fprintf(&b, "cgroup_parent: %q\n", d.CgroupParent)
	pol := d.opts.Policy
	if pol == "" {
		pol = fmt.Sprintf("version: 1\ndefault_stage1: %s\nhandlers:\n  fly: {stage1: fly}\n", d.opts.DefaultStage1)
	}
	fmt.Fprintf(&b, "cni:\n  conf_dir: %q\n", d.CNIConfDir)
	fmt.Fprintf(&b, "cdi:\n  spec_dirs: [%q]\n", d.CDIDir)
	guest := d.opts.GuestAssets
	if guest == "" {
		guest = os.Getenv("STAGELET_GUEST_ASSETS")
	}
	if guest == "" {
		guest = filepath.Join(d.Root, "no-guest-assets")
	}
	fmt.Fprintf(&b, "kvm:\n  assets_dir: %q\n  overhead_cgroup: %q\n", guest, d.OverheadCgroup)
	if d.opts.KVMPlacement != "" {
		fmt.Fprintf(&b, "  placement: %s\n", d.opts.KVMPlacement)
	}
	if d.opts.KVMNoTemplate {
		b.WriteString("  template: false\n")
	}
	if d.opts.KVMNoImageDisks {
		b.WriteString("  image_disks: false\n")
	}
	if d.opts.LiveAddress != "" {
		fmt.Fprintf(&b, "checkpoint:\n  live_address: %q\n", d.opts.LiveAddress)
	}
	if d.opts.MetricsAddress != "" {
		fmt.Fprintf(&b, "metrics:\n  address: %q\n", d.opts.MetricsAddress)
	}
	if d.opts.TracingEndpoint != "" {
		fmt.Fprintf(&b, "tracing:\n  endpoint: %q\n  sampling_rate_per_million: %d\n", d.opts.TracingEndpoint, d.opts.TracingRate)
	}
	if d.opts.NoNRI {
		b.WriteString("nri:\n  disable: true\n")
	} else {
		fmt.Fprintf(&b, "nri:\n  socket_path: %q\n  plugin_path: %q\n  plugin_config_path: %q\n", d.NRISocket, d.NRIPluginDir, d.NRIConfDir)
		if d.opts.NRIRequestTimeout != "" {
			fmt.Fprintf(&b, "  request_timeout: %q\n", d.opts.NRIRequestTimeout)
		}
	}
	if d.opts.SignaturePolicy != "" || d.opts.SignaturePolicyDir != "" {
		fmt.Fprintf(&b, "images:\n  signature_policy: %q\n  signature_policy_dir: %q\n", d.opts.SignaturePolicy, d.opts.SignaturePolicyDir)
	}
	b.WriteString("policy:\n")
	for _, line := range strings.Split(strings.TrimRight(pol, "\n"), "\n") {
		b.WriteString("  " + line + "\n")
	}
	if len(d.opts.InsecureRegistries) > 0 {
		b.WriteString("registries:\n")
		for _, h := range d.opts.InsecureRegistries {
			fmt.Fprintf(&b, "  %q:\n    insecure: true\n", h)
		}
	}
	return b.String()
}

// WritePolicy rewrites the daemon's config file with pol as the body of
// its policy: section (unindented YAML, as Options.Policy), keeping every
// other setting. A running daemon sees the change when it reloads (SIGHUP
// or its file watch). The file is replaced by a rename, so the daemon
// never reads half of it.
func (d *Daemon) WritePolicy(pol string) error {
	d.mu.Lock()
	d.opts.Policy = pol
	body := d.configYAML()
	d.mu.Unlock()
	tmp := d.ConfigPath + ".new"
	if err := os.WriteFile(tmp, []byte(body), 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, d.ConfigPath)
}

// cniConflist is the daemon's network: bridge + host-local + portmap.
func (d *Daemon) cniConflist() string {
	return fmt.Sprintf(`{
  "cniVersion": "1.0.0",
  "name": "stagelet-e2e",
  "plugins": [
    {"type": "bridge", "bridge": %q, "isGateway": true, "ipMasq": false, "hairpinMode": true,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": %q}]], "routes": [{"dst": "0.0.0.0/0"}],
              "dataDir": %q}},
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
`, d.Bridge, d.Subnet, filepath.Join(d.Root, "ipam"))
}

// Start launches the daemon and waits until it answers Version.
func (d *Daemon) Start(ctx context.Context) error {
	if err := d.Launch(); err != nil {
		return err
	}
	_, err := d.WaitReady(ctx, func(ctx context.Context) error {
		_, err := d.Runtime().Version(ctx, &runtimeapi.VersionRequest{})
		return err
	})
	return err
}

// Launch starts the daemon process and a fresh client connection, without
// waiting for it to serve. The daemon's stderr and stdout are appended to
// LogPath.
func (d *Daemon) Launch() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.cmd != nil {
		select {
		case <-d.exited:
		default:
			return errors.New("harness: daemon is already running")
		}
	}
	logf, err := os.OpenFile(d.LogPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	d.starts++
	fmt.Fprintf(logf, "===== harness: start #%d at %s =====\n", d.starts, time.Now().Format(time.RFC3339Nano))
	cmd := exec.Command(d.opts.Bin, "serve",
		"--socket", d.Socket,
		"--state-dir", d.StateDir,
		"--run-dir", d.RunDir,
		"--config", d.ConfigPath,
		"--log-level", d.opts.LogLevel,
	)
	cmd.Stdout = logf
	cmd.Stderr = logf
	// Its own process group, so that a terminal's ^C reaches the harness
	// (which tears down) rather than the daemon directly.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return fmt.Errorf("start %s serve: %w", d.opts.Bin, err)
	}
	exited := make(chan struct{})
	d.cmd = cmd
	d.exited = exited
	d.waitErr = nil
	go func() {
		err := cmd.Wait()
		logf.Close()
		d.mu.Lock()
		d.waitErr = err
		d.mu.Unlock()
		close(exited)
	}()
	d.recordCgroups(cmd.Process.Pid)
	d.log.Debug("daemon launched", "pid", cmd.Process.Pid)

	if d.conn != nil {
		d.conn.Close()
	}
	conn, err := grpc.NewClient("unix://"+d.Socket,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: 50 * time.Millisecond, Multiplier: 1.5, MaxDelay: 250 * time.Millisecond},
			MinConnectTimeout: time.Second,
		}),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(16<<20)),
	)
	if err != nil {
		return fmt.Errorf("grpc client for %s: %w", d.Socket, err)
	}
	d.conn = conn
	d.rt = runtimeapi.NewRuntimeServiceClient(conn)
	d.img = runtimeapi.NewImageServiceClient(conn)
	return nil
}

// WaitReady polls probe until it succeeds, the daemon exits or ctx ends. It
// returns every error probe returned before its first success, in order, so
// that a caller can check what the daemon answered while it was starting.
func (d *Daemon) WaitReady(ctx context.Context, probe func(context.Context) error) ([]error, error) {
	var seen []error
	for {
		if !d.Running() {
			return seen, fmt.Errorf("daemon exited while starting (%s); log tail:\n%s", d.ExitStatus(), d.LogTail(40))
		}
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		err := probe(cctx)
		cancel()
		if err == nil {
			return seen, nil
		}
		seen = append(seen, err)
		select {
		case <-ctx.Done():
			return seen, fmt.Errorf("daemon not ready: %w (last answer: %v); log tail:\n%s", ctx.Err(), err, d.LogTail(40))
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// Runtime is the CRI runtime service client of the current connection.
func (d *Daemon) Runtime() runtimeapi.RuntimeServiceClient {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.rt
}

// Image is the CRI image service client of the current connection.
func (d *Daemon) Image() runtimeapi.ImageServiceClient {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.img
}

// PID is the process ID of the daemon last launched (0 if never).
func (d *Daemon) PID() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.cmd == nil || d.cmd.Process == nil {
		return 0
	}
	return d.cmd.Process.Pid
}

// Running reports whether the daemon process last launched still runs.
func (d *Daemon) Running() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.cmd == nil {
		return false
	}
	select {
	case <-d.exited:
		return false
	default:
		return true
	}
}

// ExitStatus describes how the daemon process ended ("running" if not).
func (d *Daemon) ExitStatus() string {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.cmd == nil {
		return "never started"
	}
	select {
	case <-d.exited:
	default:
		return "running"
	}
	if d.waitErr != nil {
		return d.waitErr.Error()
	}
	return "exit status 0"
}

// Kill9 sends SIGKILL to the daemon and waits for it to be gone. Its pods
// are left running, as after a crash.
func (d *Daemon) Kill9(ctx context.Context) error {
	return d.signalAndWait(ctx, syscall.SIGKILL, 0)
}

// Stop sends SIGTERM and waits up to grace for the daemon to exit, then
// sends SIGKILL. It is a no-op when the daemon does not run.
func (d *Daemon) Stop(ctx context.Context, grace time.Duration) error {
	return d.signalAndWait(ctx, syscall.SIGTERM, grace)
}

func (d *Daemon) signalAndWait(ctx context.Context, sig syscall.Signal, grace time.Duration) error {
	d.mu.Lock()
	cmd, exited := d.cmd, d.exited
	d.mu.Unlock()
	if cmd == nil {
		return nil
	}
	select {
	case <-exited:
		return nil
	default:
	}
	pid := cmd.Process.Pid
	d.log.Debug("signalling daemon", "pid", pid, "signal", sig)
	if err := syscall.Kill(pid, sig); err != nil && !errors.Is(err, syscall.ESRCH) {
		return fmt.Errorf("kill -%d %d: %w", sig, pid, err)
	}
	if sig != syscall.SIGKILL {
		select {
		case <-exited:
			return nil
		case <-time.After(grace):
			d.log.Warn("daemon did not exit after signal; killing", "pid", pid, "signal", sig, "grace", grace)
			syscall.Kill(pid, syscall.SIGKILL)
		case <-ctx.Done():
			syscall.Kill(pid, syscall.SIGKILL)
		}
	}
	select {
	case <-exited:
		return nil
	case <-time.After(30 * time.Second):
		return fmt.Errorf("daemon %d did not exit after SIGKILL", pid)
	}
}

// Restart launches the daemon again (it must have exited) and waits until
// it answers Version.
func (d *Daemon) Restart(ctx context.Context) error {
	if d.Running() {
		return errors.New("harness: Restart of a running daemon; Stop or Kill9 it first")
	}
	return d.Start(ctx)
}

// RSS is the daemon's resident set size in bytes, from VmRSS in
// /proc/PID/status.
func (d *Daemon) RSS() (uint64, error) {
	pid := d.PID()
	if pid == 0 {
		return 0, errors.New("daemon not started")
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			f := strings.Fields(rest)
			if len(f) != 2 || f[1] != "kB" {
				return 0, fmt.Errorf("unexpected VmRSS line %q", line)
			}
			kb, err := strconv.ParseUint(f[0], 10, 64)
			if err != nil {
				return 0, err
			}
			return kb * 1024, nil
		}
	}
	return 0, errors.New("no VmRSS in /proc/PID/status")
}

// LogTail returns the last n lines of the daemon's log.
func (d *Daemon) LogTail(n int) string {
	b, err := os.ReadFile(d.LogPath)
	if err != nil && d.savedLog != nil {
		b, err = d.savedLog, nil
	}
	if err != nil {
		return fmt.Sprintf("(no daemon log: %v)", err)
	}
	lines := bytes.Split(bytes.TrimRight(b, "\n"), []byte("\n"))
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return string(bytes.Join(lines, []byte("\n")))
}

// IsCode reports whether err is a gRPC status error with code c.
func IsCode(err error, c codes.Code) bool {
	s, ok := status.FromError(err)
	return ok && s.Code() == c
}

// metricsLine is the daemon's log line saying where it serves metrics.
var metricsLine = regexp.MustCompile(`msg="serving metrics" address=(\S+)`)

// MetricsURL is the URL of the metrics endpoint the running daemon
// serves (Options.MetricsAddress), from its log: the daemon logs it
// before it serves CRI, so once Start returned it is there.
func (d *Daemon) MetricsURL() (string, error) {
	data, err := os.ReadFile(d.LogPath)
	if err != nil {
		return "", err
	}
	m := metricsLine.FindAllSubmatch(data, -1)
	if len(m) == 0 {
		return "", errors.New("harness: the daemon logged no metrics address (is Options.MetricsAddress set?)")
	}
	return string(m[len(m)-1][1]), nil
}
