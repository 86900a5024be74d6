package cgroups

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

func TestMain(m *testing.M) {
	// The fallback start re-executes this test binary as its ExecHelper.
	if len(os.Args) > 1 && os.Args[1] == "cgroup-exec" {
		os.Exit(RunExecHelper(os.Args[2:]))
	}
	os.Exit(m.Run())
}

// fakeV2 builds a directory tree shaped like a cgroup2 mount: each cgroup
// has the interface files delegateV2 reads and writes.
type fakeV2 struct{ root string }

func newFakeV2(t *testing.T, controllers string) *fakeV2 {
	f := &fakeV2{root: t.TempDir()}
	f.cgroup(t, ".", "", "")
	write(t, f.root, "cgroup.controllers", controllers)
	return f
}

func write(t *testing.T, dir, name, val string) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(dir, name), []byte(val), 0o644); err != nil {
		t.Fatal(err)
	}
}

func (f *fakeV2) cgroup(t *testing.T, rel, procs, typ string) string {
	t.Helper()
	d := filepath.Join(f.root, rel)
	if err := os.MkdirAll(d, 0o755); err != nil {
		t.Fatal(err)
	}
	if typ == "" {
		typ = "domain"
	}
	write(t, d, "cgroup.procs", procs)
	write(t, d, "cgroup.type", typ)
	write(t, d, "cgroup.subtree_control", "")
	write(t, d, "cgroup.controllers", "")
	return d
}

func read(t *testing.T, dir, name string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, name))
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}

func TestDelegateV2(t *testing.T) {
	t.Run("enables what the root offers, top down", func(t *testing.T) {
		f := newFakeV2(t, "cpuset cpu io memory pids")
		write(t, f.root, "cgroup.procs", "1 2 3") // the root is exempt
		a := f.cgroup(t, "a", "", "")
		write(t, a, "cgroup.subtree_control", "cpu memory pids")
		b := f.cgroup(t, "a/b", "", "")
		if err := delegateV2(f.root, filepath.Join(b, "pod")); err != nil {
			t.Fatal(err)
		}
		if got := read(t, f.root, "cgroup.subtree_control"); got != "+cpu +memory +pids +cpuset +io" {
			t.Errorf("root subtree_control = %q", got)
		}
		if got := read(t, a, "cgroup.subtree_control"); got != "+cpuset +io" {
			t.Errorf("a, which had all but cpuset and io, was written %q, want only +cpuset +io", got)
		}
		if got := read(t, b, "cgroup.subtree_control"); got != "+cpu +memory +pids +cpuset +io" {
			t.Errorf("b subtree_control = %q", got)
		}
	})
	t.Run("goes without cpuset where a parent holds processes", func(t *testing.T) {
		f := newFakeV2(t, "cpuset cpu memory pids")
		a := f.cgroup(t, "a", "4242", "")
		write(t, a, "cgroup.subtree_control", "cpu memory pids")
		b := f.cgroup(t, "a/b", "", "")
		if err := delegateV2(f.root, filepath.Join(b, "pod")); err != nil {
			t.Fatalf("only cpuset missing above processes: %v", err)
		}
		if got := read(t, a, "cgroup.subtree_control"); got != "cpu memory pids" {
			t.Errorf("a cgroup holding processes was written: %q", got)
		}
		if got := read(t, b, "cgroup.subtree_control"); got != "+cpu +memory +pids" {
			t.Errorf("b subtree_control = %q, want the required controllers only", got)
		}
	})
	t.Run("refuses a parent holding processes", func(t *testing.T) {
		f := newFakeV2(t, "cpu memory pids")
		svc := f.cgroup(t, "system.slice/stagelet.service", "4242", "")
		f.cgroup(t, "system.slice", "", "")
		err := delegateV2(f.root, filepath.Join(svc, "stagelet", "pod"))
		if !errors.Is(err, ErrLayout) {
			t.Fatalf("err = %v, want ErrLayout", err)
		}
		for _, want := range []string{svc, "4242", "no-internal-process"} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("error %q does not name %q", err, want)
			}
		}
		if got := read(t, svc, "cgroup.subtree_control"); got != "" {
			t.Errorf("controllers enabled in a cgroup holding processes: %q", got)
		}
	})
	t.Run("refuses a threaded cgroup", func(t *testing.T) {
		f := newFakeV2(t, "cpu memory pids")
		a := f.cgroup(t, "a", "", "domain threaded")
		err := delegateV2(f.root, filepath.Join(a, "pod"))
		if !errors.Is(err, ErrLayout) || !strings.Contains(err.Error(), "threaded") || !strings.Contains(err.Error(), a) {
			t.Fatalf("err = %v, want ErrLayout naming %s as threaded", err, a)
		}
	})
	t.Run("nothing to do without controllers", func(t *testing.T) {
		f := newFakeV2(t, "")
		a := f.cgroup(t, "a", "7", "")
		if err := delegateV2(f.root, filepath.Join(a, "pod")); err != nil {
			t.Fatal(err)
		}
	})
}

func TestKernelAtLeast(t *testing.T) {
	for _, c := range []struct {
		rel  string
		want bool
	}{
		{"4.18.0-553.el8_10.x86_64", false},
		{"5.6.19", false},
		{"5.7.0", true},
		{"5.10.0-28-cloud-amd64", true},
		{"6.1.0", true},
		{"garbage", false},
	} {
		if got := kernelAtLeast(c.rel, 5, 7); got != c.want {
			t.Errorf("kernelAtLeast(%q, 5, 7) = %v", c.rel, got)
		}
	}
}

// unifiedTestCgroup is a cgroup beneath this process's own in a cgroup2
// hierarchy: the host's, or the unified mount of a hybrid host. It is
// removed when the test ends.
func unifiedTestCgroup(t *testing.T) string {
	t.Helper()
	if os.Getuid() != 0 {
		t.Skip("needs root to create cgroups")
	}
	e, err := loadEnv()
	if err != nil {
		t.Skipf("no cgroups: %v", err)
	}
	var m *mount
	for i := range e.mounts {
		if e.mounts[i].fstype == "cgroup2" {
			m = &e.mounts[i]
			break
		}
	}
	p, ok := e.procs[""]
	if m == nil || !ok {
		t.Skip("no cgroup2 hierarchy mounted")
	}
	d := filepath.Join(dirFor(*m, p), "stagelet-v2test-"+strconv.Itoa(os.Getpid())+"-"+strings.ReplaceAll(t.Name(), "/", "_"))
	if err := os.Mkdir(d, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		c := &Cgroup{Paths: map[string]string{Unified: d}}
		if err := c.Kill(); err != nil {
			t.Error(err)
		}
		if err := c.Delete(); err != nil {
			t.Error(err)
		}
	})
	return d
}

// TestStartWithoutCloneIntoCgroup runs the path taken on kernels before
// 5.7: the command's first look at /proc/self/cgroup already shows the
// target cgroup.
func TestStartWithoutCloneIntoCgroup(t *testing.T) {
	for _, clone := range []bool{true, false} {
		t.Run("clone="+strconv.FormatBool(clone), func(t *testing.T) {
			d := unifiedTestCgroup(t)
			saved := cloneIntoCgroup
			cloneIntoCgroup = func() bool { return clone }
			defer func() { cloneIntoCgroup = saved }()
			saveHelper := ExecHelper
			ExecHelper = []string{os.Args[0], "cgroup-exec"}
			defer func() { ExecHelper = saveHelper }()

			c := &Cgroup{Paths: map[string]string{Unified: d}}
			cmd := exec.Command("/bin/sh", "-c", "cat /proc/self/cgroup; echo args:\"$1\"", "sh", "one two")
			var out strings.Builder
			cmd.Stdout = &out
			cmd.Stderr = &out
			if err := c.Start(cmd); err != nil {
				t.Fatal(err)
			}
			if err := cmd.Wait(); err != nil {
				t.Fatalf("%v: %s", err, out.String())
			}
			procs, err := parseProcCgroup(strings.NewReader(strings.Split(out.String(), "args:")[0]))
			if err != nil {
				t.Fatal(err)
			}
			want := "/" + filepath.Base(d)
			if !strings.HasSuffix(procs[""], want) {
				t.Errorf("the command ran in %q, want a cgroup ending in %q", procs[""], want)
			}
			if !strings.Contains(out.String(), "args:one two") {
				t.Errorf("arguments not passed through: %q", out.String())
			}
		})
	}
}

// TestHelperRefusesWithoutRelease: a helper whose parent never moves it
// does not run the command.
func TestHelperRefusesWithoutRelease(t *testing.T) {
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	w.Close()
	marker := filepath.Join(t.TempDir(), "ran")
	cmd := exec.Command(os.Args[0], "cgroup-exec", "3", "/bin/sh", "sh", "-c", "touch "+marker)
	cmd.ExtraFiles = []*os.File{r}
	out, err := cmd.CombinedOutput()
	r.Close()
	if err == nil {
		t.Fatalf("helper succeeded: %s", out)
	}
	if _, err := os.Stat(marker); err == nil {
		t.Error("the command ran although the helper was never released")
	}
}

// childIn starts a shell in the cgroup2 directory d that waits until the
// test ends.
func childIn(t *testing.T, d string) *exec.Cmd {
	t.Helper()
	c := &Cgroup{Paths: map[string]string{Unified: d}}
	cmd := exec.Command("/bin/sh", "-c", "read x")
	w, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Start(cmd); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.Close(); cmd.Wait() })
	return cmd
}

// TestMoveIntoLeaf moves a child process (not this test) from a cgroup2
// directory into its leaf, which makes the directory empty.
func TestMoveIntoLeaf(t *testing.T) {
	d := unifiedTestCgroup(t)
	cmd := childIn(t, d)
	root := v2RootOf(d)
	parent, err := moveIntoLeaf(root, d, LeafName, cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	if parent != d {
		t.Errorf("parent = %s, want %s", parent, d)
	}
	if got := read(t, d, "cgroup.procs"); got != "" {
		t.Errorf("%s still holds %q", d, got)
	}
	if got := read(t, filepath.Join(d, LeafName), "cgroup.procs"); got != strconv.Itoa(cmd.Process.Pid) {
		t.Errorf("leaf holds %q, want the child", got)
	}
	// Already in a leaf: the parent is the cgroup above it, nothing moves.
	again, err := moveIntoLeaf(root, filepath.Join(d, LeafName), LeafName, cmd.Process.Pid)
	if err != nil || again != d {
		t.Errorf("second move = %s, %v; want %s", again, err, d)
	}
	// The root cgroup is exempt: nothing moves.
	if p, err := moveIntoLeaf(root, root, LeafName, cmd.Process.Pid); err != nil || p != root {
		t.Errorf("move at the root = %s, %v", p, err)
	}
}

// The root of a cgroup namespace (what systemd-nspawn shows its payload)
// is an ordinary cgroup: a process there moves into the leaf like anywhere
// else, where a process at the hierarchy's real root stays.
func TestMoveIntoLeafAtNamespaceRoot(t *testing.T) {
	d := unifiedTestCgroup(t)
	cmd := childIn(t, d)
	if isHierarchyRoot(d) {
		t.Fatalf("%s has no cgroup.type: taken for the real root", d)
	}
	if !isHierarchyRoot(v2RootOf(d)) {
		t.Fatalf("the real root %s is not taken for one", v2RootOf(d))
	}
	parent, err := moveIntoLeaf(d, d, LeafName, cmd.Process.Pid)
	if err != nil || parent != d {
		t.Fatalf("moveIntoLeaf at a namespace root = %s, %v; want %s", parent, err, d)
	}
	if got := read(t, filepath.Join(d, LeafName), "cgroup.procs"); got != strconv.Itoa(cmd.Process.Pid) {
		t.Errorf("leaf holds %q, want the child", got)
	}
}
