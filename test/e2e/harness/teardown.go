package harness

import (
	"context"
	"errors"
	"fmt"
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
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// Leftovers are what Teardown found still held after every pod was removed
// through CRI and the daemon was stopped. Each is a defect of the daemon
// (or of a test that bypassed it); Teardown released them all the same.
type Leftovers struct {
	Processes []string
	Mounts    []string
	Cgroups   []string
	// Network: veths still on the daemon's bridge, IPAM allocations, and
	// iptables rules naming the daemon's pods.
	Network []string
}

// Empty reports whether nothing was left over.
func (l Leftovers) Empty() bool {
	return len(l.Processes) == 0 && len(l.Mounts) == 0 && len(l.Cgroups) == 0 && len(l.Network) == 0
}

func (l Leftovers) String() string {
	var parts []string
	if len(l.Processes) > 0 {
		parts = append(parts, "processes: "+strings.Join(l.Processes, "; "))
	}
	if len(l.Mounts) > 0 {
		parts = append(parts, "mounts: "+strings.Join(l.Mounts, "; "))
	}
	if len(l.Cgroups) > 0 {
		parts = append(parts, "cgroups: "+strings.Join(l.Cgroups, "; "))
	}
	if len(l.Network) > 0 {
		parts = append(parts, "network: "+strings.Join(l.Network, "; "))
	}
	if len(parts) == 0 {
		return "nothing"
	}
	return strings.Join(parts, "\n")
}

// RemoveAllPods stops and removes every pod the daemon lists. It is a no-op
// when the daemon does not run.
func (d *Daemon) RemoveAllPods(ctx context.Context) error {
	if !d.Running() {
		return nil
	}
	rt := d.Runtime()
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	resp, err := rt.ListPodSandbox(cctx, &runtimeapi.ListPodSandboxRequest{})
	if err != nil {
		return fmt.Errorf("list pods: %w", err)
	}
	var errs []error
	for _, p := range resp.Items {
		if _, err := rt.StopPodSandbox(cctx, &runtimeapi.StopPodSandboxRequest{PodSandboxId: p.Id}); err != nil {
			errs = append(errs, fmt.Errorf("stop pod %s: %w", p.Id, err))
		}
		if _, err := rt.RemovePodSandbox(cctx, &runtimeapi.RemovePodSandboxRequest{PodSandboxId: p.Id}); err != nil {
			errs = append(errs, fmt.Errorf("remove pod %s: %w", p.Id, err))
		}
	}
	return errors.Join(errs...)
}

// Teardown releases everything: it removes every pod through CRI (when the
// daemon runs), stops the daemon, then kills processes still running from
// the daemon's directories or cgroups, unmounts what is left beneath Root,
// removes the pods' cgroups and finally Root. It returns what it found left
// over after the CRI teardown and the daemon's stop, and the errors of the
// steps that failed. It is safe to call more than once.
func (d *Daemon) Teardown(ctx context.Context) (Leftovers, error) {
	var errs []error
	var left Leftovers
	if err := d.RemoveAllPods(ctx); err != nil {
		errs = append(errs, fmt.Errorf("CRI teardown: %w", err))
	}
	if err := d.Stop(ctx, 15*time.Second); err != nil {
		errs = append(errs, err)
	}
	if d.conn != nil {
		d.conn.Close()
	}
	if err := d.unmountState(); err != nil {
		errs = append(errs, err)
	}
	if _, err := os.Stat(d.Root); err != nil {
		return left, errors.Join(errs...)
	}

	left.Processes = d.killLeftoverProcesses()
	left.Network = d.releaseNetwork(ctx)
	left.Mounts = d.unmountLeftovers()
	cg, err := d.removeCgroups()
	left.Cgroups = cg
	if err != nil {
		errs = append(errs, err)
	}
	if b, err := os.ReadFile(d.LogPath); err == nil {
		d.savedLog = b
	}
	if err := os.RemoveAll(d.Root); err != nil {
		errs = append(errs, fmt.Errorf("remove %s: %w", d.Root, err))
	}
	return left, errors.Join(errs...)
}

// killLeftoverProcesses kills, by PID, every process that belongs to this
// daemon's pods: those in its pods' cgroups, those whose root or working
// directory lies beneath Root, and those whose command line names Root.
// Every such process descends from the daemon this harness started.
func (d *Daemon) killLeftoverProcesses() []string {
	var found []string
	self := os.Getpid()
	seen := map[int]bool{}
	for round := 0; round < 50; round++ {
		pids := d.leftoverPIDs(self)
		if len(pids) == 0 {
			break
		}
		for _, pid := range pids {
			if !seen[pid] {
				seen[pid] = true
				found = append(found, describePID(pid))
			}
			syscall.Kill(pid, syscall.SIGKILL)
		}
		time.Sleep(100 * time.Millisecond)
	}
	return found
}

func (d *Daemon) leftoverPIDs(self int) []int {
	pids := map[int]bool{}
	for dir := range d.podCgroupRoots() {
		filepath.WalkDir(dir, func(p string, e fs.DirEntry, err error) error {
			if err != nil || !e.IsDir() {
				return nil
			}
			b, err := os.ReadFile(filepath.Join(p, "cgroup.procs"))
			if err != nil {
				return nil
			}
			for _, f := range strings.Fields(string(b)) {
				if pid, err := strconv.Atoi(f); err == nil {
					pids[pid] = true
				}
			}
			return nil
		})
	}
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if d.processBelongs(pid) {
			pids[pid] = true
		}
	}
	var out []int
	for pid := range pids {
		if pid == self || pid <= 1 || isZombie(pid) {
			continue
		}
		out = append(out, pid)
	}
	sort.Ints(out)
	return out
}

func (d *Daemon) processBelongs(pid int) bool {
	under := func(p string) bool { return p == d.Root || strings.HasPrefix(p, d.Root+"/") }
	for _, link := range []string{"root", "cwd"} {
		if p, err := os.Readlink(fmt.Sprintf("/proc/%d/%s", pid, link)); err == nil && under(p) {
			return true
		}
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	return err == nil && strings.Contains(string(b), d.Root+"/")
}

func isZombie(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return true // gone
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	return i < 0 || i+2 >= len(s) || s[i+2] == 'Z' || s[i+2] == 'X'
}

func describePID(pid int) string {
	cmd, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	c := strings.TrimSpace(strings.ReplaceAll(string(cmd), "\x00", " "))
	if len(c) > 120 {
		c = c[:120] + "..."
	}
	return fmt.Sprintf("pid %d (%s)", pid, c)
}

// MountsUnder lists the mount points of this process's mount namespace
// that lie beneath dir, deepest first.
func MountsUnder(dir string) []string {
	ms, err := mountinfo.GetMounts(mountinfo.PrefixFilter(filepath.Clean(dir)))
	if err != nil {
		return nil
	}
	var out []string
	for _, m := range ms {
		out = append(out, m.Mountpoint)
	}
	sort.Slice(out, func(i, j int) bool {
		if ci, cj := strings.Count(out[i], "/"), strings.Count(out[j], "/"); ci != cj {
			return ci > cj
		}
		return out[i] > out[j]
	})
	return out
}

func (d *Daemon) unmountLeftovers() []string {
	var found []string
	for round := 0; round < 10; round++ {
		mps := MountsUnder(d.Root)
		if len(mps) == 0 {
			break
		}
		for _, mp := range mps {
			// The netns directory is bind-mounted onto itself (shared
			// propagation, as iproute2 does for /run/netns) for as long as
			// the node runs pods: infrastructure, not a pod's leftover.
			if round == 0 && mp != filepath.Join(d.RunDir, "netns") {
				found = append(found, mp)
			}
			if err := syscall.Unmount(mp, syscall.MNT_DETACH); err != nil && !errors.Is(err, syscall.EINVAL) && !errors.Is(err, syscall.ENOENT) {
				d.log.Warn("unmount leftover", "path", mp, "err", err)
			}
		}
	}
	return found
}

// recordCgroups notes the daemon's own cgroup directory in every hierarchy,
// beneath which its relative cgroup parent is resolved.
func (d *Daemon) recordCgroups(pid int) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		return
	}
	for _, dir := range daemonCgroupDirs(string(b), cgroupMounts()) {
		d.cgroupDirs[dir] = true
	}
}

// supervisorLeaf is the leaf of its cgroup a daemon moves into on a pure
// cgroup v2 host (cgroups.LeafName), so that its cgroup can delegate
// controllers to the pods' cgroups beside it.
const supervisorLeaf = "supervisor"

// daemonCgroupDirs maps a daemon's /proc/PID/cgroup to the directories its
// relative cgroup parent is resolved beneath, in every mounted hierarchy,
// cgroup v1 and v2 alike. In v2 a daemon found in its supervisor leaf
// (read after it moved there) resolves beneath the cgroup above the leaf.
func daemonCgroupDirs(procCgroup string, mounts []cgroupMount) []string {
	var out []string
	for _, line := range strings.Split(strings.TrimSpace(procCgroup), "\n") {
		parts := strings.SplitN(line, ":", 3)
		if len(parts) != 3 {
			continue
		}
		ctrls, path := parts[1], parts[2]
		if ctrls == "" && filepath.Base(path) == supervisorLeaf {
			path = filepath.Dir(path)
		}
		for _, m := range mounts {
			if m.matches(ctrls) {
				out = append(out, filepath.Join(m.point, path))
			}
		}
	}
	return out
}

// podCgroupRoots are the directories of the configured cgroup parent and
// of the kvm stage1's overhead cgroup in every hierarchy.
func (d *Daemon) podCgroupRoots() map[string]bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	out := map[string]bool{}
	for dir := range d.cgroupDirs {
		out[filepath.Join(dir, d.CgroupParent)] = true
		out[filepath.Join(dir, d.OverheadCgroup)] = true
	}
	return out
}

type cgroupMount struct {
	point string
	v2    bool
	opts  map[string]bool
}

func (m cgroupMount) matches(ctrls string) bool {
	if ctrls == "" {
		return m.v2
	}
	if m.v2 {
		return false
	}
	for _, c := range strings.Split(ctrls, ",") {
		if !m.opts[c] {
			return false
		}
	}
	return true
}

func cgroupMounts() []cgroupMount {
	ms, err := mountinfo.GetMounts(mountinfo.FSTypeFilter("cgroup", "cgroup2"))
	if err != nil {
		return nil
	}
	var out []cgroupMount
	for _, m := range ms {
		if m.FSType == "cgroup2" {
			out = append(out, cgroupMount{point: m.Mountpoint, v2: true})
			continue
		}
		opts := map[string]bool{}
		for _, o := range strings.Split(m.VFSOptions, ",") {
			opts[o] = true
		}
		out = append(out, cgroupMount{point: m.Mountpoint, opts: opts})
	}
	return out
}

// removeCgroups removes the cgroup parent's directories bottom-up. It
// returns the directories beneath the parent that were still there (the
// pods' own cgroups, a leak once their pods were removed).
func (d *Daemon) removeCgroups() ([]string, error) {
	var leftover []string
	var errs []error
	for root := range d.podCgroupRoots() {
		var dirs []string
		filepath.WalkDir(root, func(p string, e fs.DirEntry, err error) error {
			if err == nil && e.IsDir() {
				dirs = append(dirs, p)
			}
			return nil
		})
		for _, p := range dirs {
			if p != root {
				leftover = append(leftover, p)
			}
		}
		sort.Slice(dirs, func(i, j int) bool { return len(dirs[i]) > len(dirs[j]) })
		for _, p := range dirs {
			var err error
			for try := 0; try < 50; try++ {
				err = syscall.Rmdir(p)
				if err == nil || errors.Is(err, syscall.ENOENT) {
					err = nil
					break
				}
				time.Sleep(100 * time.Millisecond)
			}
			if err != nil {
				errs = append(errs, fmt.Errorf("rmdir cgroup %s: %w", p, err))
			}
		}
	}
	// The daemon's empty leaf, once it stopped, is its own: not a leak.
	for dir := range d.cgroupDirs {
		if err := syscall.Rmdir(filepath.Join(dir, supervisorLeaf)); err != nil && !errors.Is(err, syscall.ENOENT) {
			errs = append(errs, fmt.Errorf("rmdir the daemon's leaf: %w", err))
		}
	}
	sort.Strings(leftover)
	return leftover, errors.Join(errs...)
}

// unmountState unmounts the tmpfs New mounted at StateDir, if it did.
func (d *Daemon) unmountState() error {
	if !d.stateTmpfs {
		return nil
	}
	if err := unix.Unmount(d.StateDir, 0); err != nil {
		return fmt.Errorf("unmount the state tmpfs %s: %w", d.StateDir, err)
	}
	d.stateTmpfs = false
	return nil
}
