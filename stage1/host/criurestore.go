package host

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/cgroups"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/stage1"
)

// CRIURestoreLog is the name of criu's log of a restore, in the images'
// directory.
const CRIURestoreLog = "restore.log"

// RestoreApp restores, with criu, app r.Spec.ID of the pod in cg, whose
// agent is PID 1 of the pod's PID namespace, one level below the node's:
// nspawn's stage1.AppRestorer. (An agent in the node's PID namespace, as
// fly's, is no restored process's parent when criu runs here: see
// RestoreAppInAgent.) The restored process ends as a child of the agent,
// in the app's cgroup, the pod's network and IPC namespaces (and its PID
// namespace, when it shares it), on the app's rootfs with the app's
// mounts; its output goes into the agent's pipes. It returns the PID the
// agent sees.
//
// criu runs from the app's cgroup (it leaves cgroups alone) and, for a
// pod with a PID namespace of its own, in that namespace and the pod's
// cgroup namespace with a /proc of its own, so that the process it
// restores detached is re-parented to the pod's init, the agent.
// FailedPrecondition with criu's reason; ctx's error when ctx ends first.
func RestoreApp(ctx context.Context, cg *cgroups.Cgroup, r *stage1.AppRestore) (int, error) {
	const level = 1
	agent, err := PodProcess(cg, level, r.IO.PID)
	if err != nil {
		return 0, err
	}
	if r.Image.PID {
		if err := pidsFree(cg, level, r.Image.PIDs); err != nil {
			return 0, err
		}
	}
	appCg, err := appCgroup(cg, r.Spec.ID)
	if err != nil {
		return 0, err
	}

	proc := fmt.Sprintf("/proc/%d", agent)
	var files []*os.File // fd 3 on in criu
	defer func() {
		for _, f := range files {
			f.Close()
		}
	}()
	pidfile := filepath.Join(r.Images, "restore.pid")
	args, err := criuRestoreArgs(r.CRIU, pidfile, r, appCg, func(what, key string) (int, error) {
		path, flag := proc+"/ns/"+what, os.O_RDONLY
		switch what {
		case "stdout":
			path, flag = fmt.Sprintf("%s/fd/%d", proc, r.IO.Stdout), os.O_WRONLY
		case "stderr":
			path, flag = fmt.Sprintf("%s/fd/%d", proc, r.IO.Stderr), os.O_WRONLY
		}
		// The agent's pipes opened anew through its fds; the pod's
		// namespaces through the agent's.
		f, err := os.OpenFile(path, flag, 0)
		if err != nil {
			return 0, fmt.Errorf("restore: %w", err)
		}
		files = append(files, f)
		return 2 + len(files), nil
	})
	if err != nil {
		return 0, err
	}
	// criu 4's mount engine (mount-v2) cannot copy the sharing of a
	// bind of a file (the app's /dev nodes) from the slave copy of the
	// node's mounts below; the engine of criu 3 can.
	args = append(args, "--mntns-compat-mode")
	args = append([]string{"nsenter", "--target", strconv.Itoa(agent), "--pid", "--cgroup", "--",
		// Slave: the node's mounts keep their peer groups, whose sharing
		// criu copies to the external mounts it binds.
		"unshare", "--mount", "--mount-proc", "--propagation", "slave", "--"}, args...)
	path, err := exec.LookPath(args[0])
	if err != nil {
		return 0, errdefs.FailedPrecondition("restore: %w", err)
	}
	cmd := exec.CommandContext(ctx, path, args[1:]...)
	var out bytes.Buffer
	cmd.ExtraFiles, cmd.Stdout, cmd.Stderr = files, &out, &out
	if err := appCg.Start(cmd); err != nil {
		return 0, fmt.Errorf("restore: %w", err)
	}
	err = cmd.Wait()
	if err != nil && ctx.Err() != nil {
		return 0, fmt.Errorf("restore: criu ended with the call: %w", ctx.Err())
	}
	if err != nil {
		log, _ := os.ReadFile(filepath.Join(r.Images, CRIURestoreLog))
		return 0, errdefs.FailedPrecondition("restore: criu restore: %w: %s%s", err, bytes.TrimSpace(out.Bytes()), tail(log, 1024))
	}
	return readPIDFile(pidfile)
}

// RestoreAppInAgent restores, with criu run by the pod's agent as its
// child (stage1.AppRestore.InAgent), app r.Spec.ID of the pod in cg, whose agent
// runs in the node's PID namespace and mount namespace (fly's
// stage1.AppRestorer): criu, detached, leaves the restored process to the
// agent, a child subreaper. It returns the process's PID.
func RestoreAppInAgent(ctx context.Context, cg *cgroups.Cgroup, r *stage1.AppRestore) (int, error) {
	if r.InAgent == nil {
		return 0, errdefs.FailedPrecondition("restore: the agent cannot run criu for this pod")
	}
	appCg, err := appCgroup(cg, r.Spec.ID)
	if err != nil {
		return 0, err
	}
	pidfile := filepath.Join(r.Images, "restore.pid")
	// The agent's fds, as OpRestoreRun gives them.
	fds := map[string]int{"stdout": 3, "stderr": 4, "net": 5}
	args, err := criuRestoreArgs(r.CRIU, pidfile, r, appCg, func(what, key string) (int, error) {
		fd, ok := fds[what]
		if !ok {
			return 0, errdefs.FailedPrecondition("restore: the app's images leave out its pod's %s namespace, which this pod cannot give back", what)
		}
		return fd, nil
	})
	if err != nil {
		return 0, err
	}
	if err := r.InAgent(ctx, args); err != nil {
		log, _ := os.ReadFile(filepath.Join(r.Images, CRIURestoreLog))
		return 0, fmt.Errorf("%w%s", err, tail(log, 1024))
	}
	return readPIDFile(pidfile)
}

// criuRestoreArgs is the command line (criu first) that restores r, its
// PID written to pidfile. fd gives the file descriptor criu is given for
// what the images left out: "net" and "pid" (the pod's namespaces),
// "stdout" and "stderr" (the agent's pipes), each by its criu key. app is
// the new app's cgroup, which criu restores into (it leaves cgroups
// alone), and which the restored app is shown at /sys/fs/cgroup.
func criuRestoreArgs(criu, pidfile string, r *stage1.AppRestore, app *cgroups.Cgroup, fd func(what, key string) (int, error)) ([]string, error) {
	if err := os.Remove(pidfile); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("restore: %w", err) // criu refuses to overwrite it
	}
	args := []string{criu, "restore", "-D", r.Images, "-o", CRIURestoreLog, "-v4", "--restore-detached",
		"--root", r.Spec.Rootfs, "--manage-cgroups=ignore", "--pidfile", pidfile,
		// The pod's IPC namespace, as criu sees the agent.
		"--join-ns", fmt.Sprintf("ipc:/proc/%d/ns/ipc", r.IO.PID)}
	inherit := func(what, key string) error {
		n, err := fd(what, key)
		if err != nil {
			return err
		}
		args = append(args, "--inherit-fd", fmt.Sprintf("fd[%d]:%s", n, key))
		return nil
	}
	if r.Image.Net {
		if err := inherit("net", criuNetKey); err != nil {
			return nil, err
		}
	}
	if r.Image.PID {
		if err := inherit("pid", criuPIDKey); err != nil {
			return nil, err
		}
	}
	for _, n := range slices.Sorted(maps.Keys(r.Image.Stdio)) {
		key := r.Image.Stdio[n]
		var what string
		switch n {
		case 1:
			what = "stdout"
		case 2:
			what = "stderr"
		default:
			return nil, errdefs.FailedPrecondition("restore: the app's fd %d was a pipe (%s): only its output can be given back", n, key)
		}
		if err := inherit(what, key); err != nil {
			return nil, err
		}
	}
	for _, m := range r.Image.Mounts {
		src, err := mountSource(r.Spec, m, app)
		if err != nil {
			return nil, err
		}
		args = append(args, "--ext-mount-map", MountKey(m.Point)+":"+src)
	}
	return args, nil
}

// readPIDFile is the PID criu wrote to pidfile.
func readPIDFile(pidfile string) (int, error) {
	b, err := os.ReadFile(pidfile)
	if err != nil {
		return 0, fmt.Errorf("restore: criu's pidfile: %w", err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || pid <= 0 {
		return 0, fmt.Errorf("restore: criu's pidfile holds %q", b)
	}
	return pid, nil
}

// pidsFree refuses a restore into the pod in cg of an app that shared its
// pod's PID namespace (criu gives it its PIDs back) when a process or
// thread of the pod has one of them already.
func pidsFree(cg *cgroups.Cgroup, level int, pids []int) error {
	procs, err := cg.Procs()
	if err != nil {
		return err
	}
	var taken []string
	for _, p := range procs {
		tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", p))
		if err != nil {
			continue // gone meanwhile
		}
		for _, task := range tasks {
			b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/status", p, task.Name()))
			if err != nil {
				continue
			}
			if ids := nsPIDs(b); len(ids) > level {
				if n, err := strconv.Atoi(ids[level]); err == nil && slices.Contains(pids, n) {
					taken = append(taken, ids[level])
				}
			}
		}
	}
	if len(taken) > 0 {
		return errdefs.FailedPrecondition("restore: the checkpointed app shared its pod's PID namespace, and its PIDs %s are taken in this pod's: restore it where they are free", strings.Join(taken, ", "))
	}
	return nil
}

// mountSource is the node path to bind where the app had external mount
// m: the device node it showed, the new app's cgroup (app) in the
// hierarchy it showed, or the source of the app's mount there.
func mountSource(spec *api.AppSpec, m stage1.ExternalMount, app *cgroups.Cgroup) (string, error) {
	if m.Cgroup != nil {
		return cgroupSource(*m.Cgroup, app)
	}
	if m.Device != "" {
		if !slices.Contains(stdDevices, strings.TrimPrefix(m.Device, "/dev/")) {
			return "", errdefs.InvalidArgument("restore: mount %s shows device %s, not one an app is given", m.Point, m.Device)
		}
		return m.Device, nil
	}
	for _, sm := range spec.Mounts {
		if filepath.Clean(sm.Destination) == m.Point {
			return sm.Source, nil
		}
	}
	return "", errdefs.FailedPrecondition("restore: the checkpointed app had a mount at %s, which the new container does not have", m.Point)
}

// cgroupSource is the directory of hierarchy h (as /proc/PID/cgroup
// names it; "" for cgroup2) where a restored app runs: its own cgroup in
// the hierarchies its pod manages; elsewhere the restorer's, which criu
// leaves it in.
func cgroupSource(h string, app *cgroups.Cgroup) (string, error) {
	if h == "" {
		if d, ok := app.Paths[cgroups.Unified]; ok {
			return d, nil
		}
	}
	for _, c := range strings.Split(h, ",") {
		if d, ok := app.Paths[c]; ok && h != "" {
			return d, nil
		}
	}
	_, own, err := cgroups.OwnView("")
	if err != nil {
		return "", errdefs.FailedPrecondition("restore: the app's cgroup in %q: %w", h, err)
	}
	for _, d := range own {
		if strings.Join(d.Controllers, ",") == h {
			return d.Dir, nil
		}
	}
	return "", errdefs.FailedPrecondition("restore: the checkpointed app was shown its cgroup in the hierarchy %q, which this node does not mount", h)
}

// findCgroup is the directory named name beneath root (at most three
// levels down): an app's cgroup in its pod's.
func findCgroup(root, name string) (string, error) {
	found := ""
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil || !d.IsDir() {
			return nil
		}
		if d.Name() == name {
			found = p
			return fs.SkipAll
		}
		if strings.Count(strings.TrimPrefix(p, root), "/") >= 3 {
			return fs.SkipDir
		}
		return nil
	})
	if err != nil {
		return "", err
	}
	if found == "" {
		return "", errdefs.NotFound("restore: no cgroup %s in the pod's %s", name, root)
	}
	return found, nil
}
