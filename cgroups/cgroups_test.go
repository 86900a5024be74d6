package cgroups

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/stagelet/stagelet/internal/testutil"
)

// testCgroup creates a cgroup beneath the test process's own cgroup and
// removes it (killing what is left) when the test ends.
func testCgroup(t *testing.T) *Cgroup {
	t.Helper()
	if os.Getuid() != 0 {
		t.Skip("needs root to create cgroups")
	}
	self, err := Self()
	if err != nil {
		t.Skipf("no usable cgroups: %v", err)
	}
	c := self.Child(fmt.Sprintf("stagelet-cgtest-%d-%d", os.Getpid(), time.Now().UnixNano()))
	if err := c.Create(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := c.Kill(); err != nil {
			t.Errorf("cleanup kill: %v", err)
		}
		if err := c.Delete(); err != nil {
			t.Errorf("cleanup delete: %v", err)
		}
	})
	return c
}

// startGated starts a shell that runs script once release is called (so
// that it can be moved into a cgroup before it forks); the test reaps it.
func startGated(t *testing.T, c *Cgroup, script string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command("/bin/sh", "-c", "read x; "+script)
	w, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	t.Cleanup(func() {
		cmd.Process.Kill()
		<-done
	})
	if err := c.Add(cmd.Process.Pid); err != nil {
		t.Fatal(err)
	}
	if _, err := w.Write([]byte("go\n")); err != nil {
		t.Fatal(err)
	}
	return cmd
}

func TestLifecycle(t *testing.T) {
	c := testCgroup(t)
	if err := c.Create(); err != nil {
		t.Fatalf("second Create: %v", err)
	}
	for _, d := range c.dirs() {
		if _, err := os.Stat(d); err != nil {
			t.Fatalf("dir: %v", err)
		}
	}
	if err := c.Set(Resources{CPUShares: 512, CPUQuota: 50000, CPUPeriod: 100000, MemoryLimit: 256 << 20, PidsLimit: 100}); err != nil {
		t.Fatal(err)
	}
	if !c.IsV2() {
		check := func(ctl, file, want string) {
			t.Helper()
			got, err := readFile(c.Paths[ctl], file)
			if err != nil {
				t.Fatal(err)
			}
			if got != want {
				t.Errorf("%s = %q, want %q", file, got, want)
			}
		}
		check("cpu", "cpu.shares", "512")
		check("cpu", "cpu.cfs_quota_us", "50000")
		check("memory", "memory.limit_in_bytes", fmt.Sprint(256<<20))
		check("pids", "pids.max", "100")
	}
	// A cpuset: the CPUs and memory nodes the parent has, narrowed to the
	// first of each; read back where the hierarchy keeps it.
	cpusetDir := c.Paths["cpuset"]
	if c.IsV2() {
		cpusetDir = c.Paths[Unified]
	}
	if _, err := os.Stat(filepath.Join(cpusetDir, "cpuset.cpus")); err != nil {
		t.Logf("no cpuset controller here (%v): cpuset not checked", err)
	} else {
		if err := c.Set(Resources{CpusetCpus: "0", CpusetMems: "0"}); err != nil {
			t.Fatal(err)
		}
		for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
			if got, err := readFile(cpusetDir, f); err != nil || got != "0" {
				t.Errorf("%s = %q, %v, want 0", f, got, err)
			}
		}
	}

	// An OOM group: cgroup v2's, refused by v1, which has none.
	err := c.Set(Resources{OOMGroup: true})
	if c.IsV2() {
		if got, rerr := readFile(c.Paths[Unified], "memory.oom.group"); err != nil || got != "1" {
			t.Errorf("memory.oom.group = %q (%v), set: %v", got, rerr, err)
		}
	} else if err == nil {
		t.Errorf("an OOM group on cgroup v1: no error")
	}

	// A process in a child cgroup, forking more: Procs sees all of them.
	child := c.Child("app")
	if err := child.Create(); err != nil {
		t.Fatal(err)
	}
	startGated(t, child, "sleep 1000 & sleep 1000 & wait")
	waitFor(t, func() bool {
		p, err := c.Procs()
		return err == nil && len(p) >= 3
	})

	st, err := c.Stats()
	if err != nil {
		t.Fatal(err)
	}
	if st.MemoryUsage == 0 || st.Pids < 3 {
		t.Errorf("stats = %+v", st)
	}
	if st.MemoryWorkingSet > st.MemoryUsage {
		t.Errorf("working set %d > usage %d", st.MemoryWorkingSet, st.MemoryUsage)
	}
	if _, err := c.OOMKills(); err != nil {
		t.Errorf("OOMKills: %v", err)
	}

	if err := c.Kill(); err != nil {
		t.Fatal(err)
	}
	if p, _ := c.Procs(); len(p) != 0 {
		t.Errorf("procs after kill: %v", p)
	}
	if err := c.Delete(); err != nil {
		t.Fatal(err)
	}
	for _, d := range c.dirs() {
		if _, err := os.Stat(d); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("%s still exists: %v", d, err)
		}
	}
	// Idempotent on a gone cgroup.
	if err := c.Kill(); err != nil {
		t.Errorf("Kill on gone cgroup: %v", err)
	}
	if err := c.Delete(); err != nil {
		t.Errorf("Delete on gone cgroup: %v", err)
	}
	if _, err := c.Stats(); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("Stats on gone cgroup: %v, want ErrNotExist", err)
	}
}

func TestKillForkingProcesses(t *testing.T) {
	c := testCgroup(t)
	startGated(t, c, "while true; do sleep 1000 & done")
	waitFor(t, func() bool {
		p, _ := c.Procs()
		return len(p) > 5
	})
	if err := c.Kill(); err != nil {
		t.Fatal(err)
	}
	if p, _ := c.Procs(); len(p) != 0 {
		t.Errorf("procs after kill: %v", p)
	}
}

func TestSelfContainsCaller(t *testing.T) {
	self, err := Self()
	if err != nil {
		t.Skipf("no cgroups: %v", err)
	}
	for k, d := range self.Paths {
		if !filepath.IsAbs(d) {
			t.Errorf("%s: %q not absolute", k, d)
		}
	}
	if os.Getuid() != 0 {
		return
	}
	pids, err := (&Cgroup{Paths: map[string]string{"memory": self.Paths["memory"]}}).Procs()
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, p := range pids {
		found = found || p == os.Getpid()
	}
	if !found && self.Paths["memory"] != "" {
		t.Errorf("own pid %d not in %s", os.Getpid(), self.Paths["memory"])
	}
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	testutil.WaitFor(t, 10*time.Second, "the condition", testutil.Holds(cond))
}

func TestStartInCgroup(t *testing.T) {
	c := testCgroup(t)
	self, err := Self()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("/bin/sh", "-c", "cat /proc/self/cgroup; exec sleep 1000 >/dev/null")
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Start(cmd); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	t.Cleanup(func() { cmd.Process.Kill(); <-done })
	procs, err := parseProcCgroup(out)
	if err != nil {
		t.Fatal(err)
	}
	e, err := loadEnv()
	if err != nil {
		t.Fatal(err)
	}
	e.procs = procs
	got, err := e.self()
	if err != nil {
		t.Fatal(err)
	}
	for k, want := range c.Paths {
		if got.Paths[k] != want {
			t.Errorf("child %s cgroup = %s, want %s", k, got.Paths[k], want)
		}
	}
	// This process, every thread included, is still where it was.
	tasks, _ := os.ReadDir("/proc/self/task")
	for _, tk := range tasks {
		f, err := os.Open("/proc/self/task/" + tk.Name() + "/cgroup")
		if err != nil {
			continue
		}
		p, err := parseProcCgroup(f)
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		e.procs = p
		th, err := e.self()
		if err != nil {
			t.Fatal(err)
		}
		for k, want := range self.Paths {
			if th.Paths[k] != want {
				t.Errorf("thread %s %s cgroup = %s, want %s", tk.Name(), k, th.Paths[k], want)
			}
		}
	}
}

func TestOfProcessSelf(t *testing.T) {
	self, err := Self()
	if err != nil {
		t.Skipf("no cgroups: %v", err)
	}
	of, err := OfProcess(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if self.String() != of.String() {
		t.Errorf("OfProcess(self) = %s, Self() = %s", of, self)
	}
	if _, err := OfProcess(1 << 30); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("OfProcess of no process: %v, want ErrNotExist", err)
	}
}

// On cgroup v1, OOM events of a memory cgroup reach its watcher; the
// watch ends when stopped.
func TestWatchOOM(t *testing.T) {
	c := testCgroup(t)
	if c.IsV2() {
		if _, _, err := c.WatchOOM(); err == nil {
			t.Error("WatchOOM on cgroup v2: no error")
		}
		t.Skip("cgroup v2 has OOM groups of its own")
	}
	if _, ok := c.Paths["memory"]; !ok {
		t.Skip("no memory controller")
	}
	if err := c.Set(Resources{MemoryLimit: 16 << 20}); err != nil {
		t.Fatal(err)
	}
	events, stop, err := c.WatchOOM()
	if err != nil {
		t.Fatal(err)
	}
	// tail keeps what it reads of a file with no newline.
	startGated(t, c, "exec tail /dev/zero")
	select {
	case <-events:
	case <-time.After(time.Minute):
		t.Fatal("no OOM event within a minute")
	}
	// The event comes as the OOM begins; the kill follows.
	waitFor(t, func() bool {
		n, err := c.OOMKills()
		return err == nil && n > 0
	})
	stop()
	for range events {
	}
}
