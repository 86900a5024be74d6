package network

import (
	"net"
	"strings"
	"testing"
)

const netDev = `Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed
    lo:     840      10    0    0    0     0          0         0      840      10    0    0    0     0       0          0
  eth0: 1073741824 123456    1    2    0     0          0         7  5000000   4321    3    4    0     0       0          0
`

func TestParseNetDev(t *testing.T) {
	got, err := parseNetDev(strings.NewReader(netDev))
	if err != nil {
		t.Fatal(err)
	}
	want := []InterfaceStats{{Name: "eth0", RxBytes: 1 << 30, RxPackets: 123456, RxErrors: 1, RxDropped: 2, TxBytes: 5000000, TxPackets: 4321, TxErrors: 3, TxDropped: 4}}
	if len(got) != 1 || got[0] != want[0] {
		t.Fatalf("parseNetDev = %+v, want %+v (lo left out)", got, want)
	}
	if _, err := parseNetDev(strings.NewReader("h\nh\neth0: 1 2 3\n")); err == nil {
		t.Error("a short line parsed")
	}
}

// TestInterfaceCounters: a pod's eth0 counts the bytes the host sends it
// and the ones it answers; its loopback is left out.
func TestInterfaceCounters(t *testing.T) {
	tn := newTestNet(t)
	pn, res := tn.newPod(t)
	before, err := InterfaceCounters(pn.NetNS)
	if err != nil {
		t.Fatal(err)
	}
	if len(before) != 1 || before[0].Name != IfName {
		t.Fatalf("interfaces in the pod: %+v, want only %s", before, IfName)
	}
	serveEcho(listenIn(t, pn.NetNS, ":7000"))
	msg := strings.Repeat("x", 200) // the echo server reads up to 256 bytes
	conn, err := dialFrom("", net.JoinHostPort(res.IPs[0], "7000"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := roundTrip(conn, msg); err != nil {
		t.Fatal(err)
	}
	after, err := InterfaceCounters(pn.NetNS)
	if err != nil {
		t.Fatal(err)
	}
	b, a := before[0], after[0]
	if a.RxBytes-b.RxBytes < uint64(len(msg)) || a.RxPackets <= b.RxPackets || a.TxBytes-b.TxBytes < uint64(len(msg)) || a.TxPackets <= b.TxPackets {
		t.Errorf("eth0 counters did not count the exchange: before %+v, after %+v", b, a)
	}
	if _, err := InterfaceCounters("/proc/self/ns/nope"); err == nil {
		t.Error("counters of a missing netns")
	}
}
