package network

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/stagelet/stagelet/errdefs"
)

func TestWriteResolvConf(t *testing.T) {
	p := filepath.Join(t.TempDir(), "resolv.conf")
	err := WriteResolvConf(p, []string{"10.96.0.10", "fd00::a"}, []string{"default.svc.cluster.local", "svc.cluster.local"}, []string{"ndots:5", "edns0"})
	if err != nil {
		t.Fatal(err)
	}
	want := "search default.svc.cluster.local svc.cluster.local\nnameserver 10.96.0.10\nnameserver fd00::a\noptions ndots:5 edns0\n"
	if b, _ := os.ReadFile(p); string(b) != want {
		t.Errorf("got\n%s\nwant\n%s", b, want)
	}
	if fi, _ := os.Stat(p); fi.Mode().Perm() != 0o644 {
		t.Errorf("mode %v", fi.Mode())
	}
	if err := WriteResolvConf(p, nil, nil, nil); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(p); len(b) != 0 {
		t.Errorf("empty config wrote %q", b)
	}
	for _, c := range []struct{ servers, searches, options []string }{
		{servers: []string{"dns.example"}},
		{searches: []string{"a b"}},
		{options: []string{"ndots:5\nnameserver 1.2.3.4"}},
		{searches: []string{""}},
	} {
		if err := WriteResolvConf(p, c.servers, c.searches, c.options); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("%+v: %v, want InvalidArgument", c, err)
		}
	}
}

func TestWriteHostsAndHostname(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "hosts")
	if err := WriteHosts(p, "web-0", []string{"10.213.1.5", "fd00::5"}); err != nil {
		t.Fatal(err)
	}
	want := "# Kubernetes-managed hosts file.\n127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n" +
		"fe00::0\tip6-localnet\nfe00::0\tip6-mcastprefix\nfe00::1\tip6-allnodes\nfe00::2\tip6-allrouters\n" +
		"10.213.1.5\tweb-0\nfd00::5\tweb-0\n"
	if b, _ := os.ReadFile(p); string(b) != want {
		t.Errorf("got\n%s\nwant\n%s", b, want)
	}
	if err := WriteHosts(p, "web-0", []string{"nope"}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("bad IP: %v", err)
	}
	if err := WriteHosts(p, "a b", nil); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("bad hostname: %v", err)
	}

	h := filepath.Join(dir, "hostname")
	if err := WriteHostname(h, "web-0"); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(h); string(b) != "web-0\n" {
		t.Errorf("hostname %q", b)
	}
	if err := WriteHostname(h, ""); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("empty hostname: %v", err)
	}
	ents, _ := os.ReadDir(dir)
	if len(ents) != 2 {
		t.Errorf("temporary files left: %v", ents)
	}
}
