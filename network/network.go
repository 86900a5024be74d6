// Package network owns pod networking on the node: the persistent network
// namespace of each pod (bind-mounted under the run root), CNI ADD and DEL
// through libcni with the node's CNI configuration, the pod's IPs (also after
// a daemon restart, from libcni's result cache), hostPort mappings, the
// namespaced net.* sysctls of a pod, and the files that describe a pod's
// network to its apps (resolv.conf, hosts, hostname).
//
// It does not decide whether a pod gets its own network namespace (the broker
// does, from the pod's config and its stage1's capabilities) and it does not
// join processes to a namespace (each stage1 does that its own way).
package network

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"
	"unsafe"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/utils"
	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/errdefs"
)

// Defaults for Config fields left empty.
const (
	DefaultConfDir  = "/etc/cni/net.d"
	DefaultRunDir   = "/run/stagelet"
	DefaultCacheDir = "/var/lib/stagelet/cni"
)

// DefaultPluginDirs are searched for CNI plugin binaries when
// Config.PluginDirs is empty: Debian's location first, then the upstream one.
var DefaultPluginDirs = []string{"/usr/lib/cni", "/opt/cni/bin"}

// confExtensions are the file name extensions libcni reads configurations
// from.
var confExtensions = []string{".conf", ".conflist", ".json"}

// Config is the node's networking setup.
type Config struct {
	// ConfDir holds the CNI network configurations; the first valid one,
	// in file name order, is used. Default DefaultConfDir.
	ConfDir string
	// PluginDirs are searched for plugin binaries. Default
	// DefaultPluginDirs.
	PluginDirs []string
	// RunDir is the volatile run root; pod network namespaces are bind
	// mounted at RunDir/netns/<pod ID>. Default DefaultRunDir.
	RunDir string
	// CacheDir is libcni's result cache. It must outlive the daemon (it
	// lives under the state root), since DEL after a restart and the IPs
	// of recovered pods are read from it. Default DefaultCacheDir.
	CacheDir string
	// Inspect: a tool that only reads (stagelet doctor); New creates no
	// directory, and only Status, Describe and CachedResult are meant to
	// be called.
	Inspect bool
}

// Manager sets up and tears down pod networks. Its methods are safe for
// concurrent use; calls for the same pod must be serialised by the caller
// (the broker holds the pod's operation lock).
type Manager struct {
	cfg Config
	cni *libcni.CNIConfig
	log *slog.Logger

	mu sync.Mutex
	// watch is an inotify instance watching ConfDir (-1: none, while
	// the directory is missing or inotify refused); without it, stamp
	// fingerprints ConfDir as it was when net was loaded.
	watch int
	stamp string
	net   *netConf // the network in use; nil before the first load

	nsDirMu    sync.Mutex
	nsDirReady bool // RunDir/netns is a shared mount point
}

// netConf is the network chosen from ConfDir, or why there is none.
type netConf struct {
	list   *libcni.NetworkConfigList // nil when not ready
	file   string
	reason string
}

// New checks cfg, fills in defaults and creates the run and cache
// directories. A missing or empty ConfDir is not an error: Status reports
// not ready until a configuration appears.
func New(cfg Config, log *slog.Logger) (*Manager, error) {
	if log == nil {
		log = slog.Default()
	}
	if cfg.ConfDir == "" {
		cfg.ConfDir = DefaultConfDir
	}
	if len(cfg.PluginDirs) == 0 {
		cfg.PluginDirs = slices.Clone(DefaultPluginDirs)
	}
	if cfg.RunDir == "" {
		cfg.RunDir = DefaultRunDir
	}
	if cfg.CacheDir == "" {
		cfg.CacheDir = DefaultCacheDir
	}
	for name, p := range map[string]string{"conf dir": cfg.ConfDir, "run dir": cfg.RunDir, "cache dir": cfg.CacheDir} {
		if !filepath.IsAbs(p) {
			return nil, errdefs.InvalidArgument("network: %s %q must be an absolute path", name, p)
		}
	}
	for _, d := range cfg.PluginDirs {
		if !filepath.IsAbs(d) {
			return nil, errdefs.InvalidArgument("network: plugin dir %q must be an absolute path", d)
		}
	}
	if !cfg.Inspect {
		if err := os.MkdirAll(filepath.Join(cfg.RunDir, "netns"), 0o711); err != nil {
			return nil, fmt.Errorf("network: %w", err)
		}
		if err := os.MkdirAll(cfg.CacheDir, 0o700); err != nil {
			return nil, fmt.Errorf("network: %w", err)
		}
	}
	return &Manager{
		cfg:   cfg,
		cni:   libcni.NewCNIConfigWithCacheDir(cfg.PluginDirs, cfg.CacheDir, nil),
		log:   log.With("component", "network"),
		watch: -1,
	}, nil
}

// Close releases the watch on ConfDir. The Manager may still be used:
// it then fingerprints ConfDir on each call, or watches it anew.
func (m *Manager) Close() {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.stopWatchLocked()
}

// Config returns the configuration in use, defaults filled in.
func (m *Manager) Config() Config { return m.cfg }

// Status reports whether the node's pod network is ready (the CRI's
// NetworkReady condition) and, when it is not, why. ConfDir is re-read
// when it changed since the last call (changedLocked), and on every call
// while not ready.
func (m *Manager) Status() (ready bool, reason string) {
	n := m.current()
	if n.list == nil {
		return false, n.reason
	}
	return true, ""
}

// NetworkName is the name of the CNI network in use, "" when none is ready.
func (m *Manager) NetworkName() string {
	if n := m.current(); n.list != nil {
		return n.list.Name
	}
	return ""
}

// Describe names the network in use, its file and its plugins, "" when
// none is ready.
func (m *Manager) Describe() string {
	n := m.current()
	if n.list == nil {
		return ""
	}
	var types []string
	for _, p := range n.list.Plugins {
		types = append(types, p.Network.Type)
	}
	return fmt.Sprintf("network %s from %s, plugins %s", n.list.Name, n.file, strings.Join(types, ", "))
}

// current returns the network to use now, reloading ConfDir if it changed.
func (m *Manager) current() *netConf {
	m.mu.Lock()
	defer m.mu.Unlock()
	changed := m.changedLocked()
	if m.net != nil && !changed && m.net.list != nil {
		return m.net
	}
	n := load(m.cfg.ConfDir, m.cfg.PluginDirs)
	if m.net == nil || m.net.file != n.file || m.net.reason != n.reason {
		if n.list != nil {
			m.log.Info("CNI network selected", "network", n.list.Name, "file", n.file)
		} else {
			m.log.Warn("no usable CNI network", "reason", n.reason)
		}
	}
	m.net = n
	return n
}

// confEvents are the changes to ConfDir that can change the network:
// files written, created, removed, renamed or re-permissioned, and the
// directory itself going away.
const confEvents = unix.IN_CREATE | unix.IN_DELETE | unix.IN_MODIFY | unix.IN_CLOSE_WRITE | unix.IN_MOVED_FROM |
	unix.IN_MOVED_TO | unix.IN_ATTRIB | unix.IN_DELETE_SELF | unix.IN_MOVE_SELF | unix.IN_ONLYDIR

// changedLocked says whether ConfDir may have changed since the last
// call. It reads the events an inotify watch on the directory queued,
// without blocking: the kernel queues them as the change is made, so a
// call that follows a change sees it, and a call without change costs one
// read that finds nothing, not a listing of the directory and a stat of
// each file (the kubelet asks for the status every few seconds, and the
// status path answers from memory). A new watch counts as a change; while
// there is none (ConfDir missing, inotify refused), the directory's
// fingerprint is compared instead. Called with m.mu held.
func (m *Manager) changedLocked() bool {
	if m.watch < 0 {
		if m.startWatchLocked() {
			return true
		}
		stamp := m.confStamp()
		changed := stamp != m.stamp
		m.stamp = stamp
		return changed
	}
	var buf [4096]byte
	changed := false
	for {
		n, err := unix.Read(m.watch, buf[:])
		if err != nil || n <= 0 {
			// EAGAIN: nothing more queued.
			return changed
		}
		changed = true
		for off := 0; off+unix.SizeofInotifyEvent <= n; {
			ev := (*unix.InotifyEvent)(unsafe.Pointer(&buf[off]))
			if ev.Mask&(unix.IN_IGNORED|unix.IN_DELETE_SELF|unix.IN_MOVE_SELF|unix.IN_Q_OVERFLOW) != 0 {
				// The directory went (or events were lost): the
				// next call watches it anew, or fingerprints it.
				m.stopWatchLocked()
				return true
			}
			off += unix.SizeofInotifyEvent + int(ev.Len)
		}
	}
}

// startWatchLocked watches ConfDir; false when it cannot.
func (m *Manager) startWatchLocked() bool {
	fd, err := unix.InotifyInit1(unix.IN_NONBLOCK | unix.IN_CLOEXEC)
	if err != nil {
		return false
	}
	if _, err := unix.InotifyAddWatch(fd, m.cfg.ConfDir, confEvents); err != nil {
		unix.Close(fd)
		return false
	}
	m.watch = fd
	return true
}

func (m *Manager) stopWatchLocked() {
	if m.watch >= 0 {
		unix.Close(m.watch)
		m.watch = -1
	}
}

// confStamp fingerprints ConfDir: its configuration files' names, sizes
// and modification times.
func (m *Manager) confStamp() string {
	ents, err := os.ReadDir(m.cfg.ConfDir)
	if err != nil {
		return "error: " + err.Error()
	}
	var b strings.Builder
	for _, e := range ents {
		if !slices.Contains(confExtensions, filepath.Ext(e.Name())) {
			continue
		}
		fi, err := e.Info()
		if err != nil {
			continue
		}
		fmt.Fprintf(&b, "%s\x00%d\x00%d\x00", e.Name(), fi.Size(), fi.ModTime().UnixNano())
	}
	return b.String()
}

// load is loadNetwork; a variable for tests.
var load = loadNetwork

// loadNetwork picks the first valid network configuration in dir, in file
// name order, as libcni-based runtimes do. A configuration is valid when it
// parses, names a network, has plugins, and each plugin binary is found in
// pluginDirs.
func loadNetwork(dir string, pluginDirs []string) *netConf {
	files, err := libcni.ConfFiles(dir, confExtensions)
	if err != nil {
		return &netConf{reason: fmt.Sprintf("cannot read CNI config dir %s: %v", dir, err)}
	}
	slices.Sort(files)
	if len(files) == 0 {
		return &netConf{reason: fmt.Sprintf("no CNI network config in %s", dir)}
	}
	var skipped []string
	for _, f := range files {
		list, err := loadConfFile(f, pluginDirs)
		if err != nil {
			skipped = append(skipped, fmt.Sprintf("%s: %v", filepath.Base(f), err))
			continue
		}
		return &netConf{list: list, file: f}
	}
	return &netConf{reason: fmt.Sprintf("no valid CNI network config in %s: %s", dir, strings.Join(skipped, "; "))}
}

func loadConfFile(file string, pluginDirs []string) (*libcni.NetworkConfigList, error) {
	var list *libcni.NetworkConfigList
	if filepath.Ext(file) == ".conflist" {
		l, err := libcni.ConfListFromFile(file)
		if err != nil {
			return nil, err
		}
		list = l
	} else {
		c, err := libcni.ConfFromFile(file)
		if err != nil {
			return nil, err
		}
		if list, err = libcni.ConfListFromConf(c); err != nil {
			return nil, err
		}
	}
	if err := utils.ValidateNetworkName(list.Name); err != nil {
		return nil, fmt.Errorf("network name %q: %v", list.Name, err)
	}
	if len(list.Plugins) == 0 {
		return nil, errors.New("no plugins")
	}
	for _, p := range list.Plugins {
		if !pluginPresent(p.Network.Type, pluginDirs) {
			return nil, fmt.Errorf("plugin %q not found in %s", p.Network.Type, strings.Join(pluginDirs, ":"))
		}
	}
	return list, nil
}

func pluginPresent(name string, dirs []string) bool {
	if name == "" || strings.ContainsRune(name, '/') {
		return false
	}
	for _, d := range dirs {
		fi, err := os.Stat(filepath.Join(d, name))
		if err == nil && fi.Mode().IsRegular() && fi.Mode().Perm()&0o111 != 0 {
			return true
		}
	}
	return false
}

// ms is a duration in milliseconds for logs.
func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
