package kvm

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"math/big"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/network"
)

// testNet is a CNI bridge network private to one test.
type testNet struct {
	m      *network.Manager
	bridge string
	subnet netip.Prefix
}

func newTestNet(t *testing.T) *testNet {
	t.Helper()
	if _, err := os.Stat("/usr/lib/cni/bridge"); err != nil {
		t.Skip("needs the CNI plugins in /usr/lib/cni (Debian: containernetworking-plugins)")
	}
	raw := make([]byte, 3)
	rand.Read(raw)
	suffix := hex.EncodeToString(raw)
	tn := &testNet{bridge: "stgk" + suffix, subnet: freeSubnet(t)}
	base := t.TempDir()
	cfg := network.Config{
		ConfDir:    filepath.Join(base, "net.d"),
		PluginDirs: []string{"/usr/lib/cni"},
		RunDir:     filepath.Join(base, "run"),
		CacheDir:   filepath.Join(base, "cache"),
	}
	conf, _ := json.Marshal(map[string]any{
		"cniVersion": "1.0.0",
		"name":       "stgk-" + suffix,
		"plugins": []any{map[string]any{
			"type":      "bridge",
			"bridge":    tn.bridge,
			"isGateway": true,
			"ipam": map[string]any{
				"type":    "host-local",
				"dataDir": filepath.Join(base, "ipam"),
				"ranges":  [][]map[string]string{{{"subnet": tn.subnet.String()}}},
				"routes":  []map[string]string{{"dst": "0.0.0.0/0"}},
			},
		}},
	})
	if err := os.MkdirAll(cfg.ConfDir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(cfg.ConfDir, "10-test.conflist"), conf, 0o644); err != nil {
		t.Fatal(err)
	}
	m, err := network.New(cfg, testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	tn.m = m
	t.Cleanup(func() {
		if l, err := netlink.LinkByName(tn.bridge); err == nil {
			netlink.LinkDel(l)
		}
		unix.Unmount(filepath.Join(cfg.RunDir, "netns"), unix.MNT_DETACH)
	})
	return tn
}

// freeSubnet picks a /24 in 10.214.0.0/16 that no host interface uses.
func freeSubnet(t *testing.T) netip.Prefix {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		t.Fatal(err)
	}
	for range 100 {
		n, _ := rand.Int(rand.Reader, big.NewInt(250))
		p := netip.MustParsePrefix(fmt.Sprintf("10.214.%d.0/24", n.Int64()+2))
		used := false
		for _, a := range addrs {
			if ipn, ok := a.(*net.IPNet); ok {
				if ip, ok := netip.AddrFromSlice(ipn.IP); ok && p.Contains(ip.Unmap()) {
					used = true
				}
			}
		}
		if !used {
			return p
		}
	}
	t.Fatal("no free subnet")
	return netip.Prefix{}
}

// podNet makes a network namespace attached to the network; cleanup
// detaches and removes it.
func (tn *testNet) podNet(t *testing.T, id string) (netns string, res *network.Result) {
	t.Helper()
	pn := network.PodNetwork{PodID: id, Name: id, Namespace: "default", UID: id}
	path, err := tn.m.NewNetNS(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	pn.NetNS = path
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := tn.m.Teardown(ctx, pn); err != nil {
			t.Errorf("cleanup: teardown: %v", err)
		}
		if err := tn.m.RemoveNetNS(context.Background(), path); err != nil {
			t.Errorf("cleanup: remove netns: %v", err)
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if res, err = tn.m.Setup(ctx, pn); err != nil {
		t.Fatal(err)
	}
	return path, res
}

// TestTwoPodsOverCNI: two kvm pods on one CNI bridge; each guest has its
// pod's IP and MAC, one serves HTTP and the other fetches from it; after
// DestroyPod no tap and no redirect is left in either namespace.
func TestTwoPodsOverCNI(t *testing.T) {
	b := testBackend(t)
	tn := newTestNet(t)
	nsA, resA := tn.podNet(t, fmt.Sprintf("neta%d", os.Getpid()))
	nsB, resB := tn.podNet(t, fmt.Sprintf("netb%d", os.Getpid()))
	t.Logf("pod A %v %s, pod B %v %s", resA.IPs, resA.MAC, resB.IPs, resB.MAC)

	a := startVM(t, b, nsA, nil)
	vb := startVM(t, b, nsB, nil)
	serve := func(name string) []string {
		return []string{"/bin/sh", "-c", "mkdir -p /tmp/www && echo hello-from-" + name +
			" > /tmp/www/index.html && exec httpd -f -p 8080 -h /tmp/www"}
	}
	a.run(t, "web", serve("A")...)
	vb.run(t, "web", serve("B")...)

	out, _ := vb.exec(t, "web", "sh", "-c", "cat /sys/class/net/eth0/address; ip -4 -o addr show dev eth0")
	if !strings.Contains(out, resB.MAC) || !strings.Contains(out, resB.IPs[0]+"/") {
		t.Errorf("guest B's eth0: %q, want MAC %s and IP %s", out, resB.MAC, resB.IPs[0])
	}
	// Each pod fetches the other's page. busybox's static wget crashes
	// in its resolver: speak HTTP with nc.
	for _, c := range []struct {
		from *vmPod
		to   string
		want string
	}{{vb, resA.IPs[0], "hello-from-A"}, {a, resB.IPs[0], "hello-from-B"}} {
		fetch := "printf 'GET /index.html HTTP/1.0\\r\\n\\r\\n' | nc -w 5 " + c.to + " 8080"
		deadline := time.Now().Add(60 * time.Second)
		for {
			out, code := c.from.exec(t, "web", "sh", "-c", fetch)
			if code == 0 && strings.HasSuffix(strings.TrimSpace(out), c.want) {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("fetching from %s: exit %d, %q", c.to, code, out)
			}
			time.Sleep(200 * time.Millisecond) // polling: httpd may not listen yet
		}
	}

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for _, vp := range []*vmPod{a, vb} {
		if err := vp.pod.Stop(ctx, 2*time.Second); err != nil {
			t.Errorf("Stop: %v", err)
		}
		if err := b.DestroyPod(ctx, vp.spec, vp.pod.State()); err != nil {
			t.Errorf("DestroyPod: %v", err)
		}
	}
	for _, ns := range []string{nsA, nsB} {
		if left := netLeftovers(t, ns); left != "" {
			t.Errorf("left in %s after DestroyPod: %s", ns, left)
		}
	}
}

// netLeftovers describes what the backend left in a pod's namespace: a
// tap, or a qdisc on eth0 other than the default.
func netLeftovers(t *testing.T, ns string) string {
	var left []string
	err := inNetNS(ns, func() error {
		if _, err := netlink.LinkByName(tapName); err == nil {
			left = append(left, "device "+tapName)
		}
		eth, err := netlink.LinkByName(podIf)
		if err != nil {
			return err
		}
		qs, err := netlink.QdiscList(eth)
		if err != nil {
			return err
		}
		for _, q := range qs {
			if q.Type() == "ingress" {
				left = append(left, "ingress qdisc on "+podIf)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return strings.Join(left, ", ")
}
