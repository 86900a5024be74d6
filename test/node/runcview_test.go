package node

import (
	"os"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/test/runcview"
	"github.com/stagelet/stagelet/test/testregistry"
)

// TestSeenAsUnderRunc: on a pure cgroup v2 node with systemd, under both
// cgroup drivers, a program in a container of an nspawn pod and of a fly
// pod sees what it sees under containerd and runc (package runcview; on
// cgroup v2 a cgroup namespace and cgroup2 at /sys/fs/cgroup), but for
// runcview.AllowedDiffs; and OpenJDK 17 reports its container's memory
// limit and CPU count. (A kvm pod here would run under TCG inside the
// node VM's TCG: its guest's cgroups are the same as on any node, and
// test/e2e checks them.)
func TestSeenAsUnderRunc(t *testing.T) {
	e := nodeEnv(t)
	kit := os.Getenv("STAGELET_NODEE2E_KIT")
	if kit == "" {
		t.Skip("no containerd kit in the payload (STAGELET_NODEE2E_KIT): ../shared/nodee2e was missing")
	}
	// containerd gets the open files limit the service gives stagelet:
	// each runtime passes its own on.
	if n := unitLimitNOFILE(t, e.unit); n > 0 {
		if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &syscall.Rlimit{Cur: n, Max: n}); err != nil {
			t.Fatal(err)
		}
	}
	reg := testregistry.Start(t)
	busybox := reg.PushBusybox(t, "node/busybox", "view")
	jre := reg.PushJRE(t, "node/jre", "17")
	ctrd := runcview.StartContainerd(t, kit, reg)
	if _, err := ctrd.Image.PullImage(ctx(t), &runtimeapi.PullImageRequest{Image: &runtimeapi.ImageSpec{Image: busybox}}); err != nil {
		t.Fatalf("containerd: pull %s: %v", busybox, err)
	}
	// The node's default policy: nspawn by default, fly by its handler
	// in kube-system.
	stage1s := []struct {
		stage1, handler, namespace string
		pid                        runtimeapi.NamespaceMode
	}{{"nspawn", "", "default", runtimeapi.NamespaceMode_POD}, {"fly", "fly", "kube-system", runtimeapi.NamespaceMode_NODE}}
	refs := map[runtimeapi.NamespaceMode]runcview.View{}
	logs := t.TempDir()
	for _, driver := range []string{"cgroupfs", "systemd"} {
		t.Run(driver, func(t *testing.T) {
			if driver == "systemd" {
				e.installSystemdDriver(t, "runcview.yaml")
			} else {
				e.install(t, "")
				t.Cleanup(func() { stopService(t) })
			}
			rt, img := client(t)
			for _, ref := range []string{busybox, jre} {
				if _, err := img.PullImage(ctx(t), &runtimeapi.PullImageRequest{Image: &runtimeapi.ImageSpec{Image: ref}}); err != nil {
					t.Fatalf("PullImage %s: %v", ref, err)
				}
			}
			for _, s := range stage1s {
				t.Run(s.stage1, func(t *testing.T) {
					ns := &runtimeapi.NamespaceOption{Network: runtimeapi.NamespaceMode_POD, Pid: s.pid, Ipc: s.pid}
					pod := runcview.Pod{Handler: s.handler, Namespace: s.namespace, Name: "view-" + driver, NS: ns}
					ref, ok := refs[s.pid]
					if !ok {
						ref = runcview.Run(t, ctrd.RT, ctrd.Logs, busybox, runcview.Pod{Namespace: s.namespace, Name: pod.Name, NS: ns})
						refs[s.pid] = ref
					}
					ours := runcview.Run(t, rt, logs, busybox, pod)
					if bad := runcview.Unexplained(s.stage1, runcview.Diff(ref, ours)); len(bad) > 0 {
						t.Errorf("%d differences from runc that no allowed difference explains (- runc's, + %s's):\n%s", len(bad), s.stage1, strings.Join(bad, "\n"))
					}
					pod.Name = "jvm-" + driver
					out := runcview.RunJVM(t, rt, logs, jre, pod)
					for _, want := range runcview.JVMReports {
						if !strings.Contains(out, want) {
							t.Errorf("the JVM does not report %q:\n%s", want, out)
						}
					}
				})
			}
			// A pod of its own user namespace (hostUsers: false) sees
			// its cgroups as the others do: the new cgroup2 mount that
			// its namespace may not make is a bind of its cgroup.
			t.Run("nspawn-userns", func(t *testing.T) {
				ids := []*runtimeapi.IDMapping{{HostId: 1 << 30, ContainerId: 0, Length: 65536}}
				ns := &runtimeapi.NamespaceOption{Network: runtimeapi.NamespaceMode_POD, Pid: runtimeapi.NamespaceMode_POD, Ipc: runtimeapi.NamespaceMode_POD,
					UsernsOptions: &runtimeapi.UserNamespace{Mode: runtimeapi.NamespaceMode_POD, Uids: ids, Gids: ids}}
				ours := runcview.Run(t, rt, logs, busybox, runcview.Pod{Namespace: "default", Name: "view-userns-" + driver, NS: ns})
				ref := refs[runtimeapi.NamespaceMode_POD]
				for _, sec := range []string{"cgroup-files", "proc-cgroup"} {
					if !slices.Equal(ours[sec], ref[sec]) {
						t.Errorf("%s: a user-namespaced pod's %q, runc's (without one) %q", sec, ours[sec], ref[sec])
					}
				}
			})
		})
	}
}

// unitLimitNOFILE is the LimitNOFILE= of the unit file at path; 0 when it
// sets none.
func unitLimitNOFILE(t *testing.T, path string) uint64 {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(l), "LimitNOFILE="); ok {
			n, err := strconv.ParseUint(v, 10, 64)
			if err != nil {
				t.Fatalf("LimitNOFILE=%s: %v", v, err)
			}
			return n
		}
	}
	return 0
}
