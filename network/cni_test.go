package network

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/sysctl"
	"github.com/stagelet/stagelet/internal/testutil"
)

func TestTwoPodsReachEachOther(t *testing.T) {
	tn := newTestNet(t)
	a, ra := tn.newPod(t)
	b, rb := tn.newPod(t)
	t.Logf("pod A %v, pod B %v, gateway %s, routes %v", ra.IPs, rb.IPs, ra.Gateway, ra.Routes)

	for _, r := range []*Result{ra, rb} {
		if len(r.IPs) != 1 {
			t.Fatalf("IPs = %v, want one", r.IPs)
		}
		ip := netip.MustParseAddr(r.IPs[0])
		if !tn.subnet.Contains(ip) {
			t.Errorf("IP %s not in %s", ip, tn.subnet)
		}
		if r.Interface != IfName || r.MAC == "" {
			t.Errorf("interface %q MAC %q", r.Interface, r.MAC)
		}
		if r.Gateway != tn.gateway.String() {
			t.Errorf("gateway %s, want %s", r.Gateway, tn.gateway)
		}
	}
	if ra.IPs[0] == rb.IPs[0] {
		t.Fatalf("both pods got %s", ra.IPs[0])
	}

	// A server in each pod; each pod dials the other, and the host dials both.
	serveEcho(listenIn(t, a.NetNS, ":7000"))
	serveEcho(listenIn(t, b.NetNS, ":7000"))
	for _, c := range []struct{ from, to, name string }{
		{a.NetNS, net.JoinHostPort(rb.IPs[0], "7000"), "A→B"},
		{b.NetNS, net.JoinHostPort(ra.IPs[0], "7000"), "B→A"},
		{a.NetNS, "127.0.0.1:7000", "A→its own loopback"},
	} {
		conn, err := dialFrom(c.from, c.to)
		if err != nil {
			t.Fatalf("%s: dial %s: %v", c.name, c.to, err)
		}
		got, err := roundTrip(conn, c.name)
		if err != nil || got != "echo:"+c.name {
			t.Fatalf("%s: got %q, %v", c.name, got, err)
		}
	}
	threadsInHostNetNS(t)
}

func TestHostPortAndTeardown(t *testing.T) {
	tn := newTestNet(t)
	hostPort := freeHostPort(t)
	pn, res := tn.newPod(t, PortMapping{Protocol: "TCP", ContainerPort: 8080, HostPort: int32(hostPort)})
	serveEcho(listenIn(t, pn.NetNS, ":8080"))

	// The host port is DNATed for local addresses: the bridge's (gateway)
	// address, and 127.0.0.1 (portmap sets route_localnet for that).
	for _, host := range []string{tn.gateway.String(), "127.0.0.1"} {
		addr := net.JoinHostPort(host, fmt.Sprint(hostPort))
		conn, err := dialFrom("", addr)
		if err != nil {
			t.Fatalf("dial %s: %v", addr, err)
		}
		got, err := roundTrip(conn, "hi "+host)
		if err != nil || got != "echo:hi "+host {
			t.Fatalf("via %s: got %q, %v", addr, got, err)
		}
	}

	// What the pod holds now, so that the checks after teardown mean
	// something.
	veths := hostVeths(t, res.Raw)
	if len(veths) == 0 || !linkExists(veths[0]) {
		t.Fatalf("no host veth in result %s", res.Raw)
	}
	if len(iptablesMentions(t, pn.PodID)) == 0 {
		t.Fatal("no iptables rule names the pod before teardown")
	}
	if len(tn.ipamHolds(t, pn.PodID)) == 0 {
		t.Fatal("host-local holds no address for the pod before teardown")
	}
	if _, err := tn.m.CachedResult(pn.PodID); err != nil {
		t.Fatal(err)
	}

	ctx := context.Background()
	if err := tn.m.Teardown(ctx, pn); err != nil {
		t.Fatal(err)
	}
	if err := tn.m.RemoveNetNS(context.Background(), pn.NetNS); err != nil {
		t.Fatal(err)
	}
	assertReleased(t, tn, pn, veths)

	// Idempotent: DEL again after the netns is gone, and remove it again.
	if err := tn.m.Teardown(ctx, pn); err != nil {
		t.Fatalf("second teardown: %v", err)
	}
	if err := tn.m.RemoveNetNS(context.Background(), pn.NetNS); err != nil {
		t.Fatalf("second RemoveNetNS: %v", err)
	}
	if _, err := tn.m.CachedResult(pn.PodID); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("CachedResult after teardown: %v, want NotFound", err)
	}
	// The host port is free again.
	if c, err := dialFrom("", net.JoinHostPort(tn.gateway.String(), fmt.Sprint(hostPort))); err == nil {
		c.Close()
		t.Error("host port still answers after teardown")
	}
}

func assertReleased(t *testing.T, tn *testNet, pn PodNetwork, veths []string) {
	t.Helper()
	assertReleasedExcept(t, tn, pn, veths, false)
}

// assertReleasedExcept checks that nothing of the pod is left; with
// masqOK, the bridge plugin's masquerade rules may be (see Teardown).
func assertReleasedExcept(t *testing.T, tn *testNet, pn PodNetwork, veths []string, masqOK bool) {
	t.Helper()
	if _, err := os.Lstat(pn.NetNS); !os.IsNotExist(err) {
		t.Errorf("netns file %s still there: %v", pn.NetNS, err)
	}
	if mountedAt(t, pn.NetNS) {
		t.Errorf("netns %s still mounted", pn.NetNS)
	}
	for _, v := range veths {
		if linkExists(v) {
			t.Errorf("veth %s still exists", v)
		}
	}
	var left []string
	for _, l := range iptablesMentions(t, pn.PodID) {
		if masqOK && !strings.Contains(l, "dnat name") && !strings.Contains(l, "CNI-DN-") && !strings.Contains(l, "CNI-HOSTPORT") {
			t.Logf("left by the bridge plugin, whose DEL without a netns keeps ipMasq rules: %s", l)
			continue
		}
		left = append(left, l)
	}
	if len(left) > 0 {
		t.Errorf("iptables still names the pod:\n%s", strings.Join(left, "\n"))
	}
	if held := tn.ipamHolds(t, pn.PodID); len(held) > 0 {
		t.Errorf("host-local still holds %v for the pod", held)
	}
}

func TestTeardownTwiceAndAfterNetNSRemoved(t *testing.T) {
	tn := newTestNet(t)
	ctx := context.Background()

	// DEL, DEL, then remove the netns.
	a, ra := tn.newPod(t)
	va := hostVeths(t, ra.Raw)
	for i := range 2 {
		if err := tn.m.Teardown(ctx, a); err != nil {
			t.Fatalf("DEL %d: %v", i+1, err)
		}
	}
	if err := tn.m.RemoveNetNS(context.Background(), a.NetNS); err != nil {
		t.Fatal(err)
	}
	assertReleased(t, tn, a, va)

	// The netns vanishes first (a crash, a manual cleanup): DEL still
	// releases the address, the iptables rules and the veth (which died
	// with the namespace).
	b, rb := tn.newPod(t, PortMapping{ContainerPort: 80, HostPort: int32(freeHostPort(t))})
	vb := hostVeths(t, rb.Raw)
	if err := tn.m.RemoveNetNS(context.Background(), b.NetNS); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "veth to go with its namespace", func() bool { return !linkExists(vb[0]) })
	for i := range 2 {
		if err := tn.m.Teardown(ctx, b); err != nil {
			t.Fatalf("DEL %d after the netns was removed: %v", i+1, err)
		}
	}
	// Debian's bridge plugin (1.1.1, and upstream through 1.5) finds the
	// addresses whose masquerade rules it removes inside the namespace, so
	// a DEL without one leaves them; the cleanup purges them.
	assertReleasedExcept(t, tn, b, vb, true)

	// DEL of a pod that was never set up.
	if err := tn.m.Teardown(ctx, PodNetwork{PodID: randHex(16), NetNS: tn.m.NetNSPath("nothing")}); err != nil {
		t.Fatalf("DEL of an unknown pod: %v", err)
	}
}

// TestRestartTeardownUsesCache: a new Manager (a restarted daemon) reports
// the pod's IPs and releases everything from libcni's cache, even after the
// node's config file went away.
func TestRestartTeardownUsesCache(t *testing.T) {
	tn := newTestNet(t)
	pn, res := tn.newPod(t, PortMapping{ContainerPort: 80, HostPort: int32(freeHostPort(t))})
	veths := hostVeths(t, res.Raw)
	if err := os.Remove(tn.confFile); err != nil {
		t.Fatal(err)
	}
	m2, err := New(tn.cfg, testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	if ready, reason := m2.Status(); ready {
		t.Fatal("ready without a config")
	} else {
		t.Logf("not ready: %s", reason)
	}
	got, err := m2.CachedResult(pn.PodID)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got.IPs, res.IPs) || got.MAC != res.MAC || got.Gateway != res.Gateway {
		t.Errorf("cached result %+v, want %+v", got, res)
	}
	if _, err := m2.Setup(context.Background(), PodNetwork{PodID: randHex(16), NetNS: pn.NetNS}); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Errorf("Setup without config: %v, want Unavailable", err)
	}
	if err := m2.Teardown(context.Background(), pn); err != nil {
		t.Fatal(err)
	}
	if err := m2.RemoveNetNS(context.Background(), pn.NetNS); err != nil {
		t.Fatal(err)
	}
	assertReleased(t, tn, pn, veths)
}

func TestSetupIdempotent(t *testing.T) {
	tn := newTestNet(t)
	pn, r1 := tn.newPod(t)
	r2, err := tn.m.Setup(context.Background(), pn)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(r1.IPs, r2.IPs) || r1.MAC != r2.MAC {
		t.Fatalf("second Setup gave %+v, first %+v", r2, r1)
	}
	if held := tn.ipamHolds(t, pn.PodID); len(held) != 1 {
		t.Fatalf("host-local holds %v, want one address", held)
	}
}

func TestSetupInvalid(t *testing.T) {
	tn := newTestNet(t)
	ctx := context.Background()
	for _, pn := range []PodNetwork{
		{PodID: "", NetNS: "/x"},
		{PodID: "a/b", NetNS: "/x"},
		{PodID: "abc"},
		{PodID: "abc", NetNS: "/x", PortMappings: []PortMapping{{Protocol: "ICMP", ContainerPort: 1, HostPort: 1}}},
		{PodID: "abc", NetNS: "/x", PortMappings: []PortMapping{{ContainerPort: 70000}}},
		{PodID: "abc", NetNS: "/x", PortMappings: []PortMapping{{ContainerPort: 80, HostPort: 80, HostIP: "nope"}}},
	} {
		if _, err := tn.m.Setup(ctx, pn); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("Setup(%+v) = %v, want InvalidArgument", pn, err)
		}
	}
	// A path that is not a network namespace.
	notNS := filepath.Join(t.TempDir(), "plain")
	os.WriteFile(notNS, nil, 0o644)
	if _, err := tn.m.Setup(ctx, PodNetwork{PodID: randHex(16), NetNS: notNS}); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("Setup on a plain file: %v, want NotFound", err)
	}
}

func TestNetNSLifecycle(t *testing.T) {
	tn := newTestNet(t)
	id := randHex(16)
	p1, err := tn.m.NewNetNS(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tn.m.RemoveNetNS(context.Background(), p1) })
	if p1 != tn.m.NetNSPath(id) || !isNetNSMount(p1) {
		t.Fatalf("NewNetNS = %s, mounted %v", p1, isNetNSMount(p1))
	}
	ino1 := nsInode(t, p1)
	p2, err := tn.m.NewNetNS(context.Background(), id)
	if err != nil || p2 != p1 || nsInode(t, p2) != ino1 {
		t.Fatalf("second NewNetNS = %s, %v; same namespace %v", p2, err, nsInode(t, p2) == ino1)
	}
	if ino1 == nsInode(t, "/proc/self/ns/net") {
		t.Fatal("the pod netns is the host's")
	}
	// lo is up in it.
	var loUp bool
	if err := inNetNS(p1, func() error {
		i, err := net.InterfaceByName("lo")
		loUp = err == nil && i.Flags&net.FlagUp != 0
		return err
	}); err != nil || !loUp {
		t.Fatalf("lo up in pod netns: %v, %v", loUp, err)
	}
	ids, err := tn.m.NetNSPods()
	if err != nil || !slices.Contains(ids, id) {
		t.Fatalf("NetNSPods = %v, %v", ids, err)
	}
	for i := range 2 {
		if err := tn.m.RemoveNetNS(context.Background(), p1); err != nil {
			t.Fatalf("RemoveNetNS %d: %v", i+1, err)
		}
	}
	if _, err := os.Lstat(p1); !os.IsNotExist(err) || mountedAt(t, p1) {
		t.Fatalf("netns still there: %v", err)
	}

	// A plain file left by an interrupted NewNetNS is replaced.
	if err := os.WriteFile(p1, nil, 0o444); err != nil {
		t.Fatal(err)
	}
	if _, err := tn.m.NewNetNS(context.Background(), id); err != nil || !isNetNSMount(p1) {
		t.Fatalf("NewNetNS over a leftover file: %v", err)
	}
	if err := tn.m.RemoveNetNS(context.Background(), p1); err != nil {
		t.Fatal(err)
	}

	for _, bad := range []string{"", "..", "a/b"} {
		if _, err := tn.m.NewNetNS(context.Background(), bad); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("NewNetNS(%q) = %v", bad, err)
		}
	}
	if err := tn.m.RemoveNetNS(context.Background(), "/etc/hostname"); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("RemoveNetNS outside the run dir = %v", err)
	}
	threadsInHostNetNS(t)
}

func TestSysctls(t *testing.T) {
	tn := newTestNet(t)
	id := randHex(16)
	path, err := tn.m.NewNetNS(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tn.m.RemoveNetNS(context.Background(), path) })

	hostSomax := readHost(t, "net/core/somaxconn")
	hostPortStart := readHost(t, "net/ipv4/ip_unprivileged_port_start")
	want := map[string]string{
		"net.core.somaxconn":                  "1234",
		"net.ipv4.ip_unprivileged_port_start": "0",
		"net/ipv4/conf/lo/forwarding":         "1",
	}
	if hostSomax == "1234" || hostPortStart == "0" {
		t.Skip("the host already has the test's values")
	}
	if err := ApplySysctls(path, want); err != nil {
		t.Fatal(err)
	}
	for k, v := range want {
		p, _ := sysctl.Path("/proc", k)
		var got []byte
		if err := inNetNS(path, func() error {
			var err error
			got, err = os.ReadFile(p)
			return err
		}); err != nil {
			t.Fatal(err)
		}
		if string(got) != v+"\n" {
			t.Errorf("in pod: %s = %q, want %q", k, got, v)
		}
	}
	if got := readHost(t, "net/core/somaxconn"); got != hostSomax {
		t.Errorf("host somaxconn changed: %s → %s", hostSomax, got)
	}
	if got := readHost(t, "net/ipv4/ip_unprivileged_port_start"); got != hostPortStart {
		t.Errorf("host ip_unprivileged_port_start changed: %s → %s", hostPortStart, got)
	}

	err = ApplySysctls(path, map[string]string{"kernel.shmmax": "1"})
	if !errors.Is(err, ErrNotNetSysctl) || !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("kernel.shmmax: %v, want ErrNotNetSysctl", err)
	}
	for _, k := range []string{"kernel.panic", "vm.swappiness", "net.ipv4.no_such_thing", "net..x"} {
		err := ApplySysctls(path, map[string]string{k: "1"})
		if !errors.Is(err, errdefs.ErrInvalidArgument) || errors.Is(err, ErrNotNetSysctl) {
			t.Errorf("%s: %v, want InvalidArgument", k, err)
		}
	}
	if err := ApplySysctls(tn.m.NetNSPath("missing"), map[string]string{"net.core.somaxconn": "1"}); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("missing netns: %v, want NotFound", err)
	}
	threadsInHostNetNS(t)
}

func readHost(t *testing.T, rel string) string {
	t.Helper()
	b, err := os.ReadFile("/proc/sys/" + rel)
	if err != nil {
		t.Fatal(err)
	}
	return string(b[:len(b)-1])
}

func nsInode(t *testing.T, path string) uint64 {
	t.Helper()
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return statIno(fi)
}

func freeHostPort(t testing.TB) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// waitFor polls cond until it holds, failing after 10s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	testutil.WaitFor(t, 10*time.Second, what, testutil.Holds(cond))
}
