package cgroups

import (
	"os"
	"runtime"
	"syscall"
	"testing"
)

// threadCgroups reads the calling thread's cgroups (nil, reported, on
// failure: it runs outside the test's goroutine).
func threadCgroups(t *testing.T) map[string]string {
	t.Helper()
	f, err := os.Open("/proc/thread-self/cgroup")
	if err != nil {
		t.Error(err)
		return nil
	}
	defer f.Close()
	procs, err := parseProcCgroup(f)
	if err != nil {
		t.Error(err)
	}
	return procs
}

// TestPlaceThread: a process the placed thread forks starts in the
// cgroup, and Release takes the thread back to where it was, with the
// thread's own cgroups read from /proc or given.
func TestPlaceThread(t *testing.T) {
	c := testCgroup(t)
	self, err := Self()
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		home *Cgroup
	}{{"home read", nil}, {"home given", self}} {
		t.Run(tc.name, func(t *testing.T) {
			done := make(chan struct{})
			go func() {
				defer close(done)
				runtime.LockOSThread() // the thread ends with the goroutine
				before := threadCgroups(t)
				tp, err := c.PlaceThread(tc.home)
				if err != nil {
					t.Error(err)
					return
				}
				r, w, err := os.Pipe()
				if err != nil {
					t.Error(err)
					return
				}
				attr := &syscall.ProcAttr{Files: []uintptr{0, w.Fd(), 2}, Sys: &syscall.SysProcAttr{UseCgroupFD: tp.CgroupFD >= 0, CgroupFD: tp.CgroupFD}}
				pid, err := syscall.ForkExec("/bin/cat", []string{"cat", "/proc/self/cgroup"}, attr)
				w.Close()
				if rerr := tp.Release(); rerr != nil {
					t.Error(rerr)
				}
				if err != nil {
					r.Close()
					t.Error(err)
					return
				}
				child, err := parseProcCgroup(r)
				r.Close()
				var ws syscall.WaitStatus
				syscall.Wait4(pid, &ws, 0, nil)
				if err != nil {
					t.Error(err)
					return
				}
				e, err := loadEnv()
				if err != nil {
					t.Error(err)
					return
				}
				e.procs = child
				got, err := e.self()
				if err != nil {
					t.Error(err)
					return
				}
				for k, want := range c.Paths {
					if got.Paths[k] != want {
						t.Errorf("the child's %s cgroup = %s, want %s", k, got.Paths[k], want)
					}
				}
				after := threadCgroups(t)
				for k, v := range before {
					if after[k] != v {
						t.Errorf("after Release the thread's %q cgroup is %s, was %s", k, after[k], v)
					}
				}
			}()
			<-done
		})
	}
}
