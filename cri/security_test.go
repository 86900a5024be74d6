package cri

//lint:file-ignore SA1019 the tests send the deprecated profile fields older kubelets send

import (
	"errors"
	"testing"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/broker"
	"github.com/stagelet/stagelet/errdefs"
)

func TestSecurityProfiles(t *testing.T) {
	rd := broker.SecurityProfile{Type: broker.ProfileRuntimeDefault}
	un := broker.SecurityProfile{Type: broker.ProfileUnconfined}
	lh := func(ref string) broker.SecurityProfile {
		return broker.SecurityProfile{Type: broker.ProfileLocalhost, LocalhostRef: ref}
	}
	tests := []struct {
		name              string
		sc                *runtimeapi.LinuxContainerSecurityContext
		seccomp, apparmor broker.SecurityProfile
		err               bool
	}{
		{name: "nothing", sc: &runtimeapi.LinuxContainerSecurityContext{}},
		{name: "seccomp runtime default", sc: &runtimeapi.LinuxContainerSecurityContext{
			Seccomp: &runtimeapi.SecurityProfile{ProfileType: runtimeapi.SecurityProfile_RuntimeDefault}}, seccomp: rd},
		{name: "seccomp unconfined", sc: &runtimeapi.LinuxContainerSecurityContext{
			Seccomp: &runtimeapi.SecurityProfile{ProfileType: runtimeapi.SecurityProfile_Unconfined}}, seccomp: un},
		{name: "seccomp localhost", sc: &runtimeapi.LinuxContainerSecurityContext{
			Seccomp: &runtimeapi.SecurityProfile{ProfileType: runtimeapi.SecurityProfile_Localhost, LocalhostRef: "/p.json"}}, seccomp: lh("/p.json")},
		{name: "seccomp localhost without ref", sc: &runtimeapi.LinuxContainerSecurityContext{
			Seccomp: &runtimeapi.SecurityProfile{ProfileType: runtimeapi.SecurityProfile_Localhost}}, err: true},
		{name: "field wins over path", sc: &runtimeapi.LinuxContainerSecurityContext{
			Seccomp:            &runtimeapi.SecurityProfile{ProfileType: runtimeapi.SecurityProfile_Unconfined},
			SeccompProfilePath: "runtime/default"}, seccomp: un},
		{name: "path runtime/default", sc: &runtimeapi.LinuxContainerSecurityContext{SeccompProfilePath: "runtime/default"}, seccomp: rd},
		{name: "path docker/default", sc: &runtimeapi.LinuxContainerSecurityContext{SeccompProfilePath: "docker/default"}, seccomp: rd},
		{name: "path unconfined", sc: &runtimeapi.LinuxContainerSecurityContext{SeccompProfilePath: "unconfined"}, seccomp: un},
		{name: "path localhost", sc: &runtimeapi.LinuxContainerSecurityContext{SeccompProfilePath: "localhost//var/lib/p.json"}, seccomp: lh("/var/lib/p.json")},
		{name: "path unknown", sc: &runtimeapi.LinuxContainerSecurityContext{SeccompProfilePath: "strict"}, err: true},
		{name: "path localhost empty", sc: &runtimeapi.LinuxContainerSecurityContext{SeccompProfilePath: "localhost/"}, err: true},
		{name: "apparmor localhost", sc: &runtimeapi.LinuxContainerSecurityContext{
			Apparmor: &runtimeapi.SecurityProfile{ProfileType: runtimeapi.SecurityProfile_Localhost, LocalhostRef: "k8s-nginx"}}, apparmor: lh("k8s-nginx")},
		{name: "apparmor legacy runtime/default", sc: &runtimeapi.LinuxContainerSecurityContext{ApparmorProfile: "runtime/default"}, apparmor: rd},
		{name: "apparmor legacy localhost", sc: &runtimeapi.LinuxContainerSecurityContext{ApparmorProfile: "localhost/k8s-nginx"}, apparmor: lh("k8s-nginx")},
		{name: "apparmor legacy docker/default", sc: &runtimeapi.LinuxContainerSecurityContext{ApparmorProfile: "docker/default"}, err: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg := &runtimeapi.ContainerConfig{
				Metadata: &runtimeapi.ContainerMetadata{Name: "c"},
				Image:    &runtimeapi.ImageSpec{Image: "busybox"},
				Linux:    &runtimeapi.LinuxContainerConfig{SecurityContext: tc.sc},
			}
			cc, err := containerConfigFrom(cfg)
			if tc.err {
				if !errors.Is(err, errdefs.ErrInvalidArgument) {
					t.Fatalf("got %v, want InvalidArgument", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if cc.Security.Seccomp != tc.seccomp || cc.Security.AppArmor != tc.apparmor {
				t.Errorf("seccomp %+v apparmor %+v, want %+v %+v", cc.Security.Seccomp, cc.Security.AppArmor, tc.seccomp, tc.apparmor)
			}
		})
	}
}

func TestSELinuxOptionsConverted(t *testing.T) {
	cfg := &runtimeapi.ContainerConfig{
		Metadata: &runtimeapi.ContainerMetadata{Name: "c"},
		Image:    &runtimeapi.ImageSpec{Image: "busybox"},
		Linux: &runtimeapi.LinuxContainerConfig{SecurityContext: &runtimeapi.LinuxContainerSecurityContext{
			SelinuxOptions: &runtimeapi.SELinuxOption{User: "u", Role: "r", Type: "t", Level: "s0:c1"},
		}},
	}
	cc, err := containerConfigFrom(cfg)
	if err != nil {
		t.Fatal(err)
	}
	want := broker.SELinuxOptions{User: "u", Role: "r", Type: "t", Level: "s0:c1"}
	if cc.Security.SELinux == nil || *cc.Security.SELinux != want {
		t.Errorf("got %+v", cc.Security.SELinux)
	}
	cfg.Linux.SecurityContext.SelinuxOptions = nil
	if cc, _ := containerConfigFrom(cfg); cc.Security.SELinux != nil {
		t.Errorf("no options gave %+v", cc.Security.SELinux)
	}

	r := &runtimeapi.RunPodSandboxRequest{Config: &runtimeapi.PodSandboxConfig{
		Metadata: &runtimeapi.PodSandboxMetadata{Name: "p", Namespace: "n", Uid: "u"},
		Linux: &runtimeapi.LinuxPodSandboxConfig{SecurityContext: &runtimeapi.LinuxSandboxSecurityContext{
			SelinuxOptions: &runtimeapi.SELinuxOption{Level: "s0:c5,c6"},
		}},
	}}
	pc, err := podConfigFrom(r)
	if err != nil {
		t.Fatal(err)
	}
	if pc.SELinux == nil || *pc.SELinux != (broker.SELinuxOptions{Level: "s0:c5,c6"}) {
		t.Errorf("pod: got %+v", pc.SELinux)
	}
}
