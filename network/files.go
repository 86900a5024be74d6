package network

// The files here are replaced by rename: write them before they are bind
// mounted into a pod, since an existing bind mount keeps showing the old
// file.

import (
	"bytes"
	"fmt"
	"net/netip"
	"strings"

	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/atomicfile"
)

// WriteResolvConf writes a resolv.conf at path from the CRI's DNSConfig:
// one "nameserver" line per server, one "search" line, one "options" line.
// Policy limits (how many searches) are the kubelet's; this only checks that
// each entry fits in a resolv.conf line. The file is replaced atomically.
// Errors: ErrInvalidArgument for a server that is not an IP address or an
// entry with whitespace.
func WriteResolvConf(path string, servers, searches, options []string) error {
	var b bytes.Buffer
	if len(searches) > 0 {
		if err := checkWords("dns search", searches); err != nil {
			return err
		}
		fmt.Fprintf(&b, "search %s\n", strings.Join(searches, " "))
	}
	for _, s := range servers {
		a, err := netip.ParseAddr(s)
		if err != nil {
			return errdefs.InvalidArgument("dns server %q is not an IP address", s)
		}
		fmt.Fprintf(&b, "nameserver %s\n", a)
	}
	if len(options) > 0 {
		if err := checkWords("dns option", options); err != nil {
			return err
		}
		fmt.Fprintf(&b, "options %s\n", strings.Join(options, " "))
	}
	return writeFileAtomic(path, b.Bytes())
}

// WriteHosts writes an /etc/hosts at path: the localhost entries and, when
// hostname is not empty, one line mapping each of ips to it, as the kubelet
// writes for a pod. The file is replaced atomically. Errors:
// ErrInvalidArgument for an IP that does not parse or a hostname with
// whitespace.
func WriteHosts(path, hostname string, ips []string) error {
	var b bytes.Buffer
	b.WriteString("# Kubernetes-managed hosts file.\n" +
		"127.0.0.1\tlocalhost\n" +
		"::1\tlocalhost ip6-localhost ip6-loopback\n" +
		"fe00::0\tip6-localnet\n" +
		"fe00::0\tip6-mcastprefix\n" +
		"fe00::1\tip6-allnodes\n" +
		"fe00::2\tip6-allrouters\n")
	if hostname != "" {
		if err := checkWords("hostname", []string{hostname}); err != nil {
			return err
		}
		for _, ip := range ips {
			a, err := netip.ParseAddr(ip)
			if err != nil {
				return errdefs.InvalidArgument("pod IP %q is not an IP address", ip)
			}
			fmt.Fprintf(&b, "%s\t%s\n", a, hostname)
		}
	}
	return writeFileAtomic(path, b.Bytes())
}

// WriteHostname writes hostname and a newline to path, atomically.
// Errors: ErrInvalidArgument for an empty hostname or one with whitespace.
func WriteHostname(path, hostname string) error {
	if hostname == "" {
		return errdefs.InvalidArgument("hostname is empty")
	}
	if err := checkWords("hostname", []string{hostname}); err != nil {
		return err
	}
	return writeFileAtomic(path, []byte(hostname+"\n"))
}

func checkWords(what string, words []string) error {
	for _, w := range words {
		if w == "" || strings.ContainsAny(w, " \t\r\n\x00#;") {
			return errdefs.InvalidArgument("%s %q: empty or contains whitespace or a comment character", what, w)
		}
	}
	return nil
}

// writeFileAtomic replaces path with data, readable by all (apps of any
// user read these files), never torn. These files live in the pod's run
// directory, which a reboot discards: they are not synced to disk.
func writeFileAtomic(path string, data []byte) error {
	if err := atomicfile.WriteVolatile(path, data, 0o644); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
}
