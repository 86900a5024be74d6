package node

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/internal/testutil"
)

// TestVMMConfined runs in both node VMs (make test-node, AppArmor; make
// test-node-selinux, SELinux) with a VM pod A (kvm, its VM under TCG
// inside the node VM's) and a pod B on nspawn. A's qemu runs confined —
// as container_kvm_t at A's level where SELinux enforces (ps -Z; A's VM
// directory container_file_t at that level, ls -Z), under a profile of
// A's own where AppArmor does — and a guest that took over its qemu is
// played by QMP, through which qemu is told to open files: A's own
// console log opens, B's root file and B's log are denied (qemu runs as
// root, so what refuses is the module), each with the kernel's audit
// line naming A's confinement and B's file. A container created in A has
// its log directory labelled A's. Nothing else is denied on the way, and
// A's profile goes with A. A's container is not started: a container
// call in a VM emulated inside an emulated VM outlasts the daemon's
// 30-second bound on agent calls.
func TestVMMConfined(t *testing.T) {
	e := nodeEnv(t)
	guestDir := os.Getenv("STAGELET_GUEST")
	if guestDir == "" {
		t.Skip("needs the kvm guest (scripts/test-node.sh puts it in the payload when GUEST names it)")
	}
	selinuxOn := os.Getenv("STAGELET_NODE_SELINUX") != ""
	if !selinuxOn {
		if b, err := os.ReadFile("/sys/module/apparmor/parameters/enabled"); err != nil || !bytes.HasPrefix(b, []byte("Y")) {
			t.Fatalf("AppArmor is not enabled in the node VM (%v)", err)
		}
	}
	// The guest beside the binary, where the daemon looks for it; TCG,
	// as no KVM reaches this VM, whose own CPU is emulated: a VM inside
	// it boots in about a minute.
	installGuest(t, guestDir, "/usr/local/bin/guest")
	if err := os.MkdirAll(configDir, 0o755); err != nil {
		t.Fatal(err)
	}
	cfg := filepath.Join(configDir, "vmm.yaml")
	if err := os.WriteFile(cfg, []byte("version: 1\nkvm:\n  accelerator: tcg\n  boot_timeout: 5m\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	e.install(t, "--config "+cfg)
	t.Cleanup(func() {
		if t.Failed() {
			// What a confined qemu was refused, and what it said.
			t.Logf("denials since the start:\n%s\n%s", strings.Join(auditLines(start, appArmorDenied), "\n"), strings.Join(auditLines(start, avcDenied), "\n"))
			logs, _ := filepath.Glob("/run/stagelet/pods/*/vm/qemu.log")
			for _, l := range logs {
				b, _ := os.ReadFile(l)
				t.Logf("%s:\n%s", l, b)
			}
		}
		stopService(t)
		os.RemoveAll(dropInDir)
		os.Remove(cfg)
		run(t, "systemctl", "daemon-reload")
	})
	rt, img := client(t)
	ref := pullBusybox(t, img)

	b := startPod(t, rt, ref, "vmm-b", "default", "", "")
	b.check(t, rt, "vmm-b")
	execIn(t, rt, b, "echo secret-of-b > /secret")
	a := startSandbox(t, rt, "vmm-a", "default", "kvm", "")
	aDir := filepath.Join("/run/stagelet/pods", a.id, "vm")
	own := filepath.Join(aDir, "console.log")
	if b, err := os.ReadFile(own); err != nil || len(b) == 0 {
		t.Errorf("pod A's console log: %v, %d bytes", err, len(b))
	}
	secret := filepath.Join(rootfsOf(t, b.ctr), "secret")
	blog := filepath.Join(b.logDir, "app.log")
	qemu := qemuPID(t, a.id)
	profile := "stagelet-vm-" + a.id

	var aLevel, bLevel string
	if selinuxOn {
		aLevel, bLevel = podLevel(t, rt, a), podLevel(t, rt, b)
		checkProcessLabel(t, qemu, "container_kvm_t", aLevel)
		checkFileLabel(t, own, "container_file_t", aLevel)
		checkFileLabel(t, aDir, "container_file_t", aLevel)
		checkFileLabel(t, filepath.Join(aDir, "qmp.sock"), "container_file_t", aLevel)
		noDenials(t, start, "a VM pod's start")
	} else {
		if !profileLoaded(t, profile) {
			t.Errorf("pod A's qemu profile %s is not loaded", profile)
		}
		if got := strings.TrimSpace(readTrim(t, fmt.Sprintf("/proc/%d/attr/current", qemu))); got != profile+" (enforce)" {
			t.Errorf("pod A's qemu (pid %d) runs under %q, want %s (enforce)", qemu, got, profile)
		}
		if l := auditLines(start, appArmorDenied); len(l) > 0 {
			t.Errorf("a VM pod's start: %d AppArmor denials, want none:\n%s", len(l), strings.Join(l, "\n"))
		}
	}

	// qemu, told over QMP to open files: its own pod's opens, pod B's
	// root and log are denied, which root unconfined (this test) reads.
	for path, want := range map[string]string{secret: "secret-of-b", blog: "hello from vmm-b"} {
		if b, err := os.ReadFile(path); err != nil || !strings.Contains(string(b), want) {
			t.Fatalf("root unconfined reading pod B's %s: %v %q", path, err, b)
		}
	}
	since := time.Now()
	q := dialQMP(t, filepath.Join(aDir, "qmp.sock"))
	if err := q.open("own", own); err != nil {
		t.Errorf("pod A's qemu opening A's own console log %s: %v", own, err)
	}
	for i, path := range []string{secret, blog} {
		err := q.open(fmt.Sprintf("other%d", i), path)
		if err == nil || !strings.Contains(err.Error(), "Permission denied") {
			t.Errorf("pod A's qemu opening pod B's %s: %v, want Permission denied", path, err)
		}
	}
	if selinuxOn {
		waitAVC(t, "the AVC of A's qemu opening B's root file", since,
			"scontext=system_u:system_r:container_kvm_t:"+aLevel+" ", "tcontext=system_u:object_r:container_file_t:"+bLevel+" ")
		// B's log directory is the test's, in /tmp, which qemu may not
		// even search.
		waitAVC(t, "the AVC of A's qemu opening B's log", since,
			"scontext=system_u:system_r:container_kvm_t:"+aLevel+" ", "tcontext=system_u:object_r:tmp_t:s0 ")
	} else {
		waitAudit(t, "the AppArmor denial of A's qemu opening B's root file", since, `profile="`+profile+`"`, `name="`+secret+`"`)
		waitAudit(t, "the AppArmor denial of A's qemu opening B's log", since, `profile="`+profile+`"`, `name="`+blog+`"`)
	}
	q.close()

	// A container of A: its root is A's. Its log directory stays as it
	// was: the daemon writes the logs the guest sends, not qemu. (Its
	// start, a container call in the inner VM, outlasts the agent's
	// bound here: created only.)
	marker := appArmorDenied
	if selinuxOn {
		marker = avcDenied
	}
	before := auditLines(since, marker) // the denials just provoked
	logLabel := ""
	if selinuxOn {
		logLabel, _, _ = strings.Cut(run(t, "ls", "-Zd", a.logDir), " ")
	}
	cr, err := rt.CreateContainer(ctx(t), &runtimeapi.CreateContainerRequest{
		PodSandboxId: a.id, SandboxConfig: a.cfg,
		Config: &runtimeapi.ContainerConfig{
			Metadata: &runtimeapi.ContainerMetadata{Name: "app"},
			Image:    &runtimeapi.ImageSpec{Image: ref},
			Command:  []string{"true"},
			LogPath:  "app.log",
		},
	})
	if err != nil {
		t.Fatalf("CreateContainer in pod A: %v", err)
	}
	if selinuxOn {
		if l, _, _ := strings.Cut(run(t, "ls", "-Zd", a.logDir), " "); l != logLabel {
			t.Errorf("ls -Z: pod A's log directory %s was relabelled %q (was %q): qemu does not write logs", a.logDir, l, logLabel)
		}
		checkFileLabel(t, rootfsOf(t, cr.ContainerId), "container_file_t", aLevel)
	}
	if l := auditLinesBut(since, marker, before); len(l) > 0 {
		t.Errorf("a container's creation in a VM pod: %d denials, want none:\n%s", len(l), strings.Join(l, "\n"))
	}

	a.remove(t, rt)
	b.remove(t, rt)
	if !selinuxOn && profileLoaded(t, profile) {
		t.Errorf("pod A is removed and its qemu profile %s is still loaded", profile)
	}
}

// installGuest copies the kvm guest's files from dir to to, removed when
// the test ends.
func installGuest(t *testing.T, dir, to string) {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(to, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(to) })
	for _, e := range ents {
		if e.Type().IsRegular() {
			if err := copyFile(filepath.Join(dir, e.Name()), filepath.Join(to, e.Name()), 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// execIn runs script in pod p's container, which must succeed.
func execIn(t *testing.T, rt runtimeapi.RuntimeServiceClient, p *pod, script string) {
	t.Helper()
	ex, err := rt.ExecSync(ctx(t), &runtimeapi.ExecSyncRequest{ContainerId: p.ctr, Cmd: []string{"sh", "-c", script}, Timeout: 60})
	if err != nil || ex.ExitCode != 0 {
		t.Fatalf("%s in pod %s: %v %s", script, p.cfg.Metadata.Name, err, ex.GetStderr())
	}
}

// rootfsOf is where the root file system of container ctr is mounted on
// the node: the overlay mount whose mount point names the container.
func rootfsOf(t *testing.T, ctr string) string {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		// ID parent major:minor root mountpoint options ... - fstype ...
		f := strings.Fields(l)
		_, post, ok := strings.Cut(l, " - ")
		if !ok || len(f) < 5 || !strings.HasPrefix(post, "overlay ") || !strings.Contains(f[4], ctr) {
			continue
		}
		return f[4]
	}
	t.Fatalf("no overlay mount of container %s:\n%s", ctr, b)
	return ""
}

// qemuPID is the pid of the qemu of VM pod id (named stagelet-<id>).
func qemuPID(t *testing.T, id string) int {
	t.Helper()
	pid := processWhere(func(_ int, cmdline []byte) bool {
		return bytes.Contains(cmdline, []byte("\x00-name\x00stagelet-"+id+"\x00"))
	})
	if pid == 0 {
		t.Fatalf("no qemu of pod %s", id)
	}
	return pid
}

// qmpConn is a QMP session with a VM's qemu, as a guest that took over
// its qemu would have it: whatever qemu may do.
type qmpConn struct {
	t    *testing.T
	conn net.Conn
	r    *bufio.Reader
}

func dialQMP(t *testing.T, path string) *qmpConn {
	t.Helper()
	var conn net.Conn
	testutil.WaitFor(t, 30*time.Second, "qemu's QMP socket "+path, func() (bool, string) {
		var err error
		conn, err = net.Dial("unix", path)
		return err == nil, fmt.Sprint(err)
	})
	q := &qmpConn{t: t, conn: conn, r: bufio.NewReader(conn)}
	if _, err := q.r.ReadBytes('\n'); err != nil { // the greeting
		t.Fatalf("QMP greeting: %v", err)
	}
	if _, err := q.run("qmp_capabilities", nil); err != nil {
		t.Fatalf("QMP: %v", err)
	}
	return q
}

// run sends one command and returns its result, or its error as an
// error; events in between are skipped.
func (q *qmpConn) run(cmd string, args map[string]any) (json.RawMessage, error) {
	q.t.Helper()
	msg := map[string]any{"execute": cmd}
	if args != nil {
		msg["arguments"] = args
	}
	req, _ := json.Marshal(msg)
	q.conn.SetDeadline(time.Now().Add(time.Minute))
	if _, err := q.conn.Write(append(req, '\n')); err != nil {
		q.t.Fatalf("QMP %s: %v", cmd, err)
	}
	for {
		line, err := q.r.ReadBytes('\n')
		if err != nil {
			q.t.Fatalf("QMP %s: %v", cmd, err)
		}
		var m struct {
			Return json.RawMessage `json:"return"`
			Error  *struct {
				Desc string `json:"desc"`
			} `json:"error"`
		}
		if err := json.Unmarshal(line, &m); err != nil {
			q.t.Fatalf("QMP %s: %v: %s", cmd, err, line)
		}
		if m.Error != nil {
			return nil, fmt.Errorf("%s", m.Error.Desc)
		}
		if m.Return != nil {
			return m.Return, nil
		}
	}
}

// open has qemu open path read-only, as a block device node, and closes
// it again when it did.
func (q *qmpConn) open(node, path string) error {
	q.t.Helper()
	_, err := q.run("blockdev-add", map[string]any{"driver": "file", "node-name": node, "filename": path, "read-only": true, "locking": "off"})
	if err != nil {
		return err
	}
	if _, err := q.run("blockdev-del", map[string]any{"node-name": node}); err != nil {
		q.t.Errorf("QMP blockdev-del %s: %v", node, err)
	}
	return nil
}

func (q *qmpConn) close() { q.conn.Close() }
