// Package cgroups owns stagelet's use of Linux control groups: finding the
// caller's own cgroups, creating pod and app cgroups beneath a parent,
// moving processes into them, setting limits, reading usage, killing every
// process inside and removing them.
//
// Two modes are supported. When /sys/fs/cgroup is a cgroup2 file system
// (pure v2) a Cgroup has one path, under the key "unified". Otherwise (v1 or
// hybrid) a Cgroup has one directory per controller among cpu, cpuacct,
// cpuset, memory, pids, freezer and devices; the name=systemd and hybrid
// unified mounts, and the blkio controller, are not used. Co-mounted
// controllers ("cpu,cpuacct") share a directory; every operation visits a
// directory once.
//
// A Cgroup is a plain value (a set of paths) and holds no open files; it is
// safe to copy and to marshal. Methods do no locking: callers serialise
// operations on the same cgroup.
package cgroups

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
)

// Unified is the Paths key of the cgroup2 hierarchy in pure v2 mode.
const Unified = "unified"

// v1Controllers are the v1 controllers stagelet manages.
var v1Controllers = []string{"cpu", "cpuacct", "cpuset", "memory", "pids", "freezer", "devices"}

// Cgroup is one cgroup, named by its directory in each hierarchy.
type Cgroup struct {
	// Paths maps a controller name (or Unified in v2 mode) to an absolute
	// directory.
	Paths map[string]string `json:"paths"`
}

// Resources are limits to apply; a zero field is left unset. A negative
// CPUQuota means unlimited.
type Resources struct {
	CPUShares   int64
	CPUQuota    int64 // microseconds per period
	CPUPeriod   int64 // microseconds
	MemoryLimit int64 // bytes
	PidsLimit   int64
	// CpusetCpus and CpusetMems are cpuset lists ("0-3,6"): the CPUs and
	// memory nodes the cgroup's processes may use.
	CpusetCpus, CpusetMems string
	// OOMGroup makes an OOM kill take every process of the cgroup
	// (memory.oom.group); cgroup v2 only.
	OOMGroup bool
	// MemorySwap is the memory and swap the cgroup's processes may use
	// together, as OCI's memory.swap (-1: unlimited): v1's
	// memory.memsw.limit_in_bytes; v2's memory.swap.max takes the
	// difference, so v2 needs a MemoryLimit with it.
	MemorySwap int64
	// MemoryReservation is the memory below which the cgroup's pages are
	// spared when the system reclaims (v1 memory.soft_limit_in_bytes, v2
	// memory.low; -1: all of it).
	MemoryReservation int64
	// HugepageLimits cap the huge pages of each size the cgroup's
	// processes may use (v1 hugetlb.<size>.limit_in_bytes, in the
	// hugetlb hierarchy when the cgroup has one; v2 hugetlb.<size>.max).
	HugepageLimits []HugepageLimit
}

// HugepageLimit caps the huge pages of one size, in bytes.
type HugepageLimit struct {
	// PageSize is as the kernel names it in hugetlb files: "2MB", "1GB",
	// "64KB".
	PageSize string
	Limit    uint64
}

// checkPageSize refuses a page size that is not a number and KB, MB or
// GB: it becomes part of a file name.
func checkPageSize(size string) error {
	n := strings.TrimRight(size, "KMGB")
	unit := size[len(n):]
	if n == "" || strings.Trim(n, "0123456789") != "" || (unit != "KB" && unit != "MB" && unit != "GB") {
		return fmt.Errorf("cgroups: bad huge page size %q (want a number and KB, MB or GB)", size)
	}
	return nil
}

// swapV2 converts OCI's memory+swap limit to v2's memory.swap.max, the
// swap alone, as runc does.
func swapV2(swap, limit int64) (string, error) {
	switch {
	case swap < 0:
		return "max", nil
	case limit <= 0:
		return "", fmt.Errorf("cgroups: memory.swap.max: a swap limit needs a memory limit on cgroup v2")
	case swap < limit:
		return "", fmt.Errorf("cgroups: memory.swap.max: memory+swap %d is below the memory limit %d", swap, limit)
	}
	return strconv.FormatInt(swap-limit, 10), nil
}

// Stats are usage figures of a cgroup, descendants included.
type Stats struct {
	CPUUsageNanos    uint64
	MemoryUsage      uint64
	MemoryWorkingSet uint64 // usage minus inactive file pages
	MemoryRSS        uint64
	PageFaults       uint64
	MajorPageFaults  uint64
	Pids             uint64
}

// IsV2 reports whether c is a cgroup2 (pure v2) cgroup.
func (c *Cgroup) IsV2() bool {
	_, ok := c.Paths[Unified]
	return ok
}

// String lists the cgroup's directories, for logs.
func (c *Cgroup) String() string {
	if c == nil {
		return ""
	}
	return strings.Join(c.dirs(), ",")
}

// mount is one cgroup mount from mountinfo.
type mount struct {
	point  string   // where it is mounted
	root   string   // the cgroup path mounted there
	fstype string   // "cgroup" or "cgroup2"
	opts   []string // super options
}

// hostV2 reports whether /sys/fs/cgroup is a cgroup2 file system.
func hostV2() bool {
	var st unix.Statfs_t
	if err := unix.Statfs("/sys/fs/cgroup", &st); err != nil {
		return false
	}
	return st.Type == unix.CGROUP2_SUPER_MAGIC
}

// PureV2 reports whether this host runs a pure cgroup v2 hierarchy
// (/sys/fs/cgroup is cgroup2), rather than cgroup v1 or hybrid.
func PureV2() bool { return hostV2() }

// env is what the caller's cgroups are computed from.
type env struct {
	v2     bool
	procs  map[string]string // /proc/self/cgroup: controller (or "" for v2) → path
	mounts []mount
}

func loadEnv() (*env, error) { return loadEnvOf("/proc/self/cgroup") }

// loadEnvOf reads the cgroups a process's cgroup file (procCgroup) names
// and the caller's cgroup mounts.
func loadEnvOf(procCgroup string) (*env, error) {
	pc, err := os.Open(procCgroup)
	if err != nil {
		return nil, fmt.Errorf("cgroups: %w", err)
	}
	defer pc.Close()
	mi, err := os.Open("/proc/thread-self/mountinfo")
	if err != nil {
		return nil, fmt.Errorf("cgroups: %w", err)
	}
	defer mi.Close()
	return parseEnv(pc, mi, hostV2())
}

func parseEnv(procCgroup, mountInfo io.Reader, v2 bool) (*env, error) {
	procs, err := parseProcCgroup(procCgroup)
	if err != nil {
		return nil, err
	}
	mounts, err := parseMountinfo(mountInfo)
	if err != nil {
		return nil, err
	}
	return &env{v2: v2, procs: procs, mounts: mounts}, nil
}

// parseProcCgroup reads /proc/PID/cgroup. Each controller of a line gets
// the line's path; the v2 line ("0::/path") is under the key "".
func parseProcCgroup(r io.Reader) (map[string]string, error) {
	lines, err := parseProcLines(r)
	if err != nil {
		return nil, err
	}
	out := map[string]string{}
	for _, l := range lines {
		if l.controllers == nil {
			out[""] = l.path
		}
		for _, ctl := range l.controllers {
			out[ctl] = l.path
		}
	}
	return out, nil
}

// parseMountinfo returns the cgroup and cgroup2 mounts of a mountinfo file.
func parseMountinfo(r io.Reader) ([]mount, error) {
	ms, err := mountinfo.GetMountsFromReader(r, mountinfo.FSTypeFilter("cgroup", "cgroup2"))
	if err != nil {
		return nil, fmt.Errorf("cgroups: read mountinfo: %w", err)
	}
	out := make([]mount, 0, len(ms))
	for _, m := range ms {
		out = append(out, mount{point: m.Mountpoint, root: m.Root, fstype: m.FSType, opts: strings.Split(m.VFSOptions, ",")})
	}
	return out, nil
}

// hierarchy is one mounted hierarchy stagelet uses.
type hierarchy struct {
	keys []string // Paths keys it serves
	m    mount
}

func (e *env) hierarchies() ([]hierarchy, error) {
	if e.v2 {
		var best *mount
		for i := range e.mounts {
			m := &e.mounts[i]
			if m.fstype != "cgroup2" {
				continue
			}
			if best == nil || m.point == "/sys/fs/cgroup" {
				best = m
			}
		}
		if best == nil {
			return nil, errors.New("cgroups: no cgroup2 mount")
		}
		return []hierarchy{{keys: []string{Unified}, m: *best}}, nil
	}
	var out []hierarchy
	seen := map[string]int{} // mount point → index in out
	for _, ctl := range v1Controllers {
		for _, m := range e.mounts {
			if m.fstype != "cgroup" || !contains(m.opts, ctl) {
				continue
			}
			if i, ok := seen[m.point]; ok {
				out[i].keys = append(out[i].keys, ctl)
			} else {
				seen[m.point] = len(out)
				out = append(out, hierarchy{keys: []string{ctl}, m: m})
			}
			break
		}
	}
	if len(out) == 0 {
		return nil, errors.New("cgroups: no cgroup v1 controller mounted")
	}
	return out, nil
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// dirFor maps a cgroup path to its directory under a mount.
func dirFor(m mount, cgPath string) string {
	rel := cgPath
	if m.root != "/" {
		if r, ok := strings.CutPrefix(cgPath, m.root); ok && (r == "" || r[0] == '/') {
			rel = r
		}
	}
	return filepath.Join(m.point, filepath.Clean("/"+rel))
}

func (e *env) self() (*Cgroup, error) {
	hs, err := e.hierarchies()
	if err != nil {
		return nil, err
	}
	c := &Cgroup{Paths: map[string]string{}}
	for _, h := range hs {
		var p string
		var ok bool
		if e.v2 {
			p, ok = e.procs[""]
		} else {
			p, ok = e.procs[h.keys[0]]
		}
		if !ok {
			continue
		}
		d := dirFor(h.m, p)
		for _, k := range h.keys {
			c.Paths[k] = d
		}
	}
	if len(c.Paths) == 0 {
		return nil, errors.New("cgroups: the caller is in no managed cgroup")
	}
	return c, nil
}

func (e *env) resolve(parent string) (*Cgroup, error) {
	if parent == "" {
		return nil, errors.New("cgroups: empty cgroup parent")
	}
	if !filepath.IsAbs(parent) {
		if base := delegated.Load(); base != nil {
			return base.Child(parent), nil
		}
		self, err := e.self()
		if err != nil {
			return nil, err
		}
		return self.Child(parent), nil
	}
	hs, err := e.hierarchies()
	if err != nil {
		return nil, err
	}
	c := &Cgroup{Paths: map[string]string{}}
	for _, h := range hs {
		d := dirFor(h.m, filepath.Clean(parent))
		for _, k := range h.keys {
			c.Paths[k] = d
		}
	}
	return c, nil
}

// Self returns the caller's own cgroups, read from /proc/self/cgroup and
// /proc/self/mountinfo.
func Self() (*Cgroup, error) {
	e, err := loadEnv()
	if err != nil {
		return nil, err
	}
	return e.self()
}

// OfProcess returns the cgroups of the process pid, read from
// /proc/PID/cgroup and the caller's /proc/self/mountinfo: where pid runs,
// in the hierarchies this package manages, as directories the caller can
// reach. Meant for a process that shares the caller's cgroup namespace
// (one a service manager started). An error wrapping fs.ErrNotExist means
// no such process.
func OfProcess(pid int) (*Cgroup, error) {
	e, err := loadEnvOf("/proc/" + strconv.Itoa(pid) + "/cgroup")
	if err != nil {
		return nil, err
	}
	return e.self()
}

// Resolve returns the cgroup named by parent: an absolute cgroup path
// ("/stagelet", from the root of each hierarchy) or a relative one
// ("stagelet", beneath the caller's own cgroup in each hierarchy; after
// EnterLeaf moved the caller, beneath the cgroup it left). It does not
// create anything.
func Resolve(parent string) (*Cgroup, error) {
	e, err := loadEnv()
	if err != nil {
		return nil, err
	}
	return e.resolve(parent)
}

// Child returns the cgroup name beneath c in every hierarchy. No I/O.
func (c *Cgroup) Child(name string) *Cgroup {
	n := &Cgroup{Paths: make(map[string]string, len(c.Paths))}
	for k, p := range c.Paths {
		n.Paths[k] = filepath.Join(p, filepath.Clean("/"+name))
	}
	return n
}

// dirs returns the distinct directories of c, sorted.
func (c *Cgroup) dirs() []string {
	seen := map[string]bool{}
	var out []string
	for _, p := range c.Paths {
		if !seen[p] {
			seen[p] = true
			out = append(out, p)
		}
	}
	sort.Strings(out)
	return out
}

// Create makes c's directory in every hierarchy (parents included). In v2
// mode it then makes the cpu, memory and pids controllers available to c
// where the hierarchy offers them, enabling them in the ancestors that lack
// them; a layout where that would break cgroup v2's rules (an ancestor
// holding processes, a threaded ancestor) is an error wrapping ErrLayout
// that names the cgroup. Idempotent.
func (c *Cgroup) Create() error {
	for _, d := range c.dirs() {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return fmt.Errorf("cgroups: create: %w", err)
		}
	}
	if p, ok := c.Paths[Unified]; ok {
		return delegateV2(v2RootOf(p), p)
	}
	if p, ok := c.Paths["cpuset"]; ok {
		return initCpusetV1(p)
	}
	return nil
}

// initCpusetV1 gives dir, and each ancestor up to the first one that has
// them, the CPUs and memory nodes of its parent: a v1 cpuset cgroup starts
// with none, and no process can join it until it has some.
func initCpusetV1(dir string) error {
	var chain []string // dir and its ancestors without cpus or mems, deepest first
	for d := filepath.Clean(dir); ; d = filepath.Dir(d) {
		cpus, err := readFile(d, "cpuset.cpus")
		if err != nil {
			return fmt.Errorf("cgroups: cpuset: %w", err)
		}
		mems, err := readFile(d, "cpuset.mems")
		if err != nil {
			return fmt.Errorf("cgroups: cpuset: %w", err)
		}
		if cpus != "" && mems != "" {
			break
		}
		if _, err := os.Stat(filepath.Join(filepath.Dir(d), "cpuset.cpus")); d == "/" || err != nil {
			return fmt.Errorf("cgroups: cpuset: %s has no CPUs or memory nodes, nor a parent to take them from", d)
		}
		chain = append(chain, d)
	}
	for i := len(chain) - 1; i >= 0; i-- {
		d := chain[i]
		for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
			if v, err := readFile(d, f); err != nil {
				return fmt.Errorf("cgroups: cpuset: %w", err)
			} else if v != "" {
				continue
			}
			v, err := readFile(filepath.Dir(d), f)
			if err != nil {
				return fmt.Errorf("cgroups: cpuset: %w", err)
			}
			if err := writeFile(d, f, v); err != nil {
				return fmt.Errorf("cgroups: cpuset: %s=%s in %s: %w", f, v, d, err)
			}
		}
	}
	return nil
}

// Add moves the process pid (all its threads) into c in every hierarchy.
func (c *Cgroup) Add(pid int) error {
	for _, d := range c.dirs() {
		if err := writeFile(d, "cgroup.procs", strconv.Itoa(pid)); err != nil {
			return fmt.Errorf("cgroups: add %d: %w", pid, err)
		}
	}
	return nil
}

func writeFile(dir, name, val string) error {
	// cgroup files are written with one write(2); os.WriteFile does that.
	return os.WriteFile(filepath.Join(dir, name), []byte(val), 0)
}

func readFile(dir, name string) (string, error) {
	b, err := os.ReadFile(filepath.Join(dir, name))
	return strings.TrimSpace(string(b)), err
}

// SharesToWeight converts v1 cpu.shares ([2, 262144]) to v2 cpu.weight
// ([1, 10000]) linearly.
func SharesToWeight(shares int64) int64 {
	if shares <= 0 {
		return 0
	}
	if shares < 2 {
		shares = 2
	}
	if shares > 262144 {
		shares = 262144
	}
	return 1 + (shares-2)*9999/262142
}

// Set applies the non-zero fields of r.
func (c *Cgroup) Set(r Resources) error {
	if p, ok := c.Paths[Unified]; ok {
		return setV2(p, r)
	}
	type kv struct{ ctl, file, val string }
	var w []kv
	if r.CPUShares != 0 {
		w = append(w, kv{"cpu", "cpu.shares", strconv.FormatInt(r.CPUShares, 10)})
	}
	if r.CPUPeriod != 0 {
		w = append(w, kv{"cpu", "cpu.cfs_period_us", strconv.FormatInt(r.CPUPeriod, 10)})
	}
	if r.CPUQuota != 0 {
		q := r.CPUQuota
		if q < 0 {
			q = -1
		}
		w = append(w, kv{"cpu", "cpu.cfs_quota_us", strconv.FormatInt(q, 10)})
	}
	if r.MemoryLimit != 0 {
		w = append(w, kv{"memory", "memory.limit_in_bytes", strconv.FormatInt(r.MemoryLimit, 10)})
	}
	if r.MemorySwap != 0 {
		sw := kv{"memory", "memory.memsw.limit_in_bytes", strconv.FormatInt(max(r.MemorySwap, -1), 10)}
		// memsw may not go below the memory limit: when it grows past
		// the current limit, it is written first (as runc does).
		cur, err := readUint(c.Paths["memory"], "memory.limit_in_bytes")
		if r.MemoryLimit != 0 && (r.MemorySwap < 0 || (err == nil && cur < uint64(r.MemorySwap))) {
			limit := w[len(w)-1]
			w = append(w[:len(w)-1], sw, limit)
		} else {
			w = append(w, sw)
		}
	}
	if r.MemoryReservation != 0 {
		w = append(w, kv{"memory", "memory.soft_limit_in_bytes", strconv.FormatInt(max(r.MemoryReservation, -1), 10)})
	}
	for _, h := range r.HugepageLimits {
		if err := checkPageSize(h.PageSize); err != nil {
			return err
		}
		w = append(w, kv{"hugetlb", "hugetlb." + h.PageSize + ".limit_in_bytes", strconv.FormatUint(h.Limit, 10)})
	}
	if r.PidsLimit != 0 {
		v := "max"
		if r.PidsLimit > 0 {
			v = strconv.FormatInt(r.PidsLimit, 10)
		}
		w = append(w, kv{"pids", "pids.max", v})
	}
	if r.CpusetCpus != "" {
		w = append(w, kv{"cpuset", "cpuset.cpus", r.CpusetCpus})
	}
	if r.CpusetMems != "" {
		w = append(w, kv{"cpuset", "cpuset.mems", r.CpusetMems})
	}
	if r.OOMGroup {
		return fmt.Errorf("cgroups: memory.oom.group: cgroup v1 has no OOM groups")
	}
	for _, x := range w {
		d, ok := c.Paths[x.ctl]
		if !ok {
			return fmt.Errorf("cgroups: set %s: controller %s not mounted", x.file, x.ctl)
		}
		if err := writeFile(d, x.file, x.val); err != nil {
			return fmt.Errorf("cgroups: set %s=%s: %w", x.file, x.val, err)
		}
	}
	return nil
}

func setV2(d string, r Resources) error {
	type kv struct{ file, val string }
	var w []kv
	if r.CPUShares != 0 {
		w = append(w, kv{"cpu.weight", strconv.FormatInt(SharesToWeight(r.CPUShares), 10)})
	}
	if r.CPUQuota != 0 || r.CPUPeriod != 0 {
		quota := "max"
		if r.CPUQuota > 0 {
			quota = strconv.FormatInt(r.CPUQuota, 10)
		}
		val := quota
		if r.CPUPeriod > 0 {
			val += " " + strconv.FormatInt(r.CPUPeriod, 10)
		}
		w = append(w, kv{"cpu.max", val})
	}
	if r.MemoryLimit != 0 {
		v := "max"
		if r.MemoryLimit > 0 {
			v = strconv.FormatInt(r.MemoryLimit, 10)
		}
		w = append(w, kv{"memory.max", v})
	}
	if r.MemorySwap != 0 {
		v, err := swapV2(r.MemorySwap, r.MemoryLimit)
		if err != nil {
			return err
		}
		w = append(w, kv{"memory.swap.max", v})
	}
	if r.MemoryReservation != 0 {
		v := "max"
		if r.MemoryReservation > 0 {
			v = strconv.FormatInt(r.MemoryReservation, 10)
		}
		w = append(w, kv{"memory.low", v})
	}
	for _, h := range r.HugepageLimits {
		if err := checkPageSize(h.PageSize); err != nil {
			return err
		}
		w = append(w, kv{"hugetlb." + h.PageSize + ".max", strconv.FormatUint(h.Limit, 10)})
	}
	if r.PidsLimit != 0 {
		v := "max"
		if r.PidsLimit > 0 {
			v = strconv.FormatInt(r.PidsLimit, 10)
		}
		w = append(w, kv{"pids.max", v})
	}
	if r.CpusetCpus != "" {
		w = append(w, kv{"cpuset.cpus", r.CpusetCpus})
	}
	if r.CpusetMems != "" {
		w = append(w, kv{"cpuset.mems", r.CpusetMems})
	}
	if r.OOMGroup {
		w = append(w, kv{"memory.oom.group", "1"})
	}
	for _, x := range w {
		if err := writeFile(d, x.file, x.val); err != nil {
			return fmt.Errorf("cgroups: set %s=%s: %w", x.file, x.val, err)
		}
	}
	return nil
}

// walk returns dir and every cgroup directory beneath it, parents before
// children. A missing dir yields nothing.
func walk(dir string) []string {
	var out []string
	_ = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			if p == dir {
				return err
			}
			return nil // a child vanished while walking
		}
		if d.IsDir() {
			out = append(out, p)
		}
		return nil
	})
	return out
}

// Procs returns the PIDs of every process in c or in a cgroup beneath it,
// in any hierarchy, sorted and without duplicates. A cgroup that does not
// exist holds no process.
func (c *Cgroup) Procs() ([]int, error) {
	set := map[int]bool{}
	for _, root := range c.dirs() {
		for _, d := range walk(root) {
			s, err := readFile(d, "cgroup.procs")
			if err != nil {
				if errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ENODEV) {
					continue
				}
				return nil, fmt.Errorf("cgroups: procs: %w", err)
			}
			for _, f := range strings.Fields(s) {
				if pid, err := strconv.Atoi(f); err == nil && pid > 0 {
					set[pid] = true
				}
			}
		}
	}
	out := make([]int, 0, len(set))
	for p := range set {
		out = append(out, p)
	}
	sort.Ints(out)
	return out, nil
}

// KillTimeout bounds Kill.
var KillTimeout = 10 * time.Second

// Kill sends SIGKILL to every process in c and beneath it and waits until
// none is left, at most KillTimeout. With a v1 freezer (or v2 cgroup.freeze)
// the cgroup is frozen first so that no process forks while being swept;
// in v2 cgroup.kill is used where the kernel has it. A cgroup that does not
// exist is already empty: not an error. It returns an error when processes
// remain after the bound.
func (c *Cgroup) Kill() error {
	deadline := time.Now().Add(KillTimeout)
	if p, ok := c.Paths[Unified]; ok {
		if err := writeFile(p, "cgroup.kill", "1"); err == nil {
			return c.waitEmpty(deadline)
		}
	}
	thaw := c.freeze(time.Now().Add(time.Second))
	err := c.sweep()
	thaw()
	if err != nil {
		return err
	}
	return c.waitEmpty(deadline)
}

// Freeze pauses every process of c with the cgroup freezer (v2's
// cgroup.freeze, v1's freezer.state) and returns once the kernel says
// they are, with the function that resumes them. ErrNoFreezer when c has
// no freezer; the context's error when they are not frozen by its end (c
// is thawed again then).
func (c *Cgroup) Freeze(ctx context.Context) (thaw func() error, err error) {
	dir, file, on, off, done := "", "", "", "", ""
	if d, ok := c.Paths[Unified]; ok {
		dir, file, on, off, done = d, "cgroup.freeze", "1", "0", "frozen 1"
	} else if d, ok := c.Paths["freezer"]; ok {
		dir, file, on, off, done = d, "freezer.state", "FROZEN", "THAWED", "FROZEN"
	} else {
		return nil, ErrNoFreezer
	}
	thaw = func() error { return writeFile(dir, file, off) }
	if err := writeFile(dir, file, on); err != nil {
		return nil, err
	}
	state := file
	if file == "cgroup.freeze" {
		state = "cgroup.events"
	}
	for {
		s, err := readFile(dir, state)
		if err != nil {
			_ = thaw()
			return nil, err
		}
		if strings.Contains(s, done) {
			return thaw, nil
		}
		select {
		case <-ctx.Done():
			_ = thaw()
			return nil, fmt.Errorf("cgroups: freeze %s: %w", dir, ctx.Err())
		case <-time.After(5 * time.Millisecond): // polling the kernel's state
		}
	}
}

// ErrNoFreezer says a cgroup has no freezer to pause its processes with.
var ErrNoFreezer = errors.New("cgroups: no freezer")

// freeze freezes c (best effort, bounded) and returns the function that
// thaws it.
func (c *Cgroup) freeze(deadline time.Time) (thaw func()) {
	if d, ok := c.Paths["freezer"]; ok {
		if writeFile(d, "freezer.state", "FROZEN") != nil {
			return func() {}
		}
		for time.Now().Before(deadline) {
			s, err := readFile(d, "freezer.state")
			if err != nil || s == "FROZEN" {
				break
			}
			time.Sleep(5 * time.Millisecond) // polling the kernel's state
		}
		return func() { _ = writeFile(d, "freezer.state", "THAWED") }
	}
	if d, ok := c.Paths[Unified]; ok {
		if writeFile(d, "cgroup.freeze", "1") != nil {
			return func() {}
		}
		for time.Now().Before(deadline) {
			s, err := readFile(d, "cgroup.events")
			if err != nil || strings.Contains(s, "frozen 1") {
				break
			}
			time.Sleep(5 * time.Millisecond)
		}
		return func() { _ = writeFile(d, "cgroup.freeze", "0") }
	}
	return func() {}
}

// sweep sends SIGKILL to every process currently listed.
func (c *Cgroup) sweep() error {
	pids, err := c.Procs()
	if err != nil {
		return err
	}
	for _, p := range pids {
		if err := unix.Kill(p, unix.SIGKILL); err != nil && !errors.Is(err, unix.ESRCH) {
			return fmt.Errorf("cgroups: kill %d: %w", p, err)
		}
	}
	return nil
}

// waitEmpty sweeps until no process is left or the deadline passes.
func (c *Cgroup) waitEmpty(deadline time.Time) error {
	delay := time.Millisecond
	for {
		pids, err := c.Procs()
		if err != nil {
			return err
		}
		if len(pids) == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("cgroups: %d processes left in %s after SIGKILL: %v", len(pids), c, pids)
		}
		if err := c.sweep(); err != nil {
			return err
		}
		time.Sleep(delay) // waiting for the kernel to reap; no event to wait on in v1
		if delay < 50*time.Millisecond {
			delay *= 2
		}
	}
}

// DeleteTimeout bounds how long Delete retries a busy cgroup.
var DeleteTimeout = 5 * time.Second

// Delete removes c and every cgroup beneath it, children first, in every
// hierarchy. Idempotent: what is already gone is skipped. It fails (EBUSY)
// if processes remain; call Kill first.
func (c *Cgroup) Delete() error {
	deadline := time.Now().Add(DeleteTimeout)
	for _, root := range c.dirs() {
		ds := walk(root)
		for i := len(ds) - 1; i >= 0; i-- {
			if err := rmdir(ds[i], deadline); err != nil {
				return fmt.Errorf("cgroups: delete: %w", err)
			}
		}
	}
	return nil
}

// rmdir removes a cgroup directory, retrying while the kernel still counts
// exiting tasks in it.
func rmdir(d string, deadline time.Time) error {
	delay := time.Millisecond
	for {
		err := unix.Rmdir(d)
		if err == nil || errors.Is(err, unix.ENOENT) {
			return nil
		}
		if !errors.Is(err, unix.EBUSY) || time.Now().After(deadline) {
			return &os.PathError{Op: "rmdir", Path: d, Err: err}
		}
		time.Sleep(delay)
		if delay < 50*time.Millisecond {
			delay *= 2
		}
	}
}

// readKV parses "key value" lines.
func readKV(dir, name string) (map[string]uint64, error) {
	s, err := readFile(dir, name)
	if err != nil {
		return nil, err
	}
	out := map[string]uint64{}
	for _, line := range strings.Split(s, "\n") {
		f := strings.Fields(line)
		if len(f) != 2 {
			continue
		}
		if v, err := strconv.ParseUint(f[1], 10, 64); err == nil {
			out[f[0]] = v
		}
	}
	return out, nil
}

func readUint(dir, name string) (uint64, error) {
	s, err := readFile(dir, name)
	if err != nil {
		return 0, err
	}
	if s == "max" {
		return 0, nil
	}
	return strconv.ParseUint(s, 10, 64)
}

// Stats reads c's usage (descendants included). Controllers that are not
// mounted leave their figures zero; a missing cgroup is an error wrapping
// fs.ErrNotExist.
func (c *Cgroup) Stats() (*Stats, error) {
	if d, ok := c.Paths[Unified]; ok {
		return statsV2(d)
	}
	var st Stats
	var err error
	wrap := func(e error) error { return fmt.Errorf("cgroups: stats: %w", e) }
	if d, ok := c.Paths["cpuacct"]; ok {
		if st.CPUUsageNanos, err = readUint(d, "cpuacct.usage"); err != nil {
			return nil, wrap(err)
		}
	}
	if d, ok := c.Paths["memory"]; ok {
		if st.MemoryUsage, err = readUint(d, "memory.usage_in_bytes"); err != nil {
			return nil, wrap(err)
		}
		kv, err := readKV(d, "memory.stat")
		if err != nil {
			return nil, wrap(err)
		}
		pick := func(k string) uint64 {
			if v, ok := kv["total_"+k]; ok {
				return v
			}
			return kv[k]
		}
		st.MemoryRSS = pick("rss")
		st.PageFaults = pick("pgfault")
		st.MajorPageFaults = pick("pgmajfault")
		st.MemoryWorkingSet = workingSet(st.MemoryUsage, pick("inactive_file"))
	}
	if d, ok := c.Paths["pids"]; ok {
		if st.Pids, err = readUint(d, "pids.current"); err != nil {
			return nil, wrap(err)
		}
	}
	return &st, nil
}

func workingSet(usage, inactive uint64) uint64 {
	if inactive > usage {
		return 0
	}
	return usage - inactive
}

func statsV2(d string) (*Stats, error) {
	var st Stats
	wrap := func(e error) error { return fmt.Errorf("cgroups: stats: %w", e) }
	cpu, err := readKV(d, "cpu.stat")
	if err != nil {
		return nil, wrap(err)
	}
	st.CPUUsageNanos = cpu["usage_usec"] * 1000
	if v, err := readUint(d, "memory.current"); err == nil {
		st.MemoryUsage = v
		if kv, err := readKV(d, "memory.stat"); err == nil {
			st.MemoryRSS = kv["anon"]
			st.PageFaults = kv["pgfault"]
			st.MajorPageFaults = kv["pgmajfault"]
			st.MemoryWorkingSet = workingSet(v, kv["inactive_file"])
		}
	} else if !errors.Is(err, fs.ErrNotExist) {
		return nil, wrap(err)
	}
	if v, err := readUint(d, "pids.current"); err == nil {
		st.Pids = v
	} else if !errors.Is(err, fs.ErrNotExist) {
		return nil, wrap(err)
	}
	return &st, nil
}

// OOMKills returns how many processes the kernel's OOM killer killed in c
// (v1 memory.oom_control, v2 memory.events, field oom_kill). Zero when the
// kernel does not count them; an error wrapping fs.ErrNotExist when the
// cgroup is gone.
func (c *Cgroup) OOMKills() (uint64, error) {
	var d, file string
	if p, ok := c.Paths[Unified]; ok {
		d, file = p, "memory.events"
	} else if p, ok := c.Paths["memory"]; ok {
		d, file = p, "memory.oom_control"
	} else {
		return 0, errors.New("cgroups: memory controller not mounted")
	}
	kv, err := readKV(d, file)
	if err != nil {
		return 0, fmt.Errorf("cgroups: oom kills: %w", err)
	}
	return kv["oom_kill"], nil
}

// WatchOOM (cgroup v1) returns a channel that receives a value after OOM
// events in c's memory cgroup (memory.oom_control through
// cgroup.event_control; events that come while one is pending are one)
// and is closed once watching ends: stop was called, or the cgroup was
// removed. cgroup v2 has its own OOM groups (Resources.OOMGroup) and
// refuses.
func (c *Cgroup) WatchOOM() (events <-chan struct{}, stop func(), err error) {
	if c.IsV2() {
		return nil, nil, errors.New("cgroups: watching OOM events is cgroup v1's; v2 has memory.oom.group")
	}
	d, ok := c.Paths["memory"]
	if !ok {
		return nil, nil, errors.New("cgroups: memory controller not mounted")
	}
	ctl, err := os.Open(filepath.Join(d, "memory.oom_control"))
	if err != nil {
		return nil, nil, fmt.Errorf("cgroups: watch OOM: %w", err)
	}
	efd, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err != nil {
		ctl.Close()
		return nil, nil, fmt.Errorf("cgroups: watch OOM: eventfd: %w", err)
	}
	ev := os.NewFile(uintptr(efd), "oom-events") // pollable: Close ends a Read
	if err := writeFile(d, "cgroup.event_control", fmt.Sprintf("%d %d", efd, ctl.Fd())); err != nil {
		ev.Close()
		ctl.Close()
		return nil, nil, fmt.Errorf("cgroups: watch OOM: %w", err)
	}
	ch := make(chan struct{}, 1)
	go func() {
		defer close(ch)
		defer ctl.Close()
		var buf [8]byte
		for {
			if _, err := ev.Read(buf[:]); err != nil {
				return // stopped
			}
			// The kernel signals a removed cgroup's watchers too.
			if _, err := os.Stat(ctl.Name()); err != nil {
				ev.Close()
				return
			}
			select {
			case ch <- struct{}{}:
			default:
			}
		}
	}()
	return ch, func() { ev.Close() }, nil
}

// delegateFiles are the files of a cgroup its owner needs to manage the
// cgroups beneath it (cgroup v2's delegation, and v1's equivalents).
var delegateFiles = []string{"cgroup.procs", "tasks", "cgroup.subtree_control", "cgroup.threads", "cgroup.clone_children"}

// Chown delegates c to uid and gid: its directory in every hierarchy and
// the files that create and fill cgroups beneath it, so that a process
// of theirs (a pod's root in a user namespace) makes and limits its own
// children. Its own limits stay root's. Files a hierarchy lacks are
// skipped.
func (c *Cgroup) Chown(uid, gid int) error {
	for _, d := range c.dirs() {
		if err := os.Chown(d, uid, gid); err != nil {
			return fmt.Errorf("cgroups: delegate %s: %w", d, err)
		}
		for _, f := range delegateFiles {
			if err := os.Chown(filepath.Join(d, f), uid, gid); err != nil && !errors.Is(err, fs.ErrNotExist) {
				return fmt.Errorf("cgroups: delegate %s: %w", d, err)
			}
		}
	}
	return nil
}

// unlimitedV1 is where cgroup v1 memory limits start to mean "none": the
// kernel reports no limit as its page counter's maximum in bytes
// (9223372036854771712 with 4 KiB pages).
const unlimitedV1 = 1 << 62

// MemoryLimit is the most memory c's processes may use together: the
// lowest limit of c and its ancestors (memory.limit_in_bytes in v1,
// memory.max in v2), 0 when none sets one or the memory controller is not
// mounted. Directories that do not exist yet (a cgroup about to be
// created) are passed over.
func (c *Cgroup) MemoryLimit() (uint64, error) {
	dir, file := c.Paths["memory"], "memory.limit_in_bytes"
	if p, ok := c.Paths[Unified]; ok {
		dir, file = p, "memory.max"
	}
	if dir == "" {
		return 0, nil
	}
	var lowest uint64
	for d := filepath.Clean(dir); ; d = filepath.Dir(d) {
		v, err := readUint(d, file)
		switch {
		case errors.Is(err, fs.ErrNotExist):
			if _, serr := os.Stat(d); serr == nil {
				return lowest, nil // the hierarchy's root: no file there
			}
		case err != nil:
			return 0, fmt.Errorf("cgroups: memory limit: %w", err)
		case v > 0 && v < unlimitedV1 && (lowest == 0 || v < lowest):
			lowest = v
		}
		if filepath.Dir(d) == d {
			return lowest, nil
		}
	}
}
