package cri

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/policy"
)

const (
	runtimeName    = "stagelet"
	criAPIVersion  = "v1"
	kubeAPIVersion = "0.1.0"
)

// Version reports the runtime's name and versions.
func (s *Server) Version(ctx context.Context, r *runtimeapi.VersionRequest) (*runtimeapi.VersionResponse, error) {
	return &runtimeapi.VersionResponse{
		Version:           kubeAPIVersion,
		RuntimeName:       runtimeName,
		RuntimeVersion:    s.version,
		RuntimeApiVersion: criAPIVersion,
	}, nil
}

// handlerList is the runtime handlers Status reports under one policy.
type handlerList struct {
	pol  *policy.Policy
	list []*runtimeapi.RuntimeHandler
}

// runtimeHandlers are the runtime handlers of the policy in force and
// their features, made again only when the policy changes: replies share
// them, and nothing writes them once made. Every stage1's agent makes
// read-only mounts recursively read-only with mount_setattr when asked;
// user namespaces are the stage1's (for the empty handler, the default
// stage1's: a rule may still put such a pod elsewhere, where the policy's
// conflicts route it).
func (s *Server) runtimeHandlers() []*runtimeapi.RuntimeHandler {
	pol := s.b.Policy()
	if hl := s.handlers.Load(); hl != nil && hl.pol == pol {
		return hl.list
	}
	features := func(h string) *runtimeapi.RuntimeHandlerFeatures {
		c, _ := s.b.HandlerCapabilities(h)
		return &runtimeapi.RuntimeHandlerFeatures{RecursiveReadOnlyMounts: true, UserNamespaces: c.UserNamespaces}
	}
	var list []*runtimeapi.RuntimeHandler
	for _, h := range s.b.Handlers() {
		list = append(list, &runtimeapi.RuntimeHandler{Name: h, Features: features(h)})
	}
	// The empty handler: the node default, as the kubelet expects.
	list = append(list, &runtimeapi.RuntimeHandler{Name: "", Features: features("")})
	s.handlers.Store(&handlerList{pol: pol, list: list})
	return list
}

// Status reports runtime and network readiness and the runtime handlers.
// The network is ready when a valid CNI configuration is there; pods in the
// host network do not need it.
func (s *Server) Status(ctx context.Context, r *runtimeapi.StatusRequest) (*runtimeapi.StatusResponse, error) {
	netReady, netReason := s.b.NetworkStatus()
	netCond := &runtimeapi.RuntimeCondition{Type: runtimeapi.NetworkReady, Status: netReady}
	if !netReady {
		netCond.Reason = "NetworkPluginNotReady"
		netCond.Message = netReason
	}
	conds := []*runtimeapi.RuntimeCondition{
		{Type: runtimeapi.RuntimeReady, Status: true},
		netCond,
	}
	resp := &runtimeapi.StatusResponse{
		Status: &runtimeapi.RuntimeStatus{Conditions: conds},
		// Strict supplemental groups and the user reported in
		// ContainerStatus; nosuid, nodev and noexec bind mounts.
		Features: &runtimeapi.RuntimeFeatures{SupplementalGroupsPolicy: true, MountOptions: true},
	}
	resp.RuntimeHandlers = s.runtimeHandlers()
	if r.GetVerbose() {
		counts, _ := json.Marshal(s.b.DecisionCounts())
		pol := s.b.Policy()
		resp.Info = map[string]string{
			"handlers":      strings.Join(s.b.Handlers(), ","),
			"stage1s":       strings.Join(s.b.Stage1s(), ","),
			"policy":        pol.Source,
			"defaultStage1": pol.DefaultStage1,
			"decisions":     string(counts),
			"startedAt":     s.startedAt.UTC().Format("2006-01-02T15:04:05Z"),
			"pods":          fmt.Sprint(len(s.b.ListPods(podFilterAll))),
			// Records recovery could not read, moved to quarantine.
			"quarantinedRecords": fmt.Sprint(s.b.QuarantinedRecords()),
			// CDI devices are resolved (containerd's enableCDI).
			"cdi.enabled":  "true",
			"cdi.specDirs": strings.Join(s.b.CDISpecDirs(), ","),
		}
		// The signature policy: its files, when each was loaded, and
		// the error of one that no longer loads (the last good one
		// stays in force).
		if file, dir, files, ok := s.b.TrustStatus(ctx); ok {
			b, _ := json.Marshal(map[string]any{"file": file, "dir": dir, "loaded": files})
			resp.Info["signaturePolicy"] = string(b)
		} else {
			resp.Info["signaturePolicy"] = "none: every image runs unverified"
		}
		// NRI: where plugins connect and which are connected.
		if h := s.b.NRI(); h != nil {
			plugins, n := h.Plugins()
			b, _ := json.Marshal(map[string]any{"socket": h.Socket(), "connected": n, "plugins": plugins})
			resp.Info["nri"] = string(b)
		} else {
			resp.Info["nri"] = "off (nri.disable)"
		}
		for k, v := range s.b.BackendInfo(ctx) {
			resp.Info[k] = v
		}
		if info := s.nodeInfo.Load(); info != nil {
			for k, v := range *info {
				resp.Info[k] = v
			}
		}
	}
	return resp, nil
}

// RuntimeConfig reports the cgroup driver.
func (s *Server) RuntimeConfig(ctx context.Context, r *runtimeapi.RuntimeConfigRequest) (*runtimeapi.RuntimeConfigResponse, error) {
	return &runtimeapi.RuntimeConfigResponse{Linux: &runtimeapi.LinuxRuntimeConfiguration{CgroupDriver: s.cgroupDriver}}, nil
}

// UpdateRuntimeConfig accepts the pod CIDR the kubelet sends. Pod networking
// is the host's in this build, so there is nothing to reconfigure.
func (s *Server) UpdateRuntimeConfig(ctx context.Context, r *runtimeapi.UpdateRuntimeConfigRequest) (*runtimeapi.UpdateRuntimeConfigResponse, error) {
	if cidr := r.GetRuntimeConfig().GetNetworkConfig().GetPodCidr(); cidr != "" {
		s.log.InfoContext(ctx, "pod CIDR from the kubelet", "cidr", cidr)
	}
	return &runtimeapi.UpdateRuntimeConfigResponse{}, nil
}
