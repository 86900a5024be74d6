package e2e

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/agent/supervisor"
	"github.com/stagelet/stagelet/test/e2e/harness"
	"github.com/stagelet/stagelet/test/testregistry"
)

// viewProbe is what a container reports of its world, section by
// section, then it waits: the cgroup files of its limits, its cgroups,
// every resource limit, its environment, names, hosts, umask,
// capabilities, no_new_privs, seccomp mode, OOM score, /dev, its mounts,
// two network sysctls, its CPUs and /dev/shm's size.
const viewProbe = `sec() { echo "== $1"; }
sec cgroup-files
for f in memory/memory.limit_in_bytes cpu/cpu.cfs_quota_us cpu/cpu.cfs_period_us cpu/cpu.shares pids/pids.max memory.max cpu.max cpu.weight pids.max; do
	[ -f /sys/fs/cgroup/$f ] && echo "$f $(cat /sys/fs/cgroup/$f)"
done
sec cgroup-dir; ls /sys/fs/cgroup
sec proc-cgroup; cat /proc/self/cgroup
sec cgroup-mounts; awk '$5 ~ "^/sys/fs/cgroup" { print $5, $4 }' /proc/self/mountinfo
sec limits; tail -n +2 /proc/self/limits
sec env; for v in HOME PATH HOSTNAME TERM; do echo "$v=$(printenv $v)"; done
sec hostname; cat /proc/sys/kernel/hostname
sec etc-hostname; cat /etc/hostname
sec etc-hosts; cat /etc/hosts
sec etc-resolv; cat /etc/resolv.conf
sec umask; umask
sec status; grep -E '^(CapInh|CapPrm|CapEff|CapBnd|CapAmb|NoNewPrivs|Seccomp):' /proc/self/status
sec oom; cat /proc/self/oom_score_adj
sec dev; ls -A /dev
sec mounts; awk '{ split($6, o, ","); for (i = 7; $i != "-"; i++) ; print $5, $(i+1), o[1] }' /proc/self/mountinfo
sec sysctl; cat /proc/sys/net/ipv4/ping_group_range /proc/sys/net/ipv4/ip_unprivileged_port_start
sec cpus; nproc; grep Cpus_allowed_list /proc/self/status
sec shm; df -k /dev/shm | awk 'NR == 2 { print $2 }'
sec end
exec sleep 100000
`

// view is a probe's report: its lines by section.
type view map[string][]string

func parseView(lines []string) view {
	v := view{}
	sec := ""
	for _, l := range lines {
		if s, ok := strings.CutPrefix(l, "== "); ok {
			sec = s
			v[sec] = []string{}
			continue
		}
		if sec != "" {
			v[sec] = append(v[sec], strings.Join(strings.Fields(l), " "))
		}
	}
	return v
}

// cgroupConsistency replaces the proc-cgroup and cgroup-mounts sections
// with what a program that reads them makes of them (a JVM finds its
// cgroup's files where its mount's root is its cgroup's path): one line
// per hierarchy, its controllers and "reached" or "not mounted". The
// paths themselves are the runtime's to name.
func (v view) cgroupConsistency() {
	roots := map[string]string{}
	for _, l := range v["cgroup-mounts"] {
		if f := strings.Fields(l); len(f) == 2 {
			roots[f[0]] = f[1]
		}
	}
	var out []string
	for _, l := range v["proc-cgroup"] {
		parts := strings.SplitN(l, ":", 3)
		if len(parts) != 3 {
			out = append(out, "malformed: "+l)
			continue
		}
		ctls, path := parts[1], parts[2]
		point := "/sys/fs/cgroup"
		if ctls != "" {
			point += "/" + strings.TrimPrefix(ctls, "name=")
		}
		if _, ok := roots[point]; !ok && ctls == "" && len(v["proc-cgroup"]) > 1 {
			point = "/sys/fs/cgroup/unified"
		}
		state := "not mounted"
		if root, ok := roots[point]; ok {
			state = "reached"
			if root != path && root != "/" {
				state = fmt.Sprintf("inconsistent (mount root %s, cgroup %s)", root, path)
			}
		}
		out = append(out, fmt.Sprintf("%s %s", cmpOr(ctls, "cgroup2"), state))
	}
	slices.Sort(out)
	v["proc-cgroup"] = out
	delete(v, "cgroup-mounts")
}

func cmpOr(a, b string) string {
	if a != "" {
		return a
	}
	return b
}

// viewDiff is one line of a section that one runtime shows and the other
// does not: "-" runc's only, "+" stagelet's only.
type viewDiff struct{ section, sign, line string }

func (d viewDiff) String() string { return fmt.Sprintf("%s: %s %s", d.section, d.sign, d.line) }

// diffViews lists the lines of each section that only one view has,
// sections compared as sets.
func diffViews(runc, ours view) []viewDiff {
	var out []viewDiff
	secs := map[string]bool{}
	for s := range runc {
		secs[s] = true
	}
	for s := range ours {
		secs[s] = true
	}
	for s := range secs {
		for _, l := range runc[s] {
			if !slices.Contains(ours[s], l) {
				out = append(out, viewDiff{s, "-", l})
			}
		}
		for _, l := range ours[s] {
			if !slices.Contains(runc[s], l) {
				out = append(out, viewDiff{s, "+", l})
			}
		}
	}
	slices.SortFunc(out, func(a, b viewDiff) int { return strings.Compare(a.String(), b.String()) })
	return out
}

// allowedDiff is a difference from runc that stays, with its reason.
type allowedDiff struct {
	stage1s []string // empty: every stage1
	section string
	sign    string
	prefix  string // of the line
	reason  string
}

func (a allowedDiff) covers(stage1 string, d viewDiff) bool {
	return (len(a.stage1s) == 0 || slices.Contains(a.stage1s, stage1)) &&
		a.section == d.section && a.sign == d.sign && strings.HasPrefix(d.line, a.prefix)
}

// allowedDiffs are the differences from runc that a container under
// stagelet shows, each with its reason (the README lists them too).
var allowedDiffs = []allowedDiff{
	// /dev's usual nodes are bound from the agent's /dev (which works in
	// a user namespace too); runc makes them with mknod. The same nodes.
	{nil, "mounts", "+", "/dev/full ", "bound from the agent's /dev, not made"},
	{nil, "mounts", "+", "/dev/null ", "bound from the agent's /dev, not made"},
	{nil, "mounts", "+", "/dev/random ", "bound from the agent's /dev, not made"},
	{nil, "mounts", "+", "/dev/tty ", "bound from the agent's /dev, not made"},
	{nil, "mounts", "+", "/dev/urandom ", "bound from the agent's /dev, not made"},
	{nil, "mounts", "+", "/dev/zero ", "bound from the agent's /dev, not made"},
	// Masked files are covered with the agent's /dev/null, a node of
	// the node's devtmpfs (fly) or the guest's (kvm); runc's is its own
	// /dev's. The same device.
	{[]string{"fly", "kvm"}, "mounts", "+", "/proc/keys devtmpfs ", "masked with the agent's /dev/null"},
	{[]string{"fly", "kvm"}, "mounts", "+", "/proc/timer_list devtmpfs ", "masked with the agent's /dev/null"},
	{[]string{"fly", "kvm"}, "mounts", "-", "/proc/keys tmpfs ", "masked with the agent's /dev/null"},
	{[]string{"fly", "kvm"}, "mounts", "-", "/proc/timer_list tmpfs ", "masked with the agent's /dev/null"},
	// The tmpfs that holds the v1 hierarchies is read-only too; runc
	// 1.1 leaves it writable (what is written there reaches no cgroup).
	{nil, "mounts", "+", "/sys/fs/cgroup tmpfs ro", "the hierarchies' tmpfs is read-only"},
	{nil, "mounts", "-", "/sys/fs/cgroup tmpfs rw", "the hierarchies' tmpfs is read-only"},
	// A pod in the node's IPC namespace gets a /dev/shm of its own; runc
	// binds the node's (noticed, not yet changed).
	{[]string{"fly"}, "shm", "+", "65536", "a host-IPC pod's /dev/shm is its own"},
	{[]string{"fly"}, "shm", "-", "", "a host-IPC pod's /dev/shm is its own"},
	// A VM pod's container sees the guest: its CPUs are the VM's vCPUs,
	// its cgroups the guest's (cpu and cpuacct mounted together; no
	// blkio, cpuset, devices or name=systemd hierarchy: the VM's devices
	// are its own), where its limits are enforced; the pod's files reach
	// it over the pod's 9p share.
	{[]string{"kvm"}, "mounts", "-", "/proc/keys ", "the guest's kernel has no keys"},
	{[]string{"kvm"}, "cpus", "+", "", "a VM's vCPUs"},
	{[]string{"kvm"}, "cpus", "-", "", "a VM's vCPUs"},
	{[]string{"kvm"}, "cgroup-dir", "+", "cpu,cpuacct", "the guest's hierarchies"},
	{[]string{"kvm"}, "cgroup-dir", "-", "", "the guest's hierarchies"},
	{[]string{"kvm"}, "mounts", "+", "/sys/fs/cgroup/cpu,cpuacct ", "the guest's hierarchies"},
	{[]string{"kvm"}, "mounts", "-", "/sys/fs/cgroup/", "the guest's hierarchies"},
	{[]string{"kvm"}, "proc-cgroup", "+", "cpu,cpuacct reached", "the guest's hierarchies"},
	{[]string{"kvm"}, "proc-cgroup", "-", "", "the guest's hierarchies"},
	{[]string{"kvm"}, "mounts", "+", "/etc/hostname 9p ", "the pod's files over its 9p share"},
	{[]string{"kvm"}, "mounts", "+", "/etc/hosts 9p ", "the pod's files over its 9p share"},
	{[]string{"kvm"}, "mounts", "+", "/etc/resolv.conf 9p ", "the pod's files over its 9p share"},
	{[]string{"kvm"}, "mounts", "-", "/etc/hostname ", "the pod's files over its 9p share"},
	{[]string{"kvm"}, "mounts", "-", "/etc/hosts ", "the pod's files over its 9p share"},
	{[]string{"kvm"}, "mounts", "-", "/etc/resolv.conf ", "the pod's files over its 9p share"},
}

// runcRuntime is a containerd with runc, started by the node e2e kit's
// containerd-up.sh, the reference for what a container sees.
type runcRuntime struct {
	rt   runtimeapi.RuntimeServiceClient
	img  runtimeapi.ImageServiceClient
	logs string
}

// startContainerd starts a private containerd that pulls from reg, or
// skips saying why it cannot. It is stopped, and what it left removed,
// at cleanup.
func startContainerd(t *testing.T, reg *testregistry.Registry) *runcRuntime {
	t.Helper()
	root, err := harness.ModuleRoot()
	if err != nil {
		t.Fatal(err)
	}
	kit := filepath.Join(root, "..", "shared", "nodee2e")
	if _, err := os.Stat(filepath.Join(kit, "containerd-up.sh")); err != nil {
		t.Skipf("no containerd kit beside the checkout (%v)", err)
	}
	for _, tool := range []string{"containerd", "runc"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("no %s (make test-deps installs it): %v", tool, err)
		}
	}
	dir, err := os.MkdirTemp("", "se2e-ctrd-")
	if err != nil {
		t.Fatal(err)
	}
	env := append(os.Environ(), "REGISTRY="+reg.Host, "SUBNET=10.89.77", "BRIDGE=se2ectrd0", "CRICTL=/nonexistent")
	t.Cleanup(func() {
		cmd := exec.Command("bash", filepath.Join(kit, "containerd-down.sh"), dir)
		cmd.Env = env
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Errorf("containerd-down: %v: %s", err, out)
		}
		if err := os.RemoveAll(dir); err != nil {
			t.Errorf("remove containerd's directory: %v", err)
		}
	})
	// The sandbox image it asks for.
	reg.Push(t, "pause", "3.10.1", testregistry.WithConfig(testregistry.BusyboxImage(t), []string{"/bin/sleep", "2147483647"}, nil, ""))
	cmd := exec.Command("bash", filepath.Join(kit, "containerd-up.sh"), dir)
	cmd.Env = env
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("containerd-up: %v: %s", err, out)
	}
	conn, err := grpc.NewClient("unix://"+filepath.Join(dir, "containerd.sock"), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	logs := filepath.Join(dir, "pod-logs")
	if err := os.MkdirAll(logs, 0o755); err != nil {
		t.Fatal(err)
	}
	return &runcRuntime{rt: runtimeapi.NewRuntimeServiceClient(conn), img: runtimeapi.NewImageServiceClient(conn), logs: logs}
}

// probeConfigs are the pod and container the probe runs in: a pod of
// the stage1's namespaces that names no hostname and no DNS, a container
// limited to 256 MiB and half a CPU under RuntimeDefault.
func probeConfigs(image, logDir string, s podStage1) (*runtimeapi.PodSandboxConfig, *runtimeapi.ContainerConfig) {
	ns := s.podNetNS()
	pod := &runtimeapi.PodSandboxConfig{
		Metadata:     &runtimeapi.PodSandboxMetadata{Name: "view-" + s.handler, Uid: randHex(16), Namespace: "e2e"},
		LogDirectory: logDir,
		Linux: &runtimeapi.LinuxPodSandboxConfig{
			CgroupParent:    "",
			SecurityContext: &runtimeapi.LinuxSandboxSecurityContext{NamespaceOptions: ns},
		},
	}
	ctr := &runtimeapi.ContainerConfig{
		Metadata: &runtimeapi.ContainerMetadata{Name: "probe"},
		Image:    &runtimeapi.ImageSpec{Image: image},
		Command:  []string{"sh", "-c", viewProbe},
		LogPath:  "probe.log",
		Linux: &runtimeapi.LinuxContainerConfig{
			Resources: &runtimeapi.LinuxContainerResources{MemoryLimitInBytes: 256 << 20, CpuQuota: 50000, CpuPeriod: 100000, CpuShares: 512},
			SecurityContext: &runtimeapi.LinuxContainerSecurityContext{
				NamespaceOptions: ns,
				Seccomp:          &runtimeapi.SecurityProfile{ProfileType: runtimeapi.SecurityProfile_RuntimeDefault},
				// As the kubelet sends them (procMount Default).
				MaskedPaths:   slices.Clone(supervisor.DefaultMaskedPaths),
				ReadonlyPaths: slices.Clone(supervisor.DefaultReadonlyPaths),
			},
		},
	}
	return pod, ctr
}

// runProbe runs the probe on a CRI runtime and returns its report once
// complete; the pod is removed at cleanup.
func runProbe(t *testing.T, rt runtimeapi.RuntimeServiceClient, handler, logRoot, image string, s podStage1) view {
	t.Helper()
	logDir, err := os.MkdirTemp(logRoot, "view-")
	if err != nil {
		t.Fatal(err)
	}
	pod, ctr := probeConfigs(image, logDir, s)
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	resp, err := rt.RunPodSandbox(ctx, &runtimeapi.RunPodSandboxRequest{Config: pod, RuntimeHandler: handler})
	if err != nil {
		t.Fatalf("RunPodSandbox: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
		defer cancel()
		if _, err := rt.StopPodSandbox(ctx, &runtimeapi.StopPodSandboxRequest{PodSandboxId: resp.PodSandboxId}); err != nil {
			t.Errorf("StopPodSandbox: %v", err)
		}
		if _, err := rt.RemovePodSandbox(ctx, &runtimeapi.RemovePodSandboxRequest{PodSandboxId: resp.PodSandboxId}); err != nil {
			t.Errorf("RemovePodSandbox: %v", err)
		}
	})
	c, err := rt.CreateContainer(ctx, &runtimeapi.CreateContainerRequest{PodSandboxId: resp.PodSandboxId, Config: ctr, SandboxConfig: pod})
	if err != nil {
		t.Fatalf("CreateContainer: %v", err)
	}
	if _, err := rt.StartContainer(ctx, &runtimeapi.StartContainerRequest{ContainerId: c.ContainerId}); err != nil {
		t.Fatalf("StartContainer: %v", err)
	}
	path := filepath.Join(logDir, "probe.log")
	for {
		data, _ := os.ReadFile(path)
		if lines, err := harness.ParseCRILog(data); err == nil {
			out := harness.JoinPartial(lines, "stdout")
			if slices.Contains(out, "== end") {
				v := parseView(out)
				v.cgroupConsistency()
				return v
			}
		}
		select {
		case <-ctx.Done():
			t.Fatalf("the probe did not finish; its log so far:\n%s", data)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// TestSeenAsUnderRunc: a program in a container sees what it would see
// under containerd and runc on this node (its cgroup limits, cgroups,
// resource limits, environment, names, hosts, umask, capabilities,
// seccomp, OOM score, devices, mounts, sysctls, CPUs, /dev/shm), on every
// stage1, but for the differences allowedDiffs lists with their reasons.
func TestSeenAsUnderRunc(t *testing.T) {
	requireRoot(t)
	opts := harness.Options{Policy: allStage1sPolicy}
	stage1s := []podStage1{flyStage1, nspawnStage1, kvmStage1}
	if os.Getenv("STAGELET_GUEST_ASSETS") == "" {
		t.Log("no kvm guest assets (make guest): kvm is not compared")
		stage1s = stage1s[:2]
	}
	e := newEnvOpts(t, opts, true)
	ctrd := startContainerd(t, e.reg)
	if _, err := ctrd.img.PullImage(e.ctx(), &runtimeapi.PullImageRequest{Image: &runtimeapi.ImageSpec{Image: e.image}}); err != nil {
		t.Fatalf("containerd: pull %s: %v", e.image, err)
	}
	refs := map[runtimeapi.NamespaceMode]view{}
	for _, s := range stage1s {
		t.Run(s.handler, func(t *testing.T) {
			ref, ok := refs[s.pid]
			if !ok {
				ref = runProbe(t, ctrd.rt, "", ctrd.logs, e.image, s)
				refs[s.pid] = ref
			}
			ours := runProbe(t, e.rt(), s.handler, e.d.LogsDir, e.image, s)
			if os.Getenv("VIEW_DUMP") != "" {
				t.Logf("runc: %q\nours: %q", ref, ours)
			}
			var unexplained []string
			for _, d := range diffViews(ref, ours) {
				if !slices.ContainsFunc(allowedDiffs, func(a allowedDiff) bool { return a.covers(s.handler, d) }) {
					unexplained = append(unexplained, d.String())
				}
			}
			if len(unexplained) > 0 {
				t.Errorf("%d differences from runc that no allowed difference explains (- runc's, + %s's):\n%s", len(unexplained), s.handler, strings.Join(unexplained, "\n"))
			}
		})
	}
}
