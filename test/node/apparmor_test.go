package node

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/internal/testutil"
)

// TestAppArmor: on a node with AppArmor enabled (Debian's default) the
// daemon loads its default container profile at start and leaves it as
// it is across a restart; on nspawn and on fly a container that asks for
// nothing, and a command exec'd in it, run under that profile; a
// container given CAP_SYS_ADMIN cannot mount under the default profile
// (the kernel's audit line names the profile) but can when Unconfined, so
// that what stops it is AppArmor and not its namespaces; likewise a
// container whose /proc/sys is left writable cannot write a network knob
// of its own pod under the default profile (with the kernel's line) but
// can when Unconfined; a Localhost profile the kernel does not hold is
// refused with InvalidArgument naming it.
func TestAppArmor(t *testing.T) {
	e := nodeEnv(t)
	if b, err := os.ReadFile("/sys/module/apparmor/parameters/enabled"); err != nil || !bytes.HasPrefix(b, []byte("Y")) {
		t.Fatalf("AppArmor is not enabled in the node VM (%q, %v): the node image boots with it", b, err)
	}
	e.install(t, "")
	t.Cleanup(func() { stopService(t) })
	client(t)
	if !profileLoaded(t, "stagelet-default") {
		t.Fatalf("stagelet-default is not loaded after the daemon started:\n%s", journal(t))
	}
	restart(t)
	rt, img := client(t)
	testutil.WaitFor(t, 30*time.Second, "the daemon to say the profile was loaded already", func() (bool, string) {
		j := journal(t)
		return strings.Contains(j, "the default AppArmor profile is loaded already"), j
	})
	out, err := exec.Command(e.bin, "doctor").CombinedOutput()
	if !strings.Contains(strings.Join(strings.Fields(string(out)), " "), "AppArmor enabled, the default container profile stagelet-default loaded") {
		t.Errorf("stagelet doctor (%v) does not report the profile:\n%s", err, out)
	}
	ref := pullBusybox(t, img)
	for _, tc := range []struct{ name, namespace, handler string }{
		{"aa-nspawn", "default", ""},
		{"aa-fly", "kube-system", "fly"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := startPod(t, rt, ref, tc.name, tc.namespace, tc.handler, "")
			p.check(t, rt, tc.name)
			c := ctx(t)
			ex, err := rt.ExecSync(c, &runtimeapi.ExecSyncRequest{ContainerId: p.ctr, Cmd: []string{"cat", "/proc/self/attr/current"}, Timeout: 30})
			if err != nil || strings.TrimSpace(string(ex.Stdout)) != "stagelet-default (enforce)" {
				t.Errorf("a command exec'd in a container that asked for no profile runs under %q (%v), want stagelet-default (enforce)", ex.GetStdout(), err)
			}
			cs, err := rt.ContainerStatus(c, &runtimeapi.ContainerStatusRequest{ContainerId: p.ctr, Verbose: true})
			if err != nil || cs.Info["apparmorProfile"] != "stagelet-default" {
				t.Errorf("verbose ContainerStatus says profile %q (%v), want stagelet-default", cs.GetInfo()["apparmorProfile"], err)
			}
			const script = "cat /proc/self/attr/current; mkdir -p /mnt/t; mount -t tmpfs none /mnt/t && echo MOUNTED"
			confined := runOnce(t, rt, p, ref, "confined", script, &runtimeapi.SecurityProfile{ProfileType: runtimeapi.SecurityProfile_RuntimeDefault})
			if !strings.Contains(confined, "stagelet-default (enforce)") || strings.Contains(confined, "MOUNTED") || !strings.Contains(confined, "Permission denied") {
				t.Errorf("RuntimeDefault with CAP_SYS_ADMIN: want the profile and a mount denied, got:\n%s", confined)
			}
			testutil.WaitFor(t, 30*time.Second, "the kernel's audit line of the denied mount", func() (bool, string) {
				// The audit line reaches the journal through its audit
				// socket, or the kernel's log where nothing listens there.
				j, _ := exec.Command("journalctl", "--no-pager", "-g", `apparmor="DENIED" operation="mount"`).CombinedOutput()
				k, _ := exec.Command("dmesg").CombinedOutput()
				for _, l := range strings.Split(string(j)+string(k), "\n") {
					if strings.Contains(l, `apparmor="DENIED" operation="mount"`) && strings.Contains(l, `profile="stagelet-default"`) {
						return true, ""
					}
				}
				return false, string(j)
			})
			free := runOnce(t, rt, p, ref, "unconfined", script, &runtimeapi.SecurityProfile{ProfileType: runtimeapi.SecurityProfile_Unconfined})
			if !strings.Contains(free, "unconfined") || !strings.Contains(free, "MOUNTED") {
				t.Errorf("Unconfined with CAP_SYS_ADMIN: want no profile and the mount made, got:\n%s", free)
			}
			// A kernel knob the profile denies (/proc/sys outside
			// kernel.shm*): the pod's own TCP keepalive time, in its network
			// namespace, written back with the value it has. /proc/sys is
			// read-only by default (EROFS with or without the profile), so
			// these containers' read-only paths are the defaults without it;
			// they add no capability: root may write its network
			// namespace's knobs.
			const knob = "/proc/sys/net/ipv4/tcp_keepalive_time"
			const knobScript = "cat /proc/self/attr/current; grep ' /proc/sys ' /proc/self/mountinfo || echo PROCSYS-NOT-A-MOUNT; v=$(cat " + knob + ") && echo \"$v\" > " + knob + " && echo WROTE"
			knobSC := func(prof runtimeapi.SecurityProfile_ProfileType) *runtimeapi.LinuxContainerSecurityContext {
				return &runtimeapi.LinuxContainerSecurityContext{
					Apparmor:      &runtimeapi.SecurityProfile{ProfileType: prof},
					ReadonlyPaths: []string{"/proc/bus", "/proc/fs", "/proc/irq", "/proc/sysrq-trigger"},
				}
			}
			since := time.Now()
			auditNoquiet(t)
			confined = runWith(t, rt, p, ref, "knob-confined", knobScript, knobSC(runtimeapi.SecurityProfile_RuntimeDefault))
			if !strings.Contains(confined, "stagelet-default (enforce)") || !strings.Contains(confined, "PROCSYS-NOT-A-MOUNT") ||
				strings.Contains(confined, "WROTE") || !strings.Contains(confined, knob+": Permission denied") {
				t.Errorf("RuntimeDefault, /proc/sys writable: want the profile and the write to %s denied (Permission denied), got:\n%s", knob, confined)
			}
			waitAudit(t, "the kernel's audit line of the denied write to "+knob, since,
				`apparmor="DENIED"`, "operation=", `profile="stagelet-default"`, `name="`+knob+`"`)
			free = runWith(t, rt, p, ref, "knob-unconfined", knobScript, knobSC(runtimeapi.SecurityProfile_Unconfined))
			if !strings.Contains(free, "unconfined") || !strings.Contains(free, "PROCSYS-NOT-A-MOUNT") || !strings.Contains(free, "WROTE") {
				t.Errorf("Unconfined, /proc/sys writable: want no profile and %s written, got:\n%s", knob, free)
			}
			_, err = rt.CreateContainer(c, &runtimeapi.CreateContainerRequest{
				PodSandboxId: p.id, SandboxConfig: p.cfg,
				Config: &runtimeapi.ContainerConfig{
					Metadata: &runtimeapi.ContainerMetadata{Name: "missing"},
					Image:    &runtimeapi.ImageSpec{Image: ref},
					Command:  []string{"true"},
					Linux: &runtimeapi.LinuxContainerConfig{SecurityContext: &runtimeapi.LinuxContainerSecurityContext{
						Apparmor: &runtimeapi.SecurityProfile{ProfileType: runtimeapi.SecurityProfile_Localhost, LocalhostRef: "localhost/stagelet-test-missing"},
					}},
				},
			})
			if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "localhost/stagelet-test-missing") {
				t.Errorf("a profile the kernel does not hold: %v, want InvalidArgument naming it", err)
			}
			p.remove(t, rt)
		})
	}
}

// profileLoaded reads the kernel's list of AppArmor profiles.
func profileLoaded(t *testing.T, name string) bool {
	t.Helper()
	b, err := os.ReadFile("/sys/kernel/security/apparmor/profiles")
	if err != nil {
		t.Fatal(err)
	}
	return bytes.Contains(b, []byte(name+" (enforce)\n"))
}

// auditNoquiet sets AppArmor's audit mode to noquiet until the test
// ends. The default profile's deny rules are quiet (only mounts are
// audited), as containerd's and CRI-O's are; in this mode the kernel logs
// what they refuse as well.
func auditNoquiet(t *testing.T) {
	t.Helper()
	const param = "/sys/module/apparmor/parameters/audit"
	old, err := os.ReadFile(param)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(param, []byte("noquiet"), 0); err != nil {
		t.Fatalf("AppArmor's audit mode: %v", err)
	}
	t.Cleanup(func() {
		if err := os.WriteFile(param, bytes.TrimSpace(old), 0); err != nil {
			t.Errorf("AppArmor's audit mode back to %s: %v", bytes.TrimSpace(old), err)
		}
	})
}

// waitAudit waits for an AppArmor denial logged at since or later
// holding all of parts.
func waitAudit(t *testing.T, what string, since time.Time, parts ...string) {
	t.Helper()
	waitAuditLine(t, what, since, appArmorDenied, parts...)
}

// runOnce runs script in a new container of pod p with CAP_SYS_ADMIN and
// the AppArmor profile prof, waits for it to exit and returns its log.
func runOnce(t *testing.T, rt runtimeapi.RuntimeServiceClient, p *pod, ref, name, script string, prof *runtimeapi.SecurityProfile) string {
	t.Helper()
	return runWith(t, rt, p, ref, name, script, &runtimeapi.LinuxContainerSecurityContext{
		Capabilities: &runtimeapi.Capability{AddCapabilities: []string{"SYS_ADMIN"}},
		Apparmor:     prof,
	})
}

// runWith runs script in a new container of pod p with the security
// context sc, waits for it to exit and returns its log.
func runWith(t *testing.T, rt runtimeapi.RuntimeServiceClient, p *pod, ref, name, script string, sc *runtimeapi.LinuxContainerSecurityContext) string {
	t.Helper()
	return runMounts(t, rt, p, ref, name, script, sc, nil)
}

// runContainer creates and starts a container of pod p from cfg (its
// LogPath set), waits for it to exit and returns its log.
func runContainer(t *testing.T, rt runtimeapi.RuntimeServiceClient, p *pod, cfg *runtimeapi.ContainerConfig) string {
	t.Helper()
	c := ctx(t)
	name := cfg.Metadata.Name
	cr, err := rt.CreateContainer(c, &runtimeapi.CreateContainerRequest{PodSandboxId: p.id, SandboxConfig: p.cfg, Config: cfg})
	if err != nil {
		t.Fatalf("CreateContainer %s: %v", name, err)
	}
	if _, err := rt.StartContainer(c, &runtimeapi.StartContainerRequest{ContainerId: cr.ContainerId}); err != nil {
		t.Fatalf("StartContainer %s: %v", name, err)
	}
	testutil.WaitFor(t, 60*time.Second, "container "+name+" to exit", func() (bool, string) {
		cs, err := rt.ContainerStatus(c, &runtimeapi.ContainerStatusRequest{ContainerId: cr.ContainerId})
		if err != nil {
			return false, err.Error()
		}
		return cs.Status.State == runtimeapi.ContainerState_CONTAINER_EXITED, cs.Status.State.String()
	})
	b, err := os.ReadFile(filepath.Join(p.logDir, cfg.LogPath))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}
