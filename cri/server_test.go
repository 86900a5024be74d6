package cri

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"syscall"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/broker"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/stage1"
	"github.com/stagelet/stagelet/trust"
)

func TestToStatus(t *testing.T) {
	tests := []struct {
		err  error
		want codes.Code
	}{
		{fmt.Errorf("pod x: %w", errdefs.ErrNotFound), codes.NotFound},
		{errdefs.AlreadyExists("name"), codes.AlreadyExists},
		{errdefs.InvalidArgument("config.metadata.name: must not be empty"), codes.InvalidArgument},
		{errdefs.FailedPrecondition("not running"), codes.FailedPrecondition},
		{fmt.Errorf("x: %w", errdefs.ErrPermissionDenied), codes.PermissionDenied},
		{fmt.Errorf("agent: %w", errdefs.ErrUnavailable), codes.Unavailable},
		{errdefs.New(errdefs.ErrUnimplemented, "devices"), codes.Unimplemented},
		{fmt.Errorf("wrapped: %w", context.DeadlineExceeded), codes.DeadlineExceeded},
		{fmt.Errorf("persist pod record: %w", errdefs.Storage(syscall.ENOSPC, "/var/lib/stagelet")), codes.ResourceExhausted},
		{fmt.Errorf("wrapped: %w", context.Canceled), codes.Canceled},
		{&trust.Rejection{Image: "r.io/a:1", Reason: "no signature"}, codes.Unknown},
		{fmt.Errorf("something unclassified"), codes.Internal},
	}
	for _, tc := range tests {
		st := toStatus(tc.err)
		if st.Code() != tc.want {
			t.Errorf("%v: code %v, want %v", tc.err, st.Code(), tc.want)
		}
		if st.Message() != tc.err.Error() {
			t.Errorf("message %q, want %q", st.Message(), tc.err.Error())
		}
	}
}

func TestPodConfigFromNamesMissingFields(t *testing.T) {
	_, err := podConfigFrom(&runtimeapi.RunPodSandboxRequest{})
	if toStatus(err).Code() != codes.InvalidArgument || toStatus(err).Message() != "config: must be set" {
		t.Fatalf("got %v", err)
	}
	_, err = podConfigFrom(&runtimeapi.RunPodSandboxRequest{Config: &runtimeapi.PodSandboxConfig{}})
	if toStatus(err).Message() != "config.metadata: must be set" {
		t.Fatalf("got %v", err)
	}
}

func TestPodConfigFromNamespaces(t *testing.T) {
	pc, err := podConfigFrom(&runtimeapi.RunPodSandboxRequest{
		RuntimeHandler: "fly",
		Config: &runtimeapi.PodSandboxConfig{
			Metadata:    &runtimeapi.PodSandboxMetadata{Name: "n", Namespace: "ns", Uid: "u", Attempt: 2},
			Labels:      map[string]string{"a": "b"},
			Annotations: map[string]string{"c": "d"},
			Linux: &runtimeapi.LinuxPodSandboxConfig{SecurityContext: &runtimeapi.LinuxSandboxSecurityContext{
				NamespaceOptions: &runtimeapi.NamespaceOption{Network: runtimeapi.NamespaceMode_NODE, Pid: runtimeapi.NamespaceMode_CONTAINER},
			}},
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	if !pc.HostNetwork || pc.HostPID || pc.HostIPC || pc.Metadata.Attempt != 2 || pc.RuntimeHandler != "fly" || pc.Labels["a"] != "b" || pc.Annotations["c"] != "d" {
		t.Fatalf("converted: %+v", pc)
	}
}

// TestUserNS: a user namespace of the pod's (hostUsers: false) reaches
// the pod and its containers with its mapping; a mapping no stage1 can
// run is refused, naming the field; NODE (or nothing) is the host's.
func TestUserNS(t *testing.T) {
	ids := func(host, length uint32) []*runtimeapi.IDMapping {
		return []*runtimeapi.IDMapping{{HostId: host, ContainerId: 0, Length: length}}
	}
	pod := &runtimeapi.NamespaceOption{UsernsOptions: &runtimeapi.UserNamespace{Mode: runtimeapi.NamespaceMode_POD,
		Uids: ids(100000, 65536), Gids: ids(100000, 65536)}}
	podReq := func(ns *runtimeapi.NamespaceOption) *runtimeapi.RunPodSandboxRequest {
		return &runtimeapi.RunPodSandboxRequest{Config: &runtimeapi.PodSandboxConfig{
			Metadata: &runtimeapi.PodSandboxMetadata{Name: "n", Namespace: "ns", Uid: "u"},
			Linux:    &runtimeapi.LinuxPodSandboxConfig{SecurityContext: &runtimeapi.LinuxSandboxSecurityContext{NamespaceOptions: ns}},
		}}
	}
	want := stage1.IDMapping{HostID: 100000, Size: 65536}
	pc, err := podConfigFrom(podReq(pod))
	if err != nil || pc.UserNS == nil || *pc.UserNS != want {
		t.Errorf("pod with a user namespace: %+v, %v", pc, err)
	}
	cc, err := containerConfigFrom(&runtimeapi.ContainerConfig{
		Metadata: &runtimeapi.ContainerMetadata{Name: "c"},
		Image:    &runtimeapi.ImageSpec{Image: "busybox"},
		Linux:    &runtimeapi.LinuxContainerConfig{SecurityContext: &runtimeapi.LinuxContainerSecurityContext{NamespaceOptions: pod}},
	})
	if err != nil || cc.Security.UserNS == nil || *cc.Security.UserNS != want {
		t.Errorf("container with a user namespace: %+v, %v", cc, err)
	}
	for name, u := range map[string]*runtimeapi.UserNamespace{
		"two ranges":    {Mode: runtimeapi.NamespaceMode_POD, Uids: append(ids(100000, 10), ids(200000, 10)...), Gids: ids(100000, 20)},
		"gids differ":   {Mode: runtimeapi.NamespaceMode_POD, Uids: ids(100000, 65536), Gids: ids(300000, 65536)},
		"not from 0":    {Mode: runtimeapi.NamespaceMode_POD, Uids: []*runtimeapi.IDMapping{{HostId: 1, ContainerId: 5, Length: 9}}, Gids: ids(1, 9)},
		"host root":     {Mode: runtimeapi.NamespaceMode_POD, Uids: ids(0, 65536), Gids: ids(0, 65536)},
		"container":     {Mode: runtimeapi.NamespaceMode_CONTAINER},
		"node with ids": {Mode: runtimeapi.NamespaceMode_NODE, Uids: ids(100000, 65536), Gids: ids(100000, 65536)},
	} {
		_, err := podConfigFrom(podReq(&runtimeapi.NamespaceOption{UsernsOptions: u}))
		if st := toStatus(err); st.Code() != codes.InvalidArgument || !strings.Contains(st.Message(), "namespace_options.userns_options") {
			t.Errorf("%s: %v, want InvalidArgument naming the field", name, err)
		}
	}
	host := &runtimeapi.NamespaceOption{UsernsOptions: &runtimeapi.UserNamespace{Mode: runtimeapi.NamespaceMode_NODE}}
	if pc, err := podConfigFrom(podReq(host)); err != nil || pc.UserNS != nil {
		t.Errorf("pod in the host's user namespace: %+v, %v", pc, err)
	}
}

func TestContainerConfigFrom(t *testing.T) {
	uid := &runtimeapi.Int64Value{Value: 1000}
	cc, err := containerConfigFrom(&runtimeapi.ContainerConfig{
		Metadata: &runtimeapi.ContainerMetadata{Name: "c", Attempt: 1},
		Image:    &runtimeapi.ImageSpec{Image: "busybox"},
		Envs:     []*runtimeapi.KeyValue{{Key: "A", Value: []byte("1")}},
		Mounts:   []*runtimeapi.Mount{{ContainerPath: "/data", HostPath: "/tmp", Readonly: true, Propagation: runtimeapi.MountPropagation_PROPAGATION_HOST_TO_CONTAINER}},
		Linux: &runtimeapi.LinuxContainerConfig{
			Resources:       &runtimeapi.LinuxContainerResources{MemoryLimitInBytes: 1 << 20, CpuShares: 512},
			SecurityContext: &runtimeapi.LinuxContainerSecurityContext{RunAsUser: uid, ReadonlyRootfs: true, Capabilities: &runtimeapi.Capability{AddCapabilities: []string{"NET_ADMIN"}}},
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	if cc.Env[0].Value != "1" || cc.Mounts[0].Propagation != "rslave" || !cc.Mounts[0].Readonly || cc.Resources.MemoryLimit != 1<<20 ||
		*cc.Security.RunAsUser != 1000 || !cc.Security.ReadonlyRootfs || cc.Security.AddCapabilities[0] != "NET_ADMIN" {
		t.Fatalf("converted: %+v", cc)
	}
	if _, err := containerConfigFrom(&runtimeapi.ContainerConfig{Metadata: &runtimeapi.ContainerMetadata{Name: "c"}}); toStatus(err).Message() != "config.image: must be set" {
		t.Fatalf("got %v", err)
	}
}

func TestContainerConfigFromSecurityFields(t *testing.T) {
	cc, err := containerConfigFrom(&runtimeapi.ContainerConfig{
		Metadata: &runtimeapi.ContainerMetadata{Name: "c"},
		Image:    &runtimeapi.ImageSpec{Image: "busybox"},
		Mounts: []*runtimeapi.Mount{
			{ContainerPath: "/rro", HostPath: "/tmp", Readonly: true, RecursiveReadOnly: true},
			{ContainerPath: "/both", HostPath: "/tmp", Propagation: runtimeapi.MountPropagation_PROPAGATION_BIDIRECTIONAL},
		},
		Linux: &runtimeapi.LinuxContainerConfig{SecurityContext: &runtimeapi.LinuxContainerSecurityContext{
			MaskedPaths:      []string{"/proc/kcore"},
			ReadonlyPaths:    []string{"/proc/sys"},
			NamespaceOptions: &runtimeapi.NamespaceOption{Pid: runtimeapi.NamespaceMode_TARGET, TargetId: "abc"},
		}},
	})
	if err != nil {
		t.Fatal(err)
	}
	s := cc.Security
	if !cc.Mounts[0].RecursiveReadonly || cc.Mounts[1].Propagation != "rshared" || cc.Mounts[1].RecursiveReadonly ||
		s.MaskedPaths[0] != "/proc/kcore" || s.ReadonlyPaths[0] != "/proc/sys" || s.PIDMode != broker.PIDModeTarget || s.PIDTarget != "abc" {
		t.Fatalf("converted: %+v %+v", cc.Mounts, s)
	}
	_, err = containerConfigFrom(&runtimeapi.ContainerConfig{
		Metadata: &runtimeapi.ContainerMetadata{Name: "c"},
		Image:    &runtimeapi.ImageSpec{Image: "busybox"},
		Linux: &runtimeapi.LinuxContainerConfig{SecurityContext: &runtimeapi.LinuxContainerSecurityContext{
			NamespaceOptions: &runtimeapi.NamespaceOption{Pid: runtimeapi.NamespaceMode_TARGET},
		}},
	})
	if toStatus(err).Code() != codes.InvalidArgument {
		t.Fatalf("TARGET without target_id: %v", err)
	}
}

func TestMountOptions(t *testing.T) {
	cfg := func(opts ...string) *runtimeapi.ContainerConfig {
		return &runtimeapi.ContainerConfig{
			Metadata: &runtimeapi.ContainerMetadata{Name: "c"},
			Image:    &runtimeapi.ImageSpec{Image: "i"},
			Mounts:   []*runtimeapi.Mount{{ContainerPath: "/a", HostPath: "/b", MountOptions: opts}},
		}
	}
	cc, err := containerConfigFrom(cfg("nosuid", "noexec"))
	if err != nil {
		t.Fatal(err)
	}
	if m := cc.Mounts[0]; !m.NoSuid || m.NoDev || !m.NoExec {
		t.Errorf("mount options nosuid, noexec: %+v", m)
	}
	_, err = containerConfigFrom(cfg("nodev", "sync"))
	if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "config.mounts[0].mount_options") {
		t.Errorf("an option not supported: %v, want InvalidArgument naming the field", err)
	}
}

// Every status-path method is a method of the CRI services, and the calls
// that change something are not on it.
func TestStatusPathMethods(t *testing.T) {
	known := map[string]bool{}
	for _, sd := range []grpc.ServiceDesc{runtimeapi.RuntimeService_ServiceDesc, runtimeapi.ImageService_ServiceDesc} {
		for _, m := range sd.Methods {
			known["/"+sd.ServiceName+"/"+m.MethodName] = true
		}
		for _, s := range sd.Streams {
			known["/"+sd.ServiceName+"/"+s.StreamName] = true
		}
	}
	for m := range statusPath {
		if !known[m] {
			t.Errorf("%s is no CRI method", m)
		}
	}
	for _, m := range []string{"/runtime.v1.RuntimeService/RunPodSandbox", "/runtime.v1.RuntimeService/ExecSync", "/runtime.v1.ImageService/PullImage"} {
		if StatusPath(m) {
			t.Errorf("%s is on the status path", m)
		}
	}
	if !StatusPath("/runtime.v1.RuntimeService/ListContainers") {
		t.Error("ListContainers is not on the status path")
	}
}
