package cri

import (
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

func refusalOK(c codes.Code) bool {
	return c == codes.InvalidArgument || c == codes.Unimplemented
}

func mustMarshal(m proto.Message) []byte {
	b, err := proto.Marshal(m)
	if err != nil {
		panic(err)
	}
	return b
}

// FuzzRequestConversion: CRI pod and container configs, as any client
// may send them on the wire, convert without panicking, and a refusal is
// InvalidArgument (bad input) or Unimplemented (a field stagelet cannot
// honour, such as devices), never an internal error.
func FuzzRequestConversion(f *testing.F) {
	uid := &runtimeapi.Int64Value{Value: 1000}
	f.Add(mustMarshal(&runtimeapi.RunPodSandboxRequest{Config: &runtimeapi.PodSandboxConfig{
		Metadata: &runtimeapi.PodSandboxMetadata{Name: "p", Namespace: "default", Uid: "u"},
		Hostname: "p", LogDirectory: "/var/log/pods/x",
		DnsConfig:    &runtimeapi.DNSConfig{Servers: []string{"10.0.0.10"}, Searches: []string{"svc.cluster.local"}},
		PortMappings: []*runtimeapi.PortMapping{{ContainerPort: 80, HostPort: 8080}},
		Linux: &runtimeapi.LinuxPodSandboxConfig{
			Sysctls:         map[string]string{"net.ipv4.ip_forward": "1"},
			SecurityContext: &runtimeapi.LinuxSandboxSecurityContext{NamespaceOptions: &runtimeapi.NamespaceOption{Network: runtimeapi.NamespaceMode_NODE}},
			Resources:       &runtimeapi.LinuxContainerResources{MemoryLimitInBytes: 64 << 20},
		},
	}, RuntimeHandler: "kvm"}), mustMarshal(&runtimeapi.ContainerConfig{
		Metadata: &runtimeapi.ContainerMetadata{Name: "c", Attempt: 1},
		Image:    &runtimeapi.ImageSpec{Image: "busybox"},
		Command:  []string{"sh"}, Args: []string{"-c", "true"},
		Envs:   []*runtimeapi.KeyValue{{Key: "A", Value: []byte("1")}},
		Mounts: []*runtimeapi.Mount{{ContainerPath: "/data", HostPath: "/tmp", Propagation: runtimeapi.MountPropagation_PROPAGATION_BIDIRECTIONAL}},
		Linux: &runtimeapi.LinuxContainerConfig{
			Resources: &runtimeapi.LinuxContainerResources{CpuShares: 512, Unified: map[string]string{"memory.swap.max": "0"}},
			SecurityContext: &runtimeapi.LinuxContainerSecurityContext{RunAsUser: uid, Seccomp: &runtimeapi.SecurityProfile{ProfileType: runtimeapi.SecurityProfile_Localhost, LocalhostRef: "/p.json"},
				NamespaceOptions: &runtimeapi.NamespaceOption{Pid: runtimeapi.NamespaceMode_TARGET, TargetId: "x"}},
		},
	}))
	f.Add([]byte{}, []byte{})
	f.Add([]byte{0x0a, 0x00}, []byte{0x0a, 0x02, 0x0a, 0x00})
	f.Fuzz(func(t *testing.T, podMsg, ctrMsg []byte) {
		var pr runtimeapi.RunPodSandboxRequest
		if proto.Unmarshal(podMsg, &pr) == nil {
			if _, err := podConfigFrom(&pr); err != nil {
				if c := toStatus(err).Code(); !refusalOK(c) {
					t.Fatalf("podConfigFrom refused with %v: %v", c, err)
				}
			}
		}
		var cc runtimeapi.ContainerConfig
		if proto.Unmarshal(ctrMsg, &cc) == nil {
			if _, err := containerConfigFrom(&cc); err != nil {
				if c := toStatus(err).Code(); !refusalOK(c) {
					t.Fatalf("containerConfigFrom refused with %v: %v", c, err)
				}
			}
			if r := cc.GetLinux().GetResources(); r != nil {
				if _, err := containerResources(r, "linux.resources"); err != nil {
					if c := toStatus(err).Code(); !refusalOK(c) {
						t.Fatalf("containerResources refused with %v: %v", c, err)
					}
				}
			}
		}
	})
}
