package guestinit

import (
	"errors"
	"fmt"
	"log/slog"
	"net"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/agent/guest"
	"github.com/stagelet/stagelet/errdefs"
)

// retakeNetwork answers api.OpNetwork: a guest whose VM was restored into
// another pod takes that pod's network. Its interface gets the pod's MAC,
// loses the addresses and routes of the pod it was saved in, and gets the
// new ones as at boot (configureNetwork); the hostname follows.
func retakeNetwork(req *api.Request, log *slog.Logger) error {
	cfg, err := guest.ParseCmdline(req.Guest)
	if err != nil {
		return errdefs.InvalidArgument("network: %w", err)
	}
	if cfg.Hostname != "" {
		if err := unix.Sethostname([]byte(cfg.Hostname)); err != nil {
			log.Warn("set hostname", "err", err)
		}
	}
	nic, err := guestNIC()
	if err != nil {
		return err
	}
	if nic == nil {
		if cfg.MAC != nil {
			return errdefs.FailedPrecondition("network: the guest has no interface for MAC %s", cfg.MAC)
		}
		return nil
	}
	if err := flushLink(nic); err != nil {
		return fmt.Errorf("network: %w", err)
	}
	if cfg.MAC == nil {
		return nil
	}
	if nic.Attrs().HardwareAddr.String() != cfg.MAC.String() {
		if err := netlink.LinkSetDown(nic); err != nil {
			return fmt.Errorf("network: %s down: %w", nic.Attrs().Name, err)
		}
		if err := netlink.LinkSetHardwareAddr(nic, cfg.MAC); err != nil {
			return fmt.Errorf("network: set the MAC of %s to %s: %w", nic.Attrs().Name, cfg.MAC, err)
		}
	}
	if err := configureNetwork(cfg); err != nil {
		return fmt.Errorf("network: %w", err)
	}
	// The neighbours learn the addresses' new place at once; they would
	// otherwise on the guest's first packets.
	if err := announce(nic.Attrs().Index, cfg.MAC, cfg.IPs); err != nil {
		log.Warn("the guest's network", "err", err)
	}
	log.Info("the guest took its pod's network", "mac", cfg.MAC, "ips", cfg.IPs)
	return nil
}

// guestNIC is the guest's network interface (the VM has at most one);
// nil when it has none.
func guestNIC() (netlink.Link, error) {
	links, err := netlink.LinkList()
	if err != nil {
		return nil, fmt.Errorf("network: %w", err)
	}
	for _, l := range links {
		a := l.Attrs()
		if l.Type() == "device" && a.Flags&net.FlagLoopback == 0 && len(a.HardwareAddr) == 6 {
			return l, nil
		}
	}
	return nil, nil
}

// flushLink removes the routes and global addresses of link.
func flushLink(link netlink.Link) error {
	routes, err := netlink.RouteList(link, netlink.FAMILY_ALL)
	if err != nil {
		return err
	}
	for _, r := range routes {
		if r.Protocol == unix.RTPROT_KERNEL {
			continue // they go with their addresses
		}
		if err := netlink.RouteDel(&r); err != nil && !errors.Is(err, unix.ESRCH) {
			return fmt.Errorf("delete route %s: %w", r, err)
		}
	}
	addrs, err := netlink.AddrList(link, netlink.FAMILY_ALL)
	if err != nil {
		return err
	}
	for _, a := range addrs {
		if a.Scope != unix.RT_SCOPE_UNIVERSE {
			continue
		}
		if err := netlink.AddrDel(link, &a); err != nil && !errors.Is(err, unix.EADDRNOTAVAIL) {
			return fmt.Errorf("delete address %s: %w", a.IPNet, err)
		}
	}
	return nil
}
