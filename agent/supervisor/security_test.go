package supervisor_test

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/broker"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/testutil"
	"github.com/stagelet/stagelet/seccomp"
)

// denyMkdir is a Localhost-style profile: everything but mkdir.
func denyMkdir(t *testing.T) *specs.LinuxSeccomp {
	t.Helper()
	p, err := seccomp.Parse([]byte(`{"defaultAction": "SCMP_ACT_ALLOW",
		"syscalls": [{"names": ["mkdir", "mkdirat"], "action": "SCMP_ACT_ERRNO", "errnoRet": 1}]}`))
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// waitFile waits for a file the app writes in its root and returns it.
func waitFile(t *testing.T, path string) string {
	t.Helper()
	var b []byte
	testutil.WaitFor(t, 20*time.Second, path, func() (bool, string) {
		var err error
		b, err = os.ReadFile(path)
		return err == nil && strings.HasSuffix(string(b), "\n"), string(b)
	})
	return strings.TrimSpace(string(b))
}

func TestSeccompLocalhostProfile(t *testing.T) {
	ta := startAgent(t)
	// Each variant installs the filter at a different point: before the
	// credentials (root without CAP_SYS_ADMIN nor no_new_privs), after
	// them with no_new_privs (a user), after them with CAP_SYS_ADMIN.
	for _, tc := range []struct {
		name string
		spec api.AppSpec
	}{
		{"root", api.AppSpec{Capabilities: broker.DefaultCapabilities}},
		{"user-nnp", api.AppSpec{UID: 1000, GID: 1000, NoNewPrivs: true}},
		{"sysadmin", api.AppSpec{Capabilities: append([]string{"CAP_SYS_ADMIN"}, broker.DefaultCapabilities...)}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rootfs := makeRootfs(t)
			spec := tc.spec
			spec.ID = "seccomp-" + tc.name
			spec.Rootfs = rootfs
			spec.Seccomp = denyMkdir(t)
			spec.SeccompProfile = "localhost/deny-mkdir.json"
			spec.Args = sh(`mkdir /tmp/x 2>/tmp/err; echo $? >/tmp/rc; touch /tmp/file; echo ok >/tmp/echo; exec sleep 1000`)
			ta.run(&spec)
			if rc := waitFile(t, filepath.Join(rootfs, "tmp", "rc")); rc == "0" {
				t.Errorf("mkdir under the filter succeeded")
			}
			if e, _ := os.ReadFile(filepath.Join(rootfs, "tmp", "err")); !strings.Contains(string(e), "Operation not permitted") {
				t.Errorf("mkdir error: %q", e)
			}
			if _, err := os.Stat(filepath.Join(rootfs, "tmp", "x")); err == nil {
				t.Errorf("the directory was created")
			}
			if got := waitFile(t, filepath.Join(rootfs, "tmp", "echo")); got != "ok" {
				t.Errorf("echo: %q", got)
			}
			// ExecSync gets the app's filter, not the agent's (none).
			res := ta.exec(spec.ID, "mkdir", "/tmp/y")
			if res.ExitCode == 0 || !strings.Contains(string(res.Stderr), "Operation not permitted") {
				t.Errorf("exec mkdir: %+v", res)
			}
			res = ta.exec(spec.ID, "echo", "hello")
			if res.ExitCode != 0 || string(res.Stdout) != "hello\n" {
				t.Errorf("exec echo: %+v", res)
			}
			res = ta.exec(spec.ID, "grep", "^Seccomp:", "/proc/self/status")
			if f := strings.Fields(string(res.Stdout)); len(f) != 2 || f[1] != "2" {
				t.Errorf("exec's seccomp mode: %q", res.Stdout)
			}
		})
	}
}

func TestSeccompRuntimeDefault(t *testing.T) {
	ta := startAgent(t)
	// A root app with the default capabilities may create a user namespace
	// by itself; the default profile refuses unshare without
	// CAP_SYS_ADMIN. The unfiltered app shows the difference is the filter.
	for _, tc := range []struct {
		name    string
		profile *specs.LinuxSeccomp
		wantRC  string
	}{
		{"unconfined", nil, "0"},
		{"default", seccomp.RuntimeDefault(broker.DefaultCapabilities...), "1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rootfs := makeRootfs(t)
			id := "rd-" + tc.name
			ta.run(&api.AppSpec{ID: id, Rootfs: rootfs, Capabilities: broker.DefaultCapabilities,
				Seccomp: tc.profile, SeccompProfile: "runtime/default",
				Args: sh(`unshare -U true 2>/tmp/err; echo $? >/tmp/rc; exec sleep 1000`)})
			if rc := waitFile(t, filepath.Join(rootfs, "tmp", "rc")); rc != tc.wantRC {
				e, _ := os.ReadFile(filepath.Join(rootfs, "tmp", "err"))
				t.Errorf("unshare -U: rc %s, want %s (%s)", rc, tc.wantRC, e)
			}
			// Ordinary commands work.
			res := ta.exec(id, "sh", "-c", "echo hi >/tmp/hi && cat /tmp/hi && ls / >/dev/null && id -u")
			if res.ExitCode != 0 || string(res.Stdout) != "hi\n0\n" {
				t.Errorf("exec: %+v", res)
			}
			if tc.profile != nil {
				res = ta.exec(id, "hostname", "other")
				if res.ExitCode == 0 {
					t.Errorf("hostname under the default profile: %+v", res)
				}
			}
		})
	}
}

func TestSecurityCreateErrors(t *testing.T) {
	ta := startAgent(t)
	rootfs := makeRootfs(t)
	bad := &specs.LinuxSeccomp{DefaultAction: "SCMP_ACT_SOMETIMES"}
	_, err := ta.c.Create(ctx(t), &api.AppSpec{ID: "bad-seccomp", Rootfs: rootfs, Args: []string{"true"}, Seccomp: bad})
	if !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("bad profile: %v", err)
	}
	if _, err := os.Stat("/sys/kernel/security/apparmor"); err == nil {
		t.Skip("AppArmor is enabled here")
	}
	_, err = ta.c.Create(ctx(t), &api.AppSpec{ID: "aa", Rootfs: rootfs, Args: []string{"true"}, AppArmorProfile: "k8s-nginx"})
	if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "AppArmor profile k8s-nginx requested, but AppArmor is not enabled") {
		t.Errorf("AppArmor profile: %v", err)
	}
}

func TestSELinuxLabelsIgnoredWhereDisabled(t *testing.T) {
	if _, err := os.Stat("/sys/fs/selinux/enforce"); err == nil {
		t.Skip("SELinux is enabled here")
	}
	ta := startAgent(t)
	rootfs := makeRootfs(t)
	ta.run(&api.AppSpec{ID: "se", Rootfs: rootfs, Args: []string{"sleep", "1000"},
		SELinuxProcessLabel: "system_u:system_r:container_t:s0:c1,c2",
		SELinuxMountLabel:   "system_u:object_r:container_file_t:s0:c1,c2"})
	res := ta.exec("se", "echo", "ok")
	if res.ExitCode != 0 || string(res.Stdout) != "ok\n" {
		t.Errorf("exec: %+v", res)
	}
	res = ta.exec("se", "grep", " /dev ", "/proc/1/mounts")
	if strings.Contains(string(res.Stdout), "context=") {
		t.Errorf("mount label applied without SELinux: %s", res.Stdout)
	}
}
