package broker

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/moby/sys/mountinfo"

	"github.com/stagelet/stagelet/cgroups"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/mountsafe"
	"github.com/stagelet/stagelet/network"
)

// This file is the operator's side of set-aside records (stagelet doctor,
// stagelet gc): what a record recovery could not read still names on the
// node, and releasing it, with the daemon that owns the state directory
// stopped. Releasing goes through the collectors recovery uses for pods no
// record names, limited to the IDs asked for.

// SetAsideRecord is a record recovery leaves alone: one in quarantine (it
// could not be read) or one a newer stagelet wrote, and what its pod or
// container still holds on this node.
type SetAsideRecord struct {
	Kind   string `json:"kind"` // "pod" or "container"
	ID     string `json:"id"`
	Path   string `json:"path"`   // the record's file
	Reason string `json:"reason"` // why it was set aside
	// PodID is a container's pod, when a readable record says which.
	PodID string   `json:"podID,omitempty"`
	Holds Holdings `json:"holds"`
}

// Holdings is what a pod (or a container) holds on the node, found
// without its record: its cgroups and the processes in them, the mounts
// beneath its directories, its network namespace and addresses, and the
// containers whose readable records name it.
type Holdings struct {
	Processes  []int    `json:"processes,omitempty"`
	Cgroups    []string `json:"cgroups,omitempty"`
	Mounts     []string `json:"mounts,omitempty"`
	NetNS      string   `json:"netns,omitempty"`
	Addresses  []string `json:"addresses,omitempty"`
	Containers []string `json:"containers,omitempty"`
	// Dirs are its directories in the state and run directories.
	Dirs []string `json:"dirs,omitempty"`
}

// Empty reports whether nothing is held.
func (h Holdings) Empty() bool {
	return len(h.Processes) == 0 && len(h.Cgroups) == 0 && len(h.Mounts) == 0 && h.NetNS == "" &&
		len(h.Addresses) == 0 && len(h.Containers) == 0 && len(h.Dirs) == 0
}

// releasedDir keeps the records of what gc released, for forensics; they
// are no longer set aside.
const releasedDir = "released"

// SetAsideRecords lists the set-aside records of the state directory and
// what each names. It reads; it changes nothing.
func (b *Broker) SetAsideRecords(ctx context.Context) ([]SetAsideRecord, error) {
	_, ctrs, bad, err := b.rec.loadAll(false)
	if err != nil {
		return nil, err
	}
	var out []SetAsideRecord
	for path, br := range bad {
		out = append(out, SetAsideRecord{Kind: kindOf(filepath.Base(filepath.Dir(path))), ID: br.ID, Path: path, Reason: br.Reason})
	}
	qdir := filepath.Join(b.rec.dir, "quarantine")
	ents, _ := os.ReadDir(qdir)
	for _, e := range ents {
		kind, rest, ok := strings.Cut(e.Name(), "-")
		id, _, ok2 := strings.Cut(rest, ".json")
		if e.IsDir() || !ok || !ok2 || id == "" {
			continue
		}
		out = append(out, SetAsideRecord{Kind: kindOf(kind), ID: id, Path: filepath.Join(qdir, e.Name()), Reason: "in quarantine: " + unreadable(filepath.Join(qdir, e.Name()))})
	}
	for i := range out {
		r := &out[i]
		if r.Kind == "container" {
			r.PodID = podOfContainer(r.Path)
			r.Holds = b.containerHoldings(r.ID)
			continue
		}
		r.Holds = b.podHoldings(ctx, r.ID, ctrs)
	}
	slices.SortFunc(out, func(a, b SetAsideRecord) int { return strings.Compare(a.Path, b.Path) })
	return out, nil
}

func kindOf(dir string) string {
	switch dir {
	case "pods", "pod":
		return "pod"
	case "containers", "container":
		return "container"
	}
	return dir
}

// unreadable says why a quarantined record cannot be read.
func unreadable(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	var v struct {
		Version int `json:"version"`
	}
	if err := json.Unmarshal(b, &v); err != nil {
		return err.Error()
	}
	if err := checkVersion(v.Version); err != nil {
		return err.Error()
	}
	return "set aside by an earlier start"
}

// podOfContainer reads the pod ID from a container record that may be
// torn: "" when it cannot.
func podOfContainer(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	var c struct {
		PodID string `json:"podID"`
	}
	if json.Unmarshal(b, &c) == nil && cgroups.ValidPodID(c.PodID) {
		return c.PodID
	}
	return ""
}

// podHoldings finds what pod id holds: the cgroups named after it (in the
// node's cgroup parent, and wherever a process of it runs), the mounts
// beneath its run directory, its netns and cached addresses, and the
// containers whose records name it, with their file systems.
func (b *Broker) podHoldings(ctx context.Context, id string, ctrs []*ContainerRecord) Holdings {
	var h Holdings
	cgs, procs := podCgroups(id, b.NodeCgroup())
	for _, c := range cgs {
		h.Cgroups = append(h.Cgroups, c.String())
	}
	h.Processes = procs
	runDir := filepath.Join(b.podsRunDir(), id)
	if _, err := os.Lstat(runDir); err == nil {
		h.Dirs = append(h.Dirs, runDir)
	}
	h.Mounts = mountsUnder(runDir)
	if b.opts.Network != nil {
		ns := b.opts.Network.NetNSPath(id)
		if _, err := os.Lstat(ns); err == nil {
			h.NetNS = ns
			h.Mounts = append(h.Mounts, mountsUnder(ns)...)
		}
		if cr, ok := b.opts.Network.(interface {
			CachedResult(string) (*network.Result, error)
		}); ok {
			if res, err := cr.CachedResult(id); err == nil {
				h.Addresses = res.IPs
			}
		}
	}
	for _, c := range ctrs {
		if c.PodID != id {
			continue
		}
		h.Containers = append(h.Containers, c.ID)
		ch := b.containerHoldings(c.ID)
		h.Mounts = append(h.Mounts, ch.Mounts...)
		h.Dirs = append(h.Dirs, ch.Dirs...)
	}
	return h
}

// containerHoldings: a container's file system and what is mounted in it.
func (b *Broker) containerHoldings(id string) Holdings {
	var h Holdings
	d := filepath.Join(b.containersDir(), id)
	if _, err := os.Lstat(d); err == nil {
		h.Dirs = append(h.Dirs, d)
	}
	h.Mounts = mountsUnder(d)
	return h
}

// mountsUnder lists the mount points at or beneath dir.
func mountsUnder(dir string) []string {
	ms, err := mountinfo.GetMounts(mountinfo.PrefixFilter(dir))
	if err != nil {
		return nil
	}
	var out []string
	for _, m := range ms {
		out = append(out, m.Mountpoint)
	}
	slices.Sort(out)
	return slices.Compact(out)
}

// podCgroups finds the cgroups named after pod id: beneath the node's
// cgroup parent (nil: none known), and those any process on the node runs
// in (the kubelet may have placed the pod elsewhere), with the processes.
func podCgroups(id string, parent *cgroups.Cgroup) ([]*cgroups.Cgroup, []int) {
	name := cgroups.PodCgroupName(id)
	seen := map[string]bool{}
	var out []*cgroups.Cgroup
	add := func(c *cgroups.Cgroup) {
		if k := c.String(); !seen[k] {
			seen[k] = true
			out = append(out, c)
		}
	}
	if parent != nil {
		c := parent.Child(name)
		for _, d := range c.Paths {
			if _, err := os.Stat(d); err == nil {
				add(c)
				break
			}
		}
	}
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || !inCgroupNamed(pid, name) {
			continue
		}
		c, err := cgroups.OfProcess(pid)
		if err != nil {
			continue
		}
		if pc := truncateAt(c, name); pc != nil {
			add(pc)
		}
	}
	var procs []int
	for _, c := range out {
		p, _ := c.Procs()
		procs = append(procs, p...)
	}
	slices.Sort(procs)
	return out, slices.Compact(procs)
}

// inCgroupNamed reports whether process pid's cgroup path, in any
// hierarchy, has a component that is name or starts with name + "-" or
// "." (a systemd unit of the pod).
func inCgroupNamed(pid int, name string) bool {
	f, err := os.Open("/proc/" + strconv.Itoa(pid) + "/cgroup")
	if err != nil {
		return false
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		_, path, _ := strings.Cut(sc.Text(), ":")
		_, path, _ = strings.Cut(path, ":")
		for _, comp := range strings.Split(path, "/") {
			if podComponent(comp, name) {
				return true
			}
		}
	}
	return false
}

func podComponent(comp, name string) bool {
	return comp == name || strings.HasPrefix(comp, name+"-") || strings.HasPrefix(comp, name+".")
}

// truncateAt returns c cut after its first path component naming the
// pod, in the hierarchies where one does (the others hold more than the
// pod: they are left out); nil when none does.
func truncateAt(c *cgroups.Cgroup, name string) *cgroups.Cgroup {
	out := &cgroups.Cgroup{Paths: map[string]string{}}
	for k, d := range c.Paths {
		parts := strings.Split(d, "/")
		for i, p := range parts {
			if podComponent(p, name) {
				out.Paths[k] = strings.Join(parts[:i+1], "/")
				break
			}
		}
	}
	if len(out.Paths) == 0 {
		return nil
	}
	return out
}

// NodeCgroup is the node's pod cgroup parent (cgroupfs driver): the one
// configured, or the one the daemon recorded when it last started (an
// operator tool runs in another cgroup, where a relative parent means
// something else). nil when neither is known.
func (b *Broker) NodeCgroup() *cgroups.Cgroup {
	if p := b.opts.CgroupParent; p != "" && !b.opts.SystemdCgroup && cgroups.SliceOf(p) == "" {
		if c, err := cgroups.Resolve(p); err == nil {
			return c
		}
	}
	raw, err := os.ReadFile(b.nodeCgroupFile())
	if err != nil {
		return nil
	}
	var c cgroups.Cgroup
	if json.Unmarshal(raw, &c) != nil || len(c.Paths) == 0 {
		return nil
	}
	return &c
}

func (b *Broker) nodeCgroupFile() string { return filepath.Join(b.opts.StateDir, "node-cgroup.json") }

// recordNodeCgroup writes where the node's pod cgroups are, for operator
// tools (NodeCgroup).
func (b *Broker) recordNodeCgroup() {
	p := b.opts.CgroupParent
	switch {
	case p == "":
		return // an operator tool's broker: it keeps what the daemon wrote
	case b.opts.SystemdCgroup || cgroups.SliceOf(p) != "":
		removeIfExists(b.nodeCgroupFile())
		return
	}
	c, err := cgroups.Resolve(p)
	if err != nil {
		return
	}
	raw, _ := json.Marshal(c)
	if err := os.WriteFile(b.nodeCgroupFile(), raw, 0o600); err != nil {
		b.log.Warn("recording the node's pod cgroup parent for operator tools", "err", err)
	}
}

// ReleaseSetAside releases what the set-aside record of pod or container
// id names, as recovery releases a pod no record names: the processes in
// its cgroups are killed and the cgroups removed, the stage1's own host
// resources released, its address returned and its netns removed, its
// containers' file systems and its run directory unmounted and removed,
// never through a mount. The record itself moves to quarantine/released,
// kept for forensics. It must run with the daemon that owns the state
// directory stopped (the caller holds its lock) and without Recover.
//
// Errors: NotFound when id names no set-aside record; FailedPrecondition
// for a container whose pod is managed (remove that pod instead); what
// could not be released is named in the error, and the record stays.
func (b *Broker) ReleaseSetAside(ctx context.Context, id string) (Holdings, error) {
	recs, err := b.SetAsideRecords(ctx)
	if err != nil {
		return Holdings{}, err
	}
	var found []SetAsideRecord
	for _, r := range recs {
		if r.ID == id {
			found = append(found, r)
		}
	}
	if len(found) == 0 {
		return Holdings{}, errdefs.NotFound("no set-aside record names %s", id)
	}
	r := found[0]
	var paths []string // the records released with it
	for _, f := range found {
		paths = append(paths, f.Path)
	}
	// ctrIDs: the containers whose file systems go with it.
	ctrIDs := []string{id}
	if r.Kind == "container" {
		if r.PodID != "" {
			if _, err := os.Stat(b.rec.podPath(r.PodID)); err == nil {
				return r.Holds, errdefs.FailedPrecondition("container %s runs in pod %s, whose record is readable: remove that pod through the CRI (crictl stopp/rmp), which stops the container, then release this record", id, r.PodID)
			}
		}
	} else {
		ctrIDs = nil
		_, ctrs, _, _ := b.rec.loadAll(false)
		for _, c := range ctrs {
			if c.PodID == id {
				ctrIDs = append(ctrIDs, c.ID)
				paths = append(paths, b.rec.containerPath(c.ID))
			}
		}
		for _, c := range recs {
			if c.Kind == "container" && c.PodID == id {
				ctrIDs = append(ctrIDs, c.ID)
				paths = append(paths, c.Path)
			}
		}
		if err := b.releasePod(ctx, id); err != nil {
			return r.Holds, err
		}
	}
	for _, c := range ctrIDs {
		if err := b.opts.Images.UnmountRootfs(ctx, filepath.Join(b.containersDir(), c)); err != nil {
			return r.Holds, fmt.Errorf("container %s's file system: %w", c, err)
		}
	}
	// What is left, its containers' file systems included.
	var left Holdings
	if r.Kind == "pod" {
		left = b.podHoldings(ctx, id, nil)
	}
	for _, c := range ctrIDs {
		ch := b.containerHoldings(c)
		left.Mounts = append(left.Mounts, ch.Mounts...)
		left.Dirs = append(left.Dirs, ch.Dirs...)
	}
	if !left.Empty() {
		return left, fmt.Errorf("%s %s still holds %s; the record stays set aside", r.Kind, id, left)
	}
	for _, p := range paths {
		if err := b.rec.release(p); err != nil {
			return r.Holds, fmt.Errorf("keeping the released record %s: %w", p, err)
		}
	}
	return r.Holds, nil
}

// releasePod releases what pod id holds, its record unread.
func (b *Broker) releasePod(ctx context.Context, id string) error {
	var errs []error
	// The stage1's own host resources first (a unit is stopped through
	// systemd), then whatever still runs in a cgroup named after the pod.
	b.collectBackends(ctx, func(x string) bool { return x != id })
	cgs, _ := podCgroups(id, b.NodeCgroup())
	for _, c := range cgs {
		if err := c.Kill(); err != nil {
			errs = append(errs, fmt.Errorf("cgroup %s: %w", c, err))
		} else if err := c.Delete(); err != nil {
			errs = append(errs, fmt.Errorf("cgroup %s: %w", c, err))
		}
	}
	if b.opts.Network != nil {
		ns := b.opts.Network.NetNSPath(id)
		if _, err := os.Lstat(ns); err == nil {
			if err := b.teardownNetwork(ctx, &PodRecord{ID: id, NetNS: ns}, true); err != nil && !errors.Is(err, errdefs.ErrNotFound) {
				errs = append(errs, err)
			}
		}
	}
	if err := mountsafe.RemoveUnmounted(filepath.Join(b.podsRunDir(), id)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		errs = append(errs, fmt.Errorf("run directory: %w", err))
	}
	return errors.Join(errs...)
}

// String says what h holds, briefly.
func (h Holdings) String() string {
	var parts []string
	add := func(n int, what string) {
		if n > 0 {
			parts = append(parts, fmt.Sprintf("%d %s", n, what))
		}
	}
	add(len(h.Processes), "processes")
	add(len(h.Cgroups), "cgroups")
	add(len(h.Mounts), "mounts")
	if h.NetNS != "" {
		parts = append(parts, "a netns")
	}
	add(len(h.Addresses), "addresses")
	add(len(h.Containers), "containers")
	add(len(h.Dirs), "directories")
	if len(parts) == 0 {
		return "nothing"
	}
	return strings.Join(parts, ", ")
}

// ReleaseAll stops and removes every pod the state directory records, as
// the kubelet would through the CRI: for a node whose runtime is being
// removed. It runs with the daemon stopped, after Recover. Set-aside
// records are left alone.
func (b *Broker) ReleaseAll(ctx context.Context) (int, error) {
	var errs []error
	n := 0
	for _, p := range b.ListPods(PodFilter{}) {
		id := p.ID
		if err := b.StopPod(ctx, id); err != nil {
			errs = append(errs, fmt.Errorf("stop pod %s: %w", id, err))
			continue
		}
		if err := b.RemovePod(ctx, id); err != nil {
			errs = append(errs, fmt.Errorf("remove pod %s: %w", id, err))
			continue
		}
		n++
	}
	return n, errors.Join(errs...)
}
