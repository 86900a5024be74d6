package cri

import (
	"errors"
	"fmt"
	"sort"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/errdefs"
)

// fieldUse is what stagelet does with a field of a CRI request.
type fieldUse int

const (
	// honoured: read and acted on.
	honoured fieldUse = iota + 1
	// informational: nothing to apply; the comment beside it says why.
	informational
	// refused: any value but the zero one is an error naming the field
	// (TestRefusedFieldsAreRefused sets each one and checks).
	refused
)

// criFields decides every field of every request message of the CRI
// services, and of every message those reach. A field cri-api adds fails
// TestEveryRequestFieldDecided until it is put here, honoured or refused.
var criFields = map[string]fieldUse{
	"VersionRequest.version": informational, // the client's API version; the reply names ours

	"RunPodSandboxRequest.config":            honoured,
	"RunPodSandboxRequest.runtime_handler":   honoured,
	"PodSandboxConfig.metadata":              honoured,
	"PodSandboxConfig.hostname":              honoured,
	"PodSandboxConfig.log_directory":         honoured,
	"PodSandboxConfig.dns_config":            honoured,
	"PodSandboxConfig.port_mappings":         honoured,
	"PodSandboxConfig.labels":                honoured,
	"PodSandboxConfig.annotations":           honoured,
	"PodSandboxConfig.linux":                 honoured,
	"PodSandboxConfig.windows":               refused,
	"PodSandboxMetadata.name":                honoured,
	"PodSandboxMetadata.uid":                 honoured,
	"PodSandboxMetadata.namespace":           honoured,
	"PodSandboxMetadata.attempt":             honoured,
	"DNSConfig.servers":                      honoured,
	"DNSConfig.searches":                     honoured,
	"DNSConfig.options":                      honoured,
	"PortMapping.protocol":                   honoured,
	"PortMapping.container_port":             honoured,
	"PortMapping.host_port":                  honoured,
	"PortMapping.host_ip":                    honoured,
	"LinuxPodSandboxConfig.cgroup_parent":    honoured,
	"LinuxPodSandboxConfig.security_context": honoured,
	"LinuxPodSandboxConfig.sysctls":          honoured,
	// The kubelet adds the overhead to the pod cgroup it sizes itself; a
	// VM stage1 reads it to say what the pod's cgroup holds.
	"LinuxPodSandboxConfig.overhead":                honoured,
	"LinuxPodSandboxConfig.resources":               honoured,
	"LinuxSandboxSecurityContext.namespace_options": honoured,
	"LinuxSandboxSecurityContext.privileged":        honoured,
	// The pod's SELinux context: its MCS level is its containers'.
	"LinuxSandboxSecurityContext.selinux_options": honoured,
	// The rest of a sandbox's security context is its infra ("pause")
	// container's: stagelet runs none. The kubelet gives each container
	// the pod's settings in its own context.
	"LinuxSandboxSecurityContext.run_as_user":                informational,
	"LinuxSandboxSecurityContext.run_as_group":               informational,
	"LinuxSandboxSecurityContext.readonly_rootfs":            informational,
	"LinuxSandboxSecurityContext.supplemental_groups":        informational,
	"LinuxSandboxSecurityContext.supplemental_groups_policy": informational,
	"LinuxSandboxSecurityContext.seccomp":                    informational,
	"LinuxSandboxSecurityContext.apparmor":                   informational,
	"LinuxSandboxSecurityContext.seccomp_profile_path":       informational,
	"NamespaceOption.network":                                honoured,
	"NamespaceOption.pid":                                    honoured,
	"NamespaceOption.ipc":                                    honoured,
	"NamespaceOption.target_id":                              honoured,
	"NamespaceOption.userns_options":                         honoured,
	"UserNamespace.mode":                                     honoured,
	"UserNamespace.uids":                                     honoured,
	"UserNamespace.gids":                                     honoured,
	"IDMapping.host_id":                                      honoured,
	"IDMapping.container_id":                                 honoured,
	"IDMapping.length":                                       honoured,
	"SELinuxOption.user":                                     honoured,
	"SELinuxOption.role":                                     honoured,
	"SELinuxOption.type":                                     honoured,
	"SELinuxOption.level":                                    honoured,
	"Int64Value.value":                                       honoured,
	"SecurityProfile.profile_type":                           honoured,
	"SecurityProfile.localhost_ref":                          honoured,
	"LinuxContainerResources.cpu_period":                     honoured,
	"LinuxContainerResources.cpu_quota":                      honoured,
	"LinuxContainerResources.cpu_shares":                     honoured,
	"LinuxContainerResources.memory_limit_in_bytes":          honoured,
	"LinuxContainerResources.oom_score_adj":                  honoured,
	"LinuxContainerResources.cpuset_cpus":                    honoured,
	"LinuxContainerResources.cpuset_mems":                    honoured,
	"LinuxContainerResources.hugepage_limits":                honoured, // each limit is checked: refused when not zero
	"LinuxContainerResources.unified":                        refused,  // but memory.swap.max=0, which holds without swap, and memory.oom.group, applied
	"LinuxContainerResources.memory_swap_limit_in_bytes":     refused,  // but one equal to the memory limit: no swap
	// The kubelet lists every page size with a zero limit: the size
	// alone asks nothing.
	"HugepageLimit.page_size": informational,
	"HugepageLimit.limit":     refused,

	"WindowsPodSandboxConfig.security_context":                 refused,
	"WindowsSandboxSecurityContext.run_as_username":            refused,
	"WindowsSandboxSecurityContext.credential_spec":            refused,
	"WindowsSandboxSecurityContext.host_process":               refused,
	"WindowsSandboxSecurityContext.namespace_options":          refused,
	"WindowsNamespaceOption.network":                           refused,
	"WindowsContainerConfig.resources":                         refused,
	"WindowsContainerConfig.security_context":                  refused,
	"WindowsContainerResources.cpu_shares":                     refused,
	"WindowsContainerResources.cpu_count":                      refused,
	"WindowsContainerResources.cpu_maximum":                    refused,
	"WindowsContainerResources.memory_limit_in_bytes":          refused,
	"WindowsContainerResources.rootfs_size_in_bytes":           refused,
	"WindowsContainerResources.affinity_cpus":                  refused,
	"WindowsCpuGroupAffinity.cpu_mask":                         refused,
	"WindowsCpuGroupAffinity.cpu_group":                        refused,
	"WindowsContainerSecurityContext.run_as_username":          refused,
	"WindowsContainerSecurityContext.credential_spec":          refused,
	"WindowsContainerSecurityContext.host_process":             refused,
	"StopPodSandboxRequest.pod_sandbox_id":                     honoured,
	"RemovePodSandboxRequest.pod_sandbox_id":                   honoured,
	"PodSandboxStatusRequest.pod_sandbox_id":                   honoured,
	"PodSandboxStatusRequest.verbose":                          honoured,
	"ListPodSandboxRequest.filter":                             honoured,
	"PodSandboxFilter.id":                                      honoured,
	"PodSandboxFilter.state":                                   honoured,
	"PodSandboxFilter.label_selector":                          honoured,
	"PodSandboxStateValue.state":                               honoured,
	"StreamPodSandboxesRequest.filter":                         honoured,
	"CreateContainerRequest.pod_sandbox_id":                    honoured,
	"CreateContainerRequest.config":                            honoured,
	"CreateContainerRequest.sandbox_config":                    informational, // the pod's, kept from RunPodSandbox
	"ContainerConfig.metadata":                                 honoured,
	"ContainerConfig.image":                                    honoured,
	"ContainerConfig.command":                                  honoured,
	"ContainerConfig.args":                                     honoured,
	"ContainerConfig.working_dir":                              honoured,
	"ContainerConfig.envs":                                     honoured,
	"ContainerConfig.mounts":                                   honoured,
	"ContainerConfig.devices":                                  honoured,
	"ContainerConfig.labels":                                   honoured,
	"ContainerConfig.annotations":                              honoured,
	"ContainerConfig.log_path":                                 honoured,
	"ContainerConfig.stdin":                                    honoured,
	"ContainerConfig.stdin_once":                               honoured,
	"ContainerConfig.tty":                                      honoured,
	"ContainerConfig.linux":                                    honoured,
	"ContainerConfig.windows":                                  refused,
	"ContainerConfig.CDI_devices":                              honoured,
	"ContainerConfig.stop_signal":                              refused,
	"ContainerMetadata.name":                                   honoured,
	"ContainerMetadata.attempt":                                honoured,
	"ImageSpec.image":                                          honoured,
	"ImageSpec.annotations":                                    informational, // the kubelet's notes on the image
	"ImageSpec.user_specified_image":                           honoured,
	"ImageSpec.runtime_handler":                                informational, // one image store serves every handler
	"ImageSpec.image_ref":                                      informational, // the ID the kubelet resolved; image names it too
	"KeyValue.key":                                             honoured,
	"KeyValue.value":                                           honoured,
	"Mount.container_path":                                     honoured,
	"Mount.host_path":                                          honoured,
	"Mount.readonly":                                           honoured,
	"Mount.selinux_relabel":                                    honoured,
	"Mount.propagation":                                        honoured,
	"Mount.recursive_read_only":                                honoured,
	"Mount.uidMappings":                                        refused,
	"Mount.gidMappings":                                        refused,
	"Mount.image":                                              honoured,
	"Mount.image_sub_path":                                     honoured,
	"Mount.mount_options":                                      honoured,
	"Device.container_path":                                    honoured,
	"Device.host_path":                                         honoured,
	"Device.permissions":                                       honoured,
	"CDIDevice.name":                                           honoured,
	"LinuxContainerConfig.resources":                           honoured,
	"LinuxContainerConfig.security_context":                    honoured,
	"LinuxContainerSecurityContext.capabilities":               honoured,
	"LinuxContainerSecurityContext.privileged":                 honoured,
	"LinuxContainerSecurityContext.namespace_options":          honoured,
	"LinuxContainerSecurityContext.selinux_options":            honoured,
	"LinuxContainerSecurityContext.run_as_user":                honoured,
	"LinuxContainerSecurityContext.run_as_group":               honoured,
	"LinuxContainerSecurityContext.run_as_username":            honoured,
	"LinuxContainerSecurityContext.readonly_rootfs":            honoured,
	"LinuxContainerSecurityContext.supplemental_groups":        honoured,
	"LinuxContainerSecurityContext.supplemental_groups_policy": honoured,
	"LinuxContainerSecurityContext.no_new_privs":               honoured,
	"LinuxContainerSecurityContext.masked_paths":               honoured,
	"LinuxContainerSecurityContext.readonly_paths":             honoured,
	"LinuxContainerSecurityContext.seccomp":                    honoured,
	"LinuxContainerSecurityContext.apparmor":                   honoured,
	"LinuxContainerSecurityContext.apparmor_profile":           honoured,
	"LinuxContainerSecurityContext.seccomp_profile_path":       honoured,
	"Capability.add_capabilities":                              honoured,
	"Capability.drop_capabilities":                             honoured,
	"Capability.add_ambient_capabilities":                      refused,

	"StartContainerRequest.container_id":              honoured,
	"StopContainerRequest.container_id":               honoured,
	"StopContainerRequest.timeout":                    honoured,
	"RemoveContainerRequest.container_id":             honoured,
	"ListContainersRequest.filter":                    honoured,
	"ContainerFilter.id":                              honoured,
	"ContainerFilter.state":                           honoured,
	"ContainerFilter.pod_sandbox_id":                  honoured,
	"ContainerFilter.label_selector":                  honoured,
	"ContainerStateValue.state":                       honoured,
	"StreamContainersRequest.filter":                  honoured,
	"ContainerStatusRequest.container_id":             honoured,
	"ContainerStatusRequest.verbose":                  honoured,
	"UpdateContainerResourcesRequest.container_id":    honoured,
	"UpdateContainerResourcesRequest.linux":           honoured,
	"UpdateContainerResourcesRequest.windows":         refused,
	"UpdateContainerResourcesRequest.annotations":     informational, // the container's, unchanged by a resize
	"ReopenContainerLogRequest.container_id":          honoured,
	"ExecSyncRequest.container_id":                    honoured,
	"ExecSyncRequest.cmd":                             honoured,
	"ExecSyncRequest.timeout":                         honoured,
	"ExecRequest.container_id":                        honoured,
	"ExecRequest.cmd":                                 honoured,
	"ExecRequest.tty":                                 honoured,
	"ExecRequest.stdin":                               honoured,
	"ExecRequest.stdout":                              honoured,
	"ExecRequest.stderr":                              honoured,
	"AttachRequest.container_id":                      honoured,
	"AttachRequest.stdin":                             honoured,
	"AttachRequest.tty":                               honoured,
	"AttachRequest.stdout":                            honoured,
	"AttachRequest.stderr":                            honoured,
	"PortForwardRequest.pod_sandbox_id":               honoured,
	"PortForwardRequest.port":                         honoured,
	"ContainerStatsRequest.container_id":              honoured,
	"ListContainerStatsRequest.filter":                honoured,
	"ContainerStatsFilter.id":                         honoured,
	"ContainerStatsFilter.pod_sandbox_id":             honoured,
	"ContainerStatsFilter.label_selector":             honoured,
	"StreamContainerStatsRequest.filter":              honoured,
	"PodSandboxStatsRequest.pod_sandbox_id":           honoured,
	"ListPodSandboxStatsRequest.filter":               honoured,
	"PodSandboxStatsFilter.id":                        honoured,
	"PodSandboxStatsFilter.label_selector":            honoured,
	"StreamPodSandboxStatsRequest.filter":             honoured,
	"UpdateRuntimeConfigRequest.runtime_config":       honoured,
	"RuntimeConfig.network_config":                    honoured,
	"NetworkConfig.pod_cidr":                          honoured,
	"StatusRequest.verbose":                           honoured,
	"UpdatePodSandboxResourcesRequest.pod_sandbox_id": honoured,
	"UpdatePodSandboxResourcesRequest.overhead":       honoured,
	"UpdatePodSandboxResourcesRequest.resources":      honoured,
	"ListImagesRequest.filter":                        honoured,
	"ImageFilter.image":                               honoured,
	"StreamImagesRequest.filter":                      honoured,
	"ImageStatusRequest.image":                        honoured,
	"ImageStatusRequest.verbose":                      honoured,
	"PullImageRequest.image":                          honoured,
	"PullImageRequest.auth":                           honoured,
	"PullImageRequest.sandbox_config":                 informational, // one image store serves every pod
	"AuthConfig.username":                             honoured,
	"AuthConfig.password":                             honoured,
	"AuthConfig.auth":                                 honoured,
	"AuthConfig.server_address":                       informational, // the registry the image names
	"AuthConfig.identity_token":                       honoured,
	"AuthConfig.registry_token":                       honoured,
	"RemoveImageRequest.image":                        honoured,

	// Checkpoints: each call checks its arguments, then says why the
	// node or the pod's stage1 cannot checkpoint (broker/checkpoint.go);
	// the pod calls go no further yet.
	"CheckpointContainerRequest.container_id": honoured,
	"CheckpointContainerRequest.location":     honoured,
	"CheckpointContainerRequest.timeout":      honoured,
	"CheckpointPodRequest.pod_sandbox_id":     honoured,
	"CheckpointPodRequest.output_path":        honoured,
	"CheckpointPodRequest.container_ids":      honoured,
	"CheckpointPodRequest.options":            refused,
	"RestorePodRequest.checkpoint_path":       honoured,
	"RestorePodRequest.config":                honoured,
	"RestorePodRequest.runtime_handler":       honoured,
	"RestorePodRequest.options":               refused,
	"RestorePodRequest.container_configs":     informational, // their names are checked; every call is refused before a restore would start
}

// criRequests are the request messages of every call of the CRI services.
func criRequests() []protoreflect.MessageDescriptor {
	fd := (&runtimeapi.VersionRequest{}).ProtoReflect().Descriptor().ParentFile()
	var out []protoreflect.MessageDescriptor
	for i := 0; i < fd.Services().Len(); i++ {
		ms := fd.Services().Get(i).Methods()
		for j := 0; j < ms.Len(); j++ {
			out = append(out, ms.Get(j).Input())
		}
	}
	return out
}

// fieldKey names a field as criFields does: "Message.field".
func fieldKey(f protoreflect.FieldDescriptor) string {
	return string(f.ContainingMessage().Name()) + "." + string(f.Name())
}

// fieldPaths calls visit with every path of fields from root down to a
// field, a message visited at most once on one path.
func fieldPaths(root protoreflect.MessageDescriptor, visit func(path []protoreflect.FieldDescriptor)) {
	var walk func(m protoreflect.MessageDescriptor, path []protoreflect.FieldDescriptor, on map[protoreflect.FullName]bool)
	walk = func(m protoreflect.MessageDescriptor, path []protoreflect.FieldDescriptor, on map[protoreflect.FullName]bool) {
		if on[m.FullName()] {
			return
		}
		on[m.FullName()] = true
		defer delete(on, m.FullName())
		for i := 0; i < m.Fields().Len(); i++ {
			f := m.Fields().Get(i)
			p := append(append([]protoreflect.FieldDescriptor(nil), path...), f)
			visit(p)
			next := f.Message()
			if f.IsMap() {
				next = f.MapValue().Message()
			}
			if next != nil {
				walk(next, p, on)
			}
		}
	}
	walk(root, nil, map[protoreflect.FullName]bool{})
}

func TestEveryRequestFieldDecided(t *testing.T) {
	seen := map[string]bool{}
	for _, req := range criRequests() {
		fieldPaths(req, func(path []protoreflect.FieldDescriptor) {
			seen[fieldKey(path[len(path)-1])] = true
		})
	}
	var missing, stale []string
	for k := range seen {
		if criFields[k] == 0 {
			missing = append(missing, k)
		}
	}
	for k := range criFields {
		if !seen[k] {
			stale = append(stale, k)
		}
	}
	sort.Strings(missing)
	sort.Strings(stale)
	if len(missing) > 0 {
		t.Errorf("CRI request fields nobody decided on (honour or refuse them, then list them in criFields):\n%s", strings.Join(missing, "\n"))
	}
	if len(stale) > 0 {
		t.Errorf("criFields lists fields cri-api no longer has:\n%s", strings.Join(stale, "\n"))
	}
	if len(seen) < 200 {
		t.Errorf("walked %d fields: the walk lost its way", len(seen))
	}
}

// convertible are the requests whose conversion the refusal test runs,
// each with a request that converts without error and the conversion.
func convertible() map[protoreflect.FullName]struct {
	base    func() proto.Message
	convert func(proto.Message) error
} {
	type conv = struct {
		base    func() proto.Message
		convert func(proto.Message) error
	}
	podConfig := func() *runtimeapi.PodSandboxConfig {
		return &runtimeapi.PodSandboxConfig{Metadata: &runtimeapi.PodSandboxMetadata{Name: "p", Namespace: "ns", Uid: "u"}}
	}
	return map[protoreflect.FullName]conv{
		"runtime.v1.RunPodSandboxRequest": {
			base: func() proto.Message { return &runtimeapi.RunPodSandboxRequest{Config: podConfig()} },
			convert: func(m proto.Message) error {
				_, err := podConfigFrom(m.(*runtimeapi.RunPodSandboxRequest))
				return err
			},
		},
		"runtime.v1.CreateContainerRequest": {
			base: func() proto.Message {
				return &runtimeapi.CreateContainerRequest{PodSandboxId: "p", SandboxConfig: podConfig(), Config: &runtimeapi.ContainerConfig{
					Metadata: &runtimeapi.ContainerMetadata{Name: "c"},
					Image:    &runtimeapi.ImageSpec{Image: "busybox"},
				}}
			},
			convert: func(m proto.Message) error {
				_, err := containerConfigFrom(m.(*runtimeapi.CreateContainerRequest).GetConfig())
				return err
			},
		},
		"runtime.v1.UpdateContainerResourcesRequest": {
			base: func() proto.Message {
				return &runtimeapi.UpdateContainerResourcesRequest{ContainerId: "c", Linux: &runtimeapi.LinuxContainerResources{}}
			},
			convert: func(m proto.Message) error {
				_, err := updateResourcesFrom(m.(*runtimeapi.UpdateContainerResourcesRequest))
				return err
			},
		},
		"runtime.v1.CheckpointPodRequest": {
			base: func() proto.Message { return &runtimeapi.CheckpointPodRequest{PodSandboxId: "p"} },
			convert: func(m proto.Message) error {
				return noOptions(m.(*runtimeapi.CheckpointPodRequest).GetOptions())
			},
		},
		"runtime.v1.RestorePodRequest": {
			base: func() proto.Message { return &runtimeapi.RestorePodRequest{Config: podConfig()} },
			convert: func(m proto.Message) error {
				r := m.(*runtimeapi.RestorePodRequest)
				if err := noOptions(r.GetOptions()); err != nil {
					return err
				}
				_, err := podConfigFrom(&runtimeapi.RunPodSandboxRequest{Config: r.GetConfig(), RuntimeHandler: r.GetRuntimeHandler()})
				return err
			},
		},
		"runtime.v1.UpdatePodSandboxResourcesRequest": {
			base: func() proto.Message {
				return &runtimeapi.UpdatePodSandboxResourcesRequest{PodSandboxId: "p", Resources: &runtimeapi.LinuxContainerResources{}}
			},
			convert: func(m proto.Message) error {
				_, err := updatePodResourcesFrom(m.(*runtimeapi.UpdatePodSandboxResourcesRequest))
				return err
			},
		},
	}
}

// setNonZero gives the field at the end of path a value other than its
// zero one in m, making the messages on the way (the first element of a
// list of messages, appended when the list is empty).
func setNonZero(m protoreflect.Message, path []protoreflect.FieldDescriptor) error {
	for _, f := range path[:len(path)-1] {
		switch {
		case f.IsMap():
			return fmt.Errorf("%s: a map on the way", f.FullName())
		case f.IsList():
			l := m.Mutable(f).List()
			if l.Len() == 0 {
				l.Append(l.NewElement())
			}
			m = l.Get(0).Message()
		default:
			m = m.Mutable(f).Message()
		}
	}
	f := path[len(path)-1]
	switch {
	case f.IsMap():
		k := protoreflect.ValueOfString("x").MapKey()
		v := m.Mutable(f).Map().NewValue()
		if f.MapValue().Message() == nil {
			v = nonZero(f.MapValue())
		}
		m.Mutable(f).Map().Set(k, v)
	case f.IsList():
		l := m.Mutable(f).List()
		if f.Message() != nil {
			e := l.NewElement()
			fillFirst(e.Message())
			l.Append(e)
		} else {
			l.Append(nonZero(f))
		}
	case f.Message() != nil:
		fillFirst(m.Mutable(f).Message())
	default:
		m.Set(f, nonZero(f))
	}
	return nil
}

// fillFirst sets the first scalar field of m, so that the message is
// present and not empty.
func fillFirst(m protoreflect.Message) {
	fs := m.Descriptor().Fields()
	for i := 0; i < fs.Len(); i++ {
		if f := fs.Get(i); f.Message() == nil && !f.IsList() && !f.IsMap() {
			m.Set(f, nonZero(f))
			return
		}
	}
}

func nonZero(f protoreflect.FieldDescriptor) protoreflect.Value {
	switch f.Kind() {
	case protoreflect.BoolKind:
		return protoreflect.ValueOfBool(true)
	case protoreflect.EnumKind:
		return protoreflect.ValueOfEnum(f.Enum().Values().Get(1).Number())
	case protoreflect.StringKind:
		return protoreflect.ValueOfString("x")
	case protoreflect.BytesKind:
		return protoreflect.ValueOfBytes([]byte("x"))
	case protoreflect.Int32Kind, protoreflect.Sint32Kind, protoreflect.Sfixed32Kind:
		return protoreflect.ValueOfInt32(1)
	case protoreflect.Int64Kind, protoreflect.Sint64Kind, protoreflect.Sfixed64Kind:
		return protoreflect.ValueOfInt64(1)
	case protoreflect.Uint32Kind, protoreflect.Fixed32Kind:
		return protoreflect.ValueOfUint32(1)
	case protoreflect.Uint64Kind, protoreflect.Fixed64Kind:
		return protoreflect.ValueOfUint64(1)
	case protoreflect.FloatKind:
		return protoreflect.ValueOfFloat32(1)
	case protoreflect.DoubleKind:
		return protoreflect.ValueOfFloat64(1)
	}
	panic(fmt.Sprintf("no non-zero value for %s", f.Kind()))
}

// TestRefusedFieldsAreRefused sets each refused field, on every path to
// it from a request the daemon converts (but beneath an informational
// one), and checks the conversion fails
// with InvalidArgument or Unimplemented naming the field or one on its
// path. A refused field no converted request reaches fails too.
func TestRefusedFieldsAreRefused(t *testing.T) {
	convs := convertible()
	reached := map[string]bool{}
	for name, c := range convs {
		if err := c.convert(c.base()); err != nil {
			t.Fatalf("%s: the base request does not convert: %v", name, err)
		}
		fieldPaths(c.base().ProtoReflect().Descriptor(), func(path []protoreflect.FieldDescriptor) {
			leaf := path[len(path)-1]
			if criFields[fieldKey(leaf)] != refused {
				return
			}
			for _, f := range path[:len(path)-1] {
				if criFields[fieldKey(f)] == informational {
					return // nothing beneath it is applied
				}
			}
			reached[fieldKey(leaf)] = true
			var names []string
			for _, f := range path {
				names = append(names, string(f.Name()))
			}
			where := string(name.Name()) + "." + strings.Join(names, ".")
			req := c.base()
			if err := setNonZero(req.ProtoReflect(), path); err != nil {
				t.Errorf("%s: %v", where, err)
				return
			}
			err := c.convert(req)
			switch {
			case err == nil:
				t.Errorf("%s set: accepted, want it refused", where)
				return
			case !errors.Is(err, errdefs.ErrInvalidArgument) && !errors.Is(err, errdefs.ErrUnimplemented):
				t.Errorf("%s set: %v, want InvalidArgument or Unimplemented", where, err)
				return
			}
			for _, n := range names {
				if strings.Contains(err.Error(), n) {
					return
				}
			}
			t.Errorf("%s set: %q names none of %v", where, err, names)
		})
	}
	for k, use := range criFields {
		if use == refused && !reached[k] {
			t.Errorf("%s is refused, but no request the test converts reaches it: add its request to convertible", k)
		}
	}
}
