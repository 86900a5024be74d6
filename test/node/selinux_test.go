package node

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/internal/testutil"
)

// TestSELinux runs in the SELinux variant of the node VM (make
// test-node-selinux), enforcing Debian's reference policy with
// contrib/selinux's module: pods on nspawn and on fly each get an MCS
// level of their own, their processes run as container_t at it (ps -Z)
// and their root file systems are container_file_t at it (ls -Z), as
// verbose status says; a container of pod A (fly, in the node's PID
// namespace) cannot read pod B's (nspawn) files through /proc/PID/root,
// nor B's log through a host path it mounts without relabelling, each
// with the kernel's AVC, while a privileged container of pod A (spc_t)
// reads both, so that what stops A is SELinux, not its namespaces; a
// volume that asks for selinux_relabel is A's to write; the levels of
// pods alive over a restart of the daemon are not given again; a type
// the policy lacks is refused, naming it; and nothing else is denied.
func TestSELinux(t *testing.T) {
	e := nodeEnv(t)
	if os.Getenv("STAGELET_NODE_SELINUX") == "" {
		t.Skip("runs in the node VM's SELinux variant (make test-node-selinux)")
	}
	if mode := run(t, "getenforce"); mode != "Enforcing" {
		t.Fatalf("getenforce says %s in the SELinux variant of the node VM, want Enforcing", mode)
	}
	if mods := run(t, "semodule", "-l"); !regexp.MustCompile(`(?m)^stagelet\b`).MatchString(mods) {
		t.Fatalf("the stagelet policy module is not loaded:\n%s", mods)
	}
	if err := os.WriteFile("/sys/fs/selinux/context", []byte("system_u:system_r:spc_t:s0"), 0); err != nil {
		t.Errorf("the policy does not know privileged containers' context system_u:system_r:spc_t:s0: %v", err)
	}
	start := time.Now()
	e.install(t, "")
	t.Cleanup(func() { stopService(t) })
	rt, img := client(t)
	out, err := exec.Command(e.bin, "doctor").CombinedOutput()
	if d := strings.Join(strings.Fields(string(out)), " "); !strings.Contains(d, "SELinux enforcing, containers run as container_t") {
		t.Errorf("stagelet doctor (%v) does not report SELinux enforcing with container contexts:\n%s", err, out)
	}
	ref := pullBusybox(t, img)

	// Pod B on nspawn: a file of its own in its root, its log.
	b := startPod(t, rt, ref, "se-b", "default", "", "")
	b.check(t, rt, "se-b")
	bLevel := podLevel(t, rt, b)
	bPID := appPID(t, rt, b, "sleep 100000", "se-b")
	ex, err := rt.ExecSync(ctx(t), &runtimeapi.ExecSyncRequest{ContainerId: b.ctr, Cmd: []string{"sh", "-c", "echo secret-of-b > /secret"}, Timeout: 30})
	if err != nil || ex.ExitCode != 0 {
		t.Fatalf("writing a file in pod B's root: %v %s", err, ex.GetStderr())
	}
	checkProcessLabel(t, bPID, "container_t", bLevel)
	checkFileLabel(t, fmt.Sprintf("/proc/%d/root/secret", bPID), "container_file_t", bLevel)
	checkFileLabel(t, fmt.Sprintf("/proc/%d/root/bin/sh", bPID), "container_file_t", bLevel)

	// Pod A on fly, in the node's PID namespace: it sees B's processes.
	a := startPod(t, rt, ref, "se-a", "kube-system", "fly", "")
	a.check(t, rt, "se-a")
	aLevel := podLevel(t, rt, a)
	if aLevel == bLevel {
		t.Fatalf("pods A and B both have level %s", aLevel)
	}
	checkProcessLabel(t, appPID(t, rt, a, "sleep 100000", "se-a"), "container_t", aLevel)

	// A volume that asks to be relabelled is A's: it writes there.
	vol := filepath.Join("/var/lib", fmt.Sprintf("stagelet-test-volume-%d", time.Now().UnixNano()))
	if err := os.MkdirAll(vol, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(vol) })
	relabelled := runMounts(t, rt, a, ref, "relabelled", "echo written > /vol/f && cat /vol/f", nil,
		[]*runtimeapi.Mount{{ContainerPath: "/vol", HostPath: vol, SelinuxRelabel: true}})
	if !strings.Contains(relabelled, "written") {
		t.Errorf("a volume with selinux_relabel: want it written, got:\n%s", relabelled)
	}
	checkFileLabel(t, filepath.Join(vol, "f"), "container_file_t", aLevel)
	noDenials(t, start, "the pods' happy path")

	// The fence: A's container reads B's root through /proc/PID/root and
	// B's log through a host path without relabelling; privileged, it
	// can, so what stops it is SELinux.
	secret := fmt.Sprintf("/proc/%d/root/secret", bPID)
	script := "cat /proc/self/attr/current; echo; cat " + secret + "; cat /blog/app.log"
	logMount := []*runtimeapi.Mount{{ContainerPath: "/blog", HostPath: b.logDir, Readonly: true}}
	since := time.Now()
	fenced := runMounts(t, rt, a, ref, "fenced", script, nil, logMount)
	if !strings.Contains(fenced, "container_t:"+aLevel) || strings.Contains(fenced, "secret-of-b") || strings.Contains(fenced, "hello from se-b") ||
		!strings.Contains(fenced, "'"+secret+"': Permission denied") || !strings.Contains(fenced, "'/blog/app.log': Permission denied") {
		t.Errorf("pod A's container (level %s) reading pod B's root and log: want both denied, got:\n%s", aLevel, fenced)
	}
	waitAVC(t, "the AVC of A reading B's root", since, "scontext=system_u:system_r:container_t:"+aLevel, "tcontext=system_u:", ":"+bLevel)
	waitAVC(t, "the AVC of A reading B's log", since, "scontext=system_u:system_r:container_t:"+aLevel, "tmp_t:s0")
	free := runMounts(t, rt, a, ref, "privileged", script, &runtimeapi.LinuxContainerSecurityContext{Privileged: true}, logMount)
	if !strings.Contains(free, "spc_t:s0") || !strings.Contains(free, "secret-of-b") || !strings.Contains(free, "hello from se-b") {
		t.Errorf("pod A's privileged container reading pod B's root and log: want its type spc_t and both read, got:\n%s", free)
	}

	// A type the policy lacks is refused, naming it.
	_, err = rt.CreateContainer(ctx(t), &runtimeapi.CreateContainerRequest{
		PodSandboxId: a.id, SandboxConfig: a.cfg,
		Config: &runtimeapi.ContainerConfig{
			Metadata: &runtimeapi.ContainerMetadata{Name: "no-such-type"},
			Image:    &runtimeapi.ImageSpec{Image: ref},
			Command:  []string{"true"},
			Linux: &runtimeapi.LinuxContainerConfig{SecurityContext: &runtimeapi.LinuxContainerSecurityContext{
				SelinuxOptions: &runtimeapi.SELinuxOption{Type: "stagelet_no_such_t"},
			}},
		},
	})
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "stagelet_no_such_t") {
		t.Errorf("a type the policy lacks: %v, want InvalidArgument naming it", err)
	}

	// Over a restart the live pods keep their levels, and a new pod gets
	// none of them.
	restart(t)
	rt, _ = client(t)
	if got := podLevel(t, rt, b); got != bLevel {
		t.Errorf("pod B's level after a restart is %s, was %s", got, bLevel)
	}
	c := startPod(t, rt, ref, "se-c", "default", "", "")
	c.check(t, rt, "se-c")
	if cLevel := podLevel(t, rt, c); cLevel == aLevel || cLevel == bLevel {
		t.Errorf("a pod started after the restart got level %s, which a live pod holds (A %s, B %s)", cLevel, aLevel, bLevel)
	}
	for _, p := range []*pod{c, a, b} {
		p.remove(t, rt)
	}
}

// podLevel is the MCS level of the pod's process label in its verbose
// status, which must be container_t's.
func podLevel(t *testing.T, rt runtimeapi.RuntimeServiceClient, p *pod) string {
	t.Helper()
	st, err := rt.PodSandboxStatus(ctx(t), &runtimeapi.PodSandboxStatusRequest{PodSandboxId: p.id, Verbose: true})
	if err != nil {
		t.Fatal(err)
	}
	l := st.Info["selinuxProcessLabel"]
	typ, level, ok := splitLabel(l)
	if !ok || typ != "container_t" || !strings.HasPrefix(level, "s0:c") {
		t.Fatalf("pod %s's verbose status says process label %q, want container_t at a level of its own", p.cfg.Metadata.Name, l)
	}
	if m := st.Info["selinuxMountLabel"]; m != "system_u:object_r:container_file_t:"+level {
		t.Errorf("pod %s's mount label is %q, want container_file_t at %s", p.cfg.Metadata.Name, m, level)
	}
	return level
}

// splitLabel splits user:role:type:level into its type and level.
func splitLabel(l string) (typ, level string, ok bool) {
	parts := strings.SplitN(strings.TrimSpace(l), ":", 4)
	if len(parts) != 4 {
		return "", "", false
	}
	return parts[2], parts[3], true
}

// appPID finds the process of pod p's container whose command line is
// cmd, by its cgroup.
func appPID(t *testing.T, rt runtimeapi.RuntimeServiceClient, p *pod, cmd, name string) int {
	t.Helper()
	var pid int
	testutil.WaitFor(t, 30*time.Second, "the process of "+name, func() (bool, string) {
		pid = processWhere(func(n int, cmdline []byte) bool {
			if string(bytes.ReplaceAll(bytes.TrimRight(cmdline, "\x00"), []byte{0}, []byte(" "))) != cmd {
				return false
			}
			cg, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", n))
			return bytes.Contains(cg, []byte(p.id[:12])) || bytes.Contains(cg, []byte(p.ctr[:12]))
		})
		return pid != 0, "no process " + cmd
	})
	return pid
}

// processWhere is a process whose pid and command line (its arguments
// each ended by a NUL) satisfy match; 0 if none does.
func processWhere(match func(pid int, cmdline []byte) bool) int {
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		n, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", n)); err == nil && match(n, b) {
			return n
		}
	}
	return 0
}

// checkProcessLabel checks a process's label as ps -Z shows it.
func checkProcessLabel(t *testing.T, pid int, typ, level string) {
	t.Helper()
	l := run(t, "ps", "-o", "label=", "-p", strconv.Itoa(pid))
	if gt, gl, ok := splitLabel(l); !ok || gt != typ || gl != level {
		t.Errorf("ps -Z: process %d runs as %q, want %s at %s", pid, l, typ, level)
	}
}

// checkFileLabel checks a file's label as ls -Z shows it.
func checkFileLabel(t *testing.T, path, typ, level string) {
	t.Helper()
	l, _, _ := strings.Cut(run(t, "ls", "-Zd", path), " ")
	if gt, gl, ok := splitLabel(l); !ok || gt != typ || gl != level {
		t.Errorf("ls -Z: %s is %q, want %s at %s", path, l, typ, level)
	}
}

// noDenials fails on any SELinux denial since since.
func noDenials(t *testing.T, since time.Time, what string) {
	t.Helper()
	if l := auditLines(since, avcDenied); len(l) > 0 {
		t.Errorf("%s: %d SELinux denials, want none:\n%s", what, len(l), strings.Join(l, "\n"))
	}
}

// waitAVC waits for an SELinux denial logged at since or later holding
// all of parts.
func waitAVC(t *testing.T, what string, since time.Time, parts ...string) {
	t.Helper()
	waitAuditLine(t, what, since, avcDenied, parts...)
}

// runMounts runs script in a new container of pod p with the security
// context sc and mounts, waits for it to exit and returns its log.
func runMounts(t *testing.T, rt runtimeapi.RuntimeServiceClient, p *pod, ref, name, script string, sc *runtimeapi.LinuxContainerSecurityContext, mounts []*runtimeapi.Mount) string {
	t.Helper()
	return runContainer(t, rt, p, &runtimeapi.ContainerConfig{
		Metadata: &runtimeapi.ContainerMetadata{Name: name},
		Image:    &runtimeapi.ImageSpec{Image: ref},
		Command:  []string{"sh", "-c", script},
		LogPath:  name + ".log",
		Mounts:   mounts,
		Linux:    &runtimeapi.LinuxContainerConfig{SecurityContext: sc},
	})
}
