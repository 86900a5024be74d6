package network

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/types"
	types100 "github.com/containernetworking/cni/pkg/types/100"

	"github.com/stagelet/stagelet/errdefs"
)

// IfName is the pod's interface, as the kubelet expects.
const IfName = "eth0"

// PodNetwork names a pod's network attachment.
type PodNetwork struct {
	// PodID is the pod sandbox ID; it is CNI's container ID.
	PodID     string
	Name      string
	Namespace string
	UID       string
	// NetNS is the pod's network namespace (NetNSPath of the pod).
	NetNS        string
	PortMappings []PortMapping
}

// PortMapping is a CRI port mapping. Only mappings with HostPort > 0 reach
// CNI.
type PortMapping struct {
	// Protocol is "TCP", "UDP" or "SCTP"; "" means TCP.
	Protocol      string
	ContainerPort int32
	HostPort      int32
	// HostIP is the host address to bind; "" means all.
	HostIP string
}

// Result is a pod's network attachment.
type Result struct {
	// IPs are the pod's addresses, without prefix length, IPv4 first.
	IPs []string
	// Interface and MAC are the pod-side interface's.
	Interface string
	MAC       string
	// Gateway is the gateway of the first IP, if any.
	Gateway string
	// Routes are "dst" or "dst via gw".
	Routes []string
	// Raw is the CNI result as JSON, in the current CNI result version.
	Raw []byte
}

// portMapEntry is the portMappings capability argument's element.
type portMapEntry struct {
	HostPort      int32  `json:"hostPort"`
	ContainerPort int32  `json:"containerPort"`
	Protocol      string `json:"protocol"`
	HostIP        string `json:"hostIP,omitempty"`
}

// Setup attaches the pod to the node's CNI network (CNI ADD on pn.NetNS,
// interface eth0, with the pod's metadata as CNI_ARGS and its host ports as
// the portMappings capability) and returns the attachment. It also brings
// the namespace's loopback interface up, and announces the pod's IPv4
// addresses with a gratuitous ARP (see announce).
//
// Idempotent: when libcni's cache already holds an attachment of the pod
// on the current network in the same namespace, that result is returned and
// no plugin runs. A pod whose namespace changed must be torn down first. On
// failure Setup runs DEL to release what plugins took.
//
// Errors: ErrInvalidArgument for a bad pn; ErrUnavailable when the node has
// no usable network config (Status not ready) or a plugin asks to try later;
// ErrNotFound when pn.NetNS is not a network namespace; ErrDeadlineExceeded
// when ctx expires; ErrFailedPrecondition when a plugin fails otherwise.
func (m *Manager) Setup(ctx context.Context, pn PodNetwork) (*Result, error) {
	if err := checkPodNetwork(pn); err != nil {
		return nil, err
	}
	n := m.current()
	if n.list == nil {
		return nil, errdefs.New(errdefs.ErrUnavailable, "pod network not ready: %s", n.reason)
	}
	rt := m.runtimeConf(pn, pn.NetNS)
	if m.cachedNetNS(pn.PodID, n.list.Name) == pn.NetNS {
		if cached, err := m.cni.GetNetworkListCachedResult(n.list, rt); err == nil && cached != nil {
			m.log.DebugContext(ctx, "CNI ADD skipped: attachment cached", "pod", pn.PodID, "network", n.list.Name)
			return convertResult(cached)
		}
	}
	if err := inNetNS(pn.NetNS, loopbackUp); err != nil {
		return nil, fmt.Errorf("pod %s: %w", pn.PodID, err)
	}
	start := time.Now()
	res, err := m.cni.AddNetworkList(ctx, n.list, rt)
	if err != nil {
		err = classify(ctx, fmt.Sprintf("pod %s: CNI ADD on network %q", pn.PodID, n.list.Name), err)
		m.log.WarnContext(ctx, "CNI ADD failed", "pod", pn.PodID, "network", n.list.Name, "err", err)
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
		defer cancel()
		if derr := m.cni.DelNetworkList(dctx, n.list, rt); derr != nil {
			m.log.WarnContext(ctx, "CNI DEL after a failed ADD failed", "pod", pn.PodID, "network", n.list.Name, "err", derr)
		}
		return nil, err
	}
	r, err := convertResult(res)
	if err != nil {
		return nil, fmt.Errorf("pod %s: CNI ADD result: %w", pn.PodID, err)
	}
	m.log.DebugContext(ctx, "CNI ADD", "pod", pn.PodID, "network", n.list.Name, "ips", r.IPs, "ms", ms(time.Since(start)))
	ifname := cmp.Or(r.Interface, IfName)
	if err := inNetNS(pn.NetNS, func() error { return announce(ifname, r.IPs) }); err != nil {
		// The pod is reachable without it once stale neighbour entries age out.
		m.log.WarnContext(ctx, "announcing the pod's addresses failed", "pod", pn.PodID, "err", err)
	}
	return r, nil
}

// Teardown detaches the pod from the network it was attached to (CNI DEL).
// It uses the network config and arguments libcni cached at ADD, so it
// works after a daemon restart and after the node's config changed; without
// a cached attachment it runs DEL with the current config, and does nothing
// when there is none. When pn.NetNS is not a mounted network namespace any
// more, DEL runs with an empty namespace path and plugins release what they
// hold outside it (addresses, port mappings; not the bridge plugin's ipMasq
// rules, which it finds through the namespace: see RemoveNetNS).
//
// Idempotent: a second Teardown, or one after RemoveNetNS, succeeds.
// Errors: ErrInvalidArgument for an empty pod ID; ErrDeadlineExceeded when
// ctx expires; ErrUnavailable or ErrFailedPrecondition when a plugin fails.
func (m *Manager) Teardown(ctx context.Context, pn PodNetwork) error {
	if err := checkPodID(pn.PodID); err != nil {
		return err
	}
	netns := pn.NetNS
	if netns != "" && !isNetNSMount(netns) {
		netns = ""
	}
	atts, err := m.attachments(pn.PodID)
	if err != nil {
		m.log.WarnContext(ctx, "reading the CNI cache", "pod", pn.PodID, "err", err)
	}
	start := time.Now()
	if len(atts) == 0 {
		n := m.current()
		if n.list == nil {
			m.log.WarnContext(ctx, "CNI DEL skipped: no cached attachment and no network config", "pod", pn.PodID, "reason", n.reason)
			return nil
		}
		if err := m.cni.DelNetworkList(ctx, n.list, m.runtimeConf(pn, netns)); err != nil {
			return classify(ctx, fmt.Sprintf("pod %s: CNI DEL on network %q", pn.PodID, n.list.Name), err)
		}
		m.log.DebugContext(ctx, "CNI DEL", "pod", pn.PodID, "network", n.list.Name, "cached", false, "ms", ms(time.Since(start)))
		return nil
	}
	for _, a := range atts {
		list, err := libcni.ConfListFromBytes(a.Config)
		if err != nil {
			return errdefs.New(errdefs.ErrFailedPrecondition, "pod %s: cached CNI config of network %q: %w", pn.PodID, a.Network, err)
		}
		rt := &libcni.RuntimeConf{
			ContainerID:    a.ContainerID,
			NetNS:          netns,
			IfName:         a.IfName,
			Args:           a.CniArgs,
			CapabilityArgs: a.CapabilityArgs,
		}
		if err := m.cni.DelNetworkList(ctx, list, rt); err != nil {
			return classify(ctx, fmt.Sprintf("pod %s: CNI DEL on network %q", pn.PodID, list.Name), err)
		}
		m.log.DebugContext(ctx, "CNI DEL", "pod", pn.PodID, "network", list.Name, "cached", true, "ms", ms(time.Since(start)))
	}
	return nil
}

// CachedResult returns the pod's attachment as libcni cached it at ADD, so
// that IPs can be reported after a daemon restart. No plugin runs.
// Errors: ErrNotFound when nothing is cached for the pod.
func (m *Manager) CachedResult(podID string) (*Result, error) {
	if err := checkPodID(podID); err != nil {
		return nil, err
	}
	atts, err := m.attachments(podID)
	if err != nil {
		return nil, fmt.Errorf("pod %s: CNI cache: %w", podID, err)
	}
	for _, a := range atts {
		list, err := libcni.ConfListFromBytes(a.Config)
		if err != nil {
			continue
		}
		res, err := m.cni.GetNetworkListCachedResult(list, &libcni.RuntimeConf{ContainerID: podID, IfName: a.IfName})
		if err != nil || res == nil {
			continue
		}
		return convertResult(res)
	}
	return nil, errdefs.NotFound("pod %s: no cached network attachment", podID)
}

// attachments are the pod's cached attachments on interface eth0.
func (m *Manager) attachments(podID string) ([]*libcni.NetworkAttachment, error) {
	all, err := m.cni.GetCachedAttachments(podID)
	if err != nil {
		return nil, err
	}
	return slices.DeleteFunc(all, func(a *libcni.NetworkAttachment) bool {
		return a.ContainerID != podID || a.IfName != IfName
	}), nil
}

// cachedNetNS is the netns the pod's cached attachment on network was made
// in, "" when there is none.
func (m *Manager) cachedNetNS(podID, network string) string {
	atts, _ := m.attachments(podID)
	for _, a := range atts {
		if a.Network == network {
			return a.NetNS
		}
	}
	return ""
}

func (m *Manager) runtimeConf(pn PodNetwork, netns string) *libcni.RuntimeConf {
	rt := &libcni.RuntimeConf{
		ContainerID: pn.PodID,
		NetNS:       netns,
		IfName:      IfName,
		Args: [][2]string{
			{"IgnoreUnknown", "1"},
			{"K8S_POD_NAMESPACE", pn.Namespace},
			{"K8S_POD_NAME", pn.Name},
			{"K8S_POD_INFRA_CONTAINER_ID", pn.PodID},
			{"K8S_POD_UID", pn.UID},
		},
	}
	var pms []portMapEntry
	for _, p := range pn.PortMappings {
		if p.HostPort <= 0 {
			continue
		}
		proto := strings.ToLower(p.Protocol)
		if proto == "" {
			proto = "tcp"
		}
		pms = append(pms, portMapEntry{HostPort: p.HostPort, ContainerPort: p.ContainerPort, Protocol: proto, HostIP: p.HostIP})
	}
	if len(pms) > 0 {
		rt.CapabilityArgs = map[string]any{"portMappings": pms}
	}
	return rt
}

func checkPodNetwork(pn PodNetwork) error {
	if err := checkPodID(pn.PodID); err != nil {
		return err
	}
	if pn.NetNS == "" {
		return errdefs.InvalidArgument("pod %s: no network namespace to attach", pn.PodID)
	}
	for _, p := range pn.PortMappings {
		switch strings.ToUpper(p.Protocol) {
		case "", "TCP", "UDP", "SCTP":
		default:
			return errdefs.InvalidArgument("pod %s: port mapping protocol %q is not TCP, UDP or SCTP", pn.PodID, p.Protocol)
		}
		if p.ContainerPort <= 0 || p.ContainerPort > 65535 || p.HostPort < 0 || p.HostPort > 65535 {
			return errdefs.InvalidArgument("pod %s: port mapping %d→%d out of range", pn.PodID, p.HostPort, p.ContainerPort)
		}
		if p.HostIP != "" && net.ParseIP(p.HostIP) == nil {
			return errdefs.InvalidArgument("pod %s: port mapping host IP %q is not an IP address", pn.PodID, p.HostIP)
		}
	}
	return nil
}

// classify gives a CNI failure its error class.
func classify(ctx context.Context, what string, err error) error {
	if ctx.Err() != nil {
		if errors.Is(ctx.Err(), context.DeadlineExceeded) {
			return errdefs.New(errdefs.ErrDeadlineExceeded, "%s: %w", what, err)
		}
		return fmt.Errorf("%s: %w", what, ctx.Err())
	}
	var cerr *types.Error
	if errors.As(err, &cerr) && cerr.Code == types.ErrTryAgainLater {
		return errdefs.New(errdefs.ErrUnavailable, "%s: %w", what, err)
	}
	return errdefs.New(errdefs.ErrFailedPrecondition, "%s: %w", what, err)
}

func convertResult(res types.Result) (*Result, error) {
	r, err := types100.NewResultFromResult(res)
	if err != nil {
		return nil, err
	}
	raw, err := json.Marshal(r)
	if err != nil {
		return nil, err
	}
	out := &Result{Raw: raw}
	var v4, v6 []string
	for _, ip := range r.IPs {
		if ip == nil || ip.Address.IP == nil {
			continue
		}
		if ip.Interface != nil && *ip.Interface >= 0 && *ip.Interface < len(r.Interfaces) {
			if itf := r.Interfaces[*ip.Interface]; itf.Sandbox != "" && out.Interface == "" {
				out.Interface, out.MAC = itf.Name, itf.Mac
			}
		}
		if out.Gateway == "" && ip.Gateway != nil {
			out.Gateway = ip.Gateway.String()
		}
		if ip.Address.IP.To4() != nil {
			v4 = append(v4, ip.Address.IP.String())
		} else {
			v6 = append(v6, ip.Address.IP.String())
		}
	}
	out.IPs = append(v4, v6...)
	if out.Interface == "" {
		for _, itf := range r.Interfaces {
			if itf.Sandbox != "" {
				out.Interface, out.MAC = itf.Name, itf.Mac
				break
			}
		}
	}
	for _, rt := range r.Routes {
		if rt == nil {
			continue
		}
		s := rt.Dst.String()
		if rt.GW != nil {
			s += " via " + rt.GW.String()
		}
		out.Routes = append(out.Routes, s)
	}
	return out, nil
}
