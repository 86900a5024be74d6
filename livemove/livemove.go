// Package livemove carries a running pod from the daemon of one node to
// the daemon of another over a connection the two authenticate, with no
// port left open to anyone else.
//
// The source offers the pod (NewOffer): it listens on a port of its own,
// for the offer only, with a TLS certificate made for the offer, and
// hands out a Ticket: the address, the certificate's SHA-256 and a
// one-time token. The ticket travels through the API: it is written into
// the checkpoint archive the kubelet's checkpoint API returns, which
// becomes a checkpoint image a pod on the other node names. The target
// dials the address (Dial), accepts only the certificate the ticket pins
// and presents the token; the source takes the first connection that
// presents it, closes the port, and the two exchange frames (WriteFrame,
// ReadFrame): the pod's state as data frames, then the steps of the
// hand-over. An offer not taken within its time is withdrawn.
package livemove

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/atomicfile"
)

// TicketName is the ticket's file in a checkpoint's directory.
const TicketName = "live.json"

// ticketVersion is Ticket's version; a target refuses another.
const ticketVersion = 1

// OfferTTL is how long an offer waits for its target.
const OfferTTL = 10 * time.Minute

// maxAttempts is how many connections without the token an offer
// tolerates before it is withdrawn.
const maxAttempts = 16

// handshakeTimeout bounds a connection's TLS handshake and token.
const handshakeTimeout = 10 * time.Second

// tokenBytes is the token's length before hex encoding.
const tokenBytes = 32

// accepted is the source's answer to the right token.
const accepted = "ok\n"

// Ticket is what the target needs to take an offered pod, and all it
// needs: whoever holds it can take the pod once.
type Ticket struct {
	Version int `json:"version"`
	// Address is the source's host:port.
	Address string `json:"address"`
	// CertSHA256 is the hex SHA-256 of the source's certificate (DER).
	CertSHA256 string `json:"certSHA256"`
	// Token is the one-time token, hex.
	Token string `json:"token"`
	// Expires is when the offer is withdrawn.
	Expires time.Time `json:"expires"`
}

// WriteTicket writes t into dir, readable by its owner only.
func WriteTicket(dir string, t Ticket) error {
	b, err := json.Marshal(t)
	if err != nil {
		return err
	}
	return atomicfile.Write(filepath.Join(dir, TicketName), b, 0o600)
}

// ReadTicket reads the ticket in dir; ok is false when there is none.
// InvalidArgument for one that cannot be read or of another version.
func ReadTicket(dir string) (t *Ticket, ok bool, err error) {
	b, err := os.ReadFile(filepath.Join(dir, TicketName))
	if errors.Is(err, os.ErrNotExist) {
		return nil, false, nil
	}
	if err != nil {
		return nil, false, err
	}
	t = new(Ticket)
	if err := json.Unmarshal(b, t); err != nil {
		return nil, false, errdefs.InvalidArgument("live move ticket %s: %w", dir, err)
	}
	if t.Version != ticketVersion {
		return nil, false, errdefs.InvalidArgument("live move ticket %s is of version %d; this stagelet takes version %d", dir, t.Version, ticketVersion)
	}
	if t.Address == "" || len(t.Token) != 2*tokenBytes || len(t.CertSHA256) != 2*sha256.Size {
		return nil, false, errdefs.InvalidArgument("live move ticket %s: address, token or certificate missing", dir)
	}
	return t, true, nil
}

// Offer is a pod offered to one target.
type Offer struct {
	ticket Ticket
	token  []byte
	ln     net.Listener
	tls    *tls.Config
	log    *slog.Logger
	close  sync.Once
}

// NewOffer listens on address (an IP, or IP:port; port 0 or none: any)
// for the offer's target, for ttl. InvalidArgument for an address that is
// not a usable IP.
func NewOffer(address string, ttl time.Duration, log *slog.Logger) (*Offer, error) {
	address, err := listenAddress(address)
	if err != nil {
		return nil, fmt.Errorf("live move address: %w", err)
	}
	cert, sum, err := certificate()
	if err != nil {
		return nil, err
	}
	token := make([]byte, tokenBytes)
	if _, err := rand.Read(token); err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", address)
	if err != nil {
		return nil, fmt.Errorf("live move: %w", err)
	}
	return &Offer{
		ticket: Ticket{Version: ticketVersion, Address: ln.Addr().String(), CertSHA256: hex.EncodeToString(sum[:]),
			Token: hex.EncodeToString(token), Expires: time.Now().Add(ttl).UTC()},
		token: token,
		ln:    ln,
		tls:   &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS13},
		log:   log,
	}, nil
}

// CheckAddress says why address cannot be an offer's (NewOffer):
// InvalidArgument unless it is an IP, or IP:port, that another node can
// reach (not unspecified, as 0.0.0.0).
func CheckAddress(address string) error {
	_, err := listenAddress(address)
	return err
}

// listenAddress is address as IP:port (port 0 when it has none), or
// InvalidArgument (CheckAddress).
func listenAddress(given string) (string, error) {
	address := given
	if _, _, err := net.SplitHostPort(address); err != nil {
		address = net.JoinHostPort(address, "0")
	}
	host, _, _ := net.SplitHostPort(address)
	if ip := net.ParseIP(host); ip == nil || ip.IsUnspecified() {
		return "", errdefs.InvalidArgument("%q is not an IP address the other nodes reach (IP or IP:port)", given)
	}
	return address, nil
}

// Ticket is the offer's ticket.
func (o *Offer) Ticket() Ticket { return o.ticket }

// Close withdraws the offer: its port closes. Accept returns.
func (o *Offer) Close() {
	o.close.Do(func() { o.ln.Close() })
}

// Accept waits for the target, until the offer expires, ctx ends or it
// is closed, and returns its connection, authenticated; the port is then
// closed. Connections without the token are closed and logged;
// PermissionDenied after maxAttempts of them.
func (o *Offer) Accept(ctx context.Context) (net.Conn, error) {
	defer o.Close()
	stop := context.AfterFunc(ctx, o.Close)
	defer stop()
	if tl, ok := o.ln.(*net.TCPListener); ok {
		tl.SetDeadline(o.ticket.Expires)
	}
	for attempts := 0; ; {
		raw, err := o.ln.Accept()
		if err != nil {
			if time.Now().After(o.ticket.Expires) {
				return nil, errdefs.New(errdefs.ErrDeadlineExceeded, "live move offer on %s: no target came before %s", o.ticket.Address, o.ticket.Expires.Format(time.RFC3339))
			}
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			return nil, fmt.Errorf("live move offer on %s withdrawn: %w", o.ticket.Address, err)
		}
		conn, err := o.authenticate(raw)
		if err == nil {
			return conn, nil
		}
		raw.Close()
		attempts++
		o.log.WarnContext(ctx, "live move: a connection without the offer's token", "address", o.ticket.Address, "from", raw.RemoteAddr(), "err", err, "attempts", attempts)
		if attempts >= maxAttempts {
			return nil, errdefs.New(errdefs.ErrPermissionDenied, "live move offer on %s withdrawn after %d connections without its token", o.ticket.Address, attempts)
		}
	}
}

// authenticate completes raw's TLS handshake and reads its token.
func (o *Offer) authenticate(raw net.Conn) (net.Conn, error) {
	raw.SetDeadline(time.Now().Add(handshakeTimeout))
	conn := tls.Server(raw, o.tls)
	got := make([]byte, 2*tokenBytes+1)
	if _, err := io.ReadFull(conn, got); err != nil {
		return nil, err
	}
	want := []byte(o.ticket.Token + "\n")
	if subtle.ConstantTimeCompare(got, want) != 1 {
		return nil, errors.New("wrong token")
	}
	if _, err := io.WriteString(conn, accepted); err != nil {
		return nil, err
	}
	raw.SetDeadline(time.Time{})
	return conn, nil
}

// Dial connects to the source of ticket t: the certificate must be the
// one t pins, and the source must take t's token. FailedPrecondition for
// an expired ticket, PermissionDenied when the source refuses the token
// (taken already, or withdrawn), Unavailable when it cannot be reached.
func Dial(ctx context.Context, t Ticket) (net.Conn, error) {
	if time.Now().After(t.Expires) {
		return nil, errdefs.FailedPrecondition("live move ticket for %s expired at %s: take a new checkpoint", t.Address, t.Expires.Format(time.RFC3339))
	}
	want, err := hex.DecodeString(t.CertSHA256)
	if err != nil {
		return nil, errdefs.InvalidArgument("live move ticket: certificate SHA-256: %w", err)
	}
	cfg := &tls.Config{
		MinVersion: tls.VersionTLS13,
		// The certificate is checked against the ticket's SHA-256 below,
		// not against a CA: the ticket, handed through the API, is the
		// trust.
		InsecureSkipVerify: true,
		VerifyConnection: func(cs tls.ConnectionState) error {
			if len(cs.PeerCertificates) == 0 {
				return errors.New("no certificate")
			}
			sum := sha256.Sum256(cs.PeerCertificates[0].Raw)
			if subtle.ConstantTimeCompare(sum[:], want) != 1 {
				return fmt.Errorf("certificate SHA-256 %x is not the ticket's", sum)
			}
			return nil
		},
	}
	hctx, cancel := context.WithTimeout(ctx, handshakeTimeout)
	defer cancel()
	d := tls.Dialer{Config: cfg}
	conn, err := d.DialContext(hctx, "tcp", t.Address)
	if err != nil {
		return nil, errdefs.New(errdefs.ErrUnavailable, "live move: the source %s: %w", t.Address, err)
	}
	if dl, ok := hctx.Deadline(); ok {
		conn.SetDeadline(dl)
	}
	if _, err := io.WriteString(conn, t.Token+"\n"); err != nil {
		conn.Close()
		return nil, errdefs.New(errdefs.ErrUnavailable, "live move: the source %s: %w", t.Address, err)
	}
	ok := make([]byte, len(accepted))
	_, err = io.ReadFull(conn, ok)
	if err == nil && string(ok) != accepted {
		err = fmt.Errorf("it answered %q", ok)
	}
	if err != nil {
		conn.Close()
		return nil, errdefs.New(errdefs.ErrPermissionDenied, "live move: the source %s did not take the ticket's token (taken already, or withdrawn): %w", t.Address, err)
	}
	conn.SetDeadline(time.Time{})
	return conn, nil
}

// certificate makes a self-signed ECDSA certificate for one offer, and
// its SHA-256.
func certificate() (tls.Certificate, [sha256.Size]byte, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return tls.Certificate{}, [sha256.Size]byte{}, err
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return tls.Certificate{}, [sha256.Size]byte{}, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: "stagelet live move"},
		NotBefore:    now.Add(-time.Minute),
		NotAfter:     now.Add(OfferTTL + time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return tls.Certificate{}, [sha256.Size]byte{}, err
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}, sha256.Sum256(der), nil
}
