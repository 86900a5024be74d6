// Package guestinit is the guest side of the kvm stage1: `stagelet agent
// guest` is /init of the VM's initramfs (the kernel passes the words after
// "--" on its command line to init). As PID 1 it prepares a bare system,
// then runs the pod's supervisor on the VM's virtio-serial port and powers
// the VM off when told to shut down.
//
// It is configured by kernel command line parameters (guest.Config,
// guest.ParseCmdline); the host side builds them (stage1/kvm).
package guestinit

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
	"unsafe"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/agent/guest"
	"github.com/stagelet/stagelet/agent/supervisor"
	"github.com/stagelet/stagelet/agent/transport"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/network"
)

// stateDir holds the apps' records (a tmpfs: they live as long as the VM).
const stateDir = "/run/stagelet/state"

// Main is `stagelet agent guest`: the VM's init. It returns only when
// it is not PID 1; otherwise it powers the VM off when done or on a fatal
// error.
func Main(args []string) int {
	if os.Getpid() != 1 {
		fmt.Fprintln(os.Stderr, "stagelet agent guest: only runs as PID 1 of a VM (the kvm stage1's init)")
		return 2
	}
	err := guestInit()
	if err != nil {
		fmt.Fprintf(os.Stderr, "stagelet agent guest: %v\n", err)
	}
	powerOff()
	return 1 // not reached
}

// powerOff syncs and powers the VM off; as PID 1 it never returns.
func powerOff() {
	unix.Sync()
	for {
		unix.Reboot(unix.LINUX_REBOOT_CMD_POWER_OFF)
		time.Sleep(time.Second) // the kernel is powering off
	}
}

func guestInit() error {
	start := time.Now()
	if err := leaveRootfs(); err != nil {
		return fmt.Errorf("leave the initramfs root: %w", err)
	}
	if err := baseMounts(); err != nil {
		return err
	}
	consoleStdio()
	cmdline, err := os.ReadFile("/proc/cmdline")
	if err != nil {
		return err
	}
	cfg, err := guest.ParseCmdline(string(cmdline))
	if err != nil {
		return err
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: cfg.LogLevel})).With("component", "agent")
	if err := loadModules(guest.Modules, log); err != nil {
		return err
	}
	port, err := openPort(cfg.Port, 10*time.Second)
	if err != nil {
		return err
	}
	if cfg.Probe {
		fmt.Fprintln(os.Stderr, guest.Ready)
		return nil
	}
	// Streams go to this supervisor, or to the pod's agent in its user
	// namespace once there is one (nest.go).
	l := &routingListener{Listener: transport.NewSerialListener(port, log), log: log}
	var a *supervisor.Agent
	stop := func() { a.Close() }
	var setup func(*api.Request) error
	if cfg.Template {
		setup = func(req *api.Request) error {
			pod, err := setupRestored(req, log)
			if err != nil {
				return err
			}
			return l.nest(pod, stop)
		}
	} else if err := personalize(cfg, log); err != nil {
		return err
	}
	if err := guestCgroups(); err != nil {
		log.Warn("cgroups: app limits and stats are off", "err", err)
	}

	a, err = supervisor.New(supervisor.Config{StateDir: stateDir, Logger: log, Setup: setup, MountShare: podShare.mount,
		Network: func(req *api.Request) error { return retakeNetwork(req, log) }})
	if err != nil {
		return err
	}
	if !cfg.Template {
		if err := l.nest(cfg, stop); err != nil {
			return err
		}
	}
	// The host waits for this line (on the console) only in probes; it
	// tells a reader of the console log where boot ended.
	fmt.Fprintf(os.Stderr, "%s %s\n", guest.Ready, time.Since(start).Round(time.Millisecond))
	if err := a.Serve(l); err != nil {
		l.Close()
		return fmt.Errorf("serve: %w", err)
	}
	l.Close()
	log.Info("agent shut down: powering off")
	return nil
}

// personalize gives the guest its pod's identity: hostname, network and
// the shared directory.
func personalize(cfg *guest.Config, log *slog.Logger) error {
	if cfg.Hostname != "" {
		if err := unix.Sethostname([]byte(cfg.Hostname)); err != nil {
			log.Warn("set hostname", "err", err)
		}
	}
	if err := configureNetwork(cfg); err != nil {
		return fmt.Errorf("network: %w", err)
	}
	// The guest's network stack is the pod's: its sysctls are set here
	// (the host sets them in the tap's namespace too, which the pod's
	// traffic only crosses).
	if err := network.SetSysctls(cfg.Sysctls); err != nil {
		return fmt.Errorf("config.linux.sysctls: %w", err)
	}
	if cfg.FSTag == "" {
		return nil
	}
	if cfg.ShareOnDemand {
		// Mounted at the host's first OpMountShare (share.go).
		podShare.set(cfg.FSTag, cfg.FSType)
		return nil
	}
	return mountShare(cfg.FSTag, cfg.FSType)
}

// mountShare mounts the pod's shared directory, tag of file system fsType,
// at guest.Mounts.
func mountShare(tag, fsType string) error {
	if err := os.MkdirAll(guest.Mounts, 0o755); err != nil {
		return err
	}
	fstype, data := "virtiofs", ""
	if fsType == guest.FSVirtio9P {
		// cache=mmap: no page cache beyond what mmap needs, so the host's
		// changes (a volume's files, a bind made later) show at once;
		// access=client: the guest kernel checks permissions, as on any
		// local file system.
		fstype, data = "9p", "trans=virtio,version=9p2000.L,msize=262144,cache=mmap,access=client"
	}
	if err := unix.Mount(tag, guest.Mounts, fstype, 0, data); err != nil {
		return fmt.Errorf("mount %s %s: %w", fstype, tag, err)
	}
	return nil
}

// Entropy ioctls of /dev/urandom (linux/random.h).
const (
	rndAddEntropy   = 0x40085203 // _IOW('R', 0x03, int[2])
	rndReseedCRNG   = 0x5207     // _IO('R', 0x07)
	maxSeedBytes    = 512
	seedBitsPerByte = 8
)

// setupRestored is OpSetup of a guest restored from a template: every VM
// restored from one template starts with its clock and its random number
// generator's state, so the clock is set from the host's and the host's
// seed is mixed in (credited, then the generator reseeded) before the
// pod's identity is applied. It returns the pod's configuration.
func setupRestored(req *api.Request, log *slog.Logger) (*guest.Config, error) {
	cfg, err := guest.ParseCmdline(req.Guest)
	if err != nil {
		return nil, errdefs.InvalidArgument("setup: %w", err)
	}
	if req.Time > 0 {
		ts := unix.NsecToTimespec(req.Time)
		if err := unix.ClockSettime(unix.CLOCK_REALTIME, &ts); err != nil {
			return nil, fmt.Errorf("setup: set the clock: %w", err)
		}
	}
	if len(req.Seed) > 0 {
		if err := seedRandom(req.Seed); err != nil {
			return nil, fmt.Errorf("setup: seed the random number generator: %w", err)
		}
	}
	if cfg.MAC != nil {
		if err := adoptMAC(cfg.MAC); err != nil {
			return nil, fmt.Errorf("setup: network: %w", err)
		}
	}
	return cfg, personalize(cfg, log)
}

// seedRandom mixes seed into the kernel's entropy pool, credited as
// entropy, and reseeds the generator from it.
func seedRandom(seed []byte) error {
	if len(seed) > maxSeedBytes {
		seed = seed[:maxSeedBytes]
	}
	f, err := os.OpenFile("/dev/urandom", os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	// struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
	info := make([]byte, 8+len(seed))
	binary.NativeEndian.PutUint32(info[0:], uint32(len(seed)*seedBitsPerByte))
	binary.NativeEndian.PutUint32(info[4:], uint32(len(seed)))
	copy(info[8:], seed)
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, f.Fd(), rndAddEntropy, uintptr(unsafe.Pointer(&info[0]))); e != 0 {
		return e
	}
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, f.Fd(), rndReseedCRNG, 0); e != 0 {
		return e
	}
	return nil
}

// adoptMAC gives the guest's network interface the address mac, unless one
// has it already: a VM restored from a template has the template's.
func adoptMAC(mac net.HardwareAddr) error {
	links, err := netlink.LinkList()
	if err != nil {
		return err
	}
	var nic netlink.Link
	for _, l := range links {
		a := l.Attrs()
		if a.HardwareAddr.String() == mac.String() {
			return nil
		}
		if l.Type() == "device" && a.Flags&net.FlagLoopback == 0 && len(a.HardwareAddr) == 6 && nic == nil {
			nic = l
		}
	}
	if nic == nil {
		return fmt.Errorf("no network interface for MAC %s", mac)
	}
	if err := netlink.LinkSetHardwareAddr(nic, mac); err != nil {
		return fmt.Errorf("set the MAC of %s to %s: %w", nic.Attrs().Name, mac, err)
	}
	return nil
}

// leaveRootfs moves the root off the initramfs: pivot_root(2), which starts
// every app, refuses a root that is the initial rootfs. The rootfs is bound
// beneath itself and the bind moved over /, which makes the root a mount
// with a parent.
func leaveRootfs() error {
	if err := os.MkdirAll("/sysroot", 0o755); err != nil {
		return err
	}
	if err := unix.Mount("/", "/sysroot", "", unix.MS_BIND, ""); err != nil {
		return err
	}
	if err := unix.Chdir("/sysroot"); err != nil {
		return err
	}
	if err := unix.Mount(".", "/", "", unix.MS_MOVE, ""); err != nil {
		return err
	}
	if err := unix.Chroot("."); err != nil {
		return err
	}
	return unix.Chdir("/")
}

// baseMounts mounts the API file systems of a bare system.
func baseMounts() error {
	const nsx = unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC
	for _, m := range []struct {
		src, dst, fstype string
		flags            uintptr
		data             string
	}{
		{"devtmpfs", "/dev", "devtmpfs", unix.MS_NOSUID, "mode=0755"},
		{"proc", "/proc", "proc", nsx, ""},
		{"sysfs", "/sys", "sysfs", nsx, ""},
		{"tmpfs", "/run", "tmpfs", unix.MS_NOSUID | unix.MS_NODEV, "mode=0755"},
		{"tmpfs", "/tmp", "tmpfs", unix.MS_NOSUID | unix.MS_NODEV, "mode=1777"},
		{"devpts", "/dev/pts", "devpts", unix.MS_NOSUID | unix.MS_NOEXEC, "ptmxmode=0666,mode=0620"},
		{"tmpfs", "/dev/shm", "tmpfs", nsx, "mode=1777"},
	} {
		if err := os.MkdirAll(m.dst, 0o755); err != nil {
			return err
		}
		if err := unix.Mount(m.src, m.dst, m.fstype, m.flags, m.data); err != nil && !errors.Is(err, unix.EBUSY) {
			return fmt.Errorf("mount %s: %w", m.dst, err)
		}
	}
	return nil
}

// consoleStdio points stdin, stdout and stderr at /dev/console: the
// initramfs has no device nodes, so the kernel started init without them.
func consoleStdio() {
	fd, err := unix.Open("/dev/console", unix.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		return
	}
	for i := 0; i < 3; i++ {
		unix.Dup3(fd, i, 0)
	}
	if fd > 2 {
		unix.Close(fd)
	}
}

// loadModules loads the modules named in list, in order. A module already
// loaded (or built in) is fine; a missing list means none.
func loadModules(list string, log *slog.Logger) error {
	b, err := os.ReadFile(list)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	dir := filepath.Dir(list)
	for _, name := range strings.Fields(string(b)) {
		f, err := os.Open(filepath.Join(dir, name))
		if err != nil {
			return fmt.Errorf("module %s: %w", name, err)
		}
		err = unix.FinitModule(int(f.Fd()), "", 0)
		f.Close()
		if err != nil && !errors.Is(err, unix.EEXIST) {
			return fmt.Errorf("load module %s: %w", name, err)
		}
		log.Debug("module loaded", "module", name)
	}
	return nil
}

// openPort waits up to timeout for the virtio-serial port called name and
// opens it.
func openPort(name string, timeout time.Duration) (*os.File, error) {
	deadline := time.Now().Add(timeout)
	delay := time.Millisecond
	for {
		dev, err := findPort(name)
		if err == nil {
			return os.OpenFile(dev, os.O_RDWR, 0)
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("virtio-serial port %q: %w", name, err)
		}
		time.Sleep(delay) // waiting on the driver to probe the device
		if delay < 20*time.Millisecond {
			delay *= 2
		}
	}
}

// findPort returns the device node of the port called name, found through
// /sys/class/virtio-ports/*/name.
func findPort(name string) (string, error) {
	ents, err := os.ReadDir("/sys/class/virtio-ports")
	if err != nil {
		return "", err
	}
	for _, e := range ents {
		b, err := os.ReadFile(filepath.Join("/sys/class/virtio-ports", e.Name(), "name"))
		if err != nil || strings.TrimSpace(string(b)) != name {
			continue
		}
		dev := "/dev/" + e.Name()
		if _, err := os.Stat(dev); err != nil {
			return "", err
		}
		return dev, nil
	}
	return "", os.ErrNotExist
}

// configureNetwork brings lo up and, when the host passed a MAC, names that
// interface eth0 and gives it the host's addresses, MTU and routes.
func configureNetwork(cfg *guest.Config) error {
	lo, err := netlink.LinkByName("lo")
	if err != nil {
		return err
	}
	if err := netlink.LinkSetUp(lo); err != nil {
		return fmt.Errorf("lo up: %w", err)
	}
	if cfg.MAC == nil {
		return nil
	}
	var link netlink.Link
	deadline := time.Now().Add(10 * time.Second)
	for link == nil {
		links, err := netlink.LinkList()
		if err != nil {
			return err
		}
		for _, l := range links {
			if l.Attrs().HardwareAddr.String() == cfg.MAC.String() {
				link = l
			}
		}
		if link == nil {
			if time.Now().After(deadline) {
				return fmt.Errorf("no interface with MAC %s", cfg.MAC)
			}
			time.Sleep(10 * time.Millisecond) // waiting on the driver to probe the device
		}
	}
	if link.Attrs().Name != "eth0" {
		if err := netlink.LinkSetName(link, "eth0"); err != nil {
			return fmt.Errorf("rename %s: %w", link.Attrs().Name, err)
		}
	}
	if cfg.MTU > 0 {
		if err := netlink.LinkSetMTU(link, cfg.MTU); err != nil {
			return fmt.Errorf("mtu: %w", err)
		}
	}
	for _, p := range cfg.IPs {
		addr := &netlink.Addr{IPNet: &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}}
		if p.Addr().Is6() {
			addr.Flags = unix.IFA_F_NODAD
		}
		if err := netlink.AddrAdd(link, addr); err != nil {
			return fmt.Errorf("address %s: %w", p, err)
		}
	}
	if err := netlink.LinkSetUp(link); err != nil {
		return fmt.Errorf("eth0 up: %w", err)
	}
	for _, r := range cfg.Routes {
		rt := &netlink.Route{
			LinkIndex: link.Attrs().Index,
			Dst:       &net.IPNet{IP: r.Dst.Addr().AsSlice(), Mask: net.CIDRMask(r.Dst.Bits(), r.Dst.Addr().BitLen())},
		}
		if r.Gw.IsValid() {
			rt.Gw = r.Gw.AsSlice()
		} else {
			rt.Scope = netlink.SCOPE_LINK
		}
		if err := netlink.RouteReplace(rt); err != nil {
			return fmt.Errorf("route %s via %s: %w", r.Dst, r.Gw, err)
		}
	}
	return nil
}

// guestCgroups mounts the v1 hierarchies the cgroups package manages and
// moves the agent into a "pod" cgroup in each, so that its apps' cgroups
// are children of the pod's and pod stats cover every app.
func guestCgroups() error {
	const root = "/sys/fs/cgroup"
	if err := unix.Mount("tmpfs", root, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "mode=0755"); err != nil {
		return err
	}
	enabled, err := enabledControllers()
	if err != nil {
		return err
	}
	pid := []byte(strconv.Itoa(os.Getpid()))
	for _, h := range []string{"cpu,cpuacct", "memory", "pids", "freezer"} {
		skip := false
		for _, c := range strings.Split(h, ",") {
			skip = skip || !enabled[c]
		}
		if skip {
			continue
		}
		dir := filepath.Join(root, h)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return err
		}
		if err := mountCgroup(dir, h); err != nil {
			return fmt.Errorf("mount cgroup %s: %w", h, err)
		}
		pod := filepath.Join(dir, "pod")
		if err := os.MkdirAll(pod, 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(pod, "cgroup.procs"), pid, 0); err != nil {
			return fmt.Errorf("join %s: %w", pod, err)
		}
	}
	return nil
}

// mountCgroup mounts the v1 hierarchy of controllers at dir, favouring
// moves of processes between cgroups over forks and exits
// (favordynmods, Linux 6.0): every exec and app start moves a process
// into its app's cgroups, one hierarchy after another, and without it
// each move waits for an RCU grace period, which on an emulated CPU is
// milliseconds. A kernel without the option mounts without it.
func mountCgroup(dir, controllers string) error {
	const flags = unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC
	err := unix.Mount("cgroup", dir, "cgroup", flags, controllers+",favordynmods")
	if errors.Is(err, unix.EINVAL) {
		err = unix.Mount("cgroup", dir, "cgroup", flags, controllers)
	}
	return err
}

// enabledControllers reads /proc/cgroups.
func enabledControllers() (map[string]bool, error) {
	f, err := os.Open("/proc/cgroups")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	out := map[string]bool{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 4 && f[3] == "1" {
			out[f[0]] = true
		}
	}
	return out, sc.Err()
}
