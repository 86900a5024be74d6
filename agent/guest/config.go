// Package guest is what the kvm stage1's host side and the VM's init
// (package guestinit) agree on: the configuration the host passes on the
// kernel command line as stagelet.KEY=VALUE parameters, and the guest's
// paths and console markers.
package guest

import (
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/netip"
	"net/url"
	"slices"
	"strconv"
	"strings"
)

// Paths of the guest, shared with the host side that builds the VM.
const (
	// Mounts is where the pod's shared directory is mounted.
	Mounts = "/mnt/stagelet"
	// Modules lists the kernel modules to load, one file name per
	// line, in order; the files are beside it.
	Modules = "/lib/modules/stagelet.load"
	// Ready is printed on the console once the agent serves its
	// port (and, in a probe boot, just before powering off).
	Ready = "STAGELET-GUEST-READY"
	// DefaultPort is the name of the agent's virtio-serial port.
	DefaultPort = "stagelet.0"
)

// File systems of the pod's shared directory (Config.FSType).
const (
	// FSVirtio9P is 9P over virtio (qemu's virtio-9p): qemu serves it
	// itself, and the guest's memory need not be shared with another
	// process, so a VM restored from a template may map the template's
	// memory privately.
	FSVirtio9P = "9p"
	// FSVirtiofs is virtio-fs, served by a virtiofsd (vhost-user); it
	// needs the guest's memory shared with virtiofsd.
	FSVirtiofs = "virtiofs"
)

// Route is a route the guest adds on its interface: Dst via Gw (no
// Gw: on link).
type Route struct {
	Dst netip.Prefix
	Gw  netip.Addr
}

// Config is what the host tells the guest on the kernel command line,
// as stagelet.KEY=VALUE parameters.
type Config struct {
	// Port is the virtio-serial port name (stagelet.port).
	Port string
	// Probe: boot, print Ready, power off (stagelet.probe=1).
	Probe bool
	// Template: boot without a pod's identity (no hostname, network or
	// shared directory), print Ready and serve; the host saves the
	// VM then, and each pod's VM restored from it gets its identity from
	// an OpSetup call (stagelet.template=1).
	Template bool
	// Hostname of the guest (stagelet.hostname).
	Hostname string
	// FSTag is the tag of the pod's shared directory, mounted at
	// Mounts (stagelet.fs); FSType its file system: FSVirtio9P or
	// FSVirtiofs, the default (stagelet.fstype).
	FSTag  string
	FSType string
	// MAC selects the interface to configure (stagelet.mac); it is named
	// eth0. IPs (stagelet.ip, repeated) are its addresses with prefix
	// length, Routes (stagelet.route=DST,GW, repeated) its routes, MTU
	// (stagelet.mtu) its MTU.
	MAC    net.HardwareAddr
	IPs    []netip.Prefix
	Routes []Route
	MTU    int
	// LogLevel of the agent (stagelet.loglevel).
	LogLevel slog.Level
	// UserNS: the pod's containers run in a user namespace of their own
	// whose IDs 0..UserNSSize-1 are the guest's UserNSHost..
	// (stagelet.userns=HOST:SIZE; hostUsers: false). The pod's agent then
	// runs inside it, as in an nspawn pod.
	UserNSHost, UserNSSize uint32
	// Sysctls are the pod's network sysctls, set in the guest's network
	// namespace, the pod's (stagelet.sysctl=NAME=VALUE, repeated, VALUE
	// query-escaped: values such as a port range hold spaces).
	Sysctls map[string]string
	// ShareOnDemand: the shared directory (FSTag) is not mounted at boot
	// but when the host first asks for it (api.OpMountShare): a guest
	// without it mounted can be migrated (stagelet.fsdemand=1).
	ShareOnDemand bool
}

// Cmdline renders c as kernel command line parameters.
func (c *Config) Cmdline() []string {
	var out []string
	add := func(k, v string) { out = append(out, "stagelet."+k+"="+v) }
	if c.Port != "" {
		add("port", c.Port)
	}
	if c.Probe {
		add("probe", "1")
	}
	if c.Hostname != "" {
		add("hostname", c.Hostname)
	}
	if c.Template {
		add("template", "1")
	}
	if c.FSTag != "" {
		add("fs", c.FSTag)
	}
	if c.FSType != "" {
		add("fstype", c.FSType)
	}
	if c.MAC != nil {
		add("mac", c.MAC.String())
	}
	for _, ip := range c.IPs {
		add("ip", ip.String())
	}
	for _, r := range c.Routes {
		gw := ""
		if r.Gw.IsValid() {
			gw = r.Gw.String()
		}
		add("route", r.Dst.String()+","+gw)
	}
	if c.MTU > 0 {
		add("mtu", strconv.Itoa(c.MTU))
	}
	if c.LogLevel != slog.LevelInfo {
		add("loglevel", strings.ToLower(c.LogLevel.String()))
	}
	if c.UserNSSize > 0 {
		add("userns", fmt.Sprintf("%d:%d", c.UserNSHost, c.UserNSSize))
	}
	for _, k := range slices.Sorted(maps.Keys(c.Sysctls)) {
		add("sysctl", k+"="+url.QueryEscape(c.Sysctls[k]))
	}
	if c.ShareOnDemand {
		add("fsdemand", "1")
	}
	return out
}

// ParseCmdline reads the stagelet.* parameters of a kernel command
// line; other words are ignored.
func ParseCmdline(cmdline string) (*Config, error) {
	c := &Config{Port: DefaultPort}
	for _, w := range strings.Fields(cmdline) {
		if w == "--" {
			break
		}
		k, v, ok := strings.Cut(w, "=")
		key, isOurs := strings.CutPrefix(k, "stagelet.")
		if !ok || !isOurs {
			continue
		}
		var err error
		switch key {
		case "port":
			c.Port = v
		case "probe":
			c.Probe = v == "1"
		case "hostname":
			c.Hostname = v
		case "template":
			c.Template = v == "1"
		case "fs":
			c.FSTag = v
		case "fstype":
			if v != FSVirtio9P && v != FSVirtiofs {
				err = fmt.Errorf("want %s or %s", FSVirtio9P, FSVirtiofs)
			}
			c.FSType = v
		case "mac":
			c.MAC, err = net.ParseMAC(v)
		case "ip":
			var p netip.Prefix
			if p, err = netip.ParsePrefix(v); err == nil {
				c.IPs = append(c.IPs, p)
			}
		case "route":
			dst, gw, _ := strings.Cut(v, ",")
			r := Route{}
			if r.Dst, err = netip.ParsePrefix(dst); err == nil && gw != "" {
				r.Gw, err = netip.ParseAddr(gw)
			}
			if err == nil {
				c.Routes = append(c.Routes, r)
			}
		case "mtu":
			c.MTU, err = strconv.Atoi(v)
		case "loglevel":
			err = c.LogLevel.UnmarshalText([]byte(v))
		case "userns":
			c.UserNSHost, c.UserNSSize, err = parseUserNS(v)
		case "sysctl":
			err = c.addSysctl(v)
		case "fsdemand":
			c.ShareOnDemand = v == "1"
		}
		if err != nil {
			return nil, fmt.Errorf("kernel parameter %s: %v", w, err)
		}
	}
	return c, nil
}

// addSysctl adds NAME=VALUE (VALUE query-escaped) to c.Sysctls: a
// network sysctl (net.* or net/*; the guest checks the rest of the name).
func (c *Config) addSysctl(v string) error {
	name, val, ok := strings.Cut(v, "=")
	if !ok || !(strings.HasPrefix(name, "net.") || strings.HasPrefix(name, "net/")) {
		return fmt.Errorf("want net.NAME=VALUE")
	}
	val, err := url.QueryUnescape(val)
	if err != nil {
		return err
	}
	if c.Sysctls == nil {
		c.Sysctls = map[string]string{}
	}
	c.Sysctls[name] = val
	return nil
}

// parseUserNS reads HOST:SIZE, a user namespace mapping of SIZE IDs from
// HOST, both within 32 bits, HOST above 0 and SIZE at least 1.
func parseUserNS(v string) (host, size uint32, err error) {
	h, sz, ok := strings.Cut(v, ":")
	if !ok {
		return 0, 0, fmt.Errorf("want HOST:SIZE")
	}
	hv, err := strconv.ParseUint(h, 10, 32)
	if err != nil {
		return 0, 0, err
	}
	sv, err := strconv.ParseUint(sz, 10, 32)
	if err != nil {
		return 0, 0, err
	}
	if hv == 0 || sv == 0 || hv+sv > 1<<32-1 {
		return 0, 0, fmt.Errorf("want a mapping of at least one ID from a host ID above 0, within 32 bits")
	}
	return uint32(hv), uint32(sv), nil
}
