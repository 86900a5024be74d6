package supervisor

import (
	"encoding/json"
	"errors"
	"net"
	"os"
	"syscall"
	"testing"
)

// A reset (the peer closed with bytes of ours unread, as an exec'd init
// does) reads as an error and no bytes: never a negative count, on which
// json.Decoder panics.
func TestRightsReaderReset(t *testing.T) {
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	ours, err := net.FileConn(os.NewFile(uintptr(fds[0]), "ours"))
	if err != nil {
		t.Fatal(err)
	}
	defer ours.Close()
	peer := os.NewFile(uintptr(fds[1]), "peer")
	if _, err := ours.Write([]byte("unread")); err != nil {
		t.Fatal(err)
	}
	peer.Close()

	rr, err := newRightsReader(ours)
	if err != nil {
		t.Fatal(err)
	}
	defer rr.close()
	n, err := rr.Read(make([]byte, 64))
	if n != 0 || !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("Read after a reset = %d, %v; want 0, ECONNRESET", n, err)
	}
	var m syncMsg
	if err := json.NewDecoder(rr).Decode(&m); err == nil {
		t.Fatal("decoding a reset connection succeeded")
	}
}
