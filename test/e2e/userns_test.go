package e2e

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/test/e2e/harness"
)

// usernsBase and usernsSize are the user namespace range the tests' pods
// get, as the kubelet gives one: 65536 IDs from a multiple of 65536.
const usernsBase, usernsSize = 1 << 30, 65536

// podUserNS is the user namespace of a hostUsers: false pod (and of its
// containers), mapping usernsBase.. from 0.
func podUserNS() *runtimeapi.UserNamespace {
	ids := []*runtimeapi.IDMapping{{HostId: usernsBase, ContainerId: 0, Length: usernsSize}}
	return &runtimeapi.UserNamespace{Mode: runtimeapi.NamespaceMode_POD, Uids: ids, Gids: ids}
}

// TestUserNamespacePod: a hostUsers: false pod through the CRI. Status
// offers user namespaces on nspawn only; an nspawn pod with its own
// network runs its container as the pod's root, which inside maps to the
// kubelet's range and which the host sees as the range's first ID, and it
// writes its own files and log; fly refuses such a pod, naming the field.
func TestUserNamespacePod(t *testing.T) {
	e := newEnvOpts(t, harness.Options{Policy: bothStage1sPolicy}, true)
	st, err := e.rt().Status(e.ctx(), &runtimeapi.StatusRequest{})
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]bool{"nspawn": true, "fly": false, "": false} // "": the policy's default, fly
	for _, h := range st.GetRuntimeHandlers() {
		if w, ok := want[h.GetName()]; ok && h.GetFeatures().GetUserNamespaces() != w {
			t.Errorf("handler %q: user_namespaces %v, want %v", h.GetName(), h.GetFeatures().GetUserNamespaces(), w)
		}
	}

	userns := podUserNS()
	cfg := e.netPodConfig("userns", nspawnStage1)
	cfg.Linux.SecurityContext.NamespaceOptions.UsernsOptions = userns
	podID := e.runStage1Pod(cfg, nspawnStage1)
	const marker = "4242424"
	ctr := e.netContainer(nspawnStage1, "c", "sh", "-c", "echo started; exec sleep "+marker)
	ctr.Linux.SecurityContext.NamespaceOptions.UsernsOptions = userns
	id := e.createAndStart(podID, cfg, ctr)

	if got := strings.Fields(e.execOK(id, "cat", "/proc/self/uid_map")); len(got) != 3 || got[0] != "0" || got[1] != strconv.Itoa(usernsBase) || got[2] != strconv.Itoa(usernsSize) {
		t.Errorf("uid_map inside = %v, want 0 %d %d", got, usernsBase, usernsSize)
	}
	if got := strings.TrimSpace(e.execOK(id, "id", "-u")); got != "0" {
		t.Errorf("id -u inside = %s, want 0", got)
	}
	// The container names no masked and no read-only paths, as the
	// kubelet sends procMount Unmasked: /proc/sys is not made read-only.
	// One that names them, as the kubelet sends procMount Default, gets
	// them.
	const procSys = "grep ' /proc/sys ' /proc/self/mountinfo || echo UNMASKED"
	if out := e.execOK(id, "sh", "-c", procSys); !strings.Contains(out, "UNMASKED") {
		t.Errorf("procMount Unmasked: /proc/sys is read-only:\n%s", out)
	}
	masked := e.netContainer(nspawnStage1, "masked", "sleep", "3600")
	masked.Linux.SecurityContext.NamespaceOptions.UsernsOptions = userns
	masked.Linux.SecurityContext.MaskedPaths = []string{"/proc/kcore"}
	masked.Linux.SecurityContext.ReadonlyPaths = []string{"/proc/sys"}
	mid := e.createAndStart(podID, cfg, masked)
	if out := e.execOK(mid, "sh", "-c", procSys); strings.Contains(out, "UNMASKED") || !strings.Contains(out, " ro,") {
		t.Errorf("procMount Default: /proc/sys is not read-only:\n%s", out)
	}
	// The pod's root owns its root filesystem (idmapped): it writes there.
	e.execOK(id, "sh", "-c", "echo x > /made-inside && test -O /made-inside")

	// The host sees the container's process as the range's first ID.
	found := false
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, p := range procs {
		b, err := os.ReadFile(p)
		if err != nil || !bytes.Equal(b, []byte("sleep\x00"+marker+"\x00")) {
			continue
		}
		status, err := os.ReadFile(filepath.Join(filepath.Dir(p), "status"))
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(status), "\n") {
			if f := strings.Fields(line); len(f) > 1 && f[0] == "Uid:" {
				found = true
				if f[1] != strconv.Itoa(usernsBase) {
					t.Errorf("the host sees the container's root as uid %s, want %d", f[1], usernsBase)
				}
			}
		}
	}
	if !found {
		t.Error("the container's process is not among the host's")
	}
	// The pod's root serves on a port below 1024 in the pod's network
	// namespace (which the host owns).
	// (busybox httpd binds before it detaches, and fails if it cannot.)
	e.execOK(id, "httpd", "-p", "80", "-h", "/")
	// Its log, written by the pod's root through the idmapped log
	// directory, is the host's root's.
	if logs := e.logText(logPath(cfg, ctr)); !strings.Contains(logs, " stdout F started\n") {
		t.Errorf("container log: %q", logs)
	}

	fly := e.netPodConfig("userns-fly", flyStage1)
	fly.Linux.SecurityContext.NamespaceOptions.UsernsOptions = userns
	_, err = e.rt().RunPodSandbox(e.ctx(), &runtimeapi.RunPodSandboxRequest{Config: fly, RuntimeHandler: "fly"})
	requireCode(t, err, codes.InvalidArgument, "a hostUsers: false pod on fly")
	if !strings.Contains(err.Error(), "user namespace") {
		t.Errorf("fly's refusal does not say why: %v", err)
	}
}

// TestKVMUserNamespacePod: a hostUsers: false pod on kvm, in a VM
// restored from a template (the pod's agent starts at setup) and in one
// that boots its kernel (it starts at boot). Status offers user
// namespaces on kvm; the container runs as the pod's root, which inside
// maps to the kubelet's range; the image's files show as the pod root's
// (bound idmapped into the VM's share); it writes its rootfs, binds a port
// below 1024, and its log reaches the host; an exec is in the same user
// namespace; a second container shares it; after the daemon is killed and
// restarted the pod's agent answers again.
func TestKVMUserNamespacePod(t *testing.T) {
	for _, boot := range []bool{false, true} {
		t.Run(map[bool]string{false: "template", true: "boot"}[boot], func(t *testing.T) {
			kvmUserNamespacePod(t, newKVMEnvOpts(t, harness.Options{Policy: allStage1sPolicy, KVMNoTemplate: boot}))
		})
	}
}

func kvmUserNamespacePod(t *testing.T, e *env) {
	st, err := e.rt().Status(e.ctx(), &runtimeapi.StatusRequest{})
	if err != nil {
		t.Fatal(err)
	}
	offered := false
	for _, h := range st.GetRuntimeHandlers() {
		if h.GetName() == "kvm" {
			offered = h.GetFeatures().GetUserNamespaces()
		}
	}
	if !offered {
		t.Error("handler kvm does not offer user namespaces")
	}

	userns := podUserNS()
	cfg := e.netPodConfig("userns-vm", kvmStage1)
	cfg.Linux.SecurityContext.NamespaceOptions.UsernsOptions = userns
	cfg.Linux.Sysctls = guestSysctls
	podID := e.runStage1Pod(cfg, kvmStage1)
	ctr := e.netContainer(kvmStage1, "c", "sh", "-c", "echo started; exec sleep 1000")
	ctr.Linux.SecurityContext.NamespaceOptions.UsernsOptions = userns
	id := e.createAndStart(podID, cfg, ctr)

	want := []string{"0", strconv.Itoa(usernsBase), strconv.Itoa(usernsSize)}
	for _, f := range []string{"/proc/self/uid_map", "/proc/self/gid_map", "/proc/1/uid_map"} {
		if got := strings.Fields(e.execOK(id, "cat", f)); !slices.Equal(got, want) {
			t.Errorf("%s inside = %v, want %v", f, got, want)
		}
	}
	if got := strings.TrimSpace(e.execOK(id, "id", "-u")); got != "0" {
		t.Errorf("id -u inside = %s, want 0", got)
	}
	// The image's files are root's inside: the guest sees them owned by
	// the range's first ID, which maps to 0.
	if got := strings.TrimSpace(e.execOK(id, "stat", "-c", "%u:%g", "/bin/busybox")); got != "0:0" {
		t.Errorf("/bin/busybox is owned by %s inside, want 0:0", got)
	}
	e.execOK(id, "sh", "-c", "echo x > /made-inside && test -O /made-inside && rm /made-inside")
	e.execOK(id, "httpd", "-p", "80", "-h", "/")
	checkGuestSysctls(t, e, id)
	if logs := e.logText(logPath(cfg, ctr)); !strings.Contains(logs, " stdout F started\n") {
		t.Errorf("container log: %q", logs)
	}

	other := e.netContainer(kvmStage1, "d", "sleep", "1000")
	other.Linux.SecurityContext.NamespaceOptions.UsernsOptions = userns
	id2 := e.createAndStart(podID, cfg, other)
	if got := strings.Fields(e.execOK(id2, "cat", "/proc/self/uid_map")); !slices.Equal(got, want) {
		t.Errorf("second container: uid_map %v, want %v", got, want)
	}

	ctx, cancel := context.WithTimeout(t.Context(), startTimeout)
	defer cancel()
	if err := e.d.Kill9(ctx); err != nil {
		t.Fatal(err)
	}
	if err := e.d.Restart(ctx); err != nil {
		t.Fatalf("restart the daemon: %v", err)
	}
	if got := strings.TrimSpace(e.execOK(id, "id", "-u")); got != "0" {
		t.Errorf("after a daemon restart: id -u = %s, want 0", got)
	}
}
