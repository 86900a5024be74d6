package cri

import (
	"context"
	"fmt"
	"maps"
	"strings"
	"time"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/broker"
	"github.com/stagelet/stagelet/devices"
	"github.com/stagelet/stagelet/errdefs"
)

func propagation(p runtimeapi.MountPropagation) string {
	switch p {
	case runtimeapi.MountPropagation_PROPAGATION_HOST_TO_CONTAINER:
		return "rslave"
	case runtimeapi.MountPropagation_PROPAGATION_BIDIRECTIONAL:
		return "rshared"
	default:
		return "private"
	}
}

func fromPropagation(p string) runtimeapi.MountPropagation {
	switch p {
	case "rslave":
		return runtimeapi.MountPropagation_PROPAGATION_HOST_TO_CONTAINER
	case "rshared":
		return runtimeapi.MountPropagation_PROPAGATION_BIDIRECTIONAL
	default:
		return runtimeapi.MountPropagation_PROPAGATION_PRIVATE
	}
}

func containerConfigFrom(c *runtimeapi.ContainerConfig) (*broker.ContainerConfig, error) {
	if c == nil {
		return nil, badRequest("config")
	}
	if c.GetMetadata() == nil {
		return nil, badRequest("config.metadata")
	}
	if c.GetImage() == nil {
		return nil, badRequest("config.image")
	}
	cc := &broker.ContainerConfig{
		Metadata:    broker.ContainerMetadata{Name: c.GetMetadata().GetName(), Attempt: c.GetMetadata().GetAttempt()},
		Image:       c.GetImage().GetImage(),
		UserImage:   c.GetImage().GetUserSpecifiedImage(),
		Command:     c.GetCommand(),
		Args:        c.GetArgs(),
		WorkingDir:  c.GetWorkingDir(),
		Labels:      maps.Clone(c.GetLabels()),
		Annotations: maps.Clone(c.GetAnnotations()),
		LogPath:     c.GetLogPath(),
		Stdin:       c.GetStdin(),
		StdinOnce:   c.GetStdinOnce(),
		TTY:         c.GetTty(),
	}
	for _, kv := range c.GetEnvs() {
		cc.Env = append(cc.Env, broker.KeyValue{Key: kv.GetKey(), Value: string(kv.GetValue())})
	}
	if err := unsupportedContainerFields(c); err != nil {
		return nil, err
	}
	for i, d := range c.GetCDIDevices() {
		if d.GetName() == "" {
			return nil, badRequest(fmt.Sprintf("config.CDI_devices[%d].name", i))
		}
		cc.CDIDevices = append(cc.CDIDevices, d.GetName())
	}
	for _, d := range c.GetDevices() {
		cc.Devices = append(cc.Devices, devices.Request{Host: d.GetHostPath(), Container: d.GetContainerPath(), Permissions: d.GetPermissions()})
	}
	for i, m := range c.GetMounts() {
		bm := broker.Mount{
			ContainerPath:     m.GetContainerPath(),
			HostPath:          m.GetHostPath(),
			Readonly:          m.GetReadonly(),
			SelinuxRelabel:    m.GetSelinuxRelabel(),
			Propagation:       propagation(m.GetPropagation()),
			RecursiveReadonly: m.GetRecursiveReadOnly(),
			Image:             m.GetImage().GetImage(),
			UserImage:         m.GetImage().GetUserSpecifiedImage(),
			ImageSubPath:      m.GetImageSubPath(),
		}
		for _, o := range m.GetMountOptions() {
			switch o {
			case "nosuid":
				bm.NoSuid = true
			case "nodev":
				bm.NoDev = true
			case "noexec":
				bm.NoExec = true
			default:
				return nil, errdefs.InvalidArgument("config.mounts[%d].mount_options: %q: want nosuid, nodev or noexec", i, o)
			}
		}
		cc.Mounts = append(cc.Mounts, bm)
	}
	if l := c.GetLinux(); l != nil {
		res, err := containerResources(l.GetResources(), "config.linux.resources")
		if err != nil {
			return nil, err
		}
		cc.Resources = res
		if sc := l.GetSecurityContext(); sc != nil {
			if err := securityFrom(sc, &cc.Security); err != nil {
				return nil, err
			}
		}
	}
	return cc, nil
}

// unsupportedContainerFields refuses what a container's config may ask
// that no stage1 does, naming the field, rather than ignoring it.
func unsupportedContainerFields(c *runtimeapi.ContainerConfig) error {
	if c.GetWindows() != nil {
		return errdefs.InvalidArgument("config.windows: a Windows container cannot run on a Linux node")
	}
	if c.GetStopSignal() != runtimeapi.Signal_SIGNAL_RUNTIME_DEFAULT {
		return errdefs.New(errdefs.ErrUnimplemented, "config.stop_signal: a stop signal other than the image's is not supported")
	}
	for i, m := range c.GetMounts() {
		if len(m.GetUidMappings()) > 0 || len(m.GetGidMappings()) > 0 {
			return errdefs.InvalidArgument("config.mounts[%d].uidMappings, gidMappings: idmapped mounts are made for a pod's user namespace, not asked per mount", i)
		}
	}
	if len(c.GetLinux().GetSecurityContext().GetCapabilities().GetAddAmbientCapabilities()) > 0 {
		return errdefs.InvalidArgument("config.linux.security_context.capabilities.add_ambient_capabilities: ambient capabilities are not supported")
	}
	return nil
}

// securityFrom reads a container's security context into sec.
func securityFrom(sc *runtimeapi.LinuxContainerSecurityContext, sec *broker.Security) error {
	sec.Privileged = sc.GetPrivileged()
	if u := sc.GetRunAsUser(); u != nil {
		v := u.GetValue()
		sec.RunAsUser = &v
	}
	sec.RunAsUsername = sc.GetRunAsUsername()
	if g := sc.GetRunAsGroup(); g != nil {
		v := g.GetValue()
		sec.RunAsGroup = &v
	}
	sec.SupplementalGroups = sc.GetSupplementalGroups()
	sec.StrictGroups = sc.GetSupplementalGroupsPolicy() == runtimeapi.SupplementalGroupsPolicy_Strict
	sec.ReadonlyRootfs = sc.GetReadonlyRootfs()
	sec.NoNewPrivs = sc.GetNoNewPrivs()
	if ns := sc.GetNamespaceOptions(); ns != nil {
		var err error
		if sec.UserNS, err = userNS(ns, "config.linux.security_context.namespace_options"); err != nil {
			return err
		}
		switch ns.GetPid() {
		case runtimeapi.NamespaceMode_CONTAINER:
			sec.PIDMode = broker.PIDModeContainer
		case runtimeapi.NamespaceMode_POD:
			sec.PIDMode = broker.PIDModePod
		case runtimeapi.NamespaceMode_NODE:
			sec.PIDMode = broker.PIDModeNode
		case runtimeapi.NamespaceMode_TARGET:
			if ns.GetTargetId() == "" {
				return errdefs.InvalidArgument("config.linux.security_context.namespace_options: pid TARGET without target_id")
			}
			sec.PIDMode = broker.PIDModeTarget
			sec.PIDTarget = ns.GetTargetId()
		}
	}
	if caps := sc.GetCapabilities(); caps != nil {
		sec.AddCapabilities = caps.GetAddCapabilities()
		sec.DropCapabilities = caps.GetDropCapabilities()
	}
	var err error
	// The deprecated profile fields are what kubelets before 1.19's
	// structured profiles send.
	//lint:ignore SA1019 read for older kubelets
	if sec.Seccomp, err = securityProfile("seccomp", sc.GetSeccomp(), sc.GetSeccompProfilePath(), true); err != nil {
		return err
	}
	//lint:ignore SA1019 read for older kubelets
	if sec.AppArmor, err = securityProfile("apparmor", sc.GetApparmor(), sc.GetApparmorProfile(), false); err != nil {
		return err
	}
	sec.MaskedPaths = sc.GetMaskedPaths()
	sec.ReadonlyPaths = sc.GetReadonlyPaths()
	sec.SELinux = seLinuxOptions(sc.GetSelinuxOptions())
	return nil
}

// seLinuxOptions are a container's or a pod's SELinux options as the
// broker takes them; nil for none.
func seLinuxOptions(o *runtimeapi.SELinuxOption) *broker.SELinuxOptions {
	if o == nil {
		return nil
	}
	return &broker.SELinuxOptions{User: o.GetUser(), Role: o.GetRole(), Type: o.GetType(), Level: o.GetLevel()}
}

// securityProfile reads a seccomp or AppArmor choice: the SecurityProfile
// field when set, else the deprecated string form ("runtime/default",
// "docker/default" for seccomp, "unconfined", "localhost/REF"; empty means
// nothing asked). InvalidArgument for a string form it does not know.
func securityProfile(field string, p *runtimeapi.SecurityProfile, legacy string, dockerDefault bool) (broker.SecurityProfile, error) {
	if p != nil {
		switch p.GetProfileType() {
		case runtimeapi.SecurityProfile_RuntimeDefault:
			return broker.SecurityProfile{Type: broker.ProfileRuntimeDefault}, nil
		case runtimeapi.SecurityProfile_Unconfined:
			return broker.SecurityProfile{Type: broker.ProfileUnconfined}, nil
		case runtimeapi.SecurityProfile_Localhost:
			if p.GetLocalhostRef() == "" {
				return broker.SecurityProfile{}, errdefs.InvalidArgument("config.linux.security_context.%s: Localhost profile without localhost_ref", field)
			}
			return broker.SecurityProfile{Type: broker.ProfileLocalhost, LocalhostRef: p.GetLocalhostRef()}, nil
		default:
			return broker.SecurityProfile{}, errdefs.InvalidArgument("config.linux.security_context.%s: unknown profile type %v", field, p.GetProfileType())
		}
	}
	switch {
	case legacy == "":
		return broker.SecurityProfile{}, nil
	case legacy == "unconfined":
		return broker.SecurityProfile{Type: broker.ProfileUnconfined}, nil
	case legacy == "runtime/default", dockerDefault && legacy == "docker/default":
		return broker.SecurityProfile{Type: broker.ProfileRuntimeDefault}, nil
	case strings.HasPrefix(legacy, "localhost/") && len(legacy) > len("localhost/"):
		return broker.SecurityProfile{Type: broker.ProfileLocalhost, LocalhostRef: strings.TrimPrefix(legacy, "localhost/")}, nil
	default:
		return broker.SecurityProfile{}, errdefs.InvalidArgument("config.linux.security_context.%s: unknown profile %q (want runtime/default, unconfined or localhost/REF)", field, legacy)
	}
}

// CreateContainer creates a container in a pod.
func (s *Server) CreateContainer(ctx context.Context, r *runtimeapi.CreateContainerRequest) (*runtimeapi.CreateContainerResponse, error) {
	if r.GetPodSandboxId() == "" {
		return nil, badRequest("pod_sandbox_id")
	}
	cc, err := containerConfigFrom(r.GetConfig())
	if err != nil {
		return nil, err
	}
	id, err := s.b.CreateContainer(ctx, r.GetPodSandboxId(), cc)
	if err != nil {
		return nil, err
	}
	return &runtimeapi.CreateContainerResponse{ContainerId: id}, nil
}

// StartContainer starts a created container.
func (s *Server) StartContainer(ctx context.Context, r *runtimeapi.StartContainerRequest) (*runtimeapi.StartContainerResponse, error) {
	if r.GetContainerId() == "" {
		return nil, badRequest("container_id")
	}
	if err := s.b.StartContainer(ctx, r.GetContainerId()); err != nil {
		return nil, err
	}
	return &runtimeapi.StartContainerResponse{}, nil
}

// StopContainer stops a container within the request's timeout (seconds).
func (s *Server) StopContainer(ctx context.Context, r *runtimeapi.StopContainerRequest) (*runtimeapi.StopContainerResponse, error) {
	if r.GetContainerId() == "" {
		return nil, badRequest("container_id")
	}
	if r.GetTimeout() < 0 {
		return nil, errdefs.InvalidArgument("timeout: %d is negative", r.GetTimeout())
	}
	if err := s.b.StopContainer(ctx, r.GetContainerId(), time.Duration(r.GetTimeout())*time.Second); err != nil {
		return nil, err
	}
	return &runtimeapi.StopContainerResponse{}, nil
}

// RemoveContainer removes a container; idempotent.
func (s *Server) RemoveContainer(ctx context.Context, r *runtimeapi.RemoveContainerRequest) (*runtimeapi.RemoveContainerResponse, error) {
	if r.GetContainerId() == "" {
		return nil, badRequest("container_id")
	}
	if err := s.b.RemoveContainer(ctx, r.GetContainerId()); err != nil {
		return nil, err
	}
	return &runtimeapi.RemoveContainerResponse{}, nil
}

func containerState(s string) runtimeapi.ContainerState {
	switch s {
	case broker.ContainerCreated:
		return runtimeapi.ContainerState_CONTAINER_CREATED
	case broker.ContainerRunning:
		return runtimeapi.ContainerState_CONTAINER_RUNNING
	case broker.ContainerExited:
		return runtimeapi.ContainerState_CONTAINER_EXITED
	default:
		return runtimeapi.ContainerState_CONTAINER_UNKNOWN
	}
}

func brokerContainerState(s runtimeapi.ContainerState) string {
	switch s {
	case runtimeapi.ContainerState_CONTAINER_CREATED:
		return broker.ContainerCreated
	case runtimeapi.ContainerState_CONTAINER_RUNNING:
		return broker.ContainerRunning
	case runtimeapi.ContainerState_CONTAINER_EXITED:
		return broker.ContainerExited
	default:
		return broker.ContainerUnknown
	}
}

func unixNano(t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return t.UnixNano()
}

func ctrMeta(m broker.ContainerMetadata) *runtimeapi.ContainerMetadata {
	return &runtimeapi.ContainerMetadata{Name: m.Name, Attempt: m.Attempt}
}

// ContainerStatus returns a container's status.
func (s *Server) ContainerStatus(ctx context.Context, r *runtimeapi.ContainerStatusRequest) (*runtimeapi.ContainerStatusResponse, error) {
	if r.GetContainerId() == "" {
		return nil, badRequest("container_id")
	}
	rec, err := s.b.ContainerStatus(ctx, r.GetContainerId())
	if err != nil {
		return nil, err
	}
	st := containerStatus(rec)
	var info map[string]string
	if r.GetVerbose() {
		info = map[string]string{"pid": "", "rootfs": rec.Rootfs, "podId": rec.PodID}
		if a := rec.App; a != nil {
			for k, v := range map[string]string{
				"seccompProfile":      a.SeccompProfile,
				"selinuxProcessLabel": a.SELinuxProcessLabel,
				"selinuxMountLabel":   a.SELinuxMountLabel,
				"apparmorProfile":     a.AppArmorProfile,
			} {
				if v != "" {
					info[k] = v
				}
			}
		}
	}
	return &runtimeapi.ContainerStatusResponse{Status: st, Info: info}, nil
}

func containerStatus(rec *broker.ContainerRecord) *runtimeapi.ContainerStatus {
	c := &rec.Config
	st := &runtimeapi.ContainerStatus{
		Id:          rec.ID,
		Metadata:    ctrMeta(c.Metadata),
		State:       containerState(rec.State),
		CreatedAt:   unixNano(rec.CreatedAt),
		StartedAt:   unixNano(rec.StartedAt),
		FinishedAt:  unixNano(rec.FinishedAt),
		Image:       &runtimeapi.ImageSpec{Image: rec.ImageName},
		ImageRef:    rec.ImageID,
		ImageId:     rec.ImageID,
		Labels:      c.Labels,
		Annotations: c.Annotations,
		LogPath:     rec.LogPath,
	}
	if rec.State == broker.ContainerExited {
		st.ExitCode = rec.ExitCode
		st.Reason = rec.Reason
		st.Message = rec.Message
	}
	for _, m := range c.Mounts {
		st.Mounts = append(st.Mounts, &runtimeapi.Mount{
			ContainerPath:     m.ContainerPath,
			HostPath:          m.HostPath,
			Readonly:          m.Readonly,
			SelinuxRelabel:    m.SelinuxRelabel,
			Propagation:       fromPropagation(m.Propagation),
			RecursiveReadOnly: m.RecursiveReadonly,
			Image:             imageSpec(m.Image),
			ImageSubPath:      m.ImageSubPath,
		})
	}
	if rec.App != nil {
		st.User = &runtimeapi.ContainerUser{Linux: &runtimeapi.LinuxContainerUser{
			Uid: int64(rec.App.UID), Gid: int64(rec.App.GID), SupplementalGroups: toInt64s(rec.App.AdditionalGIDs),
		}}
		res := c.Resources
		st.Resources = &runtimeapi.ContainerResources{Linux: &runtimeapi.LinuxContainerResources{
			CpuPeriod: res.CPUPeriod, CpuQuota: res.CPUQuota, CpuShares: res.CPUShares,
			MemoryLimitInBytes: res.MemoryLimit, OomScoreAdj: res.OOMScoreAdj,
			CpusetCpus: res.CpusetCpus, CpusetMems: res.CpusetMems,
		}}
	}
	return st
}

func toInt64s(v []uint32) []int64 {
	out := make([]int64, len(v))
	for i, x := range v {
		out[i] = int64(x)
	}
	return out
}

func containerFilterFrom(f *runtimeapi.ContainerFilter) broker.ContainerFilter {
	bf := broker.ContainerFilter{}
	if f == nil {
		return bf
	}
	bf.ID = f.GetId()
	bf.PodID = f.GetPodSandboxId()
	bf.LabelSelector = f.GetLabelSelector()
	if sv := f.GetState(); sv != nil {
		bf.State = brokerContainerState(sv.GetState())
	}
	return bf
}

// ListContainers lists containers matching the filter.
func (s *Server) ListContainers(ctx context.Context, r *runtimeapi.ListContainersRequest) (*runtimeapi.ListContainersResponse, error) {
	list := s.b.ListContainers(ctx, containerFilterFrom(r.GetFilter()))
	resp := &runtimeapi.ListContainersResponse{Containers: make([]*runtimeapi.Container, len(list))}
	for i := range list {
		c := &list[i]
		resp.Containers[i] = &runtimeapi.Container{
			Id:           c.ID,
			PodSandboxId: c.PodID,
			Metadata:     ctrMeta(c.Metadata),
			Image:        &runtimeapi.ImageSpec{Image: c.ImageName},
			ImageRef:     c.ImageID,
			ImageId:      c.ImageID,
			State:        containerState(c.State),
			CreatedAt:    unixNano(c.CreatedAt),
			Labels:       c.Labels,
			Annotations:  c.Annotations,
		}
	}
	return resp, nil
}

// ExecSync runs a command in a container and returns its output: at most
// supervisor.ExecOutputLimit bytes of stdout and stderr together, so that the
// reply fits the kubelet's 16 MiB receive limit.
func (s *Server) ExecSync(ctx context.Context, r *runtimeapi.ExecSyncRequest) (*runtimeapi.ExecSyncResponse, error) {
	if r.GetContainerId() == "" {
		return nil, badRequest("container_id")
	}
	if len(r.GetCmd()) == 0 {
		return nil, badRequest("cmd")
	}
	if r.GetTimeout() < 0 {
		return nil, errdefs.InvalidArgument("timeout: %d is negative", r.GetTimeout())
	}
	res, err := s.b.ExecSync(ctx, r.GetContainerId(), r.GetCmd(), time.Duration(r.GetTimeout())*time.Second)
	if err != nil {
		return nil, err
	}
	markLargeReply(ctx, len(res.Stdout)+len(res.Stderr))
	return &runtimeapi.ExecSyncResponse{Stdout: res.Stdout, Stderr: res.Stderr, ExitCode: res.ExitCode}, nil
}

// ReopenContainerLog reopens a running container's log file.
func (s *Server) ReopenContainerLog(ctx context.Context, r *runtimeapi.ReopenContainerLogRequest) (*runtimeapi.ReopenContainerLogResponse, error) {
	if r.GetContainerId() == "" {
		return nil, badRequest("container_id")
	}
	if err := s.b.ReopenLog(ctx, r.GetContainerId()); err != nil {
		return nil, err
	}
	return &runtimeapi.ReopenContainerLogResponse{}, nil
}

// imageSpec is the ImageSpec of an image volume's image; nil for none.
func imageSpec(ref string) *runtimeapi.ImageSpec {
	if ref == "" {
		return nil
	}
	return &runtimeapi.ImageSpec{Image: ref}
}
