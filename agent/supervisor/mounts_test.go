package supervisor_test

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/errdefs"
)

// mountedOnHost tells whether path is a mount point in the test's (the
// host's) mount namespace.
func mountedOnHost(t *testing.T, path string) bool {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) > 4 && f[4] == path {
			return true
		}
	}
	return false
}

// sharedSource is a directory that is a shared mount on the host, as the
// kubelet's volumes with mount propagation are.
func sharedSource(t *testing.T) string {
	t.Helper()
	src := t.TempDir()
	if err := syscall.Mount(src, src, "", syscall.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Unmount(src, syscall.MNT_DETACH) })
	if err := syscall.Mount("", src, "", syscall.MS_SHARED, ""); err != nil {
		t.Fatal(err)
	}
	return src
}

// TestExecJoinsMountNamespace: an exec'd command runs in the app's mount
// namespace, so what a privileged container mounts from an exec is the
// app's own mount, seen by the app and by later execs, and not the host's.
func TestExecJoinsMountNamespace(t *testing.T) {
	ta := startAgent(t)
	rootfs := makeRootfs(t)
	ta.run(&api.AppSpec{ID: "m", Rootfs: rootfs, Args: []string{"sleep", "1000"}, Privileged: true})
	if res := ta.exec("m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /tmp && echo hi >/tmp/f"); res.ExitCode != 0 {
		t.Fatalf("mount in an exec: %+v", res)
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", ta.appPID("m")))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(b), " /tmp ") {
		t.Errorf("the exec's mount is not the app's:\n%s", b)
	}
	if res := ta.exec("m", "cat", "/tmp/f"); string(res.Stdout) != "hi\n" {
		t.Errorf("a later exec does not see it: %+v", res)
	}
	if _, err := os.Stat(filepath.Join(rootfs, "tmp", "f")); err == nil {
		t.Error("the file went to the rootfs on the host, not to the app's tmpfs")
	}
}

// TestMaskedAndReadonlyPaths: the paths the spec names are hidden or made
// read-only; without any the runtime defaults apply; privileged apps get
// neither.
func TestMaskedAndReadonlyPaths(t *testing.T) {
	ta := startAgent(t)
	rootfs := makeRootfs(t)
	os.WriteFile(filepath.Join(rootfs, "etc", "secret"), []byte("s3cret\n"), 0o600)
	os.MkdirAll(filepath.Join(rootfs, "srv", "private"), 0o755)
	os.WriteFile(filepath.Join(rootfs, "srv", "private", "f"), []byte("x"), 0o644)
	os.WriteFile(filepath.Join(rootfs, "bin", "tool"), []byte("#!/bin/sh\necho tool\n"), 0o755)
	ta.run(&api.AppSpec{ID: "given", Rootfs: rootfs, Args: []string{"sleep", "1000"},
		MaskedPaths:   []string{"/etc/secret", "/srv/private", "/does/not/exist", "/bin/tool"},
		ReadonlyPaths: []string{"/tmp", "/nowhere"},
	})
	for _, c := range []struct {
		cmd  string
		want string
	}{
		{"cat /etc/secret; echo end", "end\n"},
		{"ls -A /srv/private; echo end", "end\n"},
		{"touch /tmp/x 2>&1 || true", "touch: /tmp/x: Read-only file system\n"},
		{"touch /etc/x && echo rw", "rw\n"},
		// The lists replace the defaults: /proc/kcore is not masked.
		{"test -c /proc/kcore || echo not-masked", "not-masked\n"},
	} {
		if res := ta.exec("given", "sh", "-c", c.cmd); string(res.Stdout) != c.want {
			t.Errorf("%s: %q, want %q (stderr %q)", c.cmd, res.Stdout, c.want, res.Stderr)
		}
	}
	// A masked executable cannot run (the kubelet's and critest's check).
	if res := ta.exec("given", "sh", "-c", "tool"); res.ExitCode == 0 || !strings.Contains(string(res.Stderr), "Permission denied") {
		t.Errorf("masked /bin/tool ran: %+v", res)
	}

	ta.run(&api.AppSpec{ID: "defaults", Rootfs: makeRootfs(t), Args: []string{"sleep", "1000"}})
	if res := ta.exec("defaults", "sh", "-c", "test -e /proc/kcore || exit 0; test -c /proc/kcore && echo masked"); res.ExitCode != 0 ||
		(string(res.Stdout) != "masked\n" && string(res.Stdout) != "") {
		t.Errorf("default masks: %+v", res)
	}
	if res := ta.exec("defaults", "grep", " /proc/sys ", "/proc/self/mounts"); !strings.Contains(string(res.Stdout), " ro,") {
		t.Errorf("/proc/sys is not read-only by default: %q", res.Stdout)
	}

	ta.run(&api.AppSpec{ID: "priv", Rootfs: rootfs, Args: []string{"sleep", "1000"}, Privileged: true,
		MaskedPaths: []string{"/etc/secret"}, ReadonlyPaths: []string{"/tmp"}})
	if res := ta.exec("priv", "sh", "-c", "cat /etc/secret && touch /tmp/y && echo ok"); string(res.Stdout) != "s3cret\nok\n" {
		t.Errorf("privileged app masked: %+v", res)
	}

	if _, err := ta.c.Create(ctx(t), &api.AppSpec{ID: "rel", Rootfs: rootfs, Args: []string{"true"}, MaskedPaths: []string{"etc"}}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("relative masked path: %v, want InvalidArgument", err)
	}
}

// TestReadonlyMountRecursion: a read-only mount is read-only at its top
// only; recursive read-only covers the mounts beneath it too.
func TestReadonlyMountRecursion(t *testing.T) {
	ta := startAgent(t)
	rootfs := makeRootfs(t)
	src := t.TempDir()
	sub := filepath.Join(src, "sub")
	os.Mkdir(sub, 0o755)
	if err := syscall.Mount("tmpfs", sub, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Unmount(sub, syscall.MNT_DETACH) })
	ta.run(&api.AppSpec{ID: "ro", Rootfs: rootfs, Args: []string{"sleep", "1000"}, Mounts: []api.Mount{
		{Source: src, Destination: "/ro", Readonly: true},
		{Source: src, Destination: "/rro", Readonly: true, RecursiveReadonly: true},
	}})
	for p, wantOK := range map[string]bool{"/ro/f": false, "/ro/sub/f": true, "/rro/f": false, "/rro/sub/g": false} {
		if res := ta.exec("ro", "touch", p); (res.ExitCode == 0) != wantOK {
			t.Errorf("touch %s: code %d %s, want success %v", p, res.ExitCode, res.Stderr, wantOK)
		}
	}
	for name, m := range map[string]api.Mount{
		"not readonly": {Source: src, Destination: "/x", RecursiveReadonly: true},
		"propagating":  {Source: src, Destination: "/x", Readonly: true, RecursiveReadonly: true, Propagation: "rslave"},
	} {
		_, err := ta.c.Create(ctx(t), &api.AppSpec{ID: "bad", Rootfs: rootfs, Args: []string{"true"}, Mounts: []api.Mount{m}})
		if !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("recursive read-only, %s: %v, want InvalidArgument", name, err)
		}
	}
}

// TestBidirectionalMount: what a privileged app mounts beneath an rshared
// mount reaches the host at the source; beneath an rslave one it does not.
func TestBidirectionalMount(t *testing.T) {
	ta := startAgent(t)
	rootfs := makeRootfs(t)
	src := sharedSource(t)
	for _, d := range []string{"from-shared", "from-slave"} {
		os.Mkdir(filepath.Join(src, d), 0o755)
		t.Cleanup(func() { syscall.Unmount(filepath.Join(src, d), syscall.MNT_DETACH) })
	}
	ta.run(&api.AppSpec{ID: "b", Rootfs: rootfs, Args: []string{"sleep", "1000"}, Privileged: true, Mounts: []api.Mount{
		{Source: src, Destination: "/shared", Propagation: "rshared"},
		{Source: src, Destination: "/slave", Propagation: "rslave"},
	}})
	for _, cmd := range []string{"mount -t tmpfs tmpfs /shared/from-shared", "mount -t tmpfs tmpfs /slave/from-slave"} {
		if res := ta.exec("b", "sh", "-c", cmd); res.ExitCode != 0 {
			t.Fatalf("%s: %+v", cmd, res)
		}
	}
	if !mountedOnHost(t, filepath.Join(src, "from-shared")) {
		t.Error("a mount beneath the rshared mount did not reach the host")
	}
	if mountedOnHost(t, filepath.Join(src, "from-slave")) {
		t.Error("a mount beneath the rslave mount reached the host")
	}
}

// TestPIDNamespaceTarget: an app may join the PID namespace of another
// running app (kubectl debug --target), and its execs join it too.
func TestPIDNamespaceTarget(t *testing.T) {
	ta := startAgent(t)
	rootfs := makeRootfs(t)
	ta.run(&api.AppSpec{ID: "target", Rootfs: rootfs, Args: []string{"sleep", "1001"}, PIDNamespace: api.PIDNamespaceContainer})
	ta.run(&api.AppSpec{ID: "debug", Rootfs: rootfs, Args: []string{"sleep", "1002"}, PIDNamespace: api.PIDNamespaceTarget, PIDTarget: "target"})
	res := ta.exec("debug", "sh", "-c", "cat /proc/1/cmdline | tr '\\0' ' '; echo; ps -o args")
	out := string(res.Stdout)
	if !strings.HasPrefix(out, "sleep 1001 \n") || !strings.Contains(out, "sleep 1002") {
		t.Errorf("the debug app is not in the target's PID namespace:\n%s%s", out, res.Stderr)
	}
	// The pod's (the agent's) namespace is not the target's.
	if res := ta.exec("debug", "sh", "-c", "ps -o args | grep -c 'sleep 100[12]'"); strings.TrimSpace(string(res.Stdout)) != "2" {
		t.Errorf("processes in the target's namespace: %+v", res)
	}

	if _, err := ta.c.Create(ctx(t), &api.AppSpec{ID: "late", Rootfs: rootfs, Args: []string{"true"}, PIDNamespace: api.PIDNamespaceTarget, PIDTarget: "gone"}); err != nil {
		t.Fatal(err)
	}
	if _, err := ta.c.Start(ctx(t), "late"); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Errorf("target that does not run: %v, want FailedPrecondition", err)
	}
	_, err := ta.c.Create(ctx(t), &api.AppSpec{ID: "self", Rootfs: rootfs, Args: []string{"true"}, PIDNamespace: api.PIDNamespaceTarget, PIDTarget: "self"})
	if !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("target itself: %v, want InvalidArgument", err)
	}
}

// TestIPCSysctls: with --private-ipc the agent has an IPC namespace of its
// own, where OpSysctl sets IPC sysctls for every app; the host's stay.
func TestIPCSysctls(t *testing.T) {
	host, err := os.ReadFile("/proc/sys/fs/mqueue/msg_max")
	if err != nil {
		t.Skip("no /proc/sys/fs/mqueue/msg_max")
	}
	ta := startAgentAs(t, false, "--private-ipc")
	if err := ta.c.SetSysctls(ctx(t), map[string]string{"kernel.shm_rmid_forced": "1", "fs/mqueue/msg_max": "97", "kernel.sem": "250 32000 32 200"}); err != nil {
		t.Fatal(err)
	}
	rootfs := makeRootfs(t)
	ta.run(&api.AppSpec{ID: "s", Rootfs: rootfs, Args: []string{"sleep", "1000"}})
	res := ta.exec("s", "sh", "-c", "cat /proc/sys/kernel/shm_rmid_forced /proc/sys/fs/mqueue/msg_max /proc/sys/kernel/sem")
	if got := strings.Fields(string(res.Stdout)); strings.Join(got, " ") != "1 97 250 32000 32 200" {
		t.Errorf("in the app: %q (%s)", res.Stdout, res.Stderr)
	}
	if now, _ := os.ReadFile("/proc/sys/fs/mqueue/msg_max"); string(now) != string(host) {
		t.Errorf("the host's fs.mqueue.msg_max changed: %q → %q", host, now)
	}
	for _, bad := range []map[string]string{
		{"kernel.hostname": "x"},
		{"net.ipv4.ip_forward": "1"},
		{"kernel.shm../../x": "1"},
		{"kernel.msgmax": "not-a-number"},
	} {
		if err := ta.c.SetSysctls(ctx(t), bad); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("%v: %v, want InvalidArgument", bad, err)
		}
	}
}
