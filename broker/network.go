package broker

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/atomicfile"
	"github.com/stagelet/stagelet/internal/lsm"
	"github.com/stagelet/stagelet/internal/sysctl"
	"github.com/stagelet/stagelet/network"
	"github.com/stagelet/stagelet/tracing"
)

// Network is what the broker needs from pod networking (network.Manager).
type Network interface {
	Status() (ready bool, reason string)
	NetNSPath(podID string) string
	NewNetNS(ctx context.Context, podID string) (string, error)
	RemoveNetNS(ctx context.Context, path string) error
	NetNSPods() ([]string, error)
	Setup(ctx context.Context, pn network.PodNetwork) (*network.Result, error)
	Teardown(ctx context.Context, pn network.PodNetwork) error
}

// NetworkStatus reports whether pods that need their own network can be
// created, and why not.
func (b *Broker) NetworkStatus() (bool, string) {
	if b.opts.Network == nil {
		return false, "pod networking is not configured"
	}
	return b.opts.Network.Status()
}

// NetworkDescription names the pod network in use and its plugins, when
// the network manager can say.
func (b *Broker) NetworkDescription() string {
	if d, ok := b.opts.Network.(interface{ Describe() string }); ok {
		return d.Describe()
	}
	return ""
}

func podNetwork(rec *PodRecord) network.PodNetwork {
	c := rec.Config
	pn := network.PodNetwork{
		PodID: rec.ID, Name: c.Metadata.Name, Namespace: c.Metadata.Namespace, UID: c.Metadata.UID,
		NetNS: rec.NetNS,
	}
	for _, p := range c.PortMappings {
		if p.HostPort > 0 {
			pn.PortMappings = append(pn.PortMappings, network.PortMapping{
				Protocol: p.Protocol, ContainerPort: p.ContainerPort, HostPort: p.HostPort, HostIP: p.HostIP,
			})
		}
	}
	return pn
}

// checkSysctls refuses sysctls stagelet cannot apply to the pod alone.
func checkSysctls(c *PodConfig) error {
	for k := range c.Sysctls {
		switch sysctl.Namespace(k) {
		case sysctl.Net:
			if c.HostNetwork {
				return errdefs.InvalidArgument("config.linux.sysctls: %q would change the host's network settings (the pod uses the host network)", k)
			}
		case sysctl.IPC:
			if c.HostIPC {
				return errdefs.InvalidArgument("config.linux.sysctls: %q would change the host's IPC settings (the pod uses the host's IPC namespace)", k)
			}
		default:
			return errdefs.InvalidArgument("config.linux.sysctls: %q is not namespaced: it would change the whole node", k)
		}
	}
	return nil
}

// sysctlsOf are the pod's sysctls the namespace ns (sysctl.Net,
// sysctl.IPC) isolates.
func sysctlsOf(c *PodConfig, ns string) map[string]string {
	out := map[string]string{}
	for k, v := range c.Sysctls {
		if sysctl.Namespace(k) == ns {
			out[k] = v
		}
	}
	return out
}

// prepareNetwork makes the pod's network namespace, recorded first, with
// its net sysctls: what the pod's stage1 needs to start in it. A host
// network pod has none.
func (b *Broker) prepareNetwork(ctx context.Context, rec *PodRecord) error {
	if rec.Config.HostNetwork {
		return nil
	}
	if b.opts.Network == nil {
		return errdefs.FailedPrecondition("the pod needs its own network, and pod networking is not configured on this node")
	}
	if ok, reason := b.opts.Network.Status(); !ok {
		return errdefs.New(errdefs.ErrUnavailable, "pod network is not ready: %s", reason)
	}
	b.mu.Lock()
	path := b.opts.Network.NetNSPath(rec.ID)
	recorded := rec.NetNS == path // by startPod's first record
	rec.NetNS = path
	cp := *rec
	b.mu.Unlock()
	if !recorded {
		if err := b.rec.savePod(&cp); err != nil {
			return err
		}
	}
	if _, err := b.opts.Network.NewNetNS(ctx, rec.ID); err != nil {
		return fmt.Errorf("pod netns: %w", err)
	}
	net := sysctlsOf(&rec.Config, sysctl.Net)
	if _, set := net[network.UnprivilegedPortStart]; rec.Config.UserNS != nil && !set {
		// The pod's root is not the host's, and the network namespace is
		// the host's: without this it could not bind a port below 1024,
		// as a pod's root can (containerd sets it for every pod).
		net[network.UnprivilegedPortStart] = "0"
	}
	if len(net) > 0 {
		if err := network.ApplySysctls(rec.NetNS, net); err != nil {
			return err
		}
	}
	return nil
}

// attachNetwork attaches the pod's network namespace (prepareNetwork) to
// the node's network (CNI ADD) and keeps the pod's addresses.
func (b *Broker) attachNetwork(ctx context.Context, rec *PodRecord) (err error) {
	if rec.Config.HostNetwork {
		return nil
	}
	ctx, span := tracing.Start(ctx, "cni.add")
	defer func() { tracing.End(span, err) }()
	b.mu.Lock()
	cp := *rec
	b.mu.Unlock()
	res, err := b.opts.Network.Setup(ctx, podNetwork(&cp))
	if err != nil {
		return fmt.Errorf("pod network: %w", err)
	}
	b.mu.Lock()
	rec.IPs = res.IPs
	b.mu.Unlock()
	return nil
}

// teardownNetwork releases the pod's CNI attachment, unless rec says an
// earlier call did (the kubelet stops a pod, then removes it: CNI DEL runs
// once, as containerd runs it), and marks rec so; with remove it also
// removes the netns. Idempotent.
func (b *Broker) teardownNetwork(ctx context.Context, rec *PodRecord, remove bool) error {
	if rec.NetNS == "" || b.opts.Network == nil {
		return nil
	}
	if !rec.NetworkReleased {
		if err := b.opts.Network.Teardown(ctx, podNetwork(rec)); err != nil {
			return fmt.Errorf("pod network teardown: %w", err)
		}
		rec.NetworkReleased = true
	}
	if remove {
		if err := b.opts.Network.RemoveNetNS(ctx, rec.NetNS); err != nil {
			return fmt.Errorf("pod netns: %w", err)
		}
	}
	return nil
}

// writePodFiles writes the files the pod's containers get, as containerd
// gives them: resolv.conf from the CRI DNS config, else the node's;
// hostname, the pod's (podHostname: the node's where its client named
// none); hosts, for a pod with its own network whose client named its
// hostname one naming it at its addresses, else the node's. Paths are
// under the pod's run dir. Where SELinux is enabled they get the pod's
// mount label, which its containers read at their level.
func (b *Broker) writePodFiles(rec *PodRecord) error {
	dir := filepath.Join(rec.RunDir, "etc")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	c := rec.Config
	if c.DNS != nil && (len(c.DNS.Servers) > 0 || len(c.DNS.Searches) > 0 || len(c.DNS.Options) > 0) {
		if err := network.WriteResolvConf(filepath.Join(dir, "resolv.conf"), c.DNS.Servers, c.DNS.Searches, c.DNS.Options); err != nil {
			return err
		}
	} else if err := copyNodeFile(nodeResolvConf, filepath.Join(dir, "resolv.conf")); err != nil {
		return err
	}
	if h := podHostname(&c); h != "" {
		if err := network.WriteHostname(filepath.Join(dir, "hostname"), h); err != nil {
			return err
		}
	}
	if !c.HostNetwork && c.Hostname != "" {
		if err := network.WriteHosts(filepath.Join(dir, "hosts"), c.Hostname, rec.IPs); err != nil {
			return err
		}
	} else if err := copyNodeFile(nodeHosts, filepath.Join(dir, "hosts")); err != nil {
		return err
	}
	return lsm.Relabel(dir, rec.SELinux.Mount)
}

// The node's files a pod gets a copy of.
var (
	nodeResolvConf = "/etc/resolv.conf"
	nodeHosts      = "/etc/hosts"
)

// copyNodeFile copies the node's file src to dst, atomically; a node
// without src gives none.
func copyNodeFile(src, dst string) error {
	b, err := os.ReadFile(src)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	} else if err != nil {
		return fmt.Errorf("copy the node's %s: %w", src, err)
	}
	return atomicfile.WriteVolatile(dst, b, 0o644)
}

// podFileMounts are the bind mounts of the pod's files into a container,
// except where the container mounts something there itself (the kubelet
// mounts its own /etc/hosts).
func podFileMounts(rec *PodRecord, own []api.Mount, readonly bool) []api.Mount {
	var out []api.Mount
	for _, name := range []string{"resolv.conf", "hostname", "hosts"} {
		src := filepath.Join(rec.RunDir, "etc", name)
		dst := "/etc/" + name
		if _, err := os.Stat(src); err != nil {
			continue
		}
		if slices.ContainsFunc(own, func(m api.Mount) bool { return filepath.Clean(m.Destination) == dst }) {
			continue
		}
		out = append(out, api.Mount{Source: src, Destination: dst, Readonly: readonly})
	}
	return out
}

// collectNetNS tears down network namespaces no record names (a crash
// between creating one and recording the pod cannot happen, as the record
// comes first; this catches records that were removed by hand), except
// those of the pods set aside.
func (b *Broker) collectNetNS(ctx context.Context, aside map[string]bool) {
	if b.opts.Network == nil {
		return
	}
	ids, err := b.opts.Network.NetNSPods()
	if err != nil {
		b.log.ErrorContext(ctx, "listing pod network namespaces", "err", err)
		return
	}
	b.mu.Lock()
	known := map[string]bool{}
	for id := range b.pods {
		known[id] = true
	}
	b.mu.Unlock()
	for id := range aside {
		known[id] = true
	}
	for _, id := range ids {
		if known[id] {
			continue
		}
		rec := &PodRecord{ID: id, NetNS: b.opts.Network.NetNSPath(id)}
		b.log.WarnContext(ctx, "releasing an orphaned pod network namespace", "pod", id)
		if err := b.teardownNetwork(ctx, rec, true); err != nil && !errors.Is(err, errdefs.ErrNotFound) {
			b.log.ErrorContext(ctx, "releasing an orphaned pod network namespace", "pod", id, "err", err)
		}
	}
}
