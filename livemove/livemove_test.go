package livemove

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"io"
	"log/slog"
	"net"
	"testing"
	"time"

	"github.com/stagelet/stagelet/errdefs"
)

func newOffer(t *testing.T, ttl time.Duration) *Offer {
	t.Helper()
	o, err := NewOffer("127.0.0.1", ttl, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(o.Close)
	return o
}

// accept runs o.Accept in the background.
func accept(o *Offer) <-chan net.Conn {
	ch := make(chan net.Conn, 1)
	go func() {
		c, err := o.Accept(context.Background())
		if err != nil {
			close(ch)
			return
		}
		ch <- c
	}()
	return ch
}

func TestTicketTakesThePodOnce(t *testing.T) {
	o := newOffer(t, time.Minute)
	got := accept(o)
	tk := o.Ticket()
	dir := t.TempDir()
	if err := WriteTicket(dir, tk); err != nil {
		t.Fatal(err)
	}
	read, ok, err := ReadTicket(dir)
	if err != nil || !ok || *read != tk {
		t.Fatalf("ReadTicket = %+v, %v, %v; wrote %+v", read, ok, err, tk)
	}
	conn, err := Dial(context.Background(), *read)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	src := <-got
	if src == nil {
		t.Fatal("the offer took no connection")
	}
	defer src.Close()

	// The state crosses as data frames, the hand-over as the others.
	state := make([]byte, 3*chunk+17)
	rand.Read(state)
	go func() {
		if _, err := Expect(src, FrameReady); err != nil {
			t.Error(err)
			return
		}
		SendStream(src, bytes.NewReader(state))
		WriteFrame(src, FrameEnd, []byte(`{"bytes":1}`))
	}()
	WriteFrame(conn, FrameReady, nil)
	var recv bytes.Buffer
	end, n, err := ReceiveStream(&recv, conn)
	if err != nil || string(end) != `{"bytes":1}` || n != int64(len(state)) || !bytes.Equal(recv.Bytes(), state) {
		t.Fatalf("ReceiveStream = %q, %d, %v; %d bytes equal %v", end, n, err, recv.Len(), bytes.Equal(recv.Bytes(), state))
	}

	// The port is closed: the ticket takes nothing twice.
	if _, err := Dial(context.Background(), tk); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("second Dial with the ticket: %v, want Unavailable (the port closed)", err)
	}
}

func TestWrongTokenOrCertificateIsRefused(t *testing.T) {
	o := newOffer(t, time.Minute)
	got := accept(o)
	tk := o.Ticket()

	wrong := tk
	wrong.Token = "00" + tk.Token[2:]
	if tk.Token[:2] == "00" {
		wrong.Token = "11" + tk.Token[2:]
	}
	if _, err := Dial(context.Background(), wrong); !errors.Is(err, errdefs.ErrPermissionDenied) {
		t.Fatalf("Dial with a wrong token: %v, want PermissionDenied", err)
	}

	// A target that does not find the pinned certificate never sends
	// the token.
	other := tk
	other.CertSHA256 = "ab" + tk.CertSHA256[2:]
	if tk.CertSHA256[:2] == "ab" {
		other.CertSHA256 = "cd" + tk.CertSHA256[2:]
	}
	if _, err := Dial(context.Background(), other); err == nil {
		t.Fatal("Dial accepted a certificate the ticket does not pin")
	}

	// The offer still waits for the right token.
	conn, err := Dial(context.Background(), tk)
	if err != nil {
		t.Fatal(err)
	}
	conn.Close()
	if c := <-got; c == nil {
		t.Fatal("the offer did not take the right token after wrong ones")
	} else {
		c.Close()
	}
}

func TestOfferExpires(t *testing.T) {
	o := newOffer(t, 50*time.Millisecond)
	_, err := o.Accept(context.Background())
	if !errors.Is(err, errdefs.ErrDeadlineExceeded) {
		t.Fatalf("Accept of an expired offer: %v, want DeadlineExceeded", err)
	}
	if _, err := Dial(context.Background(), o.Ticket()); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("Dial with an expired ticket: %v, want FailedPrecondition", err)
	}
}

func TestOfferRefusesAnUnreachableAddress(t *testing.T) {
	for _, a := range []string{"0.0.0.0", "::", "node1", ""} {
		if _, err := NewOffer(a, time.Minute, slog.New(slog.DiscardHandler)); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("NewOffer(%q): %v, want InvalidArgument", a, err)
		}
	}
}

func TestFailFrameIsTheOtherSidesError(t *testing.T) {
	var b bytes.Buffer
	Fail(&b, errors.New("no disk of image sha256:abc"))
	_, err := Expect(&b, FrameLoaded)
	var re *RemoteError
	if !errors.As(err, &re) || re.Msg != "no disk of image sha256:abc" {
		t.Fatalf("Expect after Fail: %v", err)
	}
	if _, _, err := ReadFrame(&b); !errors.Is(err, io.EOF) {
		t.Fatalf("ReadFrame at the end: %v", err)
	}
}
