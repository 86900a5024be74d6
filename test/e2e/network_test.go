package e2e

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/internal/testutil"
	"github.com/stagelet/stagelet/test/e2e/harness"
)

// bothStage1sPolicy lets a pod choose fly or nspawn by runtime handler.
const bothStage1sPolicy = "version: 1\ndefault_stage1: fly\nhandlers:\n  fly: {stage1: fly}\n  nspawn: {stage1: nspawn}\n"

// podStage1 is a stage1 chosen by runtime handler, with the PID and IPC
// namespace modes its pods use: fly shares the host's, nspawn cannot.
type podStage1 struct {
	handler  string
	pid, ipc runtimeapi.NamespaceMode
}

var (
	flyStage1    = podStage1{"fly", runtimeapi.NamespaceMode_NODE, runtimeapi.NamespaceMode_NODE}
	nspawnStage1 = podStage1{"nspawn", runtimeapi.NamespaceMode_POD, runtimeapi.NamespaceMode_POD}
)

// podNetNS is the namespace option of a pod with its own network.
func (s podStage1) podNetNS() *runtimeapi.NamespaceOption {
	return &runtimeapi.NamespaceOption{Network: runtimeapi.NamespaceMode_POD, Pid: s.pid, Ipc: s.ipc}
}

// forEachStage1 runs body once for fly and once for nspawn, each on a
// daemon of its own whose policy maps both handlers.
func forEachStage1(t *testing.T, body func(t *testing.T, e *env, s podStage1)) {
	for _, s := range []podStage1{flyStage1, nspawnStage1} {
		t.Run(s.handler, func(t *testing.T) {
			e := newEnvOpts(t, harness.Options{Policy: bothStage1sPolicy}, true)
			body(t, e, s)
		})
	}
}

// netPodConfig is a pod config in a network namespace of its own.
func (e *env) netPodConfig(name string, s podStage1) *runtimeapi.PodSandboxConfig {
	cfg := e.podConfig(name)
	cfg.Linux.SecurityContext.NamespaceOptions = s.podNetNS()
	return cfg
}

// netContainer is a container of a pod with its own network.
func (e *env) netContainer(s podStage1, name string, cmd ...string) *runtimeapi.ContainerConfig {
	cfg := e.containerConfig(name, cmd...)
	cfg.Linux.SecurityContext.NamespaceOptions = s.podNetNS()
	return cfg
}

// runStage1Pod runs a pod with s's runtime handler and checks that it got
// that stage1.
func (e *env) runStage1Pod(cfg *runtimeapi.PodSandboxConfig, s podStage1) string {
	e.t.Helper()
	id := e.runPodHandler(cfg, s.handler)
	if got := e.podStatus(id).RuntimeHandler; got != s.handler {
		e.t.Fatalf("pod %s runs on stage1 %q, want %q (its runtime handler)", cfg.Metadata.Name, got, s.handler)
	}
	return id
}

// wget fetches url to stdout inside a container. Without -T: that option
// crashes Debian's busybox-static; ExecSync's timeout bounds the call.
func wget(url string) []string { return []string{"wget", "-q", "-O", "-", url} }

// httpServer is a container command serving body at / on port 8080 with
// busybox httpd.
func httpServer(body string) []string {
	return []string{"sh", "-c", fmt.Sprintf("mkdir -p /www && echo %s > /www/index.html && exec httpd -f -p 8080 -h /www", body)}
}

// podIP returns the pod's IP from PodSandboxStatus and checks it lies in
// the daemon's subnet.
func (e *env) podIP(podID string) netip.Addr {
	e.t.Helper()
	st := e.podStatus(podID)
	ip, err := netip.ParseAddr(st.GetNetwork().GetIp())
	if err != nil {
		e.t.Fatalf("pod %s: PodSandboxStatus network ip %q: %v", podID, st.GetNetwork().GetIp(), err)
	}
	subnet := netip.MustParsePrefix(e.d.Subnet)
	if !subnet.Contains(ip) {
		e.t.Fatalf("pod %s has IP %s, outside the daemon's subnet %s", podID, ip, subnet)
	}
	if ip == e.gateway() {
		e.t.Fatalf("pod %s has the bridge's gateway address %s", podID, ip)
	}
	return ip
}

// gateway is the bridge's address: the first of the daemon's subnet.
func (e *env) gateway() netip.Addr {
	return netip.MustParsePrefix(e.d.Subnet).Addr().Next()
}

// httpGet fetches url from the test process (host network namespace).
func httpGet(url string) (string, error) {
	c := &http.Client{Timeout: 3 * time.Second}
	resp, err := c.Get(url)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", err
	}
	if resp.StatusCode != http.StatusOK {
		return string(b), fmt.Errorf("%s: %s", url, resp.Status)
	}
	return string(b), nil
}

// waitHTTP waits until url answers want from the test process.
func (e *env) waitHTTP(url, want string) {
	e.t.Helper()
	testutil.WaitFor(e.t, stateTimeout, "GET "+url, func() (bool, string) {
		got, err := httpGet(url)
		if err != nil {
			return false, err.Error()
		}
		return got == want, fmt.Sprintf("body %q, want %q", got, want)
	})
}

// networkHeld lists what the daemon's pods hold of its network right now:
// pod netns files under RunDir/netns, veths on its bridge, host-local
// address allocations.
func (e *env) networkHeld() []string {
	e.t.Helper()
	var held []string
	ents, err := os.ReadDir(filepath.Join(e.d.RunDir, "netns"))
	if err != nil && !os.IsNotExist(err) {
		e.t.Fatalf("list netns dir: %v", err)
	}
	for _, ent := range ents {
		held = append(held, "netns "+ent.Name())
	}
	out, err := exec.Command("ip", "-o", "link", "show", "master", e.d.Bridge).CombinedOutput()
	if err == nil {
		for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
			if f := strings.Fields(line); len(f) > 1 {
				held = append(held, "veth "+strings.TrimSuffix(f[1], ":"))
			}
		}
	}
	filepath.Walk(filepath.Join(e.d.Root, "ipam"), func(p string, info os.FileInfo, err error) error {
		if err != nil || info.IsDir() {
			return nil
		}
		if n := info.Name(); n != "lock" && !strings.HasPrefix(n, "last_reserved_ip") {
			held = append(held, "ipam "+n)
		}
		return nil
	})
	slices.Sort(held)
	return held
}

// natRulesFor returns the nat table's rules naming addr.
func natRulesFor(t *testing.T, addr string) []string {
	t.Helper()
	out, err := exec.Command("iptables-save", "-t", "nat").CombinedOutput()
	if err != nil {
		t.Fatalf("iptables-save: %v\n%s", err, out)
	}
	var rules []string
	for _, line := range strings.Split(string(out), "\n") {
		if strings.Contains(line, addr) {
			rules = append(rules, line)
		}
	}
	return rules
}

// freePort returns a TCP port nothing listens on right now.
func freePort(t *testing.T) int32 {
	t.Helper()
	l, err := net.Listen("tcp4", "0.0.0.0:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return int32(l.Addr().(*net.TCPAddr).Port)
}

// Two pods in their own network namespaces get distinct addresses in the
// node's pod subnet, hold them on their own interface, and reach each other.
func TestPodNetworkTwoPodsReachEachOther(t *testing.T) {
	forEachStage1(t, func(t *testing.T, e *env, s podStage1) {
		cfgA := e.netPodConfig("net-a", s)
		podA := e.runStage1Pod(cfgA, s)
		cfgB := e.netPodConfig("net-b", s)
		podB := e.runStage1Pod(cfgB, s)
		srvA := e.createAndStart(podA, cfgA, e.netContainer(s, "server", httpServer("hello-from-a")...))
		srvB := e.createAndStart(podB, cfgB, e.netContainer(s, "server", httpServer("hello-from-b")...))
		e.waitContainerState(srvA, running, stateTimeout)
		e.waitContainerState(srvB, running, stateTimeout)

		ipA, ipB := e.podIP(podA), e.podIP(podB)
		if ipA == ipB {
			t.Fatalf("both pods got the address %s", ipA)
		}
		// Each pod holds its address on its own interface, and not the
		// other's.
		for _, c := range []struct {
			ctr      string
			own, not netip.Addr
		}{{srvA, ipA, ipB}, {srvB, ipB, ipA}} {
			addrs := e.execOK(c.ctr, "ip", "-o", "-4", "addr", "show")
			if !strings.Contains(addrs, " "+c.own.String()+"/") {
				t.Errorf("pod with IP %s does not hold it; its addresses:\n%s", c.own, addrs)
			}
			if strings.Contains(addrs, " "+c.not.String()+"/") {
				t.Errorf("pod with IP %s also holds the other pod's %s: the pods share a network namespace:\n%s", c.own, c.not, addrs)
			}
		}

		fetch := func(from, ip, want string) {
			t.Helper()
			url := "http://" + ip + ":8080/"
			testutil.WaitFor(t, stateTimeout, "wget "+url+" from the other pod", func() (bool, string) {
				r := e.execSync(from, wget(url)...)
				if r.ExitCode != 0 {
					return false, fmt.Sprintf("exit %d: %s", r.ExitCode, r.Stderr)
				}
				return string(r.Stdout) == want, fmt.Sprintf("got %q, want %q", r.Stdout, want)
			})
		}
		fetch(srvB, ipA.String(), "hello-from-a\n")
		fetch(srvA, ipB.String(), "hello-from-b\n")
	})
}

// A hostPort mapping reaches the server in the pod from the node; the
// mapping's NAT rules exist while the pod runs and go with it.
func TestPodHostPort(t *testing.T) {
	forEachStage1(t, func(t *testing.T, e *env, s podStage1) {
		hostPort := freePort(t)
		cfg := e.netPodConfig("hostport", s)
		cfg.PortMappings = []*runtimeapi.PortMapping{{
			Protocol: runtimeapi.Protocol_TCP, ContainerPort: 8080, HostPort: hostPort,
		}}
		podID := e.runStage1Pod(cfg, s)
		ctr := e.createAndStart(podID, cfg, e.netContainer(s, "server", httpServer("via-hostport")...))
		e.waitContainerState(ctr, running, stateTimeout)
		ip := e.podIP(podID)

		// The server itself, straight at the pod's address.
		e.waitHTTP(fmt.Sprintf("http://%s:8080/", ip), "via-hostport\n")
		rules := natRulesFor(t, ip.String()+":8080")
		if len(rules) == 0 {
			t.Errorf("no DNAT rule to %s:8080 while the pod with hostPort %d runs", ip, hostPort)
		}
		// Through the hostPort, on the node's address on the pod bridge
		// and on loopback.
		e.waitHTTP(fmt.Sprintf("http://%s:%d/", e.gateway(), hostPort), "via-hostport\n")
		e.waitHTTP(fmt.Sprintf("http://127.0.0.1:%d/", hostPort), "via-hostport\n")

		if _, err := e.rt().StopPodSandbox(e.ctx(), &runtimeapi.StopPodSandboxRequest{PodSandboxId: podID}); err != nil {
			t.Fatalf("StopPodSandbox: %v", err)
		}
		if rules := natRulesFor(t, ip.String()); len(rules) > 0 {
			t.Errorf("NAT rules naming the pod's address after StopPodSandbox:\n%s", strings.Join(rules, "\n"))
		}
		if _, err := httpGet(fmt.Sprintf("http://%s:%d/", e.gateway(), hostPort)); err == nil {
			t.Errorf("hostPort %d still answers after StopPodSandbox", hostPort)
		}
	})
}

// A pod outside the host's network has a UTS namespace of its own on every
// stage1, also without a hostname: a container allowed to set the host
// name (CAP_SYS_ADMIN) sets its pod's, never the node's. On fly, whose
// apps are host processes, the apps' own UTS namespace is all that keeps
// it from the host's.
func TestPodUTSNamespace(t *testing.T) {
	hostBefore, err := os.Hostname()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// A failure here would leave the machine renamed.
		if h, err := os.Hostname(); err == nil && h != hostBefore {
			if err := unix.Sethostname([]byte(hostBefore)); err != nil {
				t.Errorf("restore the host's name %q: %v", hostBefore, err)
			}
		}
	})
	forEachStage1(t, func(t *testing.T, e *env, s podStage1) {
		cfg := e.netPodConfig("uts", s)
		cfg.Hostname = ""
		podID := e.runStage1Pod(cfg, s)
		ctrCfg := e.netContainer(s, "app", "sleep", "3600")
		ctrCfg.Linux.SecurityContext.Capabilities = &runtimeapi.Capability{AddCapabilities: []string{"SYS_ADMIN"}}
		ctr := e.createAndStart(podID, cfg, ctrCfg)
		e.waitContainerState(ctr, running, stateTimeout)
		const name = "set-in-the-pod"
		e.execOK(ctr, "hostname", name)
		if got := strings.TrimSpace(e.execOK(ctr, "hostname")); got != name {
			t.Errorf("hostname in the container after setting it: %q, want %q", got, name)
		}
		if h, err := os.Hostname(); err != nil || h != hostBefore {
			t.Fatalf("the host's name is %q after a pod set its own (was %q, %v)", h, hostBefore, err)
		}
		if s != flyStage1 {
			return
		}
		// A fly pod in the host's network keeps the node's name, as
		// hostNetwork pods do under runc.
		hostCfg := e.podConfig("uts-host")
		hostPod := e.runStage1Pod(hostCfg, s)
		hostCtr := e.createAndStart(hostPod, hostCfg, e.containerConfig("app", "sleep", "3600"))
		e.waitContainerState(hostCtr, running, stateTimeout)
		if got := strings.TrimSpace(e.execOK(hostCtr, "hostname")); got != hostBefore {
			t.Errorf("hostname in a hostNetwork fly container: %q, want the node's %q", got, hostBefore)
		}
	})
}

// The CRI DNS config becomes the containers' /etc/resolv.conf, and the
// pod's hostname is the containers' host name, /etc/hostname, and in
// /etc/hosts with the pod's address.
func TestPodDNSAndHostname(t *testing.T) {
	forEachStage1(t, func(t *testing.T, e *env, s podStage1) {
		cfg := e.netPodConfig("dns", s)
		cfg.Hostname = "dns-pod-" + randHex(3)
		cfg.DnsConfig = &runtimeapi.DNSConfig{
			Servers:  []string{"192.0.2.53", "192.0.2.54"},
			Searches: []string{"e2e.svc.cluster.local", "svc.cluster.local", "cluster.local"},
			Options:  []string{"ndots:5", "timeout:2"},
		}
		podID := e.runStage1Pod(cfg, s)
		ctr := e.createAndStart(podID, cfg, e.netContainer(s, "app", "sleep", "3600"))
		e.waitContainerState(ctr, running, stateTimeout)

		resolv := e.execOK(ctr, "cat", "/etc/resolv.conf")
		lines := map[string]bool{}
		for _, l := range strings.Split(resolv, "\n") {
			lines[strings.Join(strings.Fields(l), " ")] = true
		}
		for _, want := range []string{
			"nameserver 192.0.2.53",
			"nameserver 192.0.2.54",
			"search e2e.svc.cluster.local svc.cluster.local cluster.local",
			"options ndots:5 timeout:2",
		} {
			if !lines[want] {
				t.Errorf("/etc/resolv.conf lacks the line %q:\n%s", want, resolv)
			}
		}
		if strings.Count(resolv, "nameserver") != 2 {
			t.Errorf("/etc/resolv.conf holds other name servers than the pod's:\n%s", resolv)
		}

		if got := strings.TrimSpace(e.execOK(ctr, "hostname")); got != cfg.Hostname {
			t.Errorf("hostname in the container: %q, want %q", got, cfg.Hostname)
		}
		if got := strings.TrimSpace(e.execOK(ctr, "cat", "/etc/hostname")); got != cfg.Hostname {
			t.Errorf("/etc/hostname: %q, want %q", got, cfg.Hostname)
		}
		ip := e.podIP(podID)
		hosts := e.execOK(ctr, "cat", "/etc/hosts")
		found := false
		for _, l := range strings.Split(hosts, "\n") {
			f := strings.Fields(l)
			if len(f) > 1 && f[0] == ip.String() && slices.Contains(f[1:], cfg.Hostname) {
				found = true
			}
		}
		if !found {
			t.Errorf("/etc/hosts does not map %s to the pod's address %s:\n%s", cfg.Hostname, ip, hosts)
		}
	})
}

func readHostSysctl(t *testing.T, name string) string {
	t.Helper()
	b, err := os.ReadFile("/proc/sys/" + strings.ReplaceAll(name, ".", "/"))
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}

// Namespaced net.* sysctls apply inside the pod's network namespace and
// leave the host's alone; sysctls that would change the node are refused.
func TestPodSysctls(t *testing.T) {
	forEachStage1(t, func(t *testing.T, e *env, s podStage1) {
		const portStart, somaxconn = "net.ipv4.ip_unprivileged_port_start", "net.core.somaxconn"
		hostPortStart, hostSomaxconn := readHostSysctl(t, portStart), readHostSysctl(t, somaxconn)
		want := map[string]string{portStart: "80", somaxconn: "1234"}
		if hostPortStart == want[portStart] {
			want[portStart] = "81"
		}
		if hostSomaxconn == want[somaxconn] {
			want[somaxconn] = "1235"
		}
		cfg := e.netPodConfig("sysctl", s)
		cfg.Linux.Sysctls = want
		podID := e.runStage1Pod(cfg, s)
		ctr := e.createAndStart(podID, cfg, e.netContainer(s, "app", "sleep", "3600"))
		e.waitContainerState(ctr, running, stateTimeout)
		for name, v := range want {
			path := "/proc/sys/" + strings.ReplaceAll(name, ".", "/")
			if got := strings.TrimSpace(e.execOK(ctr, "cat", path)); got != v {
				t.Errorf("%s inside the pod: %q, want %q", name, got, v)
			}
		}
		if got := readHostSysctl(t, portStart); got != hostPortStart {
			t.Errorf("the host's %s changed: %q, was %q", portStart, got, hostPortStart)
		}
		if got := readHostSysctl(t, somaxconn); got != hostSomaxconn {
			t.Errorf("the host's %s changed: %q, was %q", somaxconn, got, hostSomaxconn)
		}

		// kernel.panic is the node's, whatever the pod's namespaces.
		bad := e.netPodConfig("sysctl-host", s)
		bad.Linux.Sysctls = map[string]string{"kernel.panic": "7"}
		hostPanic := readHostSysctl(t, "kernel.panic")
		_, err := e.rt().RunPodSandbox(e.ctx(), &runtimeapi.RunPodSandboxRequest{Config: bad, RuntimeHandler: s.handler})
		requireCode(t, err, codes.InvalidArgument, "RunPodSandbox with sysctl kernel.panic")
		if !strings.Contains(err.Error(), "kernel.panic") {
			t.Errorf("the refusal does not name the sysctl: %v", err)
		}
		// A net.* sysctl of a host-network pod would be the host's.
		hostNet := e.netPodConfig("sysctl-hostnet", s)
		hostNet.Linux.SecurityContext.NamespaceOptions.Network = runtimeapi.NamespaceMode_NODE
		hostNet.Linux.Sysctls = map[string]string{somaxconn: "1236"}
		_, err = e.rt().RunPodSandbox(e.ctx(), &runtimeapi.RunPodSandboxRequest{Config: hostNet, RuntimeHandler: s.handler})
		requireCode(t, err, codes.InvalidArgument, "RunPodSandbox of a host-network pod with sysctl "+somaxconn)
		if got := readHostSysctl(t, "kernel.panic"); got != hostPanic {
			t.Errorf("the host's kernel.panic changed: %q, was %q", got, hostPanic)
		}
		if got := readHostSysctl(t, somaxconn); got != hostSomaxconn {
			t.Errorf("the host's %s changed: %q, was %q", somaxconn, got, hostSomaxconn)
		}
	})
}

// A pod's network is held while it runs, released by StopPodSandbox (CNI
// DEL: veth and address; idempotent) and its netns goes with
// RemovePodSandbox. The harness's teardown then finds nothing left.
func TestPodNetworkTeardown(t *testing.T) {
	forEachStage1(t, func(t *testing.T, e *env, s podStage1) {
		if held := e.networkHeld(); len(held) > 0 {
			t.Fatalf("the daemon's network holds %v before any pod ran", held)
		}
		cfg := e.netPodConfig("teardown", s)
		podID := e.runStage1Pod(cfg, s)
		ctr := e.createAndStart(podID, cfg, e.netContainer(s, "app", "sleep", "3600"))
		e.waitContainerState(ctr, running, stateTimeout)
		ip := e.podIP(podID)

		held := e.networkHeld()
		wantHeld := []string{"ipam " + ip.String(), "netns " + podID}
		for _, w := range wantHeld {
			if !slices.Contains(held, w) {
				t.Errorf("while the pod runs the network holds %v, want %q among them", held, w)
			}
		}
		if !slices.ContainsFunc(held, func(h string) bool { return strings.HasPrefix(h, "veth ") }) {
			t.Errorf("while the pod runs no veth is on the bridge %s: %v", e.d.Bridge, held)
		}

		for i := 1; i <= 2; i++ {
			if _, err := e.rt().StopPodSandbox(e.ctx(), &runtimeapi.StopPodSandboxRequest{PodSandboxId: podID}); err != nil {
				t.Fatalf("StopPodSandbox #%d: %v", i, err)
			}
		}
		held = e.networkHeld()
		if slices.ContainsFunc(held, func(h string) bool { return !strings.HasPrefix(h, "netns ") }) {
			t.Errorf("after StopPodSandbox the network still holds %v, want at most the netns", held)
		}
		for i := 1; i <= 2; i++ {
			if _, err := e.rt().RemovePodSandbox(e.ctx(), &runtimeapi.RemovePodSandboxRequest{PodSandboxId: podID}); err != nil {
				t.Fatalf("RemovePodSandbox #%d: %v", i, err)
			}
		}
		if held := e.networkHeld(); len(held) > 0 {
			t.Errorf("after RemovePodSandbox the network still holds %v", held)
		}
		if mi, err := os.ReadFile("/proc/self/mountinfo"); err == nil && strings.Contains(string(mi), filepath.Join(e.d.RunDir, "netns", podID)) {
			t.Errorf("the pod's netns is still mounted after RemovePodSandbox")
		}
		if rules := natRulesFor(t, ip.String()); len(rules) > 0 {
			t.Errorf("NAT rules naming the pod's address after removal:\n%s", strings.Join(rules, "\n"))
		}
	})
}

// The daemon is killed with SIGKILL while a networked pod serves. The pod
// keeps its address and stays reachable while the daemon is down and after
// the restart; its teardown then releases the whole network.
func TestPodNetworkSurvivesDaemonKill9(t *testing.T) {
	forEachStage1(t, func(t *testing.T, e *env, s podStage1) {
		hostPort := freePort(t)
		cfg := e.netPodConfig("net-kill9", s)
		cfg.PortMappings = []*runtimeapi.PortMapping{{
			Protocol: runtimeapi.Protocol_TCP, ContainerPort: 8080, HostPort: hostPort,
		}}
		podID := e.runStage1Pod(cfg, s)
		ctr := e.createAndStart(podID, cfg, e.netContainer(s, "server", httpServer("still-here")...))
		e.waitContainerState(ctr, running, stateTimeout)
		ip := e.podIP(podID)
		direct := fmt.Sprintf("http://%s:8080/", ip)
		viaHostPort := fmt.Sprintf("http://%s:%d/", e.gateway(), hostPort)
		e.waitHTTP(direct, "still-here\n")
		e.waitHTTP(viaHostPort, "still-here\n")

		if err := e.d.Kill9(t.Context()); err != nil {
			t.Fatalf("kill -9 the daemon: %v", err)
		}
		if got, err := httpGet(direct); err != nil || got != "still-here\n" {
			t.Errorf("while the daemon is down the pod answers %q, %v", got, err)
		}
		ctx, cancel := context.WithTimeout(t.Context(), startTimeout)
		defer cancel()
		if err := e.d.Restart(ctx); err != nil {
			t.Fatalf("restart the daemon: %v", err)
		}
		if got := e.podIP(podID); got != ip {
			t.Errorf("after the restart the pod reports IP %s, was %s", got, ip)
		}
		if st := e.podStatus(podID); st.State != runtimeapi.PodSandboxState_SANDBOX_READY || st.RuntimeHandler != s.handler {
			t.Errorf("after the restart the pod is %s on %q, want SANDBOX_READY on %q", st.State, st.RuntimeHandler, s.handler)
		}
		e.waitContainerState(ctr, running, stateTimeout)
		e.waitHTTP(direct, "still-here\n")
		e.waitHTTP(viaHostPort, "still-here\n")
		if out := e.execOK(ctr, wget("http://127.0.0.1:8080/")...); out != "still-here\n" {
			t.Errorf("exec in the recovered pod fetches %q from its own server", out)
		}

		if _, err := e.rt().StopPodSandbox(e.ctx(), &runtimeapi.StopPodSandboxRequest{PodSandboxId: podID}); err != nil {
			t.Fatalf("StopPodSandbox after recovery: %v", err)
		}
		if _, err := e.rt().RemovePodSandbox(e.ctx(), &runtimeapi.RemovePodSandboxRequest{PodSandboxId: podID}); err != nil {
			t.Fatalf("RemovePodSandbox after recovery: %v", err)
		}
		if held := e.networkHeld(); len(held) > 0 {
			t.Errorf("after the recovered pod was removed the network still holds %v", held)
		}
		if rules := natRulesFor(t, ip.String()); len(rules) > 0 {
			t.Errorf("NAT rules naming the pod's address after removal:\n%s", strings.Join(rules, "\n"))
		}
		if _, err := httpGet(direct); err == nil {
			t.Errorf("the removed pod's address %s still answers", ip)
		}
	})
}

// TestPodNetworkStats: a pod's eth0 counters in PodSandboxStats and its
// network metrics grow with the traffic the host sends it; a pod in the
// host's network has none.
func TestPodNetworkStats(t *testing.T) {
	forEachStage1(t, func(t *testing.T, e *env, s podStage1) {
		cfg := e.netPodConfig("netstats", s)
		podID := e.runStage1Pod(cfg, s)
		e.createAndStart(podID, cfg, e.netContainer(s, "server", httpServer(strings.Repeat("x", 4096))...))
		rx := func() (uint64, uint64) {
			t.Helper()
			resp, err := e.rt().PodSandboxStats(e.ctx(), &runtimeapi.PodSandboxStatsRequest{PodSandboxId: podID})
			if err != nil {
				t.Fatal(err)
			}
			n := resp.GetStats().GetLinux().GetNetwork()
			if n.GetDefaultInterface().GetName() != "eth0" || n.GetTimestamp() == 0 || len(n.GetInterfaces()) == 0 {
				t.Fatalf("pod network stats: %v", n)
			}
			return n.GetDefaultInterface().GetRxBytes().GetValue(), n.GetDefaultInterface().GetTxBytes().GetValue()
		}
		rx0, tx0 := rx()
		url := "http://" + e.podIP(podID).String() + ":8080/"
		e.waitHTTP(url, strings.Repeat("x", 4096)+"\n")
		rx1, tx1 := rx()
		if rx1 <= rx0 || tx1-tx0 < 4096 {
			t.Errorf("eth0 counters after a 4 KiB answer: rx %d → %d, tx %d → %d bytes", rx0, rx1, tx0, tx1)
		}

		resp, err := e.rt().ListPodSandboxMetrics(e.ctx(), &runtimeapi.ListPodSandboxMetricsRequest{})
		if err != nil {
			t.Fatal(err)
		}
		var sent uint64
		for _, pm := range resp.PodMetrics {
			for _, m := range pm.Metrics {
				if pm.PodSandboxId == podID && m.Name == "container_network_transmit_bytes_total" && m.LabelValues[len(m.LabelValues)-1] == "eth0" {
					sent = m.GetValue().GetValue()
				}
			}
		}
		if sent < tx1 {
			t.Errorf("container_network_transmit_bytes_total{interface=eth0} = %d, want at least %d", sent, tx1)
		}

		host := e.podConfig("netstats-host")
		host.Linux.SecurityContext.NamespaceOptions = &runtimeapi.NamespaceOption{Network: runtimeapi.NamespaceMode_NODE, Pid: s.pid, Ipc: s.ipc}
		hostID := e.runStage1Pod(host, s)
		hs, err := e.rt().PodSandboxStats(e.ctx(), &runtimeapi.PodSandboxStatsRequest{PodSandboxId: hostID})
		if err != nil {
			t.Fatal(err)
		}
		if n := hs.GetStats().GetLinux().GetNetwork(); n != nil {
			t.Errorf("a pod in the host network has network stats: %v", n)
		}
	})
}
