package network

import (
	"context"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
)

func TestGarpPacket(t *testing.T) {
	mac := net.HardwareAddr{0x0a, 0x58, 0x0a, 0xf4, 0x00, 0x05}
	ip := netip.MustParseAddr("10.244.0.5")
	for _, c := range []struct {
		op   uint16
		want []byte
	}{
		{arpRequest, []byte{
			0, 1, 8, 0, 6, 4, 0, 1, // Ethernet, IPv4, request
			0x0a, 0x58, 0x0a, 0xf4, 0x00, 0x05, 10, 244, 0, 5, // sender
			0, 0, 0, 0, 0, 0, 10, 244, 0, 5, // target: the same address
		}},
		{arpReply, []byte{
			0, 1, 8, 0, 6, 4, 0, 2, // Ethernet, IPv4, reply
			0x0a, 0x58, 0x0a, 0xf4, 0x00, 0x05, 10, 244, 0, 5,
			0x0a, 0x58, 0x0a, 0xf4, 0x00, 0x05, 10, 244, 0, 5, // target: the sender
		}},
	} {
		if p := garpPacket(c.op, mac, ip); string(p) != string(c.want) {
			t.Errorf("op %d\n got % x\nwant % x", c.op, p, c.want)
		}
	}
}

// A pod that gets the address of a deleted pod is reachable from the node
// at once: the node's neighbour entry, still naming the deleted pod's MAC,
// is replaced when the pod is attached.
func TestReusedAddressReachable(t *testing.T) {
	tn := newTestNet(t)
	// A node's bridge outlives its pods: another pod keeps its carrier up,
	// and its address is fixed, so that neither A's leaving (carrier down,
	// the bridge taking the lowest address of its ports) flushes the
	// node's neighbour entries.
	tn.newPod(t)
	br, err := netlink.LinkByName(tn.bridge)
	if err != nil {
		t.Fatal(err)
	}
	if err := netlink.LinkSetHardwareAddr(br, net.HardwareAddr{0x02, 0x5e, 0x10, 0, 0, 1}); err != nil {
		t.Fatal(err)
	}
	a, ra := tn.newPod(t)
	ip := ra.IPs[0]
	serveEcho(listenIn(t, a.NetNS, ":7000"))
	conn, err := dialFrom("", net.JoinHostPort(ip, "7000"))
	if err != nil {
		t.Fatalf("dial pod A: %v", err)
	}
	if got, err := roundTrip(conn, "a"); err != nil || got != "echo:a" {
		t.Fatalf("pod A: got %q, %v", got, err)
	}
	if mac := neighMAC(t, br, ip); mac != ra.MAC {
		t.Fatalf("node's neighbour entry for %s is %q, want pod A's %s", ip, mac, ra.MAC)
	}

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := tn.m.Teardown(ctx, a); err != nil {
		t.Fatal(err)
	}
	if err := tn.m.RemoveNetNS(context.Background(), a.NetNS); err != nil {
		t.Fatal(err)
	}
	// host-local hands out the address after the last one it reserved.
	prev := netip.MustParseAddr(ip).Prev().String()
	if err := os.WriteFile(filepath.Join(tn.dataDir, tn.name, "last_reserved_ip.0"), []byte(prev), 0o644); err != nil {
		t.Fatal(err)
	}

	b, rb := tn.newPod(t)
	if rb.IPs[0] != ip {
		t.Fatalf("pod B got %s, want the reused %s", rb.IPs[0], ip)
	}
	if rb.MAC == ra.MAC {
		t.Fatalf("pod B has pod A's MAC %s", rb.MAC)
	}
	waitFor(t, "the node's neighbour entry to name pod B", func() bool { return neighMAC(t, br, ip) == rb.MAC })
	serveEcho(listenIn(t, b.NetNS, ":7000"))
	conn, err = dialFrom("", net.JoinHostPort(ip, "7000"))
	if err != nil {
		t.Fatalf("dial pod B at the reused address: %v", err)
	}
	if got, err := roundTrip(conn, "b"); err != nil || got != "echo:b" {
		t.Fatalf("pod B: got %q, %v", got, err)
	}
}

// neighMAC is the MAC of the node's neighbour entry for ip on link, "" if
// there is none.
func neighMAC(t *testing.T, link netlink.Link, ip string) string {
	t.Helper()
	ns, err := netlink.NeighList(link.Attrs().Index, netlink.FAMILY_V4)
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range ns {
		if n.IP.String() == ip {
			return n.HardwareAddr.String()
		}
	}
	return ""
}
