package network

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"log/slog"
	"math/big"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/internal/testutil"
)

// needNetRoot skips tests that create namespaces, bridges and iptables rules.
func needNetRoot(t testing.TB) {
	t.Helper()
	testutil.NeedRoot(t, "creates network namespaces, a bridge and iptables rules")
	if _, err := os.Stat("/usr/lib/cni/bridge"); err != nil {
		t.Skip("needs the CNI plugins in /usr/lib/cni (Debian package containernetworking-plugins)")
	}
	for _, bin := range []string{"ip", "iptables-save"} {
		if _, err := exec.LookPath(bin); err != nil {
			t.Skipf("needs %s", bin)
		}
	}
}

func randHex(n int) string {
	b := make([]byte, n)
	rand.Read(b)
	return hex.EncodeToString(b)
}

func testLogger(t testing.TB) *slog.Logger {
	if testing.Verbose() {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.DiscardHandler)
}

// testNet is a CNI network private to one test: its own bridge, a /24 in
// 10.213.0.0/16 that no host interface uses, its own IPAM data dir, conf
// dir, run dir and cache dir.
type testNet struct {
	m        *Manager
	cfg      Config
	name     string // CNI network name
	bridge   string
	subnet   netip.Prefix
	gateway  netip.Addr
	dataDir  string // host-local's
	confFile string
}

func pickSubnet(t testing.TB) netip.Prefix {
	t.Helper()
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		t.Fatal(err)
	}
	for range 100 {
		n, _ := rand.Int(rand.Reader, big.NewInt(250))
		p := netip.MustParsePrefix(fmt.Sprintf("10.213.%d.0/24", n.Int64()+2))
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
	t.Fatal("no free /24 in 10.213.0.0/16")
	return netip.Prefix{}
}

func testConflist(name, bridge string, subnet netip.Prefix, dataDir string) []byte {
	conf := map[string]any{
		"cniVersion": "1.0.0",
		"name":       name,
		"plugins": []any{
			map[string]any{
				"type":        "bridge",
				"bridge":      bridge,
				"isGateway":   true,
				"ipMasq":      true,
				"hairpinMode": true,
				"ipam": map[string]any{
					"type":    "host-local",
					"dataDir": dataDir,
					"ranges":  [][]map[string]string{{{"subnet": subnet.String()}}},
					"routes":  []map[string]string{{"dst": "0.0.0.0/0"}},
				},
			},
			map[string]any{"type": "portmap", "capabilities": map[string]bool{"portMappings": true}},
		},
	}
	b, _ := json.Marshal(conf)
	return b
}

func newTestNet(t testing.TB) *testNet {
	t.Helper()
	needNetRoot(t)
	suffix := randHex(3)
	tn := &testNet{
		name:   "stgt-" + suffix,
		bridge: "stgt" + suffix,
		subnet: pickSubnet(t),
	}
	tn.gateway = tn.subnet.Addr().Next()
	base := t.TempDir()
	tn.dataDir = filepath.Join(base, "ipam")
	tn.cfg = Config{
		ConfDir:    filepath.Join(base, "net.d"),
		PluginDirs: []string{"/usr/lib/cni"},
		RunDir:     filepath.Join(base, "run"),
		CacheDir:   filepath.Join(base, "cache"),
	}
	if err := os.MkdirAll(tn.cfg.ConfDir, 0o755); err != nil {
		t.Fatal(err)
	}
	tn.confFile = filepath.Join(tn.cfg.ConfDir, "10-test.conflist")
	if err := os.WriteFile(tn.confFile, testConflist(tn.name, tn.bridge, tn.subnet, tn.dataDir), 0o644); err != nil {
		t.Fatal(err)
	}
	m, err := New(tn.cfg, testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	tn.m = m
	t.Cleanup(func() {
		// The bridge outlives its last pod (the plugin never deletes it).
		exec.Command("ip", "link", "del", tn.bridge).Run()
		// RunDir/netns was made a shared mount point.
		unix.Unmount(filepath.Join(tn.cfg.RunDir, "netns"), unix.MNT_DETACH)
	})
	return tn
}

// newPod creates a netns and attaches it; cleanup releases both, also when
// the test fails.
func (tn *testNet) newPod(t testing.TB, ports ...PortMapping) (PodNetwork, *Result) {
	t.Helper()
	pn := PodNetwork{PodID: randHex(16), Name: "pod-" + randHex(2), Namespace: "default", UID: randHex(8), PortMappings: ports}
	path, err := tn.m.NewNetNS(context.Background(), pn.PodID)
	if err != nil {
		t.Fatal(err)
	}
	pn.NetNS = path
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := tn.m.Teardown(ctx, pn); err != nil {
			t.Errorf("cleanup teardown: %v", err)
		}
		if err := tn.m.RemoveNetNS(context.Background(), path); err != nil {
			t.Errorf("cleanup remove netns: %v", err)
		}
		purgeIptables(t, pn.PodID)
	})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	res, err := tn.m.Setup(ctx, pn)
	if err != nil {
		t.Fatal(err)
	}
	return pn, res
}

// listenIn opens a TCP listener inside the netns at path.
func listenIn(t testing.TB, path, addr string) net.Listener {
	t.Helper()
	var l net.Listener
	err := inNetNS(path, func() error {
		var err error
		l, err = net.Listen("tcp", addr)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

// serveEcho answers each connection with "echo:" and what it read.
func serveEcho(l net.Listener) {
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				c.SetDeadline(time.Now().Add(10 * time.Second))
				buf := make([]byte, 256)
				n, err := c.Read(buf)
				if err != nil {
					return
				}
				c.Write(append([]byte("echo:"), buf[:n]...))
			}()
		}
	}()
}

// roundTrip sends msg over conn and returns the answer.
func roundTrip(c net.Conn, msg string) (string, error) {
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Write([]byte(msg)); err != nil {
		return "", err
	}
	buf := make([]byte, 256)
	n, err := c.Read(buf)
	return string(buf[:n]), err
}

// dialFrom dials addr from inside the netns at path ("" = the host's).
func dialFrom(path, addr string) (net.Conn, error) {
	d := net.Dialer{Timeout: 5 * time.Second}
	if path == "" {
		return d.Dial("tcp", addr)
	}
	var c net.Conn
	err := inNetNS(path, func() error {
		var err error
		c, err = d.Dial("tcp", addr)
		return err
	})
	return c, err
}

// hostVeths are the host-side interfaces a CNI result names.
func hostVeths(t testing.TB, raw []byte) []string {
	t.Helper()
	var r struct {
		Interfaces []struct {
			Name    string `json:"name"`
			Sandbox string `json:"sandbox"`
		} `json:"interfaces"`
	}
	if err := json.Unmarshal(raw, &r); err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, i := range r.Interfaces {
		if i.Sandbox == "" && strings.HasPrefix(i.Name, "veth") {
			out = append(out, i.Name)
		}
	}
	return out
}

func linkExists(name string) bool {
	return exec.Command("ip", "link", "show", "dev", name).Run() == nil
}

func iptablesMentions(t testing.TB, s string) []string {
	t.Helper()
	out, err := exec.Command("iptables-save").Output()
	if err != nil {
		t.Fatalf("iptables-save: %v", err)
	}
	var lines []string
	for _, l := range bytes.Split(out, []byte("\n")) {
		if bytes.Contains(l, []byte(s)) {
			lines = append(lines, string(l))
		}
	}
	return lines
}

// ipamHolds lists host-local's allocation files that name podID.
func (tn *testNet) ipamHolds(t testing.TB, podID string) []string {
	t.Helper()
	dir := filepath.Join(tn.dataDir, tn.name)
	ents, err := os.ReadDir(dir)
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	var out []string
	for _, e := range ents {
		b, err := os.ReadFile(filepath.Join(dir, e.Name()))
		if err == nil && bytes.Contains(b, []byte(podID)) {
			out = append(out, e.Name())
		}
	}
	return out
}

func mountedAt(t testing.TB, path string) bool {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.Fields(l)
		if len(f) > 4 && f[4] == path {
			return true
		}
	}
	return false
}

// startNetNS is the network namespace the test process started in.
var startNetNS, _ = os.Readlink("/proc/self/ns/net")

// threadsInHostNetNS fails the test when a thread of this process is not in
// the network namespace the process started in.
func threadsInHostNetNS(t testing.TB) {
	t.Helper()
	want := startNetNS
	if want == "" {
		t.Fatal("the test process's netns is unknown")
	}
	tasks, err := os.ReadDir("/proc/self/task")
	if err != nil {
		t.Fatal(err)
	}
	for _, task := range tasks {
		got, err := os.Readlink(filepath.Join("/proc/self/task", task.Name(), "ns/net"))
		if err != nil {
			continue // the thread ended
		}
		if got != want {
			t.Errorf("thread %s is in %s, not the host's %s", task.Name(), got, want)
		}
	}
}

func statIno(fi os.FileInfo) uint64 { return fi.Sys().(*syscall.Stat_t).Ino }

// purgeIptables removes nat rules that still name podID, and the per-pod
// chains they jump to, so that a failed or leaky test leaves the host's
// iptables as it found them.
func purgeIptables(t testing.TB, podID string) {
	t.Helper()
	out, err := exec.Command("iptables-save", "-t", "nat").Output()
	if err != nil {
		return
	}
	chains := map[string]bool{} // chains holding rules that name the pod
	podChains := map[string]bool{}
	for _, l := range strings.Split(string(out), "\n") {
		if !strings.HasPrefix(l, "-A ") || !strings.Contains(l, podID) {
			continue
		}
		f := strings.Fields(l)
		chains[f[1]] = true
		if i := slices.Index(f, "-j"); i > 0 && i+1 < len(f) && strings.HasPrefix(f[i+1], "CNI-") && !strings.HasPrefix(f[i+1], "CNI-HOSTPORT-") {
			podChains[f[i+1]] = true
		}
	}
	for c := range chains {
		if podChains[c] {
			continue
		}
		list, err := exec.Command("iptables", "-t", "nat", "-L", c, "-n", "--line-numbers").Output()
		if err != nil {
			continue
		}
		var nums []int
		for _, l := range strings.Split(string(list), "\n") {
			if strings.Contains(l, podID) {
				var n int
				if _, err := fmt.Sscan(l, &n); err == nil {
					nums = append(nums, n)
				}
			}
		}
		slices.Sort(nums)
		for i := len(nums) - 1; i >= 0; i-- {
			exec.Command("iptables", "-t", "nat", "-D", c, fmt.Sprint(nums[i])).Run()
		}
	}
	for c := range podChains {
		exec.Command("iptables", "-t", "nat", "-F", c).Run()
		exec.Command("iptables", "-t", "nat", "-X", c).Run()
	}
}
