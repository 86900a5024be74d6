// Package config loads and validates the node operator's YAML configuration
// and holds the embedded default. Loading is strict: unknown keys and wrong
// types are errors naming the file and line.
package config

import (
	"bytes"
	_ "embed"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"net/url"
	"os"
	"path"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"gopkg.in/yaml.v3"
	"k8s.io/apimachinery/pkg/api/resource"

	"github.com/stagelet/stagelet/cgroups"
	"github.com/stagelet/stagelet/livemove"
	"github.com/stagelet/stagelet/policy"
	"github.com/stagelet/stagelet/stage1"
)

// CurrentVersion is the config format version this build reads.
const CurrentVersion = 1

//go:embed default.yaml
var defaultYAML []byte

// DefaultYAML returns the embedded default configuration text.
func DefaultYAML() []byte { return bytes.Clone(defaultYAML) }

// Registry configures one registry host.
type Registry struct {
	// Mirrors are tried in order; when any is listed the host itself is
	// not contacted. "http://" marks a mirror as plain HTTP.
	Mirrors []string `yaml:"mirrors"`
	// Insecure allows plain HTTP to this host.
	Insecure bool `yaml:"insecure"`
}

// KVM configures the kvm stage1.
type KVM struct {
	// AssetsDir holds the guest kernel and initramfs (`make guest`);
	// empty means "guest" beside the stagelet binary, else
	// /usr/lib/stagelet/guest (the Debian package's). Without them the
	// kvm stage1 is not offered.
	AssetsDir string `yaml:"assets_dir"`
	// Accelerator: "kvm", "tcg", or empty to probe with a real boot.
	Accelerator string `yaml:"accelerator"`
	// Machine is qemu's machine type: "microvm" (the default: no PCI
	// bus, the fastest to start) or "q35" (PCI: what VFIO passthrough
	// needs).
	Machine string `yaml:"machine"`
	// Template: pods' VMs are restored from a VM booted once and saved
	// (kept in <run_dir>/kvm-templates) instead of booting their kernel.
	// Absent means true.
	Template *bool `yaml:"template"`
	// BootTimeout is how long a pod's start waits for its VM's agent to
	// answer, booted or restored, as a Go duration ("2m"); empty: 60s.
	// A node without KVM, whose VMs run under TCG, may need more.
	BootTimeout string `yaml:"boot_timeout"`
	// Placement is where a pod's qemu runs, and whose memory its VM is
	// charged to: "auto" (the default: the pod's cgroup when the limit
	// the kubelet gives it holds the VM and qemu, else the overhead
	// cgroup), "pod" (always the pod's cgroup: a pod it cannot hold is
	// refused) or "overhead" (always the overhead cgroup).
	Placement string `yaml:"placement"`
	// OverheadCgroup is the overhead cgroup: with cgroup_driver cgroupfs
	// a cgroup path, absolute or relative to the daemon's own cgroup
	// (empty: "stagelet-vmm"); with systemd a slice (empty:
	// "stagelet-vmm.slice").
	OverheadCgroup string `yaml:"overhead_cgroup"`
	// OverheadMemoryMax caps the overhead cgroup, all VMs in it together,
	// as a Kubernetes quantity ("8Gi"); empty: no cap but each VM's own.
	OverheadMemoryMax string `yaml:"overhead_memory_max"`
	// ImageDisks: containers read their image from a read-only erofs
	// disk of it plugged into the VM (made by mkfs.erofs, package
	// erofs-utils) instead of over 9p; nil means true.
	ImageDisks *bool `yaml:"image_disks"`
}

// ImageDisksOn reports whether kvm pods' containers read their image
// from a disk (ImageDisks).
func (k KVM) ImageDisksOn() bool { return k.ImageDisks == nil || *k.ImageDisks }

// OverheadMemoryMaxBytes is OverheadMemoryMax in bytes, 0 when empty
// (Validate has checked it).
func (k KVM) OverheadMemoryMaxBytes() int64 {
	if k.OverheadMemoryMax == "" {
		return 0
	}
	q, err := resource.ParseQuantity(k.OverheadMemoryMax)
	if err != nil {
		return 0
	}
	return q.Value()
}

// Templates reports whether kvm pods' VMs are restored from templates.
func (k KVM) Templates() bool { return k.Template == nil || *k.Template }

// BootTimeoutDuration is BootTimeout parsed; 0 when empty (the kvm
// stage1's default). Validate refuses one that does not parse.
func (k KVM) BootTimeoutDuration() time.Duration {
	d, _ := time.ParseDuration(k.BootTimeout)
	return d
}

// CNI configures pod networking.
type CNI struct {
	// ConfDir holds CNI configurations; the first valid one (by name) is
	// used.
	ConfDir string `yaml:"conf_dir"`
	// PluginDirs are searched for plugin binaries, in order.
	PluginDirs []string `yaml:"plugin_dirs"`
}

// Streaming configures the server that exec, attach and port-forward
// sessions connect to (the URLs Exec, Attach and PortForward return; the
// kubelet proxies them). It has no authentication beyond the one-time
// tokens in its URLs: keep it on loopback unless something in front of
// it restricts who reaches it.
type Streaming struct {
	// Address is the IP address to listen on.
	Address string `yaml:"address"`
	// Port is the TCP port; 0 means any free port.
	Port int `yaml:"port"`
}

// Metrics configures the Prometheus metrics endpoint (/metrics). It is
// off unless an address is set, as containerd's and CRI-O's are: an open
// port on every node is the operator's choice. The endpoint has no
// authentication: loopback (127.0.0.1:PORT) is the safe choice, reached
// by a node-local agent; any other address lets whoever reaches it read
// the figures.
type Metrics struct {
	// Address is the host:port to listen on; "" (the default): no
	// endpoint. Port 0 takes any free port (logged).
	Address string `yaml:"address"`
}

// CDI configures the Container Device Interface: the specs of devices
// that CDI_devices and cdi.k8s.io/* annotations name.
type CDI struct {
	// SpecDirs are read in order; a later directory's spec of a device
	// wins.
	SpecDirs []string `yaml:"spec_dirs"`
}

// Checkpoint configures checkpoints and restores of containers.
type Checkpoint struct {
	// CRIU is the criu binary; "" (the default): the first of
	// /usr/local/sbin/criu and criu on PATH whose `criu check` passes on
	// this kernel.
	CRIU string `yaml:"criu"`
	// LiveAddress is the IP (or IP:port; no port: any) of this node
	// where a pod moving live (annotation stagelet.io/checkpoint: live)
	// is offered to the other node's daemon: a port opened for one
	// authenticated connection (package livemove). "" (the default):
	// pods do not move live from this node.
	LiveAddress string `yaml:"live_address"`
}

// validate checks the checkpoint section.
func (c *Checkpoint) validate() []error {
	var errs []error
	if c.CRIU != "" && !path.IsAbs(c.CRIU) {
		errs = append(errs, fmt.Errorf("checkpoint.criu: %q is not absolute", c.CRIU))
	}
	if a := c.LiveAddress; a != "" {
		if err := livemove.CheckAddress(a); err != nil {
			errs = append(errs, fmt.Errorf("checkpoint.live_address: %w", err))
		}
	}
	return errs
}

// NRI is how the daemon hosts NRI (Node Resource Interface) plugins, as
// containerd 2.x does: on by default, on the paths the NRI documentation
// gives.
type NRI struct {
	// Disable turns NRI off: no socket, no plugin started.
	Disable bool `yaml:"disable"`
	// SocketPath is where plugins that start on their own connect
	// ("": /var/run/nri/nri.sock).
	SocketPath string `yaml:"socket_path"`
	// PluginPath holds the plugins the daemon starts, as "NN-name"
	// executables ("": /opt/nri/plugins); PluginConfigPath their
	// configuration ("": /etc/nri/conf.d).
	PluginPath       string `yaml:"plugin_path"`
	PluginConfigPath string `yaml:"plugin_config_path"`
	// RegistrationTimeout and RequestTimeout bound a plugin's
	// registration and each answer ("": 5s and 2s): one that takes
	// longer is disconnected, and the call goes on without it.
	RegistrationTimeout string `yaml:"registration_timeout"`
	RequestTimeout      string `yaml:"request_timeout"`
	// DisableConnections accepts only the plugins the daemon starts.
	DisableConnections bool `yaml:"disable_connections"`
}

// Timeouts are RegistrationTimeout and RequestTimeout parsed (0 when
// empty: the library's defaults).
func (n NRI) Timeouts() (registration, request time.Duration) {
	registration, _ = time.ParseDuration(n.RegistrationTimeout)
	request, _ = time.ParseDuration(n.RequestTimeout)
	return registration, request
}

func (n NRI) validate() []error {
	var errs []error
	for _, d := range []struct{ name, v string }{{"nri.registration_timeout", n.RegistrationTimeout}, {"nri.request_timeout", n.RequestTimeout}} {
		if d.v == "" {
			continue
		}
		if t, err := time.ParseDuration(d.v); err != nil || t <= 0 {
			errs = append(errs, fmt.Errorf("%s: %q: want a positive duration such as 2s", d.name, d.v))
		}
	}
	return errs
}

// Images says which images may run.
type Images struct {
	// SignaturePolicy is a containers-policy.json(5) file: which images
	// need which signatures. Empty (the default): every image is accepted
	// unverified, as with {"default": [{"type": "insecureAcceptAnything"}]}.
	SignaturePolicy string `yaml:"signature_policy"`
	// SignaturePolicyDir holds one policy per Kubernetes namespace,
	// "<namespace>.json", used instead of SignaturePolicy for that
	// namespace's pods. Empty: beside SignaturePolicy, its name without
	// ".json" and with ".d" ("/etc/stagelet/signature-policy.d").
	SignaturePolicyDir string `yaml:"signature_policy_dir"`
}

// PolicyDir is the directory of per-namespace signature policies, ""
// for none.
func (i Images) PolicyDir() string {
	if i.SignaturePolicyDir != "" || i.SignaturePolicy == "" {
		return i.SignaturePolicyDir
	}
	return strings.TrimSuffix(i.SignaturePolicy, ".json") + ".d"
}

// Tracing configures OpenTelemetry traces, sent over OTLP/gRPC to a
// collector. It is off unless an endpoint is set.
type Tracing struct {
	// Endpoint is the collector's OTLP/gRPC host:port, plaintext (as the
	// kubelet's tracing); "" (the default): no traces.
	Endpoint string `yaml:"endpoint"`
	// SamplingRatePerMillion is how many in a million CRI calls without a
	// sampled caller are traced (0, the default: only those whose caller
	// sampled its trace).
	SamplingRatePerMillion int `yaml:"sampling_rate_per_million"`
	// ServiceName names the daemon in its spans ("stagelet").
	ServiceName string `yaml:"service_name"`
}

// Config is the node configuration.
type Config struct {
	Version int `yaml:"version"`
	// Socket, StateDir and RunDir default to the serve flags' defaults;
	// flags given on the command line win.
	Socket   string `yaml:"socket"`
	StateDir string `yaml:"state_dir"`
	RunDir   string `yaml:"run_dir"`
	// CgroupDriver is how pods' cgroups are managed, as the kubelet's
	// --cgroup-driver (they must agree): "cgroupfs" (the default: stagelet
	// writes the cgroup file system itself) or "systemd" (every pod
	// process runs as a transient unit in a slice; needs systemd as PID 1).
	CgroupDriver string `yaml:"cgroup_driver"`
	// CgroupParent is where pods go when the kubelet names no parent. For
	// cgroupfs: an absolute cgroup path, or a path relative to the
	// daemon's own cgroup; for systemd: a slice. Empty means "stagelet"
	// (cgroupfs) or "stagelet.slice" (systemd).
	CgroupParent string              `yaml:"cgroup_parent"`
	Registries   map[string]Registry `yaml:"registries"`
	// KVM configures the kvm stage1.
	KVM KVM `yaml:"kvm"`
	// CNI locates the pod network configuration and plugins.
	CNI CNI `yaml:"cni"`
	// Streaming is where exec, attach and port-forward sessions connect.
	Streaming Streaming `yaml:"streaming"`
	// CDI locates the CDI device specs.
	CDI CDI `yaml:"cdi"`
	// Metrics is the Prometheus endpoint; off by default.
	Metrics Metrics `yaml:"metrics"`
	// Tracing exports OpenTelemetry traces; off by default.
	Tracing Tracing `yaml:"tracing"`
	// Checkpoint says which criu takes checkpoints.
	Checkpoint Checkpoint `yaml:"checkpoint"`
	// Images says which images may run (signature verification).
	Images Images `yaml:"images"`
	// NRI hosts NRI plugins; on by default.
	NRI NRI `yaml:"nri"`
	// Policy decides each pod's stage1. Absent: the embedded default
	// policy. PolicyFile names a policy file instead (relative to this
	// file's directory); the two are exclusive.
	Policy     *policy.Policy `yaml:"policy"`
	PolicyFile string         `yaml:"policy_file"`

	// Source names where the config came from ("embedded default" or a path).
	Source string `yaml:"-"`
}

// Cgroup drivers.
const (
	CgroupDriverCgroupfs = "cgroupfs"
	CgroupDriverSystemd  = "systemd"
)

// PodCgroupParent is the cgroup parent of pods the kubelet gives none:
// cgroup_parent, or the driver's default.
func (c *Config) PodCgroupParent() string {
	switch {
	case c.CgroupParent != "":
		return c.CgroupParent
	case c.CgroupDriver == CgroupDriverSystemd:
		return cgroups.DefaultSlice
	}
	return "stagelet"
}

// Default returns the embedded default configuration.
func Default() *Config {
	c, err := Parse("embedded default", defaultYAML)
	if err != nil {
		panic("config: embedded default is invalid: " + err.Error())
	}
	return c
}

// Load reads and validates the file at path.
func Load(path string) (*Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	return Parse(path, data)
}

// Parse decodes and validates data; name is used in error messages.
// Keys absent from data keep the embedded defaults' values.
func Parse(name string, data []byte) (*Config, error) {
	c := &Config{}
	if name != "embedded default" {
		c = Default()
	}
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	if err := dec.Decode(c); err != nil && !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("%s: %s", name, strings.TrimPrefix(err.Error(), "yaml: "))
	}
	c.Source = name
	if err := c.Validate(); err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	return c, nil
}

// Validate checks what can be checked without touching the host.
func (c *Config) Validate() error {
	var errs []error
	if c.Version != CurrentVersion {
		errs = append(errs, fmt.Errorf("version: %d is not supported (want %d)", c.Version, CurrentVersion))
	}
	switch c.KVM.Accelerator {
	case "", "kvm", "tcg":
	default:
		errs = append(errs, fmt.Errorf("kvm.accelerator: %q: want kvm, tcg or empty (probe)", c.KVM.Accelerator))
	}
	if c.KVM.BootTimeout != "" {
		if d, err := time.ParseDuration(c.KVM.BootTimeout); err != nil || d <= 0 {
			errs = append(errs, fmt.Errorf("kvm.boot_timeout: %q: want a positive duration such as 2m", c.KVM.BootTimeout))
		}
	}
	switch c.KVM.Machine {
	case "", "microvm", "q35":
	default:
		errs = append(errs, fmt.Errorf("kvm.machine: %q: want microvm or q35", c.KVM.Machine))
	}
	errs = append(errs, c.validateKVMPlacement()...)
	errs = append(errs, c.NRI.validate()...)
	if c.Policy != nil && c.PolicyFile != "" {
		errs = append(errs, fmt.Errorf("policy and policy_file: give one of them, not both"))
	}
	switch c.CgroupDriver {
	case CgroupDriverCgroupfs:
		if c.CgroupParent != "" && (path.Clean(c.CgroupParent) != strings.TrimSuffix(c.CgroupParent, "/") || strings.Contains(c.CgroupParent, "..")) {
			errs = append(errs, fmt.Errorf("cgroup_parent: %q must be a clean path, without a \"..\" element", c.CgroupParent))
		}
	case CgroupDriverSystemd:
		if c.CgroupParent != "" && cgroups.SliceOf(c.CgroupParent) == "" {
			errs = append(errs, fmt.Errorf("cgroup_parent: %q: with cgroup_driver systemd it must be a slice such as stagelet.slice", c.CgroupParent))
		}
	default:
		errs = append(errs, fmt.Errorf("cgroup_driver: %q: want cgroupfs or systemd", c.CgroupDriver))
	}
	if _, err := netip.ParseAddr(c.Streaming.Address); err != nil {
		errs = append(errs, fmt.Errorf("streaming.address: %q: want an IP address", c.Streaming.Address))
	}
	if c.Streaming.Port < 0 || c.Streaming.Port > 65535 {
		errs = append(errs, fmt.Errorf("streaming.port: %d: want 0 (any free port) to 65535", c.Streaming.Port))
	}
	if err := checkHostPort(c.Metrics.Address); c.Metrics.Address != "" && err != nil {
		errs = append(errs, fmt.Errorf("metrics.address: %q: %v", c.Metrics.Address, err))
	}
	if err := checkHostPort(c.Tracing.Endpoint); c.Tracing.Endpoint != "" && err != nil {
		errs = append(errs, fmt.Errorf("tracing.endpoint: %q: %v", c.Tracing.Endpoint, err))
	}
	if r := c.Tracing.SamplingRatePerMillion; r < 0 || r > 1_000_000 {
		errs = append(errs, fmt.Errorf("tracing.sampling_rate_per_million: %d: want 0 to 1000000", r))
	}
	errs = append(errs, c.Checkpoint.validate()...)
	for _, kv := range [][2]string{{"images.signature_policy", c.Images.SignaturePolicy}, {"images.signature_policy_dir", c.Images.SignaturePolicyDir}} {
		if kv[1] != "" && !path.IsAbs(kv[1]) {
			errs = append(errs, fmt.Errorf("%s: %q is not absolute", kv[0], kv[1]))
		}
	}
	for _, d := range c.CDI.SpecDirs {
		if !path.IsAbs(d) {
			errs = append(errs, fmt.Errorf("cdi.spec_dirs: %q is not absolute", d))
		}
	}
	for host, r := range c.Registries {
		if host == "" || strings.ContainsAny(host, "/ ") {
			errs = append(errs, fmt.Errorf("registries: %q is not a registry host", host))
		}
		for _, m := range r.Mirrors {
			if err := checkMirror(m); err != nil {
				errs = append(errs, fmt.Errorf("registries: %s: mirror %q: %v", host, m, err))
			}
		}
	}
	return errors.Join(errs...)
}

// minOverheadMemoryMax is the least overhead_memory_max: one VM of the
// smallest size and its qemu.
const minOverheadMemoryMax = 256 << 20

// validateKVMPlacement checks the kvm stage1's placement keys.
func (c *Config) validateKVMPlacement() []error {
	var errs []error
	switch c.KVM.Placement {
	case "", "auto", "pod", "overhead":
	default:
		errs = append(errs, fmt.Errorf("kvm.placement: %q: want auto, pod or overhead", c.KVM.Placement))
	}
	if oc := c.KVM.OverheadCgroup; oc != "" {
		switch c.CgroupDriver {
		case CgroupDriverSystemd:
			if !cgroups.ValidSlice(oc) {
				errs = append(errs, fmt.Errorf("kvm.overhead_cgroup: %q: with cgroup_driver systemd it must be a slice such as stagelet-vmm.slice", oc))
			}
		default:
			if path.Clean(oc) != strings.TrimSuffix(oc, "/") || strings.Contains(oc, "..") || cgroups.SliceOf(oc) != "" {
				errs = append(errs, fmt.Errorf("kvm.overhead_cgroup: %q: with cgroup_driver cgroupfs it must be a clean cgroup path without \"..\", not a slice", oc))
			}
		}
	}
	if m := c.KVM.OverheadMemoryMax; m != "" {
		q, err := resource.ParseQuantity(m)
		switch {
		case err != nil:
			errs = append(errs, fmt.Errorf("kvm.overhead_memory_max: %q: want a size such as 8Gi: %v", m, err))
		case q.Value() < minOverheadMemoryMax:
			errs = append(errs, fmt.Errorf("kvm.overhead_memory_max: %q: want at least 256Mi (one VM and its qemu), or empty for no cap", m))
		}
	}
	return errs
}

// StreamingAddr is the host:port the streaming server listens on.
func (c *Config) StreamingAddr() string {
	return net.JoinHostPort(c.Streaming.Address, strconv.Itoa(c.Streaming.Port))
}

// LoadPolicy returns the policy the configuration names: policy_file (read
// now), the inline policy section, or the embedded default. Problems that
// only name stage1s this node lacks are not errors here: the same policy
// may serve nodes with and without them, and pods routed to a missing
// stage1 are refused when they come.
func (c *Config) LoadPolicy() (*policy.Policy, error) {
	var p *policy.Policy
	switch {
	case c.PolicyFile != "":
		f := c.PolicyFile
		if !filepath.IsAbs(f) && c.Source != "" && c.Source != "embedded default" {
			f = filepath.Join(filepath.Dir(c.Source), f)
		}
		data, err := os.ReadFile(f)
		if err != nil {
			return nil, fmt.Errorf("policy_file: %w", err)
		}
		if p, err = policy.Parse(f, data); err != nil {
			return nil, err
		}
		p.Source = f
	case c.Policy != nil:
		cp := *c.Policy
		p = &cp
		p.Source = c.Source
	default:
		p = policy.Default()
		p.Source = "embedded default policy"
	}
	return p, nil
}

// CheckPolicy validates p against the node's stage1s and returns the
// problems that only name stage1s the node lacks and, separately, those
// that are errors.
func CheckPolicy(p *policy.Policy, known map[string]stage1.Capabilities) (missing []string, errs error) {
	err := p.Validate(known)
	if err == nil {
		return nil, nil
	}
	var ps policy.Problems
	if !errors.As(err, &ps) {
		return nil, err
	}
	var real policy.Problems
	for _, pr := range ps {
		if errors.Is(pr, policy.ErrUnknownStage1) {
			missing = append(missing, pr.Error())
		} else {
			real = append(real, pr)
		}
	}
	if len(real) > 0 {
		return missing, real
	}
	return missing, nil
}

// checkHostPort checks a listen address: host:port, the host an IP
// address or a name (empty: every address), the port 0 to 65535.
func checkHostPort(a string) error {
	h, p, err := net.SplitHostPort(a)
	if err != nil {
		return fmt.Errorf("want host:port (127.0.0.1:9090, [::1]:9090, :9090)")
	}
	if n, err := strconv.Atoi(p); err != nil || n < 0 || n > 65535 {
		return fmt.Errorf("port %q: want 0 (any free port) to 65535", p)
	}
	if h != "" && strings.ContainsAny(h, " /%") {
		return fmt.Errorf("host %q: want an IP address or a host name", h)
	}
	return nil
}

func checkMirror(m string) error {
	if !strings.Contains(m, "://") {
		m = "https://" + m
	}
	u, err := url.Parse(m)
	if err != nil {
		return err
	}
	if u.Scheme != "http" && u.Scheme != "https" {
		return fmt.Errorf("scheme %q: want http or https", u.Scheme)
	}
	if u.Host == "" {
		return fmt.Errorf("no host")
	}
	return nil
}
