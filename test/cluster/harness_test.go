// Package cluster is stagelet as one node of many: a Kubernetes cluster
// on this machine (make test-cluster). The control plane (etcd,
// kube-apiserver, kube-controller-manager, kube-scheduler) runs on the
// host; each node is a Debian 12 tree booted with systemd-nspawn -b (as
// kind runs nodes as containers), in a network namespace of its own on a
// bridge the test makes, running stagelet and a kubelet as systemd
// services. kube-proxy, the pod network (podnet) and CoreDNS run as pods,
// from images the test builds and serves from a registry on the bridge.
//
// The test needs root, a cgroup v1 (hybrid) host, and what
// scripts/cluster-build.sh builds; `make test-cluster` runs it with those.
// It skips, saying why, without them.
package cluster

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stagelet/stagelet/internal/testutil"
	"github.com/stagelet/stagelet/preflight"
	"github.com/stagelet/stagelet/test/e2e/harness"
	"github.com/stagelet/stagelet/test/otlpsink"
)

const (
	// hostIP is the host's address on the nodes' bridge: the API server
	// and the registry listen there.
	hostIP     = "172.30.99.1"
	nodeSubnet = "172.30.99.0/24"
	// clusterCIDR is the pod network; the controller manager gives each
	// node a /24 of it.
	clusterCIDR = "10.244.0.0/16"
	serviceCIDR = "10.96.0.0/16"
	dnsIP       = "10.96.0.10"
)

// env is what make test-cluster passes: where the binaries are.
type env struct {
	k8sBin   string // kube-apiserver, kubelet, ...
	tools    string // coredns, cni/
	tree     string // the nodes' Debian tree
	stagelet string // the static binary under test
	guest    string // the kvm guest assets
	criu     string // the criu the nodes checkpoint with; "": none works
}

func loadEnv(t *testing.T) env {
	e := env{
		k8sBin:   os.Getenv("STAGELET_CLUSTER_K8S_BIN"),
		tools:    os.Getenv("STAGELET_CLUSTER_TOOLS"),
		tree:     os.Getenv("STAGELET_CLUSTER_TREE"),
		stagelet: os.Getenv("STAGELET_BIN"),
		guest:    os.Getenv("STAGELET_GUEST_ASSETS"),
	}
	// The nodes checkpoint with this host's criu, where it is the one
	// scripts/build-criu.sh installs (Debian 12's fails on newer kernels).
	if path, _, _, err := preflight.FindCRIU(context.Background(), ""); err == nil && path == preflight.LocalCRIU {
		e.criu = path
	}
	if e.k8sBin == "" || e.tools == "" || e.tree == "" || e.stagelet == "" {
		t.Skip("the cluster test runs under make test-cluster (STAGELET_CLUSTER_K8S_BIN, STAGELET_CLUSTER_TOOLS, STAGELET_CLUSTER_TREE, STAGELET_BIN unset)")
	}
	testutil.NeedRoot(t, "boots a Kubernetes cluster of node containers")
	if _, err := os.Stat("/sys/fs/cgroup/cgroup.controllers"); err == nil {
		// On a pure v2 host the nodes' cgroups would need controllers
		// enabled beneath the test's own cgroup, which holds the test
		// itself: that needs the test started in a delegated leaf.
		t.Skip("the cluster test's nodes need a cgroup v1 (hybrid) host")
	}
	return e
}

// cluster is the running cluster and everything the test made for it, all
// under dir.
type cluster struct {
	t        *testing.T
	env      env
	id       string
	dir      string
	pki      *pki
	bridge   string
	api      string // https://hostIP:port
	admin    string // the admin's kubeconfig
	registry string // hostIP:port
	// traces receives the spans of every node's kubelet and stagelet.
	traces   *otlpsink.Sink
	nodes    []*node
	logsKept bool
}

func newID() string {
	b := make([]byte, 3)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	return hex.EncodeToString(b)
}

// startCluster brings the whole cluster up, with its cleanup registered;
// it fails the test when a part does not come up.
func startCluster(t *testing.T, e env, nodeNames ...string) *cluster {
	dir, err := os.MkdirTemp("/var/tmp", "stagelet-cluster.")
	if err != nil {
		t.Fatal(err)
	}
	c := &cluster{t: t, env: e, id: newID(), dir: dir}
	c.bridge = "stcl" + c.id
	t.Cleanup(c.removeDir)
	if err := c.copyUnderTest(); err != nil {
		t.Fatal(err)
	}
	if err := c.makePKI(); err != nil {
		t.Fatal(err)
	}
	if err := c.makeBridge(); err != nil {
		t.Fatal(err)
	}
	c.startRegistry()
	c.traces = otlpsink.StartAddr(t, hostIP+":0")
	if err := c.startControlPlane(); err != nil {
		c.dumpLogs()
		t.Fatal(err)
	}
	if err := c.applyAddons(); err != nil {
		c.dumpLogs()
		t.Fatal(err)
	}
	for i, name := range nodeNames {
		n, err := c.startNode(name, fmt.Sprintf("172.30.99.%d", 11+i))
		if err != nil {
			c.dumpLogs()
			t.Fatal(err)
		}
		c.nodes = append(c.nodes, n)
	}
	for _, n := range c.nodes {
		if err := c.waitFor(4*time.Minute, "node "+n.name+" Ready", func() (bool, error) {
			out, err := c.kubectlErr("get", "node", n.name, "-o", `jsonpath={.status.conditions[?(@.type=="Ready")].status}`)
			return strings.TrimSpace(out) == "True", err
		}); err != nil {
			c.dumpLogs()
			t.Fatal(err)
		}
	}
	return c
}

// copyUnderTest copies the binary and the guest assets under test into
// the cluster's directory, which the nodes bind: a build of the tree
// during the run (make build rewrites bin/stagelet in place) would
// otherwise change the nodes' binary beneath their running daemons and
// break every pod started after it.
func (c *cluster) copyUnderTest() error {
	bin := c.path("under-test", "stagelet")
	if err := copyTo(c.env.stagelet, bin); err != nil {
		return err
	}
	c.env.stagelet = bin
	if c.env.guest == "" {
		return nil
	}
	entries, err := os.ReadDir(c.env.guest)
	if err != nil {
		return err
	}
	guest := c.path("under-test", "guest")
	for _, e := range entries {
		if e.Type().IsRegular() {
			if err := copyTo(filepath.Join(c.env.guest, e.Name()), filepath.Join(guest, e.Name())); err != nil {
				return err
			}
		}
	}
	c.env.guest = guest
	return nil
}

// copyTo copies the regular file from to the new file to, with its mode,
// making to's directory.
func copyTo(from, to string) error {
	src, err := os.Open(from)
	if err != nil {
		return err
	}
	defer src.Close()
	fi, err := src.Stat()
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(to), 0o755); err != nil {
		return err
	}
	dst, err := os.OpenFile(to, os.O_WRONLY|os.O_CREATE|os.O_EXCL, fi.Mode().Perm())
	if err != nil {
		return err
	}
	if _, err := io.Copy(dst, src); err != nil {
		dst.Close()
		return err
	}
	return dst.Close()
}

func (c *cluster) path(elem ...string) string {
	return filepath.Join(append([]string{c.dir}, elem...)...)
}

func (c *cluster) makePKI() error {
	p, err := newPKI(c.path("pki"))
	if err != nil {
		return err
	}
	c.pki = p
	if err := p.serviceAccountKeys(); err != nil {
		return err
	}
	apiHosts := []string{hostIP, "10.96.0.1", "127.0.0.1", "kubernetes", "kubernetes.default",
		"kubernetes.default.svc", "kubernetes.default.svc.cluster.local"}
	for _, cert := range []struct {
		name, cn string
		orgs     []string
		hosts    []string
	}{
		{"apiserver", "kube-apiserver", nil, apiHosts},
		{"apiserver-kubelet-client", "kube-apiserver-kubelet-client", []string{"system:masters"}, nil},
		{"admin", "kubernetes-admin", []string{"system:masters"}, nil},
		{"controller-manager", "system:kube-controller-manager", nil, nil},
		{"scheduler", "system:kube-scheduler", nil, nil},
	} {
		if err := p.issue(cert.name, cert.cn, cert.orgs, cert.hosts...); err != nil {
			return fmt.Errorf("certificate %s: %w", cert.name, err)
		}
	}
	return nil
}

// makeBridge makes the nodes' network: a bridge holding hostIP, which the
// nodes' veths join.
func (c *cluster) makeBridge() error {
	if out, err := exec.Command("ip", "-o", "addr", "show", "to", hostIP).Output(); err == nil && len(bytes.TrimSpace(out)) > 0 {
		return fmt.Errorf("%s is already on this host (another cluster test?): %s", hostIP, out)
	}
	c.t.Cleanup(func() { _ = exec.Command("ip", "link", "del", c.bridge).Run() })
	return ipCmds(
		[]string{"link", "add", c.bridge, "type", "bridge"},
		[]string{"addr", "add", hostIP + "/24", "dev", c.bridge},
		[]string{"link", "set", c.bridge, "up"},
	)
}

func ipCmds(cmds ...[]string) error {
	for _, a := range cmds {
		if out, err := exec.Command("ip", a...).CombinedOutput(); err != nil {
			return fmt.Errorf("ip %s: %v: %s", strings.Join(a, " "), err, out)
		}
	}
	return nil
}

// freePort returns a TCP port free on ip now.
func freePort(ip string) (int, error) {
	l, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// process is a control-plane program the test started.
type process struct {
	name string
	cmd  *exec.Cmd
	log  string
	done chan struct{}
}

// start starts a program of the cluster with its output in logs/NAME.log
// and registers its stop: SIGTERM, then SIGKILL after 10 s, by PID.
func (c *cluster) start(name, bin string, args ...string) (*process, error) {
	if err := os.MkdirAll(c.path("logs"), 0o755); err != nil {
		return nil, err
	}
	logPath := c.path("logs", name+".log")
	f, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = f, f
	cmd.Dir = c.dir
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &process{name: name, cmd: cmd, log: logPath, done: make(chan struct{})}
	go func() { _ = cmd.Wait(); close(p.done) }()
	c.t.Cleanup(func() { p.stop(10 * time.Second) })
	return p, nil
}

func (p *process) stop(grace time.Duration) {
	select {
	case <-p.done:
		return
	default:
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(grace):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}

func (p *process) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

func (c *cluster) bin(name string) string { return filepath.Join(c.env.k8sBin, name) }

func (c *cluster) startControlPlane() error {
	etcdClient, err := freePort("127.0.0.1")
	if err != nil {
		return err
	}
	etcdPeer, err := freePort("127.0.0.1")
	if err != nil {
		return err
	}
	etcdURL := fmt.Sprintf("http://127.0.0.1:%d", etcdClient)
	etcd, err := c.start("etcd", c.bin("etcd"),
		"--data-dir", c.path("etcd"), "--name", "stagelet-cluster",
		"--listen-client-urls", etcdURL, "--advertise-client-urls", etcdURL,
		"--listen-peer-urls", fmt.Sprintf("http://127.0.0.1:%d", etcdPeer),
		"--initial-advertise-peer-urls", fmt.Sprintf("http://127.0.0.1:%d", etcdPeer),
		"--initial-cluster", fmt.Sprintf("stagelet-cluster=http://127.0.0.1:%d", etcdPeer),
		"--listen-metrics-urls", "", "--log-level", "warn")
	if err != nil {
		return err
	}
	apiPort, err := freePort(hostIP)
	if err != nil {
		return err
	}
	c.api = fmt.Sprintf("https://%s:%d", hostIP, apiPort)
	p := c.pki.path
	apiserver, err := c.start("kube-apiserver", c.bin("kube-apiserver"),
		"--etcd-servers", etcdURL,
		"--bind-address", hostIP, "--secure-port", strconv.Itoa(apiPort), "--advertise-address", hostIP,
		"--tls-cert-file", p("apiserver.crt"), "--tls-private-key-file", p("apiserver.key"),
		"--client-ca-file", p("ca.crt"),
		"--kubelet-client-certificate", p("apiserver-kubelet-client.crt"),
		"--kubelet-client-key", p("apiserver-kubelet-client.key"),
		"--service-cluster-ip-range", serviceCIDR,
		"--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file", p("sa.pub"),
		"--service-account-signing-key-file", p("sa.key"),
		"--authorization-mode", "Node,RBAC",
		"--enable-admission-plugins", "NodeRestriction",
		"--allow-privileged=true",
		"--feature-gates=ImageVolume=true",
		// The nodes' names are not in this host's DNS.
		"--kubelet-preferred-address-types", "InternalIP,Hostname",
		"--cert-dir", c.path("apiserver-certs"),
		"--profiling=false", "--v=1")
	if err != nil {
		return err
	}
	c.admin = c.path("admin.kubeconfig")
	if err := c.pki.kubeconfig(c.admin, c.api, "admin"); err != nil {
		return err
	}
	if err := c.waitFor(2*time.Minute, "the API server ready", func() (bool, error) {
		if etcd.exited() || apiserver.exited() {
			return false, errors.New("etcd or the API server exited")
		}
		out, err := c.kubectlErr("get", "--raw", "/readyz")
		return err == nil && strings.TrimSpace(out) == "ok", nil
	}); err != nil {
		return err
	}
	for _, comp := range []struct{ name, cert string }{
		{"kube-controller-manager", "controller-manager"}, {"kube-scheduler", "scheduler"},
	} {
		if err := c.pki.kubeconfig(c.path(comp.cert+".kubeconfig"), c.api, comp.cert); err != nil {
			return err
		}
	}
	kcm := c.path("controller-manager.kubeconfig")
	if _, err := c.start("kube-controller-manager", c.bin("kube-controller-manager"),
		"--kubeconfig", kcm, "--authentication-kubeconfig", kcm, "--authorization-kubeconfig", kcm,
		"--bind-address", "127.0.0.1", "--secure-port", "0",
		"--leader-elect=false", "--use-service-account-credentials",
		"--service-account-private-key-file", p("sa.key"), "--root-ca-file", p("ca.crt"),
		"--cluster-signing-cert-file", p("ca.crt"), "--cluster-signing-key-file", p("ca.key"),
		"--allocate-node-cidrs", "--cluster-cidr", clusterCIDR, "--node-cidr-mask-size", "24",
		"--service-cluster-ip-range", serviceCIDR,
		"--node-monitor-grace-period", "40s", "--v=1"); err != nil {
		return err
	}
	sched := c.path("scheduler.kubeconfig")
	if _, err := c.start("kube-scheduler", c.bin("kube-scheduler"),
		"--kubeconfig", sched, "--authentication-kubeconfig", sched, "--authorization-kubeconfig", sched,
		"--bind-address", "127.0.0.1", "--secure-port", "0", "--leader-elect=false", "--v=1"); err != nil {
		return err
	}
	return nil
}

// kubectl runs kubectl as the cluster's admin and fails t on error.
func (c *cluster) kubectl(t testing.TB, args ...string) string {
	t.Helper()
	out, err := c.kubectlErr(args...)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func (c *cluster) kubectlErr(args ...string) (string, error) {
	return c.kubectlIn("", args...)
}

// kubectlIn runs kubectl with stdin as its input.
func (c *cluster) kubectlIn(stdin string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, c.bin("kubectl"), append([]string{"--kubeconfig", c.admin}, args...)...)
	cmd.Stdin = strings.NewReader(stdin)
	var out, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &stderr
	if err := cmd.Run(); err != nil {
		return out.String(), fmt.Errorf("kubectl %s: %v: %s", strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return out.String(), nil
}

// waitFor polls cond until it holds; what the last poll said is reported
// when time is up.
func (c *cluster) waitFor(timeout time.Duration, what string, cond func() (bool, error)) error {
	deadline := time.Now().Add(timeout)
	for {
		ok, err := cond()
		if ok {
			return nil
		}
		if time.Now().After(deadline) {
			if err == nil {
				return fmt.Errorf("timed out after %s waiting for %s", timeout, what)
			}
			return fmt.Errorf("timed out after %s waiting for %s (last poll: %v)", timeout, what, err)
		}
		time.Sleep(time.Second) // polling a condition that no event announces
	}
}

// dumpLogs prints the end of every log the cluster wrote, for a failure.
func (c *cluster) dumpLogs() {
	logs, _ := filepath.Glob(c.path("logs", "*.log"))
	for _, n := range c.nodes {
		for _, f := range []string{"kubelet.log", "stagelet.log"} {
			logs = append(logs, filepath.Join(n.root, "var/log", f))
		}
		logs = append(logs, n.console)
	}
	for _, l := range logs {
		b, err := os.ReadFile(l)
		if err != nil {
			continue
		}
		lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
		if len(lines) > 40 {
			lines = lines[len(lines)-40:]
		}
		c.t.Logf("--- %s (last %d lines)\n%s", l, len(lines), strings.Join(lines, "\n"))
	}
}

// keepLogs copies the cluster's logs into $STAGELET_CLUSTER_KEEP, when set,
// for a failed run.
// Once: every node's teardown calls it, the first before its root goes.
func (c *cluster) keepLogs() {
	dest := os.Getenv("STAGELET_CLUSTER_KEEP")
	if dest == "" || !c.t.Failed() || c.logsKept {
		return
	}
	c.logsKept = true
	dest = filepath.Join(dest, "cluster-"+c.id)
	logs, _ := filepath.Glob(c.path("logs", "*.log"))
	for _, n := range c.nodes {
		for _, f := range []string{"kubelet.log", "stagelet.log"} {
			logs = append(logs, filepath.Join(n.root, "var/log", f))
		}
		logs = append(logs, n.console)
	}
	for _, l := range logs {
		rel, err := filepath.Rel(c.dir, l)
		if err != nil {
			continue
		}
		if b, err := os.ReadFile(l); err == nil {
			to := filepath.Join(dest, strings.ReplaceAll(rel, "/", "_"))
			if os.MkdirAll(dest, 0o755) == nil && os.WriteFile(to, b, 0o644) == nil {
				continue
			}
		}
	}
	c.t.Logf("logs kept in %s", dest)
}

// removeDir removes the test's directory once nothing is mounted beneath
// it: never through a mount.
func (c *cluster) removeDir() {
	if ms := harness.MountsUnder(c.dir); len(ms) > 0 {
		c.t.Errorf("mounts remain beneath %s, left in place: %v", c.dir, ms)
		return
	}
	if err := os.RemoveAll(c.dir); err != nil {
		c.t.Errorf("remove %s: %v", c.dir, err)
	}
}
