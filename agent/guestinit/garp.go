package guestinit

import (
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"

	"golang.org/x/sys/unix"
)

// announce sends a gratuitous ARP request for each IPv4 address of the
// interface ifindex, whose MAC is mac, so that its neighbours learn at
// once where the address now is (a guest restored into another pod).
func announce(ifindex int, mac net.HardwareAddr, ips []netip.Prefix) error {
	proto := htons(unix.ETH_P_ARP)
	fd, err := unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, int(proto))
	if err != nil {
		return fmt.Errorf("gratuitous ARP: %w", err)
	}
	defer unix.Close(fd)
	sa := &unix.SockaddrLinklayer{Protocol: proto, Ifindex: ifindex, Halen: 6}
	copy(sa.Addr[:], broadcastMAC)
	for _, p := range ips {
		if !p.Addr().Is4() {
			continue
		}
		if err := unix.Sendto(fd, garpFrame(mac, p.Addr()), 0, sa); err != nil {
			return fmt.Errorf("gratuitous ARP for %s: %w", p.Addr(), err)
		}
	}
	return nil
}

var broadcastMAC = net.HardwareAddr{0xff, 0xff, 0xff, 0xff, 0xff, 0xff}

// garpFrame is the Ethernet frame of a gratuitous ARP request: ip is at
// mac, asked of everyone for ip itself (RFC 5227's announcement).
func garpFrame(mac net.HardwareAddr, ip netip.Addr) []byte {
	f := make([]byte, 0, 42)
	f = append(f, broadcastMAC...)
	f = append(f, mac...)
	f = binary.BigEndian.AppendUint16(f, unix.ETH_P_ARP)
	f = binary.BigEndian.AppendUint16(f, 1)      // hardware: Ethernet
	f = binary.BigEndian.AppendUint16(f, 0x0800) // protocol: IPv4
	f = append(f, 6, 4)                          // their lengths
	f = binary.BigEndian.AppendUint16(f, 1)      // request
	a := ip.As4()
	f = append(f, mac...)
	f = append(f, a[:]...)
	f = append(f, 0, 0, 0, 0, 0, 0)
	return append(f, a[:]...)
}

// htons is v in network byte order, as AF_PACKET takes a protocol.
func htons(v uint16) uint16 { return v<<8 | v>>8 }
