// Package rlimit owns the resource limits an app's processes start with:
// the ones the daemon's own children get, which is what containerd gives
// runc's containers (its shim and runc pass their own on), read once by
// the daemon and carried to every pod's agent, which sets them for its
// apps, in a VM's guest too, where the kernel's defaults for init (1024
// open files) would otherwise stand.
package rlimit

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"runtime"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
)

// Limit is one resource limit: its name as in setrlimit(2)
// ("RLIMIT_NOFILE") and its soft and hard values (unix.RLIM_INFINITY:
// unlimited).
type Limit struct {
	Type string `json:"type"`
	Soft uint64 `json:"soft"`
	Hard uint64 `json:"hard"`
}

// resources are the limits carried, by name, in the order of
// /proc/PID/limits.
var resources = []struct {
	name string
	res  int
}{
	{"RLIMIT_CPU", unix.RLIMIT_CPU},
	{"RLIMIT_FSIZE", unix.RLIMIT_FSIZE},
	{"RLIMIT_DATA", unix.RLIMIT_DATA},
	{"RLIMIT_STACK", unix.RLIMIT_STACK},
	{"RLIMIT_CORE", unix.RLIMIT_CORE},
	{"RLIMIT_RSS", unix.RLIMIT_RSS},
	{"RLIMIT_NPROC", unix.RLIMIT_NPROC},
	{"RLIMIT_NOFILE", unix.RLIMIT_NOFILE},
	{"RLIMIT_MEMLOCK", unix.RLIMIT_MEMLOCK},
	{"RLIMIT_AS", unix.RLIMIT_AS},
	{"RLIMIT_LOCKS", unix.RLIMIT_LOCKS},
	{"RLIMIT_SIGPENDING", unix.RLIMIT_SIGPENDING},
	{"RLIMIT_MSGQUEUE", unix.RLIMIT_MSGQUEUE},
	{"RLIMIT_NICE", unix.RLIMIT_NICE},
	{"RLIMIT_RTPRIO", unix.RLIMIT_RTPRIO},
	{"RLIMIT_RTTIME", unix.RLIMIT_RTTIME},
}

// resource is the number of the limit named name.
func resource(name string) (int, bool) {
	for _, r := range resources {
		if r.name == name {
			return r.res, true
		}
	}
	return 0, false
}

var (
	inheritedOnce sync.Once
	inherited     []Limit
	inheritedErr  error
)

// Inherited returns the limits a child of this process starts with. They
// are this process's own, but for the soft limit of open files: the Go
// runtime raises its own to the hard limit at start and gives children
// the one it was started with, which only a child shows. So a copy of
// this program is started stopped at its first instruction (ptrace), its
// limits read and the copy killed. Computed once.
func Inherited() ([]Limit, error) {
	inheritedOnce.Do(func() { inherited, inheritedErr = probe() })
	return inherited, inheritedErr
}

// probe reads the limits of a stopped child.
func probe() ([]Limit, error) {
	// ptrace requests come from the thread that started the child.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	null, err := os.Open(os.DevNull)
	if err != nil {
		return nil, err
	}
	defer null.Close()
	fd := null.Fd()
	pid, err := syscall.ForkExec("/proc/self/exe", []string{"rlimit-probe"}, &syscall.ProcAttr{
		Files: []uintptr{fd, fd, fd},
		Sys:   &syscall.SysProcAttr{Ptrace: true, Pdeathsig: syscall.SIGKILL},
	})
	if err != nil {
		return nil, fmt.Errorf("rlimit: start a probe: %w", err)
	}
	defer func() {
		_ = syscall.Kill(pid, syscall.SIGKILL)
		var ws syscall.WaitStatus
		for {
			if _, err := syscall.Wait4(pid, &ws, 0, nil); !errors.Is(err, syscall.EINTR) {
				return
			}
		}
	}()
	var ws syscall.WaitStatus
	for {
		_, err = syscall.Wait4(pid, &ws, 0, nil)
		if !errors.Is(err, syscall.EINTR) {
			break
		}
	}
	if err != nil {
		return nil, fmt.Errorf("rlimit: wait for the probe: %w", err)
	}
	if !ws.Stopped() {
		return nil, fmt.Errorf("rlimit: the probe did not stop (status %v)", ws)
	}
	return Of(pid)
}

// Of returns the limits of process pid (0: the caller).
func Of(pid int) ([]Limit, error) {
	out := make([]Limit, 0, len(resources))
	for _, r := range resources {
		var l unix.Rlimit
		if err := unix.Prlimit(pid, r.res, nil, &l); err != nil {
			return nil, fmt.Errorf("rlimit: %s: %w", r.name, err)
		}
		out = append(out, Limit{Type: r.name, Soft: l.Cur, Hard: l.Max})
	}
	return out, nil
}

// Check refuses a limit of an unknown type or whose soft value exceeds
// its hard one.
func Check(ls []Limit) error {
	for _, l := range ls {
		if _, ok := resource(l.Type); !ok {
			return fmt.Errorf("rlimit: unknown limit %q", l.Type)
		}
		if l.Soft > l.Hard {
			return fmt.Errorf("rlimit: %s: soft %d above hard %d", l.Type, l.Soft, l.Hard)
		}
	}
	return nil
}

// Apply gives the calling process the limits ls. A hard limit above the
// process's own cannot be raised without CAP_SYS_RESOURCE: the limit is
// then set as high as it may be, and the shortfall reported through warn.
// Setting the open files limit also stops the Go runtime from giving
// children its start value (syscall.Setrlimit), so that children started
// from here on get ls.
func Apply(ls []Limit, warn func(string, ...any)) error {
	if err := Check(ls); err != nil {
		return err
	}
	for _, l := range ls {
		res, _ := resource(l.Type)
		want := syscall.Rlimit{Cur: l.Soft, Max: l.Hard}
		err := syscall.Setrlimit(res, &want)
		if !errors.Is(err, syscall.EPERM) {
			if err != nil {
				return fmt.Errorf("rlimit: %s: %w", l.Type, err)
			}
			continue
		}
		var own syscall.Rlimit
		if err := syscall.Getrlimit(res, &own); err != nil {
			return fmt.Errorf("rlimit: %s: %w", l.Type, err)
		}
		got := syscall.Rlimit{Cur: min(want.Cur, own.Max), Max: min(want.Max, own.Max)}
		if err := syscall.Setrlimit(res, &got); err != nil {
			return fmt.Errorf("rlimit: %s: %w", l.Type, err)
		}
		warn("%s: hard limit %d above the agent's %d, which it may not raise: %d/%d", l.Type, want.Max, own.Max, got.Cur, got.Max)
	}
	return nil
}

// limitJSON is a Limit as records keep it: an unlimited value is
// "unlimited", so that a record read and written by any JSON tool (which
// may hold numbers as doubles) keeps it.
type limitJSON struct {
	Type string `json:"type"`
	Soft any    `json:"soft"`
	Hard any    `json:"hard"`
}

func jsonValue(v uint64) any {
	if v == unix.RLIM_INFINITY {
		return "unlimited"
	}
	return v
}

func parseValue(v any) (uint64, error) {
	switch x := v.(type) {
	case string:
		if x == "unlimited" {
			return unix.RLIM_INFINITY, nil
		}
	case float64:
		if x >= 0 && x < 1<<53 && x == float64(uint64(x)) {
			return uint64(x), nil
		}
	}
	return 0, fmt.Errorf("rlimit: bad value %v", v)
}

// MarshalJSON implements json.Marshaler.
func (l Limit) MarshalJSON() ([]byte, error) {
	return json.Marshal(limitJSON{Type: l.Type, Soft: jsonValue(l.Soft), Hard: jsonValue(l.Hard)})
}

// UnmarshalJSON implements json.Unmarshaler.
func (l *Limit) UnmarshalJSON(b []byte) error {
	var j limitJSON
	if err := json.Unmarshal(b, &j); err != nil {
		return err
	}
	soft, err := parseValue(j.Soft)
	if err != nil {
		return err
	}
	hard, err := parseValue(j.Hard)
	if err != nil {
		return err
	}
	*l = Limit{Type: j.Type, Soft: soft, Hard: hard}
	return nil
}
