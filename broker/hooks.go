package broker

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/opencontainers/runtime-spec/specs-go"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/ocihooks"
)

// A container's OCI hooks (what NRI plugins inject: ContainerRecord.Hooks)
// run as runc runs them, the daemon standing in for runc (package
// ocihooks): prestart and createRuntime once the agent created the
// container and before it counts as created; poststart once it runs;
// poststop once it is removed. The agent starts a container's process
// with its command, at StartContainer: before that no process exists, so
// the state's pid is 0 at prestart and createRuntime, and
// createContainer and startContainer hooks, which run in that process's
// namespaces, are refused (NRIValidate). The pid a hook gets is the
// host's. A failing hook of any stage but poststop fails the CRI
// call that ran it, the container stopped or forgotten. The pod's
// stage1 must run its containers on this host (NRIValidate refuses hooks
// for a pod in a VM).

// runHooks runs container c's hooks of stages, with the container's state
// (status, and the PID pidOf says, asked only when there are hooks) on
// their stdin; a failure of a stage that is not fatal is logged and nil.
func (b *Broker) runHooks(ctx context.Context, c *container, status string, pidOf func() int, stages ...ocihooks.Stage) error {
	b.mu.Lock()
	hooks, dir, id := c.rec.Hooks, c.rec.Dir, c.rec.ID
	ann := c.rec.OCIAnnotations
	b.mu.Unlock()
	if hooks == nil {
		return nil
	}
	pid := hostPID(id, pidOf())
	st := ocihooks.State{Version: specs.Version, ID: id, Status: specs.ContainerState(status), Pid: pid, Bundle: dir, Annotations: ann}
	for _, stage := range stages {
		list := stage.Of(hooks)
		if len(list) == 0 {
			continue
		}
		var err error
		if stage.InContainer() {
			err = ocihooks.RunInNamespaces(ctx, stage, list, st, pid)
		} else {
			err = ocihooks.Run(ctx, stage, list, st)
		}
		if err == nil {
			continue
		}
		if stage.Fatal() {
			return err
		}
		b.log.WarnContext(ctx, "an OCI hook failed", "container", id, "stage", stage, "err", err)
	}
	return nil
}

// procRoot is where hostPID reads the host's processes.
var procRoot = "/proc"

// hostPID is the host's PID of container id's process whose PID in its
// own PID namespace is pid (the agent's answer, which in a pod with a PID
// namespace of its own is not the host's): the process in the container's
// cgroup (api.AppCgroup) whose innermost NSpid is pid. 0 when none is,
// or pid is 0.
func hostPID(id string, pid int) int {
	if pid <= 0 {
		return 0
	}
	ents, err := os.ReadDir(procRoot)
	if err != nil {
		return 0
	}
	suffix := "/" + api.AppCgroup(id)
	for _, e := range ents {
		hp, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		cg, err := os.ReadFile(filepath.Join(procRoot, e.Name(), "cgroup"))
		if err != nil || !slices.ContainsFunc(strings.Split(string(cg), "\n"), func(l string) bool { return strings.HasSuffix(l, suffix) }) {
			continue
		}
		if innermostPID(filepath.Join(procRoot, e.Name(), "status")) == pid {
			return hp
		}
	}
	return 0
}

// innermostPID is the last NSpid of a /proc/PID/status file, 0 when it
// cannot be read.
func innermostPID(status string) int {
	b, err := os.ReadFile(status)
	if err != nil {
		return 0
	}
	for _, l := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(l, "NSpid:"); ok {
			f := strings.Fields(rest)
			if len(f) > 0 {
				n, _ := strconv.Atoi(f[len(f)-1])
				return n
			}
		}
	}
	return 0
}
