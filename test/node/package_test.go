package node

import (
	"errors"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/moby/sys/mountinfo"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/internal/testutil"
)

// What the package installs and what purging it must remove.
const (
	packagedUnit = "/lib/systemd/system/stagelet.service"
	packagedBin  = "/usr/bin/stagelet"
	stateDir     = "/var/lib/stagelet"
	runDir       = "/run/stagelet"
)

// TestDebianPackage: the package of `make deb` on a node. apt installs it
// (its dependencies already on the node), and the service runs enabled
// with the packaged binary and configuration; a pod it runs keeps running,
// the same processes in the same cgroup, through an upgrade to a higher
// version, whose daemon reattaches to it; remove stops the service and
// keeps the state; purge leaves no unit, state, mount or pod cgroup.
//
// The other tests install the unit of contrib in /etc/systemd/system,
// which would hide the package's: it removes that first, and leaves the
// node without stagelet (each of them installs its own).
func TestDebianPackage(t *testing.T) {
	nodeEnv(t)
	debA, debB := os.Getenv("STAGELET_DEB_A"), os.Getenv("STAGELET_DEB_B")
	if debA == "" || debB == "" {
		t.Fatal("STAGELET_DEB_A and STAGELET_DEB_B must name the packages to install and upgrade to")
	}
	for _, d := range []string{debA, debB} {
		if _, err := os.Stat(d); err != nil {
			t.Fatalf("no package to test (scripts/test-node.sh builds them when NODE_TESTS selects this test): %v", err)
		}
	}
	clearHandInstall(t)
	t.Cleanup(func() {
		if dpkgStatus(t) != "" {
			out, err := exec.Command("apt-get", "purge", "-y", "stagelet").CombinedOutput()
			t.Logf("cleanup: apt-get purge stagelet: %v\n%s", err, out)
		}
	})

	apt(t, "install", "-y", debA)
	checkPackagedService(t)
	checkSELinuxSource(t)
	rt, img := client(t)
	checkGuestFound(t)
	v1 := runtimeVersion(t, rt)
	ref := pullBusybox(t, img)
	p := startPod(t, rt, ref, "deb-pod", "default", "", "")
	p.check(t, rt, "deb-pod")
	app := appCgroup(t, cgroupFS, p.ctr)
	procs := readTrim(t, filepath.Join(app, "cgroup.procs"))
	pid := mainPID(t)

	apt(t, "install", "-y", debB)
	checkPackagedService(t)
	if after := mainPID(t); after == pid {
		t.Errorf("the daemon's PID did not change across the upgrade (%d)", pid)
	}
	rt, _ = client(t)
	checkGuestFound(t)
	if v2 := runtimeVersion(t, rt); v2 == v1 {
		t.Errorf("the daemon's version is %s before and after the upgrade", v1)
	}
	p.check(t, rt, "deb-pod")
	if got := readTrim(t, filepath.Join(app, "cgroup.procs")); got != procs {
		t.Errorf("the container's processes changed across the upgrade: %q, then %q", procs, got)
	}

	// remove: the service stops and its pods go (stagelet gc --all), or,
	// with a binary without gc, the test removes the pod itself first.
	gc := hasGC(t)
	if !gc {
		t.Log("this stagelet has no gc command: the pod is removed through CRI before the package")
		p.remove(t, rt)
	}
	apt(t, "remove", "-y", "stagelet")
	p.removed = true
	if st := dpkgStatus(t); !strings.Contains(st, "config-files") {
		t.Errorf("after remove the package is %q, want config-files", st)
	}
	if got := unitProp(t, unitName, "ActiveState"); got == "active" {
		t.Errorf("the service is %s after remove", got)
	}
	for _, keep := range []string{stateDir, filepath.Join(configDir, "config.yaml")} {
		if _, err := os.Stat(keep); err != nil {
			t.Errorf("remove did not keep %s: %v", keep, err)
		}
	}
	if gc {
		// The pod is gone with its runtime: processes, cgroups, mounts
		// (but the daemon's own netns directory, which purge releases).
		for _, pid := range strings.Fields(procs) {
			if _, err := os.Stat("/proc/" + pid); err == nil {
				t.Errorf("the container's process %s runs after remove", pid)
			}
		}
		noPodCgroups(t)
		noMountsUnder(t, filepath.Join(runDir, "netns"), stateDir, runDir)
	}

	// Purge never deletes through a mount: a directory of the test's,
	// bound beneath /etc/stagelet, keeps its file and /etc/stagelet is
	// left, while the state directories go.
	canary := bindCanary(t, filepath.Join(configDir, "mnt"))
	out := apt(t, "purge", "-y", "stagelet")
	if st := dpkgStatus(t); st != "" {
		t.Errorf("after purge the package is %q, want unknown to dpkg", st)
	}
	if _, err := os.Stat(canary); err != nil {
		t.Errorf("purge deleted through a mount: %v", err)
	}
	if want := configDir + " is left: " + filepath.Join(configDir, "mnt") + " is mounted there"; !strings.Contains(out, want) {
		t.Errorf("purge did not say %q", want)
	}
	run(t, "umount", filepath.Join(configDir, "mnt"))
	if err := os.RemoveAll(configDir); err != nil {
		t.Fatal(err)
	}
	noMountsUnder(t, "", stateDir, runDir)
	noPodCgroups(t)
	for _, gone := range []string{stateDir, runDir, packagedUnit, packagedBin, unitPath,
		"/etc/systemd/system/multi-user.target.wants/" + unitName} {
		if _, err := os.Lstat(gone); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("%s is left after purge (%v)", gone, err)
		}
	}
	if got := unitProp(t, unitName, "LoadState"); got != "not-found" {
		t.Errorf("the unit is %s after purge, want not-found", got)
	}
	// Where pods without a kubelet-given parent go on a systemd without
	// DelegateSubgroup= (Debian 12's); the service's own cgroup goes with
	// the service.
	if _, err := os.Stat(filepath.Join(cgroupFS, "stagelet")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("the pods' cgroup parent /stagelet is left after purge (%v):\n%s", err, cgroupTree(filepath.Join(cgroupFS, "stagelet")))
	}
}

// clearHandInstall stops a service the other tests installed by hand and
// removes their unit and drop-ins, which would hide the package's.
func clearHandInstall(t *testing.T) {
	t.Helper()
	if unitProp(t, unitName, "LoadState") != "not-found" {
		stopService(t)
	}
	for _, p := range []string{unitPath, dropInDir} {
		if err := os.RemoveAll(p); err != nil {
			t.Fatal(err)
		}
	}
	run(t, "systemctl", "daemon-reload")
}

// bindCanary binds a directory of the test's, holding a file, at mnt and
// returns the file's path in the test's directory.
func bindCanary(t *testing.T, mnt string) string {
	t.Helper()
	src := t.TempDir()
	canary := filepath.Join(src, "canary")
	if err := os.WriteFile(canary, []byte("not stagelet's\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(mnt, 0o755); err != nil {
		t.Fatal(err)
	}
	run(t, "mount", "--bind", src, mnt)
	// Unmounted before t.TempDir's removal, which runs later.
	t.Cleanup(func() { exec.Command("umount", mnt).Run() })
	return canary
}

// apt runs apt-get as an operator would, offline: the package's
// dependencies are on the node image. It returns apt-get's output.
func apt(t *testing.T, args ...string) string {
	t.Helper()
	start := time.Now()
	cmd := exec.Command("apt-get", args...)
	cmd.Env = append(os.Environ(), "DEBIAN_FRONTEND=noninteractive")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("apt-get %s: %v\n%s\n%s", strings.Join(args, " "), err, out, journal(t))
	}
	t.Logf("apt-get %s (%.1fs):\n%s", strings.Join(args, " "), time.Since(start).Seconds(), out)
	return string(out)
}

// dpkgStatus is dpkg's status of the package, "" when dpkg does not know it.
func dpkgStatus(t *testing.T) string {
	t.Helper()
	out, err := exec.Command("dpkg-query", "-W", "-f", "${Status}", "stagelet").Output()
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(out))
}

// checkPackagedService: the service runs from the package's unit, enabled,
// with the packaged binary and configuration.
func checkPackagedService(t *testing.T) {
	t.Helper()
	testutil.WaitFor(t, 60*time.Second, "the packaged service to be active", func() (bool, string) {
		s := unitProp(t, unitName, "ActiveState")
		return s == "active", s + "\n" + journal(t)
	})
	if got := unitProp(t, unitName, "FragmentPath"); got != packagedUnit {
		t.Errorf("the service's unit is %s, want %s", got, packagedUnit)
	}
	if got := unitProp(t, unitName, "UnitFileState"); got != "enabled" {
		t.Errorf("the service is %s, want enabled", got)
	}
	exe, err := os.Readlink("/proc/" + unitProp(t, unitName, "MainPID") + "/exe")
	if err != nil || exe != packagedBin {
		t.Errorf("the daemon runs %q (%v), want %s", exe, err, packagedBin)
	}
	if es := unitProp(t, unitName, "ExecStart"); !strings.Contains(es, "--config "+filepath.Join(configDir, "config.yaml")) {
		t.Errorf("the service does not read the packaged configuration: %s", es)
	}
}

// checkSELinuxSource: the package carries the SELinux module's source
// and container contexts, for an SELinux node to build and load.
func checkSELinuxSource(t *testing.T) {
	t.Helper()
	dir := "/usr/share/stagelet/selinux"
	for _, f := range []string{"stagelet.fc", "stagelet.if", "lxc_contexts"} {
		if _, err := os.Stat(filepath.Join(dir, f)); err != nil {
			t.Errorf("the package lacks the SELinux module's %s: %v", f, err)
		}
	}
	te, err := os.ReadFile(filepath.Join(dir, "stagelet.te"))
	if err != nil || !strings.HasPrefix(string(te), "policy_module(stagelet,") {
		t.Errorf("the package's %s/stagelet.te is not stagelet's module (%v): %.60q", dir, err, te)
	}
}

// checkGuestFound: the packaged guest in /usr/lib/stagelet/guest is found
// without configuration: the daemon's start, logged before it answers,
// offers kvm among its stage1s.
func checkGuestFound(t *testing.T) {
	t.Helper()
	id := unitProp(t, unitName, "InvocationID")
	out, err := exec.Command("journalctl", "--no-pager", "-o", "cat", "_SYSTEMD_INVOCATION_ID="+id).CombinedOutput()
	if err != nil {
		t.Fatalf("journalctl: %v\n%s", err, out)
	}
	var serving string
	for _, l := range strings.Split(string(out), "\n") {
		if strings.Contains(l, "stagelet serving") {
			serving = l
		}
	}
	if serving == "" || !strings.Contains(serving, "kvm") || strings.Contains(string(out), "kvm stage1 is not offered") {
		t.Errorf("the packaged daemon does not offer kvm (its guest in /usr/lib/stagelet/guest):\n%s", out)
	}
}

func runtimeVersion(t *testing.T, rt runtimeapi.RuntimeServiceClient) string {
	t.Helper()
	v, err := rt.Version(ctx(t), &runtimeapi.VersionRequest{})
	if err != nil {
		t.Fatal(err)
	}
	return v.RuntimeVersion
}

// hasGC reports whether the installed binary has `stagelet gc`, as the
// package's prerm asks it.
func hasGC(t *testing.T) bool {
	t.Helper()
	out, _ := exec.Command(packagedBin, "help").CombinedOutput()
	return strings.Contains(string(out), "\n  gc ")
}

// noMountsUnder fails for anything mounted at or beneath dirs, but a
// mount at except ("" for none).
func noMountsUnder(t *testing.T, except string, dirs ...string) {
	t.Helper()
	for _, d := range dirs {
		ms, err := mountinfo.GetMounts(mountinfo.PrefixFilter(d))
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range ms {
			if m.Mountpoint != except {
				t.Errorf("%s is still mounted (%s)", m.Mountpoint, m.FSType)
			}
		}
	}
}

// noPodCgroups fails for any pod cgroup (stagelet-pod-<id>, a directory or
// a systemd unit's) left anywhere in the hierarchy.
func noPodCgroups(t *testing.T) {
	t.Helper()
	filepath.WalkDir(cgroupFS, func(p string, d fs.DirEntry, err error) error {
		if err == nil && d.IsDir() && strings.HasPrefix(d.Name(), "stagelet-pod-") {
			t.Errorf("pod cgroup %s is left", p)
			return fs.SkipDir
		}
		return nil
	})
}
