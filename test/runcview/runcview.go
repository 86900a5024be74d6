// Package runcview compares what a program in a container sees under
// stagelet with what it sees under containerd and runc on the same node:
// a probe (a shell script of busybox) reports its cgroup files and
// hierarchies, /proc/self/cgroup against its mounts, every rlimit, its
// environment, names, /etc files, umask, capabilities, no_new_privs,
// seccomp, OOM score, /dev, mounts, two network sysctls, CPUs and
// /dev/shm, section by section; Diff lists what only one runtime shows,
// and AllowedDiffs the differences that stay, each with its reason. Used
// by test/e2e on this host and by test/node in the cgroup v2 node VM.
package runcview

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
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

// Probe is what a container reports of its world, section by
// section, then it waits: the cgroup files of its limits, its cgroups,
// every resource limit, its environment, names, hosts, umask,
// capabilities, no_new_privs, seccomp mode, OOM score, /dev, its mounts,
// two network sysctls, its CPUs and /dev/shm's size.
const Probe = `sec() { echo "== $1"; }
sec cgroup-files
for f in memory/memory.limit_in_bytes cpu/cpu.cfs_quota_us cpu/cpu.cfs_period_us cpu/cpu.shares pids/pids.max memory.max cpu.max cpu.weight pids.max; do
	[ -f /sys/fs/cgroup/$f ] && echo "$f $(cat /sys/fs/cgroup/$f)"
done
sec cgroup-dir; ls /sys/fs/cgroup
sec proc-cgroup; cat /proc/self/cgroup
sec cgroup-mounts; awk '$5 ~ "^/sys/fs/cgroup" { print $5, $4 }' /proc/self/mountinfo
sec limits; tail -n +2 /proc/self/limits
sec env; env | grep -E '^(HOME|PATH|HOSTNAME|TERM)=' | sort
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

// reported are the sections a probe always fills, in any container.
var reported = []string{"proc-cgroup", "limits", "env", "hostname", "etc-hostname", "etc-hosts", "umask", "status", "oom", "dev", "mounts", "sysctl", "cpus", "shm"}

// View is a probe's report: its lines by section.
type View map[string][]string

// Parse reads a probe's output lines into its sections, each line's
// fields joined by one space.
func Parse(lines []string) View {
	v := View{}
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

// podFiles are the files a runtime binds into every container from the
// pod's own (hostname, hosts, resolv.conf).
var podFiles = []string{"/etc/hostname", "/etc/hosts", "/etc/resolv.conf"}

// podFileMounts names the file system of each bind of a pod file
// "(pod file)": which one a runtime keeps them on (a disk, /run's tmpfs,
// a VM's 9p share) is its own.
func (v View) podFileMounts() {
	for i, l := range v["mounts"] {
		if f := strings.Fields(l); len(f) == 3 && slices.Contains(podFiles, f[0]) {
			v["mounts"][i] = f[0] + " (pod file) " + f[2]
		}
	}
}

// cgroupConsistency replaces the proc-cgroup and cgroup-mounts sections
// with what a program that reads them makes of them (a JVM finds its
// cgroup's files where its mount's root is its cgroup's path): one line
// per hierarchy, its controllers and "reached" or "not mounted". The
// paths themselves are the runtime's to name.
func (v View) cgroupConsistency() {
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
		out = append(out, fmt.Sprintf("%s %s", cmp.Or(ctls, "cgroup2"), state))
	}
	slices.Sort(out)
	v["proc-cgroup"] = out
	delete(v, "cgroup-mounts")
}

// Difference is one line of a section that one runtime shows and the other
// does not: "-" runc's only, "+" stagelet's only.
type Difference struct{ section, sign, line string }

// String is the difference as the test reports it.
func (d Difference) String() string { return fmt.Sprintf("%s: %s %s", d.section, d.sign, d.line) }

// Diff lists the lines of each section that only one view has,
// sections compared as sets.
func Diff(runc, ours View) []Difference {
	var out []Difference
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
				out = append(out, Difference{s, "-", l})
			}
		}
		for _, l := range ours[s] {
			if !slices.Contains(runc[s], l) {
				out = append(out, Difference{s, "+", l})
			}
		}
	}
	slices.SortFunc(out, func(a, b Difference) int { return strings.Compare(a.String(), b.String()) })
	return out
}

// Allowed is a difference from runc that stays, with its reason.
type Allowed struct {
	stage1s []string // empty: every stage1
	section string
	sign    string
	prefix  string // of the line
	reason  string
}

// covers tells whether a explains difference d of stage1's view.
func (a Allowed) covers(stage1 string, d Difference) bool {
	return (len(a.stage1s) == 0 || slices.Contains(a.stage1s, stage1)) &&
		a.section == d.section && a.sign == d.sign && strings.HasPrefix(d.line, a.prefix)
}

// AllowedDiffs are the differences from runc that a container under
// stagelet shows, each with its reason (the README lists them too).
var AllowedDiffs = []Allowed{
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
	{[]string{"fly", "kvm"}, "mounts", "+", "/proc/kcore devtmpfs ", "masked with the agent's /dev/null"},
	{[]string{"fly", "kvm"}, "mounts", "-", "/proc/kcore tmpfs ", "masked with the agent's /dev/null"},
	{[]string{"fly", "kvm"}, "mounts", "+", "/proc/keys devtmpfs ", "masked with the agent's /dev/null"},
	{[]string{"fly", "kvm"}, "mounts", "+", "/proc/timer_list devtmpfs ", "masked with the agent's /dev/null"},
	{[]string{"fly", "kvm"}, "mounts", "-", "/proc/keys tmpfs ", "masked with the agent's /dev/null"},
	{[]string{"fly", "kvm"}, "mounts", "-", "/proc/timer_list tmpfs ", "masked with the agent's /dev/null"},
	// On cgroup v2 systemd-nspawn hands its payload only the controllers
	// systemd manages (cpu, cpuset, io, memory, pids): an nspawn pod's
	// containers have no hugetlb, misc or rdma files; fly's have them, as
	// runc's do.
	{[]string{"nspawn"}, "cgroup-dir", "-", "hugetlb.", "nspawn delegates the controllers systemd manages"},
	{[]string{"nspawn"}, "cgroup-dir", "-", "misc.", "nspawn delegates the controllers systemd manages"},
	{[]string{"nspawn"}, "cgroup-dir", "-", "rdma.", "nspawn delegates the controllers systemd manages"},
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
	// are its own), where its limits are enforced.
	{[]string{"kvm"}, "mounts", "-", "/proc/keys ", "the guest's kernel has no keys"},
	{[]string{"kvm"}, "mounts", "+", "/proc/scsi tmpfs ro", "the guest's kernel has SCSI (its image disks), masked as runc masks it where it exists"},
	{[]string{"kvm"}, "cpus", "+", "", "a VM's vCPUs"},
	{[]string{"kvm"}, "cpus", "-", "", "a VM's vCPUs"},
	{[]string{"kvm"}, "cgroup-dir", "+", "cpu,cpuacct", "the guest's hierarchies"},
	{[]string{"kvm"}, "cgroup-dir", "-", "", "the guest's hierarchies"},
	{[]string{"kvm"}, "mounts", "+", "/sys/fs/cgroup/cpu,cpuacct ", "the guest's hierarchies"},
	{[]string{"kvm"}, "mounts", "-", "/sys/fs/cgroup/", "the guest's hierarchies"},
	{[]string{"kvm"}, "proc-cgroup", "+", "cpu,cpuacct reached", "the guest's hierarchies"},
	{[]string{"kvm"}, "proc-cgroup", "-", "", "the guest's hierarchies"},
}

// Pod is where a probe runs: its runtime handler, Kubernetes namespace
// and name, and its Linux namespaces.
type Pod struct {
	Handler, Namespace, Name string
	NS                       *runtimeapi.NamespaceOption
}

// Runtime is a containerd with runc, started by the node e2e kit's
// containerd-up.sh, the reference for what a container sees.
type Runtime struct {
	RT    runtimeapi.RuntimeServiceClient
	Image runtimeapi.ImageServiceClient
	// Logs is a directory for its pods' logs.
	Logs string
}

// StartContainerd starts a private containerd (the node e2e kit's
// containerd-up.sh in kit) that pulls from reg, or skips saying why it
// cannot. It is stopped, and what it left removed, at cleanup.
func StartContainerd(t *testing.T, kit string, reg *testregistry.Registry) *Runtime {
	t.Helper()
	if _, err := os.Stat(filepath.Join(kit, "containerd-up.sh")); err != nil {
		t.Skipf("no containerd kit (%v)", err)
	}
	for _, tool := range []string{"containerd", "runc"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("no %s (make test-deps installs it): %v", tool, err)
		}
	}
	dir, err := os.MkdirTemp("", "runcview-ctrd-")
	if err != nil {
		t.Fatal(err)
	}
	env := append(os.Environ(), "REGISTRY="+reg.Host, "SUBNET=10.89.77", "BRIDGE=rcview0", "CRICTL=/nonexistent")
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
	return &Runtime{RT: runtimeapi.NewRuntimeServiceClient(conn), Image: runtimeapi.NewImageServiceClient(conn), Logs: logs}
}

// Configs are the pod p and the container the probe runs in: a pod that
// names no hostname and no DNS, a container
// limited to 256 MiB and half a CPU under RuntimeDefault, with the
// masked and read-only paths the kubelet sends.
func Configs(image, logDir string, p Pod) (*runtimeapi.PodSandboxConfig, *runtimeapi.ContainerConfig) {
	ns := p.NS
	pod := &runtimeapi.PodSandboxConfig{
		Metadata:     &runtimeapi.PodSandboxMetadata{Name: p.Name, Uid: randHex(16), Namespace: p.Namespace},
		LogDirectory: logDir,
		Linux: &runtimeapi.LinuxPodSandboxConfig{
			CgroupParent:    "",
			SecurityContext: &runtimeapi.LinuxSandboxSecurityContext{NamespaceOptions: ns},
		},
	}
	ctr := &runtimeapi.ContainerConfig{
		Metadata: &runtimeapi.ContainerMetadata{Name: "probe"},
		Image:    &runtimeapi.ImageSpec{Image: image},
		Command:  []string{"sh", "-c", Probe},
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

// Run runs the probe from image (busybox) on a CRI runtime in pod p,
// logging beneath logRoot, and returns its report once complete; the pod
// is removed at cleanup.
func Run(t *testing.T, rt runtimeapi.RuntimeServiceClient, logRoot, image string, p Pod) View {
	t.Helper()
	logDir, err := os.MkdirTemp(logRoot, "view-")
	if err != nil {
		t.Fatal(err)
	}
	pod, ctr := Configs(image, logDir, p)
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	start(t, ctx, rt, p.Handler, pod, ctr)
	path := filepath.Join(logDir, "probe.log")
	for {
		data, _ := os.ReadFile(path)
		if lines, err := harness.ParseCRILog(data); err == nil {
			out := harness.JoinPartial(lines, "stdout")
			if slices.Contains(out, "== end") {
				v := Parse(out)
				// A section the probe failed to fill compares equal to
				// another runtime's failure: every one must say something.
				for _, sec := range reported {
					if len(v[sec]) == 0 {
						t.Fatalf("the probe reported nothing in section %s (a missing applet?); its output:\n%s", sec, strings.Join(out, "\n"))
					}
				}
				v.cgroupConsistency()
				v.podFileMounts()
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

// Unexplained are the differences ds of stage1's view from runc's that no
// AllowedDiffs entry explains.
func Unexplained(stage1 string, ds []Difference) []string {
	var out []string
	for _, d := range ds {
		if !slices.ContainsFunc(AllowedDiffs, func(a Allowed) bool { return a.covers(stage1, d) }) {
			out = append(out, d.String())
		}
	}
	return out
}

func randHex(n int) string {
	b := make([]byte, n/2)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// jvmLimits are what RunJVM's pod and container are limited to, and
// what the JVM must report (JVMReports): 256 MiB and half a CPU.
func jvmLimits() *runtimeapi.LinuxContainerResources {
	return &runtimeapi.LinuxContainerResources{MemoryLimitInBytes: 256 << 20, CpuQuota: 50000, CpuPeriod: 100000}
}

// JVMReports are the lines OpenJDK 17's -XshowSettings:system prints for
// RunJVM's limits, as under runc.
var JVMReports = []string{"Memory Limit: 256.00M", "Effective CPU Count: 1"}

// RunJVM runs `java -XshowSettings:system -version` from image (an
// image holding a JRE, testregistry.PushJRE) on a CRI runtime, in pod p,
// whose container and pod carry its limits
// (the pod's, the sum of its containers', as the kubelet sends it: a VM
// is sized from it), and returns what the JVM printed once it exited 0.
func RunJVM(t *testing.T, rt runtimeapi.RuntimeServiceClient, logRoot, image string, p Pod) string {
	t.Helper()
	logDir, err := os.MkdirTemp(logRoot, "jvm-")
	if err != nil {
		t.Fatal(err)
	}
	pod, ctr := Configs(image, logDir, p)
	pod.Linux.Resources = jvmLimits()
	ctr.Command = []string{"java", "-XshowSettings:system", "-version"}
	ctr.Linux.Resources = jvmLimits()
	// Under TCG (a VM pod here) the JVM starts in many seconds.
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Minute)
	defer cancel()
	id := start(t, ctx, rt, p.Handler, pod, ctr)
	for {
		st, err := rt.ContainerStatus(ctx, &runtimeapi.ContainerStatusRequest{ContainerId: id})
		if err != nil {
			t.Fatalf("ContainerStatus: %v", err)
		}
		if s := st.GetStatus(); s.GetState() == runtimeapi.ContainerState_CONTAINER_EXITED {
			data, _ := os.ReadFile(filepath.Join(logDir, ctr.LogPath))
			lines, err := harness.ParseCRILog(data)
			if err != nil {
				t.Fatalf("the JVM's log: %v", err)
			}
			out := strings.Join(append(harness.JoinPartial(lines, "stdout"), harness.JoinPartial(lines, "stderr")...), "\n")
			if s.GetExitCode() != 0 {
				t.Fatalf("java exited %d:\n%s", s.GetExitCode(), out)
			}
			return out
		}
		select {
		case <-ctx.Done():
			t.Fatalf("java did not exit: %v", ctx.Err())
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// start runs pod and starts ctr in it on rt (handler: the runtime
// handler), and returns the container's ID; the pod is removed at
// cleanup.
func start(t *testing.T, ctx context.Context, rt runtimeapi.RuntimeServiceClient, handler string, pod *runtimeapi.PodSandboxConfig, ctr *runtimeapi.ContainerConfig) string {
	t.Helper()
	resp, err := rt.RunPodSandbox(ctx, &runtimeapi.RunPodSandboxRequest{Config: pod, RuntimeHandler: handler})
	if err != nil {
		t.Fatalf("RunPodSandbox: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
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
	return c.ContainerId
}
