package cgroups

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
)

// v2Controllers are the cgroup2 controllers stagelet enables for the cgroups
// it creates, where the hierarchy offers them.
var v2Controllers = []string{"cpu", "memory", "pids"}

// v2Optional are controllers enabled where the layout allows: their
// absence only matters to a cgroup that is asked for their limits (Set
// then reports the missing file). Besides cpuset, whose limits stagelet
// sets, they are every other controller the node may delegate, as runc
// enables them: a container sees their files (io.max, hugetlb.*) in its
// cgroup, as under runc.
var v2Optional = []string{"cpuset", "io", "hugetlb", "misc", "rdma"}

func isRequired(c string) bool { return slices.Contains(v2Controllers, c) }

// ErrLayout says the cgroup layout stagelet was given cannot work under
// cgroup v2's rules: a cgroup that must delegate controllers holds
// processes (the no-internal-process rule), or is threaded. The message
// names the cgroup and the rule.
var ErrLayout = errors.New("cgroup layout not usable")

// delegateV2 makes the controllers of v2Controllers that the hierarchy
// offers available to dir: it enables them, top down from the mount root
// (root) to dir's parent, in the cgroup.subtree_control of every cgroup
// that lacks them. It never enables a controller in a cgroup that holds
// processes (cgroup v2's no-internal-process rule, which the kernel would
// only satisfy by turning the cgroup threaded) and never writes into a
// threaded cgroup: either is an error wrapping ErrLayout that names the
// cgroup. A controller the root does not offer is left alone (Set reports
// the missing file). dir need not exist.
func delegateV2(root, dir string) error {
	root = filepath.Clean(root)
	dir = filepath.Clean(dir)
	rel, err := filepath.Rel(root, dir)
	if err != nil || rel == "." || strings.HasPrefix(rel, "..") {
		return nil // dir is the root, or not beneath it: nothing to delegate
	}
	avail, err := readList(root, "cgroup.controllers")
	if err != nil {
		return fmt.Errorf("cgroups: %w", err)
	}
	var want []string
	for _, c := range slices.Concat(v2Controllers, v2Optional) {
		if contains(avail, c) {
			want = append(want, c)
		}
	}
	if len(want) == 0 {
		return nil
	}
	// The chain from the root down to dir's parent.
	chain := []string{root}
	parts := strings.Split(rel, string(filepath.Separator))
	for i := 1; i < len(parts); i++ {
		chain = append(chain, filepath.Join(root, filepath.Join(parts[:i]...)))
	}
	for _, d := range chain {
		have, err := readList(d, "cgroup.subtree_control")
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				// Not created yet: Create makes the directories first;
				// a caller that only checks sees nothing to check here.
				return nil
			}
			return fmt.Errorf("cgroups: %w", err)
		}
		var missing []string
		for _, c := range want {
			if !contains(have, c) {
				missing = append(missing, c)
			}
		}
		if d != root {
			if err := checkDomain(d); err != nil {
				return err
			}
		}
		if len(missing) == 0 {
			continue
		}
		if d != root {
			pids, err := readList(d, "cgroup.procs")
			if err != nil {
				return fmt.Errorf("cgroups: %w", err)
			}
			if len(pids) > 0 && !slices.ContainsFunc(missing, isRequired) {
				// Only optional controllers are missing: the cgroups
				// beneath go without them.
				want = slices.DeleteFunc(want, func(c string) bool { return !isRequired(c) })
				continue
			}
			if len(pids) > 0 {
				return fmt.Errorf("%w: cannot enable %s for the cgroups beneath %s: it holds processes (%s), and cgroup v2's no-internal-process rule lets only a cgroup without processes hand controllers to its children; point cgroup_parent at a cgroup that holds no process, or run stagelet as a service with Delegate=yes (it then moves itself into a leaf of its own cgroup)",
					ErrLayout, strings.Join(missing, ","), d, summarize(pids))
			}
		}
		var b strings.Builder
		for i, c := range missing {
			if i > 0 {
				b.WriteByte(' ')
			}
			b.WriteString("+" + c)
		}
		if err := writeFile(d, "cgroup.subtree_control", b.String()); err != nil {
			return fmt.Errorf("cgroups: enable %s in %s: %w", strings.Join(missing, ","), d, err)
		}
	}
	return nil
}

// checkDomain refuses a cgroup that is not a plain domain cgroup: stagelet
// never uses threaded mode, and a domain cgroup beneath a threaded one is
// "domain invalid" (no process can be placed in it).
func checkDomain(d string) error {
	t, err := readFile(d, "cgroup.type")
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil // kernels before 4.14 have no threaded mode
		}
		return fmt.Errorf("cgroups: %w", err)
	}
	if t != "domain" {
		return fmt.Errorf("%w: %s is a %q cgroup; stagelet places pods only beneath plain domain cgroups and never uses threaded mode (a controller enabled in a cgroup that held processes turns it threaded: see cgroup_parent)",
			ErrLayout, d, t)
	}
	return nil
}

// readList reads a whitespace-separated cgroup file.
func readList(dir, name string) ([]string, error) {
	s, err := readFile(dir, name)
	if err != nil {
		return nil, err
	}
	return strings.Fields(s), nil
}

// summarize shortens a PID list for an error message.
func summarize(pids []string) string {
	if len(pids) <= 5 {
		return "PIDs " + strings.Join(pids, " ")
	}
	return "PIDs " + strings.Join(pids[:5], " ") + " and " + strconv.Itoa(len(pids)-5) + " more"
}

// v2Root returns the cgroup2 mount point.
func (e *env) v2Root() (string, error) {
	hs, err := e.hierarchies()
	if err != nil {
		return "", err
	}
	return hs[0].m.point, nil
}

// v2RootOf returns the root of the cgroup2 mount dir lies in: its topmost
// ancestor that is still a cgroup directory.
func v2RootOf(dir string) string {
	root := filepath.Clean(dir)
	for {
		up := filepath.Dir(root)
		if up == root {
			return root
		}
		if _, err := os.Stat(filepath.Join(up, "cgroup.controllers")); err != nil {
			return root
		}
		root = up
	}
}

// LeafName is the child of its own cgroup that a process moves itself into
// (EnterLeaf) so that its cgroup may delegate controllers to siblings.
const LeafName = "supervisor"

// EnterLeaf prepares the caller's own cgroup to be the parent of the
// cgroups it will create. In cgroup v1 (or hybrid) mode it does nothing
// and returns Self(). On a pure cgroup v2 host, where a cgroup that holds
// processes cannot delegate controllers to its children, it moves the
// calling process (every thread) into the child leaf of its cgroup, as
// systemd asks of a service with Delegate=yes, and returns the cgroup it
// was in: the parent for the cgroups it creates from then on. It does not
// move when the caller is in the root cgroup (which is exempt from the
// rule; the root of a cgroup namespace is not) or already in a cgroup
// named leaf. Other processes left in the
// cgroup are not moved: creating a cgroup beneath it then fails with
// ErrLayout, naming them.
func EnterLeaf(leaf string) (*Cgroup, error) {
	e, err := loadEnv()
	if err != nil {
		return nil, err
	}
	self, err := e.self()
	if err != nil {
		return nil, err
	}
	if !e.v2 {
		return self, nil
	}
	root, err := e.v2Root()
	if err != nil {
		return nil, err
	}
	parent, err := moveIntoLeaf(root, self.Paths[Unified], leaf, os.Getpid())
	if err != nil {
		return nil, err
	}
	base := &Cgroup{Paths: map[string]string{Unified: parent}}
	delegated.Store(base)
	return base, nil
}

// delegated is the cgroup EnterLeaf moved the process out of: relative
// cgroup parents are resolved beneath it.
var delegated atomic.Pointer[Cgroup]

// moveIntoLeaf moves pid from the cgroup2 directory dir into dir/leaf and
// returns dir, the parent for the cgroups pid creates; see EnterLeaf.
func moveIntoLeaf(root, dir, leaf string, pid int) (string, error) {
	dir = filepath.Clean(dir)
	if dir == filepath.Clean(root) && isHierarchyRoot(dir) {
		return dir, nil
	}
	if filepath.Base(dir) == leaf {
		// Moved before (a re-executed process, say): the parent is the
		// cgroup above the leaf.
		return filepath.Dir(dir), nil
	}
	if err := checkDomain(dir); err != nil {
		return "", err
	}
	to := filepath.Join(dir, leaf)
	if err := os.Mkdir(to, 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
		return "", fmt.Errorf("cgroups: create %s: %w", to, err)
	}
	if err := writeFile(to, "cgroup.procs", strconv.Itoa(pid)); err != nil {
		return "", fmt.Errorf("cgroups: move into %s: %w", to, err)
	}
	return dir, nil
}

// isHierarchyRoot tells the root cgroup of the hierarchy, which is exempt
// from the no-internal-process rule, from the root of a cgroup namespace
// (a container's view, as systemd-nspawn gives its payload), which is an
// ordinary cgroup and is not: only the real root has no cgroup.type.
func isHierarchyRoot(dir string) bool {
	_, err := os.Stat(filepath.Join(dir, "cgroup.type"))
	return errors.Is(err, fs.ErrNotExist)
}

// Path returns c's cgroup path (as in /proc/PID/cgroup, "/a/b") in pure v2
// mode, for passing a cgroup to another process of the same cgroup
// namespace; "" in v1 mode, where each hierarchy has its own path.
func (c *Cgroup) Path() string {
	d, ok := c.Paths[Unified]
	if !ok {
		return ""
	}
	e, err := loadEnv()
	if err != nil {
		return ""
	}
	root, err := e.v2Root()
	if err != nil {
		return ""
	}
	rel, err := filepath.Rel(root, d)
	if err != nil || strings.HasPrefix(rel, "..") {
		return ""
	}
	return filepath.Clean("/" + rel)
}
