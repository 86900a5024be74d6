package network

import (
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"

	"golang.org/x/sys/unix"
)

// announce sends a gratuitous ARP for each IPv4 address in ips from the
// interface ifname of the calling thread's network namespace (as a request
// and as a reply, see garpPacket), so that the neighbours on its link (the
// node's bridge above all) learn its MAC address now.
//
// Addresses are reused: host-local hands out a freed address again once its
// range wraps. The node keeps the neighbour entry of the pod that had the
// address before, naming a MAC that is gone, and sends there until the
// entry is found stale: 5 to 45 s in which nothing from the node reaches
// the new pod (a gRPC liveness probe with a 5 s timeout failed so in the
// node conformance suite, and the kubelet restarted a healthy container).
// A gratuitous ARP reply replaces an existing entry whatever its state; it
// creates none (arp_accept=0), so it costs nothing where nobody knew the
// address. CNI's bridge plugin sends none in the version Debian 12 ships.
func announce(ifname string, ips []string) error {
	itf, err := net.InterfaceByName(ifname)
	if err != nil {
		return fmt.Errorf("gratuitous ARP: %w", err)
	}
	if len(itf.HardwareAddr) != 6 || itf.Flags&net.FlagUp == 0 {
		return nil // not Ethernet, or down: nothing to announce on
	}
	var v4 []netip.Addr
	for _, s := range ips {
		if a, err := netip.ParseAddr(s); err == nil && a.Unmap().Is4() {
			v4 = append(v4, a.Unmap())
		}
	}
	if len(v4) == 0 {
		return nil
	}
	fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, int(htons(unix.ETH_P_ARP)))
	if err != nil {
		return fmt.Errorf("gratuitous ARP: socket: %w", err)
	}
	defer unix.Close(fd)
	to := &unix.SockaddrLinklayer{
		Protocol: htons(unix.ETH_P_ARP),
		Ifindex:  itf.Index,
		Halen:    6,
		Addr:     [8]byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff},
	}
	for _, a := range v4 {
		for _, op := range []uint16{arpRequest, arpReply} {
			if err := unix.Sendto(fd, garpPacket(op, itf.HardwareAddr, a), 0, to); err != nil {
				return fmt.Errorf("gratuitous ARP for %s on %s: %w", a, ifname, err)
			}
		}
	}
	return nil
}

// garpPacket is a gratuitous ARP for ip from mac, without the Ethernet
// header: sender and target address are both ip. A request (op 1, target
// hardware address zero) is RFC 5227's announcement; a reply (op 2, target
// hardware address mac) is what Linux heeds on an interface that forwards,
// where it passes over requests for addresses that are not its own.
func garpPacket(op uint16, mac net.HardwareAddr, ip netip.Addr) []byte {
	p := make([]byte, 28)
	binary.BigEndian.PutUint16(p[0:], 1)      // hardware: Ethernet
	binary.BigEndian.PutUint16(p[2:], 0x0800) // protocol: IPv4
	p[4], p[5] = 6, 4
	binary.BigEndian.PutUint16(p[6:], op)
	copy(p[8:14], mac)
	a := ip.As4()
	copy(p[14:18], a[:])
	if op == arpReply {
		copy(p[18:24], mac)
	}
	copy(p[24:28], a[:])
	return p
}

const (
	arpRequest = 1
	arpReply   = 2
)

// htons puts v in network byte order, as the packet socket calls want it.
func htons(v uint16) uint16 {
	var b [2]byte
	binary.BigEndian.PutUint16(b[:], v)
	return binary.NativeEndian.Uint16(b[:])
}
