package cluster

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/moby/sys/mountinfo"

	"github.com/stagelet/stagelet/policy"
	"github.com/stagelet/stagelet/test/e2e/harness"
)

// node is one node of the cluster: a systemd-nspawn container booted from
// the node tree, with its own network namespace and cgroups.
type node struct {
	name    string
	ip      string
	machine string   // systemd-nspawn's machine name, unique on the host
	netns   string   // its name under /run/netns
	dir     string   // what the test keeps for it
	root    string   // its root: an overlay of the tree
	console string   // systemd-nspawn's output
	cgroups []string // its cgroup in each hierarchy, on the host
	proc    *process
}

// nodePrep makes a booted container a node: what kind's entrypoint does,
// as a unit that runs before the runtime and the kubelet.
const nodePrep = `#!/bin/sh
# Makes this container a Kubernetes node; runs before stagelet and the kubelet.
set -eu
# systemd-nspawn mounts the cgroup v1 controllers read-only: the node's
# kubelet and runtime make pods' cgroups in them (the node's own subtree,
# behind its cgroup namespace).
awk '$3 == "cgroup" {print $2}' /proc/self/mounts | while read -r m; do
	mount -o remount,bind,rw "$m"
done
# The kubelet sets these kernel tunables, machine-wide, when they differ
# from what it wants: here it finds its values, and the host's stay.
mkdir -p /run/node-sysctl
for kv in vm/overcommit_memory=1 vm/panic_on_oom=0 kernel/panic=10 kernel/panic_on_oops=1 \
	kernel/keys/root_maxkeys=1000000 kernel/keys/root_maxbytes=25000000; do
	f=/run/node-sysctl/$(echo "${kv%%=*}" | tr / _)
	echo "${kv#*=}" >"$f"
	mount --bind "$f" "/proc/sys/${kv%%=*}"
done
# criu, restoring a checkpoint, sets the next PID and IPC IDs of the
# node's own namespaces: those tunables writable (systemd-nspawn mounts
# /proc/sys read-only).
for k in kernel/ns_last_pid kernel/sem_next_id kernel/msg_next_id kernel/shm_next_id; do
	mount --bind "/proc/sys/$k" "/proc/sys/$k"
	mount -o remount,bind,rw "/proc/sys/$k"
done
# The kubelet's OOM watcher reads the kernel log, which a container does
# not have.
[ -e /dev/kmsg ] || ln -s /dev/console /dev/kmsg
`

const nodePrepUnit = `[Unit]
Description=Make this container a Kubernetes node
DefaultDependencies=no
After=local-fs.target
Before=stagelet.service kubelet.service

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/usr/local/sbin/node-prep

[Install]
WantedBy=multi-user.target
`

// stageletDropIn runs the unit of contrib/systemd with the node's
// configuration file and a log the test can read.
const stageletDropIn = `[Unit]
Requires=node-prep.service
After=node-prep.service

[Service]
ExecStart=
ExecStart=/usr/local/bin/stagelet serve --config /etc/stagelet/config.yaml
StandardOutput=append:/var/log/stagelet.log
StandardError=inherit
`

const kubeletUnit = `[Unit]
Description=kubelet: the Kubernetes node agent
Requires=node-prep.service
Wants=stagelet.service
After=node-prep.service stagelet.service

[Service]
ExecStart=/usr/local/bin/kubelet --config=/var/lib/kubelet/config.yaml --kubeconfig=/var/lib/kubelet/kubeconfig --hostname-override=%s --node-ip=%s --v=2
StandardOutput=append:/var/log/kubelet.log
StandardError=inherit
Restart=always
RestartSec=2

[Install]
WantedBy=multi-user.target
`

// kubeletConfig: the cgroupfs driver on both sides (the node's systemd
// does not manage the v1 controllers it found read-only at boot), stagelet's
// socket, cluster DNS, x509 and webhook authentication, no eviction
// or image garbage collection on a shared test machine, image volumes
// (the ImageVolume gate, beta and off by default in 1.34, on in the
// API server too), and every trace sent to the test's receiver.
const kubeletConfig = `apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cgroupDriver: cgroupfs
containerRuntimeEndpoint: unix:///run/stagelet/stagelet.sock
clusterDNS: [%s]
clusterDomain: cluster.local
resolvConf: ""
failSwapOn: false
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: /var/lib/kubelet/pki/ca.crt}
authorization: {mode: Webhook}
evictionHard: {memory.available: "0%%", nodefs.available: "0%%", nodefs.inodesFree: "0%%", imagefs.available: "0%%", imagefs.inodesFree: "0%%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
featureGates: {ImageVolume: true}
tracing:
  endpoint: %s
  samplingRatePerMillion: 1000000
`

// stageletConfig is the node's stagelet configuration: the cgroupfs
// driver the kubelet uses, the cluster's registry, the kvm guest, the
// node's policy (nodePolicy) beside it, and its signature policies: the
// node's accepts every image (nodeSignaturePolicy), and the directory of
// namespace policies is where the signature test writes its own; traces
// go to the test's receiver, only the calls the kubelet sampled; pods
// that ask to move live are offered on the node's address.
const stageletConfig = `version: 1
cgroup_driver: cgroupfs
registries:
  "%s": {insecure: true}
kvm: {assets_dir: /usr/lib/stagelet/guest}
images:
  signature_policy: ` + signaturePolicy + `
  signature_policy_dir: ` + signaturePolicyDir + `
policy_file: policy.yaml
tracing: {endpoint: "%s"}
checkpoint: {live_address: "%s"}
`

// The nodes' signature policy files, as the nodes see them.
const (
	signaturePolicy    = "/etc/stagelet/signature-policy.json"
	signaturePolicyDir = "/etc/stagelet/signature-policy.d"
)

// nodeSignaturePolicy accepts every image unverified: the rest of the
// suite runs as without a policy, and only a namespace with a file of
// its own in signaturePolicyDir needs signatures.
const nodeSignaturePolicy = `{"default": [{"type": "insecureAcceptAnything"}]}
`

// vmsNamespace is the namespace an operator's rule of the nodes' policy
// runs in VMs.
const vmsNamespace = "vms"

// nodePolicy is the nodes' isolation policy: the embedded default, and an
// operator's rule that sends every pod of vmsNamespace to kvm, RuntimeClass
// or not.
func nodePolicy() string {
	return strings.Replace(string(policy.DefaultYAML()), "\nrules:\n", `
rules:
  - name: vms-namespace
    match: {namespaces: [`+vmsNamespace+`]}
    stage1: kvm
`, 1)
}

// startNode boots a node and registers its teardown.
func (c *cluster) startNode(name, ip string) (*node, error) {
	n := &node{
		name:    name,
		ip:      ip,
		machine: "stcl" + c.id + "-" + name,
		netns:   "stcl" + c.id + "-" + name,
		dir:     c.path("nodes", name),
	}
	n.root = filepath.Join(n.dir, "root")
	n.console = filepath.Join(n.dir, "console.log")
	for _, d := range []string{"upper", "work", "root", "var-lib-stagelet", "var-lib-kubelet/pki"} {
		if err := os.MkdirAll(filepath.Join(n.dir, d), 0o755); err != nil {
			return nil, err
		}
	}
	// Torn down in the reverse order of these registrations.
	c.t.Cleanup(func() { c.unmountRoot(n) })
	opts := fmt.Sprintf("lowerdir=%s,upperdir=%s,workdir=%s", c.env.tree, filepath.Join(n.dir, "upper"), filepath.Join(n.dir, "work"))
	if err := syscall.Mount("overlay", n.root, "overlay", 0, opts); err != nil {
		return nil, fmt.Errorf("node %s: overlay root: %w", name, err)
	}
	if err := c.writeNodeFiles(n); err != nil {
		return nil, fmt.Errorf("node %s: %w", name, err)
	}
	c.t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", n.netns).Run() })
	if err := c.nodeNetwork(n); err != nil {
		return nil, fmt.Errorf("node %s: %w", name, err)
	}
	c.t.Cleanup(func() { c.removeCgroups(n) })
	if err := c.nodeCgroups(n); err != nil {
		return nil, fmt.Errorf("node %s: %w", name, err)
	}
	args := []string{
		"--register=no", "--keep-unit", "--settings=no", "--boot",
		"--directory=" + n.root, "--machine=" + n.machine, "--hostname=" + name,
		"--network-namespace-path=/run/netns/" + n.netns,
		// A node runs pods: nested namespaces, mounts, its own cgroups.
		"--capability=all", "--system-call-filter=add_key keyctl request_key",
		"--resolv-conf=off", "--timezone=off", "--link-journal=no", "--console=read-only",
		"--bind-ro=" + c.env.stagelet + ":/usr/local/bin/stagelet",
		"--bind-ro=" + c.bin("kubelet") + ":/usr/local/bin/kubelet",
		// Image layers and rootfs overlays cannot live on the root's
		// overlayfs: real directories of the host.
		"--bind=" + filepath.Join(n.dir, "var-lib-stagelet") + ":/var/lib/stagelet",
		"--bind=" + filepath.Join(n.dir, "var-lib-kubelet") + ":/var/lib/kubelet",
		"--bind=/dev/net/tun",
	}
	if c.env.guest != "" {
		args = append(args, "--bind-ro="+c.env.guest+":/usr/lib/stagelet/guest")
	}
	if c.env.criu != "" {
		args = append(args, "--bind-ro="+c.env.criu+":/usr/local/sbin/criu")
	}
	// systemd-nspawn starts in the node's cgroups, beneath the test's own:
	// the node's cgroup namespace is rooted there.
	script := `for d in $NODE_CGROUPS; do echo $$ >"$d/cgroup.procs" || exit 1; done; exec systemd-nspawn "$@"`
	cmd := exec.Command("/bin/sh", append([]string{"-c", script, "sh"}, args...)...)
	// No system call filter on the node, as on a machine: criu, which
	// checkpoints its pods, cannot suspend the pods' filters from under
	// one of its own (PTRACE_O_SUSPEND_SECCOMP).
	cmd.Env = append(os.Environ(), "NODE_CGROUPS="+strings.Join(n.cgroups, " "), "SYSTEMD_SECCOMP=0")
	f, err := os.Create(n.console)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	cmd.Stdout, cmd.Stderr = f, f
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("node %s: systemd-nspawn: %w", name, err)
	}
	n.proc = &process{name: "node " + name, cmd: cmd, log: n.console, done: make(chan struct{})}
	go func() { _ = cmd.Wait(); close(n.proc.done) }()
	// SIGTERM is an orderly shutdown of the node: systemd stops the
	// kubelet and stagelet, then ends every process left (the pods').
	c.t.Cleanup(func() {
		c.keepLogs()
		n.proc.stop(90 * time.Second)
		_ = os.Remove("/run/systemd/nspawn/propagate/" + n.machine)
	})
	return n, nil
}

func (c *cluster) writeNodeFiles(n *node) error {
	unit, err := os.ReadFile(filepath.Join(moduleRoot(), "contrib/systemd/stagelet.service"))
	if err != nil {
		return err
	}
	if err := c.pki.issue("kubelet-"+n.name, "system:node:"+n.name, []string{"system:nodes"}); err != nil {
		return err
	}
	ca, err := os.ReadFile(c.pki.path("ca.crt"))
	if err != nil {
		return err
	}
	crt, err := os.ReadFile(c.pki.path("kubelet-" + n.name + ".crt"))
	if err != nil {
		return err
	}
	key, err := os.ReadFile(c.pki.path("kubelet-" + n.name + ".key"))
	if err != nil {
		return err
	}
	kl := filepath.Join(n.dir, "var-lib-kubelet")
	files := []struct {
		path string
		data string
		mode os.FileMode
	}{
		{filepath.Join(n.root, "etc/hostname"), n.name + "\n", 0o644},
		{filepath.Join(n.root, "etc/hosts"), "127.0.0.1 localhost\n" + n.ip + " " + n.name + "\n", 0o644},
		{filepath.Join(n.root, "etc/resolv.conf"), "# the cluster is offline: no upstream DNS\n", 0o644},
		{filepath.Join(n.root, "usr/local/sbin/node-prep"), nodePrep, 0o755},
		{filepath.Join(n.root, "etc/systemd/system/node-prep.service"), nodePrepUnit, 0o644},
		{filepath.Join(n.root, "etc/systemd/system/stagelet.service"), string(unit), 0o644},
		{filepath.Join(n.root, "etc/systemd/system/stagelet.service.d/node.conf"), stageletDropIn, 0o644},
		{filepath.Join(n.root, "etc/systemd/system/kubelet.service"), fmt.Sprintf(kubeletUnit, n.name, n.ip), 0o644},
		{filepath.Join(n.root, "etc/stagelet/config.yaml"), fmt.Sprintf(stageletConfig, c.registry, c.traces.Addr, n.ip), 0o644},
		{filepath.Join(n.root, "etc/stagelet/policy.yaml"), nodePolicy(), 0o644},
		{filepath.Join(n.root, signaturePolicy), nodeSignaturePolicy, 0o644},
		{filepath.Join(kl, "config.yaml"), fmt.Sprintf(kubeletConfig, dnsIP, c.traces.Addr), 0o644},
		{filepath.Join(kl, "kubeconfig"), kubeconfig(c.api, "/var/lib/kubelet/pki/ca.crt",
			"/var/lib/kubelet/pki/kubelet-client.crt", "/var/lib/kubelet/pki/kubelet-client.key"), 0o600},
		{filepath.Join(kl, "pki/ca.crt"), string(ca), 0o644},
		{filepath.Join(kl, "pki/kubelet-client.crt"), string(crt), 0o644},
		{filepath.Join(kl, "pki/kubelet-client.key"), string(key), 0o600},
	}
	for _, f := range files {
		if err := os.MkdirAll(filepath.Dir(f.path), 0o755); err != nil {
			return err
		}
		// The tree's files are links at times (/etc/resolv.conf): replace,
		// never write through.
		_ = os.Remove(f.path)
		if err := os.WriteFile(f.path, []byte(f.data), f.mode); err != nil {
			return err
		}
	}
	wants := filepath.Join(n.root, "etc/systemd/system/multi-user.target.wants")
	if err := os.MkdirAll(wants, 0o755); err != nil {
		return err
	}
	for _, u := range []string{"node-prep.service", "stagelet.service", "kubelet.service"} {
		if err := os.Symlink("/etc/systemd/system/"+u, filepath.Join(wants, u)); err != nil {
			return err
		}
	}
	return nil
}

// nodeNetwork gives the node its namespace, joined to the bridge by a
// veth, with its address and a default route through the host.
func (c *cluster) nodeNetwork(n *node) error {
	host := "v" + c.id + n.name
	if len(host) > 15 {
		host = host[:15]
	}
	return ipCmds(
		[]string{"netns", "add", n.netns},
		[]string{"link", "add", host, "type", "veth", "peer", "name", "eth0", "netns", n.netns},
		[]string{"link", "set", host, "master", c.bridge, "up"},
		[]string{"-n", n.netns, "addr", "add", n.ip + "/24", "dev", "eth0"},
		[]string{"-n", n.netns, "link", "set", "eth0", "up"},
		[]string{"-n", n.netns, "link", "set", "lo", "up"},
		[]string{"-n", n.netns, "route", "add", "default", "via", hostIP},
	)
}

// nodeCgroups makes the node's cgroup in every hierarchy, beneath the
// test's own cgroup there: stagelet-cluster-ID/NODE.
func (c *cluster) nodeCgroups(n *node) error {
	hs, err := hierarchies()
	if err != nil {
		return err
	}
	for _, h := range hs {
		parent := filepath.Join(h.mount, h.own, "stagelet-cluster-"+c.id)
		dir := filepath.Join(parent, n.name)
		for _, d := range []string{parent, dir} {
			if err := os.Mkdir(d, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
				return err
			}
			if h.cpuset {
				// A v1 cpuset starts empty: copy the parent's.
				for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
					v, err := os.ReadFile(filepath.Join(filepath.Dir(d), f))
					if err != nil {
						return err
					}
					if err := os.WriteFile(filepath.Join(d, f), v, 0o644); err != nil {
						return err
					}
				}
			}
		}
		n.cgroups = append(n.cgroups, dir)
	}
	return nil
}

// removeCgroups removes the node's cgroups, deepest first, once the
// node's processes are gone, and the cluster's parent when it is empty.
func (c *cluster) removeCgroups(n *node) {
	for _, top := range n.cgroups {
		var dirs []string
		_ = filepath.WalkDir(top, func(p string, d os.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				dirs = append(dirs, p)
			}
			return nil
		})
		slices.SortFunc(dirs, func(a, b string) int { return strings.Count(b, "/") - strings.Count(a, "/") })
		for _, d := range dirs {
			if err := os.Remove(d); err != nil && !errors.Is(err, os.ErrNotExist) {
				c.t.Errorf("node %s: cgroup %s: %v", n.name, d, err)
			}
		}
		_ = os.Remove(filepath.Dir(top)) // the cluster's, once the last node's is gone
	}
}

func (c *cluster) unmountRoot(n *node) {
	if n.proc != nil && !n.proc.exited() {
		c.t.Errorf("node %s still runs: its root stays mounted", n.name)
		return
	}
	for _, m := range harness.MountsUnder(n.dir) {
		if err := syscall.Unmount(m, 0); err != nil {
			c.t.Errorf("node %s: unmount %s: %v", n.name, m, err)
		}
	}
}

// hierarchy is a cgroup hierarchy of the host and the test's cgroup in it.
type hierarchy struct {
	mount  string
	own    string
	cpuset bool
}

// hierarchies lists the host's cgroup hierarchies (v1 controllers, named
// ones and a hybrid host's unified one) with the test's cgroup in each.
func hierarchies() ([]hierarchy, error) {
	own := map[string]string{} // controller list ("cpu", "name=systemd", "" for v2) → path
	b, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return nil, err
	}
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		f := strings.SplitN(line, ":", 3)
		if len(f) == 3 {
			own[f[1]] = f[2]
		}
	}
	ms, err := mountinfo.GetMounts(mountinfo.FSTypeFilter("cgroup", "cgroup2"))
	if err != nil {
		return nil, err
	}
	var out []hierarchy
	for _, m := range ms {
		fstype, mp, opts := m.FSType, m.Mountpoint, m.VFSOptions
		switch fstype {
		case "cgroup2":
			if p, ok := own[""]; ok {
				out = append(out, hierarchy{mount: mp, own: p})
			}
		case "cgroup":
			for key, p := range own {
				if key == "" {
					continue
				}
				if sameControllers(key, opts) {
					out = append(out, hierarchy{mount: mp, own: p, cpuset: slices.Contains(strings.Split(key, ","), "cpuset")})
				}
			}
		}
	}
	return out, nil
}

// sameControllers tells whether a /proc/self/cgroup controller list names
// the hierarchy mounted with the super options opts.
func sameControllers(key, opts string) bool {
	o := strings.Split(opts, ",")
	for _, c := range strings.Split(key, ",") {
		if !slices.Contains(o, c) {
			return false
		}
	}
	return true
}
