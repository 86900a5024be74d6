package cri

import (
	"context"
	"maps"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/broker"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/stage1"
)

var podFilterAll = broker.PodFilter{}

func podConfigFrom(r *runtimeapi.RunPodSandboxRequest) (*broker.PodConfig, error) {
	c := r.GetConfig()
	if c == nil {
		return nil, badRequest("config")
	}
	if c.GetMetadata() == nil {
		return nil, badRequest("config.metadata")
	}
	if c.GetWindows() != nil {
		return nil, errdefs.InvalidArgument("config.windows: a Windows pod cannot run on a Linux node")
	}
	m := c.GetMetadata()
	pc := &broker.PodConfig{
		Metadata:       broker.PodMetadata{Name: m.GetName(), Namespace: m.GetNamespace(), UID: m.GetUid(), Attempt: m.GetAttempt()},
		Hostname:       c.GetHostname(),
		LogDirectory:   c.GetLogDirectory(),
		Labels:         maps.Clone(c.GetLabels()),
		Annotations:    maps.Clone(c.GetAnnotations()),
		RuntimeHandler: r.GetRuntimeHandler(),
	}
	if d := c.GetDnsConfig(); d != nil {
		pc.DNS = &broker.DNSConfig{Servers: d.GetServers(), Searches: d.GetSearches(), Options: d.GetOptions()}
	}
	for _, p := range c.GetPortMappings() {
		pc.PortMappings = append(pc.PortMappings, broker.PortMapping{
			Protocol:      p.GetProtocol().String(),
			ContainerPort: p.GetContainerPort(),
			HostPort:      p.GetHostPort(),
			HostIP:        p.GetHostIp(),
		})
	}
	if l := c.GetLinux(); l != nil {
		pc.CgroupParent = l.GetCgroupParent()
		pc.Sysctls = maps.Clone(l.GetSysctls())
		if r := l.GetResources(); r != nil {
			// The OOM score is a process's, not used for a pod.
			res, err := podResources(r, "config.linux.resources")
			if err != nil {
				return nil, err
			}
			pc.Resources = &res
		}
		if o := l.GetOverhead(); o != nil {
			res, err := podResources(o, "config.linux.overhead")
			if err != nil {
				return nil, err
			}
			pc.Overhead = &res
		}
		if sc := l.GetSecurityContext(); sc != nil {
			pc.Privileged = sc.GetPrivileged()
			pc.SELinux = seLinuxOptions(sc.GetSelinuxOptions())
			if ns := sc.GetNamespaceOptions(); ns != nil {
				var err error
				if pc.UserNS, err = userNS(ns, "config.linux.security_context.namespace_options"); err != nil {
					return nil, err
				}
				pc.HostNetwork = ns.GetNetwork() == runtimeapi.NamespaceMode_NODE
				pc.HostPID = ns.GetPid() == runtimeapi.NamespaceMode_NODE
				pc.HostIPC = ns.GetIpc() == runtimeapi.NamespaceMode_NODE
			}
		}
	}
	return pc, nil
}

// userNS reads user namespace options: none or mode NODE is the host's
// user namespace (nil); mode POD is a user namespace of the pod's own
// (hostUsers: false) with the mapping given, which must be one range of
// user IDs from container ID 0 and the same range of group IDs, as the
// kubelet sends. Anything else is InvalidArgument naming the field.
func userNS(ns *runtimeapi.NamespaceOption, field string) (*stage1.IDMapping, error) {
	u := ns.GetUsernsOptions()
	if u == nil {
		return nil, nil
	}
	field += ".userns_options"
	switch u.GetMode() {
	case runtimeapi.NamespaceMode_NODE:
		if len(u.GetUids()) > 0 || len(u.GetGids()) > 0 {
			return nil, errdefs.InvalidArgument("%s: mode NODE (the host's user namespace) takes no ID mappings", field)
		}
		return nil, nil
	case runtimeapi.NamespaceMode_POD:
	default:
		return nil, errdefs.InvalidArgument("%s: mode %s: a user namespace is the node's or the pod's", field, u.GetMode())
	}
	uids, gids := u.GetUids(), u.GetGids()
	if len(uids) != 1 || len(gids) != 1 {
		return nil, errdefs.InvalidArgument("%s: %d uid and %d gid mappings: want one of each", field, len(uids), len(gids))
	}
	uid, gid := uids[0], gids[0]
	if uid.GetContainerId() != 0 || gid.GetContainerId() != 0 {
		return nil, errdefs.InvalidArgument("%s: the mappings start at container ID %d (uids) and %d (gids): want 0", field, uid.GetContainerId(), gid.GetContainerId())
	}
	if uid.GetHostId() != gid.GetHostId() || uid.GetLength() != gid.GetLength() {
		return nil, errdefs.InvalidArgument("%s: uids map %d from host ID %d, gids %d from %d: want the same range for both", field, uid.GetLength(), uid.GetHostId(), gid.GetLength(), gid.GetHostId())
	}
	if uid.GetHostId() == 0 || uid.GetLength() == 0 {
		return nil, errdefs.InvalidArgument("%s: %d IDs from host ID %d: want a range that does not start at the host's root", field, uid.GetLength(), uid.GetHostId())
	}
	return &stage1.IDMapping{HostID: uid.GetHostId(), Size: uid.GetLength()}, nil
}

// RunPodSandbox creates and starts a pod.
func (s *Server) RunPodSandbox(ctx context.Context, r *runtimeapi.RunPodSandboxRequest) (*runtimeapi.RunPodSandboxResponse, error) {
	pc, err := podConfigFrom(r)
	if err != nil {
		return nil, err
	}
	id, err := s.b.RunPod(ctx, pc)
	if err != nil {
		return nil, err
	}
	return &runtimeapi.RunPodSandboxResponse{PodSandboxId: id}, nil
}

// StopPodSandbox stops a pod; idempotent.
func (s *Server) StopPodSandbox(ctx context.Context, r *runtimeapi.StopPodSandboxRequest) (*runtimeapi.StopPodSandboxResponse, error) {
	if r.GetPodSandboxId() == "" {
		return nil, badRequest("pod_sandbox_id")
	}
	if err := s.b.StopPod(ctx, r.GetPodSandboxId()); err != nil {
		return nil, err
	}
	return &runtimeapi.StopPodSandboxResponse{}, nil
}

// RemovePodSandbox removes a pod; idempotent.
func (s *Server) RemovePodSandbox(ctx context.Context, r *runtimeapi.RemovePodSandboxRequest) (*runtimeapi.RemovePodSandboxResponse, error) {
	if r.GetPodSandboxId() == "" {
		return nil, badRequest("pod_sandbox_id")
	}
	if err := s.b.RemovePod(ctx, r.GetPodSandboxId()); err != nil {
		return nil, err
	}
	return &runtimeapi.RemovePodSandboxResponse{}, nil
}

func podState(ready bool) runtimeapi.PodSandboxState {
	if ready {
		return runtimeapi.PodSandboxState_SANDBOX_READY
	}
	return runtimeapi.PodSandboxState_SANDBOX_NOTREADY
}

func podMeta(m broker.PodMetadata) *runtimeapi.PodSandboxMetadata {
	return &runtimeapi.PodSandboxMetadata{Name: m.Name, Namespace: m.Namespace, Uid: m.UID, Attempt: m.Attempt}
}

func nsMode(host bool) runtimeapi.NamespaceMode {
	if host {
		return runtimeapi.NamespaceMode_NODE
	}
	return runtimeapi.NamespaceMode_POD
}

// PodSandboxStatus returns a pod's status, with the stage1 decision in the
// verbose info.
func (s *Server) PodSandboxStatus(ctx context.Context, r *runtimeapi.PodSandboxStatusRequest) (*runtimeapi.PodSandboxStatusResponse, error) {
	if r.GetPodSandboxId() == "" {
		return nil, badRequest("pod_sandbox_id")
	}
	st, err := s.b.PodStatus(ctx, r.GetPodSandboxId(), r.GetVerbose())
	if err != nil {
		return nil, err
	}
	return &runtimeapi.PodSandboxStatusResponse{Status: podSandboxStatus(st), Info: st.Info}, nil
}

func podSandboxStatus(st *broker.PodStatus) *runtimeapi.PodSandboxStatus {
	rec := &st.Record
	c := &rec.Config
	return &runtimeapi.PodSandboxStatus{
		Id:          rec.ID,
		Metadata:    podMeta(c.Metadata),
		State:       podState(st.Ready),
		CreatedAt:   rec.CreatedAt.UnixNano(),
		Network:     podNetworkStatus(rec.IPs),
		Labels:      c.Labels,
		Annotations: c.Annotations,
		Linux: &runtimeapi.LinuxPodSandboxStatus{Namespaces: &runtimeapi.Namespace{Options: &runtimeapi.NamespaceOption{
			Network: nsMode(c.HostNetwork), Pid: nsMode(c.HostPID), Ipc: nsMode(c.HostIPC),
		}}},
		RuntimeHandler: rec.Stage1,
	}
}

// ListPodSandbox lists pods matching the filter.
func (s *Server) ListPodSandbox(ctx context.Context, r *runtimeapi.ListPodSandboxRequest) (*runtimeapi.ListPodSandboxResponse, error) {
	f := broker.PodFilter{}
	if rf := r.GetFilter(); rf != nil {
		f.ID = rf.GetId()
		f.LabelSelector = rf.GetLabelSelector()
		if sv := rf.GetState(); sv != nil {
			f.State = broker.PodNotReady
			if sv.GetState() == runtimeapi.PodSandboxState_SANDBOX_READY {
				f.State = broker.PodReady
			}
		}
	}
	list := s.b.ListPods(f)
	resp := &runtimeapi.ListPodSandboxResponse{Items: make([]*runtimeapi.PodSandbox, len(list))}
	for i := range list {
		p := &list[i]
		resp.Items[i] = &runtimeapi.PodSandbox{
			Id:             p.ID,
			Metadata:       podMeta(p.Metadata),
			State:          podState(p.Ready),
			CreatedAt:      p.CreatedAt.UnixNano(),
			Labels:         p.Labels,
			Annotations:    p.Annotations,
			RuntimeHandler: p.Stage1,
		}
	}
	return resp, nil
}

func podNetworkStatus(ips []string) *runtimeapi.PodSandboxNetworkStatus {
	st := &runtimeapi.PodSandboxNetworkStatus{}
	for i, ip := range ips {
		if i == 0 {
			st.Ip = ip
			continue
		}
		st.AdditionalIps = append(st.AdditionalIps, &runtimeapi.PodIP{Ip: ip})
	}
	return st
}
