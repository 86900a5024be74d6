package cri

import (
	"context"
	"fmt"
	"strings"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
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

// Status reports runtime and network readiness and the runtime handlers.
// Networking is the host's for every stage1 this build has, so the network
// is ready when the runtime is.
func (s *Server) Status(ctx context.Context, r *runtimeapi.StatusRequest) (*runtimeapi.StatusResponse, error) {
	conds := []*runtimeapi.RuntimeCondition{
		{Type: runtimeapi.RuntimeReady, Status: true},
		{Type: runtimeapi.NetworkReady, Status: true, Reason: "", Message: "pods use the host network"},
	}
	resp := &runtimeapi.StatusResponse{Status: &runtimeapi.RuntimeStatus{Conditions: conds}}
	for _, h := range s.b.Handlers() {
		resp.RuntimeHandlers = append(resp.RuntimeHandlers, &runtimeapi.RuntimeHandler{Name: h, Features: &runtimeapi.RuntimeHandlerFeatures{}})
	}
	// The empty handler: the node default, as the kubelet expects.
	resp.RuntimeHandlers = append(resp.RuntimeHandlers, &runtimeapi.RuntimeHandler{Name: "", Features: &runtimeapi.RuntimeHandlerFeatures{}})
	if r.GetVerbose() {
		resp.Info = map[string]string{
			"handlers":  strings.Join(s.b.Handlers(), ","),
			"startedAt": s.startedAt.UTC().Format("2006-01-02T15:04:05Z"),
			"pods":      fmt.Sprint(len(s.b.ListPods(podFilterAll))),
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
		s.log.Info("pod CIDR from the kubelet", "cidr", cidr)
	}
	return &runtimeapi.UpdateRuntimeConfigResponse{}, nil
}
