package e2e

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/internal/testutil"
)

// Seccomp, SELinux and AppArmor through the real daemon.

func TestSeccompLocalhostThroughCRI(t *testing.T) {
	e := newEnv(t)
	profile := filepath.Join(t.TempDir(), "deny-mkdir.json")
	if err := os.WriteFile(profile, []byte(`{"defaultAction": "SCMP_ACT_ALLOW",
		"syscalls": [{"names": ["mkdir", "mkdirat"], "action": "SCMP_ACT_ERRNO", "errnoRet": 1}]}`), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg := e.containerConfig("seccomp", "sh", "-c", "exec sleep 3600")
	cfg.Linux.SecurityContext.Seccomp = &runtimeapi.SecurityProfile{
		ProfileType: runtimeapi.SecurityProfile_Localhost, LocalhostRef: profile,
	}
	_, id, _ := e.runOne("seccomp-localhost", cfg)
	e.waitContainerState(id, running, stateTimeout)
	r := e.execSync(id, "mkdir", "/tmp/x")
	if r.ExitCode == 0 || !strings.Contains(string(r.Stderr), "Operation not permitted") {
		t.Errorf("mkdir under a profile denying it: exit %d, stderr %q", r.ExitCode, r.Stderr)
	}
	if out := e.execOK(id, "echo", "fine"); out != "fine\n" {
		t.Errorf("echo: %q", out)
	}
	resp, err := e.rt().ContainerStatus(e.ctx(), &runtimeapi.ContainerStatusRequest{ContainerId: id, Verbose: true})
	if err != nil {
		t.Fatal(err)
	}
	if got := resp.Info["seccompProfile"]; got != "localhost/"+profile {
		t.Errorf("verbose info seccompProfile %q", got)
	}
}

func TestSeccompProfileErrorsThroughCRI(t *testing.T) {
	e := newEnv(t)
	podCfg := e.podConfig("seccomp-errors")
	podID := e.runPod(podCfg)
	for name, sp := range map[string]*runtimeapi.SecurityProfile{
		"relative": {ProfileType: runtimeapi.SecurityProfile_Localhost, LocalhostRef: "profiles/deny.json"},
		"missing":  {ProfileType: runtimeapi.SecurityProfile_Localhost, LocalhostRef: "/nonexistent/profile.json"},
	} {
		cfg := e.containerConfig("c-"+name, "true")
		cfg.Linux.SecurityContext.Seccomp = sp
		_, err := e.rt().CreateContainer(e.ctx(), &runtimeapi.CreateContainerRequest{PodSandboxId: podID, Config: cfg, SandboxConfig: podCfg})
		requireCode(t, err, codes.InvalidArgument, "Localhost profile "+name)
	}
}

func TestSeccompRuntimeDefaultThroughCRI(t *testing.T) {
	e := newEnv(t)
	cfg := e.containerConfig("rd", "sh", "-c", "unshare -U true 2>/dev/null; echo unshare=$? >/tmp/rc; exec sleep 3600")
	cfg.Linux.SecurityContext.Seccomp = &runtimeapi.SecurityProfile{ProfileType: runtimeapi.SecurityProfile_RuntimeDefault}
	_, id, _ := e.runOne("seccomp-default", cfg)
	e.waitContainerState(id, running, stateTimeout)
	var out string
	testutil.WaitFor(t, stateTimeout, "the container's result", func() (bool, string) {
		r := e.execSync(id, "cat", "/tmp/rc")
		out = string(r.Stdout)
		return r.ExitCode == 0, string(r.Stderr)
	})
	if out != "unshare=1\n" {
		t.Errorf("unshare -U under RuntimeDefault: %q", out)
	}
	if got := e.execOK(id, "grep", "^Seccomp:", "/proc/self/status"); !strings.HasSuffix(strings.TrimSpace(got), "2") {
		t.Errorf("exec not filtered: %q", got)
	}
}

func TestAppArmorRefusedWhereDisabled(t *testing.T) {
	if b, err := os.ReadFile("/sys/module/apparmor/parameters/enabled"); err == nil && strings.HasPrefix(string(b), "Y") {
		t.Skip("AppArmor is enabled on this machine")
	}
	e := newEnv(t)
	podCfg := e.podConfig("apparmor")
	podID := e.runPod(podCfg)
	cfg := e.containerConfig("aa", "true")
	cfg.Linux.SecurityContext.Apparmor = &runtimeapi.SecurityProfile{ProfileType: runtimeapi.SecurityProfile_Localhost, LocalhostRef: "k8s-nginx"}
	_, err := e.rt().CreateContainer(e.ctx(), &runtimeapi.CreateContainerRequest{PodSandboxId: podID, Config: cfg, SandboxConfig: podCfg})
	requireCode(t, err, codes.FailedPrecondition, "AppArmor profile where AppArmor is disabled")
	if want := "AppArmor profile localhost/k8s-nginx requested, but AppArmor is not enabled on this node"; !strings.Contains(err.Error(), want) {
		t.Errorf("message %q, want it to say %q", err, want)
	}
	// Unconfined asks for nothing.
	cfg = e.containerConfig("aa-unconfined", "true")
	cfg.Linux.SecurityContext.Apparmor = &runtimeapi.SecurityProfile{ProfileType: runtimeapi.SecurityProfile_Unconfined}
	e.createContainer(podID, podCfg, cfg)
}

func TestSELinuxLabelsRecorded(t *testing.T) {
	if _, err := os.Stat("/sys/fs/selinux/enforce"); err == nil {
		t.Skip("SELinux is enabled: the policy decides the labels")
	}
	e := newEnv(t)
	cfg := e.containerConfig("selinux", "sleep", "3600")
	cfg.Linux.SecurityContext.SelinuxOptions = &runtimeapi.SELinuxOption{Type: "spc_t", Level: "s0:c10,c20"}
	_, id, _ := e.runOne("selinux", cfg)
	e.waitContainerState(id, running, stateTimeout)
	resp, err := e.rt().ContainerStatus(e.ctx(), &runtimeapi.ContainerStatusRequest{ContainerId: id, Verbose: true})
	if err != nil {
		t.Fatal(err)
	}
	if got, want := resp.Info["selinuxProcessLabel"], "system_u:system_r:spc_t:s0:c10,c20"; got != want {
		t.Errorf("process label %q, want %q", got, want)
	}
	if got, want := resp.Info["selinuxMountLabel"], "system_u:object_r:container_file_t:s0:c10,c20"; got != want {
		t.Errorf("mount label %q, want %q", got, want)
	}
	// Not applied: SELinux is off.
	e.execOK(id, "true")

}

// Options of the pod's own where SELinux is off, as the kubelet sends
// them (its emptyDir specs give level s0): the nspawn pod starts.
// systemd-nspawn was given the labels and refused a SELinux context on a
// host without SELinux.
func TestSELinuxPodOptionsInNspawnPod(t *testing.T) {
	if _, err := os.Stat("/sys/fs/selinux/enforce"); err == nil {
		t.Skip("SELinux is enabled: the policy decides the labels")
	}
	e := newNspawnEnv(t)
	cfg := e.netPodConfig("selinux-pod", nspawnStage1)
	cfg.Linux.SecurityContext.SelinuxOptions = &runtimeapi.SELinuxOption{Level: "s0"}
	podID := e.runStage1Pod(cfg, nspawnStage1)
	id := e.createAndStart(podID, cfg, e.nspawnContainer("app", "sleep", "3600"))
	e.waitContainerState(id, running, stateTimeout)
	e.execOK(id, "true")
}

// In an nspawn pod the agent cannot see the node's files: the daemon loads
// the Localhost profile and sends it, and the agent inside filters the app
// and its execs.
func TestSeccompLocalhostInNspawnPod(t *testing.T) {
	e := newNspawnEnv(t)
	profile := filepath.Join(t.TempDir(), "deny-mkdir.json")
	if err := os.WriteFile(profile, []byte(`{"defaultAction": "SCMP_ACT_ALLOW",
		"syscalls": [{"names": ["mkdir", "mkdirat"], "action": "SCMP_ACT_ERRNO", "errnoRet": 1}]}`), 0o644); err != nil {
		t.Fatal(err)
	}
	podID, podCfg := e.nspawnPod("seccomp-nspawn")
	cfg := e.nspawnContainer("app", "sh", "-c", "mkdir /tmp/x 2>/dev/null; echo mkdir=$?; exec sleep 3600")
	cfg.Linux.SecurityContext.Seccomp = &runtimeapi.SecurityProfile{
		ProfileType: runtimeapi.SecurityProfile_Localhost, LocalhostRef: profile,
	}
	id := e.createAndStart(podID, podCfg, cfg)
	e.waitContainerState(id, running, stateTimeout)
	e.waitLogLine(logPath(podCfg, cfg), "stdout", "mkdir=1")
	r := e.execSync(id, "mkdir", "/tmp/y")
	if r.ExitCode == 0 || !strings.Contains(string(r.Stderr), "Operation not permitted") {
		t.Errorf("exec mkdir in an nspawn pod: exit %d, stderr %q", r.ExitCode, r.Stderr)
	}
	if out := e.execOK(id, "echo", "fine"); out != "fine\n" {
		t.Errorf("echo: %q", out)
	}
}
