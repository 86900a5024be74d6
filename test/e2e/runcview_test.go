package e2e

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/test/e2e/harness"
	"github.com/stagelet/stagelet/test/runcview"
)

// TestSeenAsUnderRunc: a program in a container sees what it would see
// under containerd and runc on this node (package runcview: its cgroup
// limits, cgroups, resource limits, environment, names, hosts, umask,
// capabilities, seccomp, OOM score, devices, mounts, sysctls, CPUs,
// /dev/shm), on every stage1, but for the differences
// runcview.AllowedDiffs lists with their reasons.
func TestSeenAsUnderRunc(t *testing.T) {
	requireRoot(t)
	stage1s := []podStage1{flyStage1, nspawnStage1, kvmStage1}
	if os.Getenv("STAGELET_GUEST_ASSETS") == "" {
		t.Log("no kvm guest assets (make guest): kvm is not compared")
		stage1s = stage1s[:2]
	}
	root, err := harness.ModuleRoot()
	if err != nil {
		t.Fatal(err)
	}
	e := newEnvOpts(t, harness.Options{Policy: allStage1sPolicy}, true)
	ctrd := runcview.StartContainerd(t, filepath.Join(root, "..", "shared", "nodee2e"), e.reg)
	if _, err := ctrd.Image.PullImage(e.ctx(), &runtimeapi.PullImageRequest{Image: &runtimeapi.ImageSpec{Image: e.image}}); err != nil {
		t.Fatalf("containerd: pull %s: %v", e.image, err)
	}
	refs := map[runtimeapi.NamespaceMode]runcview.View{}
	for _, s := range stage1s {
		t.Run(s.handler, func(t *testing.T) {
			name := "view-" + s.handler
			ref, ok := refs[s.pid]
			if !ok {
				ref = runcview.Run(t, ctrd.RT, ctrd.Logs, e.image, runcview.Pod{Namespace: "e2e", Name: name, NS: s.podNetNS()})
				refs[s.pid] = ref
			}
			ours := runcview.Run(t, e.rt(), e.d.LogsDir, e.image, runcview.Pod{Handler: s.handler, Namespace: "e2e", Name: name, NS: s.podNetNS()})
			if bad := runcview.Unexplained(s.handler, runcview.Diff(ref, ours)); len(bad) > 0 {
				t.Errorf("%d differences from runc that no allowed difference explains (- runc's, + %s's):\n%s", len(bad), s.handler, strings.Join(bad, "\n"))
			}
		})
	}
}

// TestCgroupViewWritableWhenPrivileged: a privileged container's cgroups
// at /sys/fs/cgroup are read-write, as runc mounts them; an
// unprivileged one's read-only (TestSeenAsUnderRunc compares those with
// runc's).
func TestCgroupViewWritableWhenPrivileged(t *testing.T) {
	forEachStage1(t, func(t *testing.T, e *env, s podStage1) {
		cfg := e.netPodConfig("privileged-view", s)
		cfg.Linux.SecurityContext.Privileged = true
		pod := e.runStage1Pod(cfg, s)
		c := e.netContainer(s, "app", "sleep", "3600")
		c.Linux.SecurityContext.Privileged = true
		id := e.createAndStart(pod, cfg, c)
		mi := e.execOK(id, "cat", "/proc/self/mountinfo")
		var seen int
		for _, l := range strings.Split(mi, "\n") {
			f := strings.Fields(l)
			if len(f) < 6 || !strings.HasPrefix(f[4], "/sys/fs/cgroup/") {
				continue
			}
			seen++
			if opts := strings.Split(f[5], ","); opts[0] != "rw" {
				t.Errorf("a privileged container's %s is mounted %s, want rw", f[4], f[5])
			}
		}
		if seen == 0 {
			t.Errorf("a privileged container sees no cgroup mounts beneath /sys/fs/cgroup:\n%s", mi)
		}
	})
}
