package guestinit

import (
	"bytes"
	"net"
	"net/netip"
	"testing"
)

func TestGARPFrame(t *testing.T) {
	mac, _ := net.ParseMAC("02:42:0a:58:00:07")
	f := garpFrame(mac, netip.MustParseAddr("10.88.0.7"))
	want := []byte{
		0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02, 0x42, 0x0a, 0x58, 0x00, 0x07, 0x08, 0x06,
		0x00, 0x01, 0x08, 0x00, 6, 4, 0x00, 0x01,
		0x02, 0x42, 0x0a, 0x58, 0x00, 0x07, 10, 88, 0, 7,
		0, 0, 0, 0, 0, 0, 10, 88, 0, 7,
	}
	if !bytes.Equal(f, want) {
		t.Errorf("garpFrame = % x\nwant        % x", f, want)
	}
}
