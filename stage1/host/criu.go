package host

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/cgroups"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/stage1"
)

// CRIUDumpLog is the name of criu's log in a dump's image directory (as
// a checkpoint archive names it).
const CRIUDumpLog = "dump.log"

// CheckpointApp saves, with criu s.CRIU, app s.ID of the pod in cg whose
// first process is s.PID at PID namespace level (as PodProcess), left
// running, into s.Dir: the stage1s' stage1.AppCheckpointer.
func CheckpointApp(ctx context.Context, cg *cgroups.Cgroup, level int, s *stage1.AppSave) (*stage1.AppImage, error) {
	node, err := PodProcess(cg, level, s.PID)
	if err != nil {
		return nil, err
	}
	appCg, err := appCgroup(cg, s.ID)
	if err != nil {
		return nil, err
	}
	return CRIUDump(ctx, s.CRIU, node, appCg, s.Dir)
}

// appCgroup is app id's cgroup in the pod's cg: its directory in each of
// the pod's hierarchies that has one. On cgroup v1 it must have a freezer
// (the apps are paused with it): FailedPrecondition otherwise.
func appCgroup(cg *cgroups.Cgroup, id string) (*cgroups.Cgroup, error) {
	app := &cgroups.Cgroup{Paths: map[string]string{}}
	for k, root := range cg.Paths {
		dir, err := findCgroup(root, api.AppCgroup(id))
		if errdefs.IsNotFound(err) {
			continue
		}
		if err != nil {
			return nil, err
		}
		app.Paths[k] = dir
	}
	if len(app.Paths) == 0 {
		return nil, errdefs.NotFound("no cgroup of app %s in the pod's %s", id, cg)
	}
	if freezerDir(app) == "" {
		return nil, errdefs.FailedPrecondition("app %s has no freezer cgroup (the cgroup v1 freezer controller), which checkpoints pause it with", id)
	}
	return app, nil
}

// freezerDir is the directory of cg's freezer: its cgroup v2 directory, or
// its v1 freezer's; "" when it has none.
func freezerDir(cg *cgroups.Cgroup) string {
	if d, ok := cg.Paths[cgroups.Unified]; ok {
		return d
	}
	return cg.Paths["freezer"]
}

// FreezeApps pauses the processes of apps ids of the pod in cg (the
// cgroup freezer) and returns the function that resumes them all: the
// stage1s' stage1.AppCheckpointer. On failure none stays paused.
func FreezeApps(ctx context.Context, cg *cgroups.Cgroup, ids []string) (thaw func() error, err error) {
	var thaws []func() error
	thaw = func() error {
		var errs []error
		for _, t := range thaws {
			errs = append(errs, t())
		}
		return errors.Join(errs...)
	}
	for _, id := range ids {
		app, err := appCgroup(cg, id)
		var t func() error
		if err == nil {
			t, err = app.Freeze(ctx)
		}
		if err != nil {
			_ = thaw()
			return nil, fmt.Errorf("pause app %s: %w", id, err)
		}
		thaws = append(thaws, t)
	}
	return thaw, nil
}

// PodProcess returns the node's PID of the process in cg (or beneath it)
// that the PID namespace level levels below the node's numbers pid: level
// 0 is the node's own numbering (fly's agent), 1 the pod's (nspawn's
// agent, PID 1 of the pod's namespace). NotFound when no process of the
// pod has that PID.
func PodProcess(cg *cgroups.Cgroup, level, pid int) (int, error) {
	procs, err := cg.Procs()
	if err != nil {
		return 0, err
	}
	want := strconv.Itoa(pid)
	for _, p := range procs {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", p))
		if err != nil {
			continue // gone meanwhile
		}
		if ids := nsPIDs(b); len(ids) > level && ids[level] == want {
			return p, nil
		}
	}
	return 0, errdefs.NotFound("no process of the pod is PID %d in its namespace", pid)
}

// nsPIDs are the fields of a status file's NSpid line: the process's PID
// in the node's namespace, then in each nested one.
func nsPIDs(status []byte) []string {
	for _, l := range strings.Split(string(status), "\n") {
		if f, ok := strings.CutPrefix(l, "NSpid:"); ok {
			return strings.Fields(f)
		}
	}
	return nil
}

// CRIUDump saves the process tree of the node's PID pid with criu, left
// running, as images in the empty directory dir (its log there too, as
// CRIUDumpLog). What the tree shares with the rest of its pod is named
// external, to be given back at a restore rather than saved:
//
//   - its network namespace, when it is not criu's (the node's), as
//     "net";
//   - its PID namespace, when the process is not that namespace's init
//     (an app sharing the pod's namespace), as "pid";
//   - every mount of a file system the app does not mount whole (a bind
//     of a file or directory: the /dev nodes, /etc/hosts, volumes), as a
//     key made of its mount point (MountKey).
//
// app is the app's cgroup (appCgroup), whose freezer pauses it. It
// returns what it named external and the tree's standard streams that are
// pipes. FailedPrecondition, with the end of criu's log, when criu cannot
// save the tree; ctx's error (context.DeadlineExceeded or Canceled) when
// ctx ends first (criu is killed then).
func CRIUDump(ctx context.Context, criu string, pid int, app *cgroups.Cgroup, dir string) (*stage1.AppImage, error) {
	cgroup := freezerDir(app)
	proc := fmt.Sprintf("/proc/%d", pid)
	img := &stage1.AppImage{Stdio: map[int]string{}}
	args := []string{"dump", "-t", strconv.Itoa(pid), "-D", dir, "-o", CRIUDumpLog, "-v4", "--leave-running",
		// The app's own cgroup's freezer pauses it, and keeps it as
		// it was (paused, in a pod's checkpoint) afterwards.
		"--freeze-cgroup", cgroup}
	if its, mine := nsInode(proc+"/ns/net"), nsInode("/proc/self/ns/net"); its != "" && its != mine {
		args = append(args, "--external", "net["+its+"]:"+criuNetKey)
		img.Net = true
	}
	status, err := os.ReadFile(proc + "/status")
	if err != nil {
		return nil, errdefs.FailedPrecondition("checkpoint: process %d: %w", pid, err)
	}
	if ids := nsPIDs(status); len(ids) > 1 && ids[len(ids)-1] != "1" {
		if its := nsInode(proc + "/ns/pid"); its != "" {
			args = append(args, "--external", "pid["+its+"]:"+criuPIDKey)
			img.PID = true
			img.PIDs = cgroupPIDs(cgroup, len(ids)-1)
		}
	}
	mounts, err := readMountinfo(proc + "/mountinfo")
	if err != nil {
		return nil, errdefs.FailedPrecondition("checkpoint: process %d: %w", pid, err)
	}
	for _, m := range externalMounts(mounts) {
		point := m.Mountpoint
		args = append(args, "--ext-mount-map", point+":"+MountKey(point))
		img.Mounts = append(img.Mounts, stage1.ExternalMount{Point: point, Device: deviceOf(filepath.Join(proc, "root", point)), Cgroup: cgroupsOf(m)})
	}
	for fd := 0; fd <= 2; fd++ {
		if l, err := os.Readlink(fmt.Sprintf("%s/fd/%d", proc, fd)); err == nil && strings.HasPrefix(l, "pipe:") {
			img.Stdio[fd] = l
		}
	}
	argv := append([]string{criu}, args...)
	if its, mine := nsInode(proc+"/ns/cgroup"), nsInode("/proc/self/ns/cgroup"); its != "" && its != mine && !app.IsV2() {
		// On cgroup v1 an nspawn pod's cgroup namespace is rooted at its
		// agent's memory cgroup, beside the pod's
		// (cgroups.RuntimeMemoryCgroup): criu, which reads the tree's
		// cgroups from inside its namespace and from its own, finds them
		// consistent only from inside, and the layout it would save
		// cannot be walked from there. A
		// restore ignores cgroups (the pod makes them): so does the dump.
		argv = append([]string{"nsenter", "--target", strconv.Itoa(pid), "--cgroup", "--"}, append(argv, "--manage-cgroups=ignore")...)
	}
	path, err := exec.LookPath(argv[0])
	if err != nil {
		return nil, errdefs.FailedPrecondition("checkpoint: %w", err)
	}
	cmd := exec.CommandContext(ctx, path, argv[1:]...)
	out, err := cmd.CombinedOutput()
	if err != nil && ctx.Err() != nil {
		return nil, fmt.Errorf("checkpoint: criu dump of process %d ended with the call: %w", pid, ctx.Err())
	}
	if err != nil {
		log, _ := os.ReadFile(filepath.Join(dir, CRIUDumpLog))
		return nil, errdefs.FailedPrecondition("checkpoint: criu dump of process %d: %w: %s%s", pid, err, bytes.TrimSpace(out), tail(log, 1024))
	}
	return img, nil
}

// cgroupPIDs are the PIDs, at PID namespace level, of the processes in
// the cgroup directory dir (the app's); nil when they cannot be read.
func cgroupPIDs(dir string, level int) []int {
	procs, err := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
	if err != nil {
		return nil
	}
	var out []int
	for _, f := range strings.Fields(string(procs)) {
		st, err := os.ReadFile("/proc/" + f + "/status")
		if err != nil {
			continue
		}
		if ids := nsPIDs(st); len(ids) > level {
			if n, err := strconv.Atoi(ids[level]); err == nil {
				out = append(out, n)
			}
		}
	}
	return out
}

// criu's keys of the pod's namespaces an app's images leave out.
const (
	criuNetKey = "net"
	criuPIDKey = "pid"
)

// stdDevices are the device nodes an app's /dev binds from its agent's.
var stdDevices = []string{"null", "zero", "full", "random", "urandom", "tty"}

// deviceOf is the node's device node (one of stdDevices) that the
// character device at path is; "" when path is not one.
func deviceOf(path string) string {
	var st unix.Stat_t
	if unix.Stat(path, &st) != nil || st.Mode&unix.S_IFMT != unix.S_IFCHR {
		return ""
	}
	for _, name := range stdDevices {
		var d unix.Stat_t
		if unix.Stat("/dev/"+name, &d) == nil && d.Mode&unix.S_IFMT == unix.S_IFCHR && d.Rdev == st.Rdev {
			return "/dev/" + name
		}
	}
	return ""
}

func readMountinfo(path string) ([]*mountinfo.Info, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return mountinfo.GetMountsFromReader(f, nil)
}

// MountKey is the criu key of the external mount at point.
func MountKey(point string) string {
	return "m" + strings.NewReplacer("/", "_", ":", "_", ",", "_").Replace(point)
}

// cgroupsOf is the controllers of the hierarchy mount m shows, as
// /proc/PID/cgroup names them ("" for cgroup2); nil when m is no cgroup
// mount.
func cgroupsOf(m *mountinfo.Info) *string {
	var ctls string
	switch m.FSType {
	case "cgroup2":
	case "cgroup":
		ctls = cgroups.HierarchyOf(strings.Split(m.VFSOptions, ","))
	default:
		return nil
	}
	return &ctls
}

// externalMounts are the mounts, in a process's mountinfo, of file
// systems it does not mount whole: criu cannot reach their source from
// the process's namespace, so they are named external.
func externalMounts(ms []*mountinfo.Info) []*mountinfo.Info {
	type dev struct{ major, minor int }
	whole := map[dev]bool{}
	for _, m := range ms {
		if m.Root == "/" {
			whole[dev{m.Major, m.Minor}] = true
		}
	}
	var out []*mountinfo.Info
	for _, m := range ms {
		if m.Mountpoint != "/" && !whole[dev{m.Major, m.Minor}] {
			out = append(out, m)
		}
	}
	return out
}

// nsInode is the inode of the namespace at path (a /proc/PID/ns link), ""
// when it cannot be read.
func nsInode(path string) string {
	l, err := os.Readlink(path)
	if err != nil {
		return ""
	}
	i, j := strings.LastIndex(l, "["), strings.LastIndex(l, "]")
	if i < 0 || j < i {
		return ""
	}
	return l[i+1 : j]
}

// tail is what a criu log says of its failure, for an error message:
// its first errors, else its last n bytes.
func tail(b []byte, n int) string {
	b = bytes.TrimSpace(b)
	if len(b) == 0 {
		return ""
	}
	var errs []string
	for _, l := range strings.Split(string(b), "\n") {
		if strings.Contains(l, "Error (") && len(errs) < 4 {
			errs = append(errs, strings.TrimSpace(l))
		}
	}
	if len(errs) > 0 {
		return "; its log says: " + strings.Join(errs, "; ")
	}
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return "; its log ends: " + string(b)
}
