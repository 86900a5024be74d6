package kvm

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/agent/guest"
	"github.com/stagelet/stagelet/internal/osthread"
)

// Names in the pod's network namespace.
const (
	// podIf is the CNI interface of the pod (network.IfName).
	podIf = "eth0"
	// tapName is the tap device qemu's virtio-net is backed by.
	tapName = "tap0"
)

// netConfig is what the guest's interface gets from the pod's eth0.
type netConfig struct {
	MAC    net.HardwareAddr
	MTU    int
	IPs    []netip.Prefix
	Routes []guest.Route
}

// errNoNetNS says a path does not name a network namespace (any more).
var errNoNetNS = errors.New("not a network namespace")

// inNetNS runs fn on a thread of its own inside the network namespace at
// path. The thread is never returned to the Go scheduler: it ends with fn
// (osthread.Run).
func inNetNS(path string, fn func() error) error {
	return osthread.Run(func() error {
		fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		err = unix.Setns(fd, unix.CLONE_NEWNET)
		unix.Close(fd)
		if errors.Is(err, unix.EINVAL) {
			return fmt.Errorf("%s: %w", path, errNoNetNS)
		}
		if err != nil {
			return fmt.Errorf("setns %s: %w", path, err)
		}
		return fn()
	})
}

// setupTap reads eth0 of the pod's network namespace, creates the tap
// device name there (open on the returned file, which qemu inherits; the
// device goes when the last holder closes it, unless persist, when it
// stays until teardownTap and qemu opens it by name) and redirects every frame
// arriving on either device out of the other with tc (ingress qdisc, u32
// match-all filter, mirred egress redirect), as Kata Containers does. The
// guest takes eth0's MAC and addresses, so the pod keeps the identity CNI
// gave it.
func setupTap(netnsPath, name string, persist bool) (*netConfig, *os.File, error) {
	var nc *netConfig
	var tap *os.File
	err := inNetNS(netnsPath, func() error {
		eth, err := netlink.LinkByName(podIf)
		if err != nil {
			return fmt.Errorf("%s: %w", podIf, err)
		}
		if nc, err = readNetConfig(eth); err != nil {
			return err
		}
		if tap, err = openTap(name); err != nil {
			return err
		}
		if persist {
			if err := unix.IoctlSetInt(int(tap.Fd()), unix.TUNSETPERSIST, 1); err != nil {
				return fmt.Errorf("tap %s: persist: %w", name, err)
			}
		}
		t, err := netlink.LinkByName(name)
		if err != nil {
			return err
		}
		if err := netlink.LinkSetMTU(t, nc.MTU); err != nil {
			return fmt.Errorf("%s mtu: %w", name, err)
		}
		if err := netlink.LinkSetUp(t); err != nil {
			return fmt.Errorf("%s up: %w", name, err)
		}
		if err := redirect(eth, t); err != nil {
			return err
		}
		return redirect(t, eth)
	})
	if err != nil {
		if tap != nil {
			tap.Close()
		}
		return nil, nil, err
	}
	return nc, tap, nil
}

// readNetConfig reads a link's MAC, MTU, global addresses and the routes
// CNI added (not the kernel's prefix routes, which the guest makes itself).
func readNetConfig(l netlink.Link) (*netConfig, error) {
	nc := &netConfig{MAC: l.Attrs().HardwareAddr, MTU: l.Attrs().MTU}
	addrs, err := netlink.AddrList(l, netlink.FAMILY_ALL)
	if err != nil {
		return nil, err
	}
	for _, a := range addrs {
		if a.Scope != unix.RT_SCOPE_UNIVERSE {
			continue
		}
		ip, ok := netip.AddrFromSlice(a.IP)
		if !ok {
			continue
		}
		ones, _ := a.Mask.Size()
		nc.IPs = append(nc.IPs, netip.PrefixFrom(ip.Unmap(), ones))
	}
	routes, err := netlink.RouteList(l, netlink.FAMILY_ALL)
	if err != nil {
		return nil, err
	}
	for _, r := range routes {
		if r.Protocol == unix.RTPROT_KERNEL || r.Table != unix.RT_TABLE_MAIN && r.Table != 0 {
			continue
		}
		gr := guest.Route{}
		if r.Dst != nil {
			ip, _ := netip.AddrFromSlice(r.Dst.IP)
			ones, _ := r.Dst.Mask.Size()
			gr.Dst = netip.PrefixFrom(ip.Unmap(), ones)
		} else if r.Gw != nil && r.Gw.To4() != nil {
			gr.Dst = netip.MustParsePrefix("0.0.0.0/0")
		} else {
			gr.Dst = netip.MustParsePrefix("::/0")
		}
		if gr.Dst.Addr().Is6() && gr.Dst.Addr().IsLinkLocalUnicast() {
			continue
		}
		if r.Gw != nil {
			gw, _ := netip.AddrFromSlice(r.Gw)
			gr.Gw = gw.Unmap()
		}
		nc.Routes = append(nc.Routes, gr)
	}
	return nc, nil
}

// openTap creates the tap device name (with virtio-net headers, no packet
// information) in the calling thread's network namespace.
func openTap(name string) (*os.File, error) {
	fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open /dev/net/tun: %w", err)
	}
	ifr, err := unix.NewIfreq(name)
	if err != nil {
		unix.Close(fd)
		return nil, err
	}
	ifr.SetUint16(unix.IFF_TAP | unix.IFF_NO_PI | unix.IFF_VNET_HDR)
	if err := unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("create tap %s: %w", name, err)
	}
	return os.NewFile(uintptr(fd), "/dev/net/tun:"+name), nil
}

// redirect sends every frame arriving on from out of to.
func redirect(from, to netlink.Link) error {
	ingress := &netlink.Ingress{QdiscAttrs: netlink.QdiscAttrs{
		LinkIndex: from.Attrs().Index,
		Parent:    netlink.HANDLE_INGRESS,
		Handle:    netlink.MakeHandle(0xffff, 0),
	}}
	if err := netlink.QdiscReplace(ingress); err != nil {
		return fmt.Errorf("ingress qdisc on %s: %w", from.Attrs().Name, err)
	}
	f := &netlink.U32{
		FilterAttrs: netlink.FilterAttrs{
			LinkIndex: from.Attrs().Index,
			Parent:    netlink.MakeHandle(0xffff, 0),
			Priority:  1,
			Protocol:  unix.ETH_P_ALL,
		},
		Actions: []netlink.Action{netlink.NewMirredAction(to.Attrs().Index)},
	}
	if err := netlink.FilterReplace(f); err != nil {
		return fmt.Errorf("redirect %s to %s: %w", from.Attrs().Name, to.Attrs().Name, err)
	}
	return nil
}

// teardownTap removes the tap device (if it outlived qemu) and the ingress
// qdisc, with its redirect, from eth0. A namespace or device already gone
// is not an error.
func teardownTap(netnsPath, name string) error {
	if _, err := os.Stat(netnsPath); errors.Is(err, os.ErrNotExist) {
		return nil
	}
	err := inNetNS(netnsPath, func() error {
		var errs []error
		if t, err := netlink.LinkByName(name); err == nil {
			if err := netlink.LinkDel(t); err != nil && !isGone(err) {
				errs = append(errs, fmt.Errorf("delete %s: %w", name, err))
			}
		}
		if eth, err := netlink.LinkByName(podIf); err == nil {
			ingress := &netlink.Ingress{QdiscAttrs: netlink.QdiscAttrs{
				LinkIndex: eth.Attrs().Index,
				Parent:    netlink.HANDLE_INGRESS,
				Handle:    netlink.MakeHandle(0xffff, 0),
			}}
			if err := netlink.QdiscDel(ingress); err != nil && !isGone(err) {
				errs = append(errs, fmt.Errorf("ingress qdisc on %s: %w", podIf, err))
			}
		}
		return errors.Join(errs...)
	})
	if errors.Is(err, errNoNetNS) {
		return nil
	}
	return err
}

func isGone(err error) bool {
	return errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ENODEV) || errors.Is(err, unix.EINVAL)
}
