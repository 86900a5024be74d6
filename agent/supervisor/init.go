package supervisor

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"

	securejoin "github.com/cyphar/filepath-securejoin"
	"github.com/moby/sys/capability"
	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/devices"
	"github.com/stagelet/stagelet/internal/lsm"
	"github.com/stagelet/stagelet/internal/rlimit"
	"github.com/stagelet/stagelet/seccomp"
)

// The agent starts an app, and an exec'd command where it cannot start
// one from its own thread (execdirect_linux.go), through a re-executed
// copy of itself (`stagelet agent init` / `stagelet agent exec-init`). The
// agent keeps one end of a socket pair, the child gets the other as fd 3:
//
//	agent                                  child
//	  start child (new mount namespace)
//	  add child to the app's cgroup
//	  send procSpec  ───────────────────▶   read procSpec
//	                                        set up root, credentials
//	  log warnings   ◀───────────────────   {"warn": ...}  (any number)
//	  keep master    ◀───────────────────   {"pty": true} + the terminal's
//	                                        master (SCM_RIGHTS), with TTY
//	                 ◀───────────────────   {"exec": true} then execve
//	  EOF: exec worked                      (fd 3 is close-on-exec)
//	  {"error": ...}: start failed ◀──────  or {"error": ...} and exit 1
//
// An EOF before "exec" means the child died during setup.

// Child entry points, the first argument of `stagelet agent`.
const (
	cmdInit     = "init"
	cmdExecInit = "exec-init"
)

// Files of a child: syncFD is its end of the sync socket; an exec child
// also gets the app's mount namespace as mntFD, its cgroup namespace as
// cgroupNSFD and, when the app has its own hostname, the app's UTS
// namespace as utsFD.
const (
	syncFD     = 3
	mntFD      = 4
	cgroupNSFD = 5
	utsFD      = 6
)

// procSpec is what the agent sends a child.
type procSpec struct {
	App *api.AppSpec `json:"app"`
	// Args is what to execute: the app's Args, or the exec'd command.
	Args []string `json:"args"`
	// JoinUTS (exec): fd utsFD is the app's UTS namespace, to join.
	JoinUTS bool `json:"joinUTS,omitempty"`
	// TTY: open a terminal in the root, send its master to the agent and
	// run the command on its slave; Size is its initial size.
	TTY  bool              `json:"tty,omitempty"`
	Size *api.TerminalSize `json:"size,omitempty"`
}

// syncMsg is one message from the child.
type syncMsg struct {
	Warn  string `json:"warn,omitempty"`
	Error string `json:"error,omitempty"`
	Code  string `json:"code,omitempty"`
	Exec  bool   `json:"exec,omitempty"`
	PTY   bool   `json:"pty,omitempty"`
}

// childError is a setup failure with the error class to report.
type childError struct {
	code string
	err  error
}

func (e *childError) Error() string { return e.err.Error() }

func failedPrecondition(err error) error {
	return &childError{code: api.CodeFailedPrecondition, err: err}
}

// childMain runs `stagelet agent init|exec-init`. It only returns on
// failure, after reporting it to the agent.
func childMain(cmd string) int {
	// Credentials, capabilities and namespaces joined with setns are
	// per thread: everything happens on this thread, which then execs.
	runtime.LockOSThread()
	// Whether the kernel runs SELinux is read here, in the agent's mount
	// namespace: the app's root, entered later, may have no selinuxfs.
	lsm.SELinuxInKernel()
	// Only stdio reaches the command: the sync socket, the exec files and
	// whatever the agent itself inherited without close-on-exec are
	// closed by execve.
	cloexecFrom(syncFD)
	sock := os.NewFile(syncFD, "sync")
	enc := json.NewEncoder(sock)
	report := func(m syncMsg) { _ = enc.Encode(m) }
	warn := func(format string, args ...any) { report(syncMsg{Warn: fmt.Sprintf(format, args...)}) }

	var spec procSpec
	if err := json.NewDecoder(sock).Decode(&spec); err != nil {
		report(syncMsg{Error: "read spec: " + err.Error(), Code: api.CodeInternal})
		return 1
	}
	sendPTY := func(master int) error {
		b, err := json.Marshal(syncMsg{PTY: true})
		if err != nil {
			return err
		}
		return unix.Sendmsg(syncFD, append(b, '\n'), unix.UnixRights(master), nil, 0)
	}
	err := runChild(cmd, &spec, warn, sendPTY, func() { report(syncMsg{Exec: true}) })
	code := api.CodeFailedPrecondition
	var ce *childError
	if errors.As(err, &ce) {
		code = ce.code
	}
	report(syncMsg{Error: err.Error(), Code: code})
	return 1
}

// ownOOMScoreAdj is the calling process's OOM score adjustment.
const ownOOMScoreAdj = "/proc/self/oom_score_adj"

// setOOMScoreAdj gives the process the oom_score_adj its app asked for (0
// when it names none, as runc gives), but never below the agent's own,
// which the process inherited: every app of the pod needs the agent, so
// the OOM killer must not prefer the agent to an app (at equal scores it
// takes the larger, the app). Under the service unit the agent inherits
// the daemon's -999 and the kubelet's scores (-997 at the lowest) stand;
// where the daemon runs with a higher score and may not lower one (no
// CAP_SYS_RESOURCE), an app asking less than the agent's gets the
// agent's, with a warning. Raising a score needs no privilege.
//
// The score is written to target: the caller's own (/proc/self) or a
// process it started (/proc/PID), whose score is still the agent's.
func setOOMScoreAdj(asked int, target string, warn func(string, ...any)) {
	b, err := os.ReadFile(ownOOMScoreAdj)
	if err != nil {
		warn("oom_score_adj: %v", err)
		return
	}
	agentAdj, err := strconv.Atoi(trimNL(b))
	if err != nil {
		warn("oom_score_adj %q: %v", trimNL(b), err)
		return
	}
	adj := max(asked, agentAdj)
	if asked != 0 && adj != asked {
		warn("oom_score_adj %d is below the agent's %d: the app gets %d, so that the OOM killer never prefers the pod's agent", asked, agentAdj, adj)
	}
	if adj == agentAdj {
		return
	}
	if err := os.WriteFile(target, []byte(strconv.Itoa(adj)), 0); errors.Is(err, unix.ESRCH) || errors.Is(err, os.ErrNotExist) {
		return // a started process that is already gone
	} else if err != nil {
		warn("oom_score_adj %d refused (%v); keeping %d", adj, err, agentAdj)
	}
}

// runChild is the child's work after reading spec: it enters the app's
// root (cmdInit: builds it; cmdExecInit: joins the app's namespaces),
// takes the terminal, sets the security module labels, credentials,
// working directory, no_new_privs and filter, reports "exec" through
// execNow and executes the command. It returns only on failure.
func runChild(cmd string, spec *procSpec, warn func(string, ...any), sendPTY func(master int) error, execNow func()) error {
	app := spec.App
	if app == nil || len(spec.Args) == 0 {
		return &childError{code: api.CodeInvalidArgument, err: errors.New("empty spec")}
	}
	if err := enterAppRoot(cmd, spec, warn); err != nil {
		return err
	}
	// While the child may still raise a hard limit (CAP_SYS_RESOURCE).
	if err := rlimit.Apply(app.Rlimits, warn); err != nil {
		return failedPrecondition(err)
	}
	if spec.TTY {
		if err := takeTerminal(app.UID, spec.Size, sendPTY); err != nil {
			return err
		}
	}
	env := execEnv(app.Env, spec.TTY)

	cwd := app.Cwd
	if cwd == "" {
		cwd = "/"
	}
	filter, err := compileSeccomp(app, cmd == cmdInit, warn)
	if err != nil {
		return err
	}
	// Security module labels take effect at execve. They are written while
	// the process is still root and dumpable: after the switch to the
	// app's user its /proc files belong to root.
	if err := setExecLabels(app); err != nil {
		return err
	}
	early := filter != nil && seccompBeforeCreds(app)
	if early {
		if err := seccomp.Install(filter); err != nil {
			return failedPrecondition(err)
		}
	}
	if err := becomeAppUser(app, cwd, warn); err != nil {
		return err
	}
	if app.NoNewPrivs {
		if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
			return fmt.Errorf("no_new_privs: %w", err)
		}
	}
	path, err := lookPath(spec.Args[0], env)
	if err != nil {
		return failedPrecondition(err)
	}
	execNow()
	// The filter comes last, after "exec" is reported: from here on only
	// execve (and, should it fail, the error report) is left to do.
	if filter != nil && !early {
		if err := seccomp.Install(filter); err != nil {
			return failedPrecondition(err)
		}
	}
	err = unix.Exec(path, spec.Args, env)
	return failedPrecondition(fmt.Errorf("exec %s: %w", spec.Args[0], err))
}

// enterAppRoot puts the child where its command runs, as cmd says: an
// app's init builds the app's root (setupRoot), sets its hostname and
// OOM score; an exec'd command joins the running app's namespaces.
func enterAppRoot(cmd string, spec *procSpec, warn func(string, ...any)) error {
	switch cmd {
	case cmdInit:
		return setupAppInit(spec.App, warn)
	case cmdExecInit:
		return joinAppNamespaces(spec, warn)
	default:
		return fmt.Errorf("unknown child command %q", cmd)
	}
}

// setupAppInit builds the app's root and pivots into it, sets the app's
// hostname, when it has one, and gives the process the app's OOM score.
func setupAppInit(app *api.AppSpec, warn func(string, ...any)) error {
	if err := setupRoot(app, warn); err != nil {
		return err
	}
	if app.Hostname != "" {
		if err := unix.Sethostname([]byte(app.Hostname)); err != nil {
			return fmt.Errorf("sethostname: %w", err)
		}
	}
	setOOMScoreAdj(app.Resources.OOMScoreAdj, ownOOMScoreAdj, warn)
	return nil
}

// joinAppNamespaces moves an exec'd command's child into the app's UTS
// namespace (fd utsFD, when spec.JoinUTS), cgroup namespace (fd
// cgroupNSFD; the child is in the app's cgroups already) and mount
// namespace (fd mntFD), closing each fd once joined, and gives it the
// app's OOM score.
func joinAppNamespaces(spec *procSpec, warn func(string, ...any)) error {
	if spec.JoinUTS {
		if err := unix.Setns(utsFD, unix.CLONE_NEWUTS); err != nil {
			return fmt.Errorf("join uts namespace: %w", err)
		}
		unix.Close(utsFD)
	}
	if err := unix.Setns(cgroupNSFD, unix.CLONE_NEWCGROUP); err != nil {
		return failedPrecondition(fmt.Errorf("join the app's cgroup namespace: %w", err))
	}
	unix.Close(cgroupNSFD)
	if err := joinMountNS(mntFD); err != nil {
		return failedPrecondition(fmt.Errorf("enter the app's mount namespace: %w", err))
	}
	unix.Close(mntFD)
	// An exec'd command scores as its app does, as runc's exec does.
	setOOMScoreAdj(spec.App.Resources.OOMScoreAdj, ownOOMScoreAdj, warn)
	return nil
}

// setExecLabels sets the app's SELinux process label and AppArmor profile
// for the calling thread's next execve. Errors are FailedPrecondition.
func setExecLabels(app *api.AppSpec) error {
	if err := lsm.SetSELinuxExec(app.SELinuxProcessLabel); err != nil {
		return failedPrecondition(err)
	}
	if err := lsm.SetAppArmorExec(app.AppArmorProfile); err != nil {
		return failedPrecondition(err)
	}
	return nil
}

// becomeAppUser enters the working directory cwd and switches to the
// app's credentials (applyCreds). The directory is entered with the
// agent's credentials first (it may be reachable by root only) and, where
// that failed, again as the app's user.
func becomeAppUser(app *api.AppSpec, cwd string, warn func(string, ...any)) error {
	cwdErr := unix.Chdir(cwd)
	if err := applyCreds(app, warn); err != nil {
		return err
	}
	if cwdErr != nil {
		if err := unix.Chdir(cwd); err != nil {
			return failedPrecondition(fmt.Errorf("chdir %s: %w", cwd, err))
		}
	}
	return nil
}

// joinMountNS moves the calling thread into the mount namespace fd, whose
// root and working directory it then has ("/" of the app after its
// pivot_root), so that the command sees the app's mounts and its own
// mounts go where the app's do (propagation included). The kernel lets
// only a task that shares its file system attributes with no other join a
// mount namespace: the Go runtime's threads share them, so this thread
// first takes its own copy (unshare CLONE_FS). The thread is locked and
// execs next; the runtime starts new threads from a template thread, not
// from this one.
func joinMountNS(fd int) error {
	if err := unix.Unshare(unix.CLONE_FS); err != nil {
		return fmt.Errorf("unshare CLONE_FS: %w", err)
	}
	if err := unix.Setns(fd, unix.CLONE_NEWNS); err != nil {
		return fmt.Errorf("setns: %w", err)
	}
	return unix.Chdir("/")
}

// takeTerminal opens a terminal in the root the child is in, hands its
// master to the agent and makes the slave the child's controlling terminal
// and stdio.
func takeTerminal(uid uint32, size *api.TerminalSize, sendPTY func(int) error) error {
	master, slave, err := openTerminal(uid, size)
	if err != nil {
		return failedPrecondition(err)
	}
	err = sendPTY(master)
	unix.Close(master)
	if err != nil {
		unix.Close(slave)
		return fmt.Errorf("send the terminal to the agent: %w", err)
	}
	return becomeTerminal(slave)
}

// compileSeccomp compiles the app's system call filter; nil when it has
// none. With notes, what the compiler skipped is reported once, when the
// app starts (not on every exec).
func compileSeccomp(app *api.AppSpec, notes bool, warn func(string, ...any)) (*seccomp.Filter, error) {
	if app.Seccomp == nil {
		return nil, nil
	}
	f, err := seccomp.Compile(app.Seccomp)
	if err != nil {
		return nil, &childError{code: api.CodeInvalidArgument, err: fmt.Errorf("seccomp profile %s: %w", app.SeccompProfile, err)}
	}
	if notes && len(f.Notes) > 0 {
		warn("seccomp profile %s: %s", app.SeccompProfile, strings.Join(f.Notes, "; "))
	}
	return f, nil
}

// seccompBeforeCreds tells whether the app's filter must be installed
// before its credentials are applied. The kernel takes a filter only from
// a thread with no_new_privs or CAP_SYS_ADMIN: an app with neither loses
// the right in applyCreds, so its filter goes in first (as runc does), and
// the profile must then allow the credential calls (setgroups, setresuid,
// capset, prctl) besides execve.
func seccompBeforeCreds(app *api.AppSpec) bool {
	return !app.NoNewPrivs && !app.Privileged && !slices.Contains(app.Capabilities, "CAP_SYS_ADMIN")
}

func trimNL(b []byte) string {
	s := string(b)
	for len(s) > 0 && (s[len(s)-1] == '\n') {
		s = s[:len(s)-1]
	}
	return s
}

// targetCaps is the capability set an app gets: every capability the agent
// holds when privileged, else the named ones the agent holds (the others
// are reported through warn and left out: the agent cannot grant what it
// lacks).
func targetCaps(app *api.AppSpec, warn func(string, ...any)) ([]capability.Cap, error) {
	own, err := capability.NewPid2(0)
	if err != nil {
		return nil, err
	}
	if err := own.Load(); err != nil {
		return nil, err
	}
	var want []capability.Cap
	if app.Privileged {
		want, err = capability.ListSupported()
	} else {
		want, err = parseCaps(app.Capabilities)
	}
	if err != nil {
		return nil, err
	}
	var caps, missing []capability.Cap
	for _, c := range want {
		if own.Get(capability.BOUNDING, c) && own.Get(capability.PERMITTED, c) {
			caps = append(caps, c)
		} else {
			missing = append(missing, c)
		}
	}
	if len(missing) > 0 && !app.Privileged {
		names := make([]string, len(missing))
		for i, c := range missing {
			names[i] = capName(c)
		}
		warn("capabilities not held by the agent, not granted: %v", names)
	}
	return caps, nil
}

// applyCreds drops the bounding set to the app's capabilities, switches to
// the app's groups and user (keeping capabilities across setuid), then sets
// the permitted, effective and inheritable sets and clears the ambient set.
// A non-root user thus ends with empty effective and permitted sets after
// execve, as Kubernetes gives it; root keeps the set.
func applyCreds(app *api.AppSpec, warn func(string, ...any)) error {
	caps, err := targetCaps(app, warn)
	if err != nil {
		return fmt.Errorf("capabilities: %w", err)
	}
	if err := dropBounding(caps); err != nil {
		return err
	}
	if err := unix.Prctl(unix.PR_SET_KEEPCAPS, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("keepcaps: %w", err)
	}
	groups := make([]int, len(app.AdditionalGIDs))
	for i, g := range app.AdditionalGIDs {
		groups[i] = int(g)
	}
	// syscall's Setgroups/Setgid/Setuid change every thread of the process.
	if err := syscall.Setgroups(groups); err != nil {
		return fmt.Errorf("setgroups %v: %w", groups, err)
	}
	if err := syscall.Setgid(int(app.GID)); err != nil {
		return fmt.Errorf("setgid %d: %w", app.GID, err)
	}
	if err := syscall.Setuid(int(app.UID)); err != nil {
		return fmt.Errorf("setuid %d: %w", app.UID, err)
	}
	if err := unix.Prctl(unix.PR_SET_KEEPCAPS, 0, 0, 0, 0); err != nil {
		return fmt.Errorf("keepcaps: %w", err)
	}
	c, err := capability.NewPid2(0)
	if err != nil {
		return fmt.Errorf("capabilities: %w", err)
	}
	if err := c.Load(); err != nil {
		return fmt.Errorf("capabilities: %w", err)
	}
	c.Clear(capability.CAPS | capability.AMBS)
	// The inheritable set stays empty, as in runc and containerd since
	// CVE-2022-24769: a non-empty one lets file capabilities of binaries
	// in the image grant more than the container was given.
	c.Set(capability.EFFECTIVE|capability.PERMITTED, caps...)
	if err := c.Apply(capability.CAPS | capability.AMBS); err != nil {
		return fmt.Errorf("set capabilities: %w", err)
	}
	return nil
}

// dropBounding drops every capability but caps from the calling thread's
// bounding set, which its children inherit and which bounds what a
// program they execute may gain.
func dropBounding(caps []capability.Cap) error {
	supported, err := capability.ListSupported()
	if err != nil {
		return fmt.Errorf("capabilities: %w", err)
	}
	for _, c := range supported {
		if slices.Contains(caps, c) {
			continue
		}
		if err := unix.Prctl(unix.PR_CAPBSET_DROP, uintptr(c), 0, 0, 0); err != nil && !errors.Is(err, unix.EINVAL) {
			return fmt.Errorf("drop bounding capability %s: %w", capName(c), err)
		}
	}
	return nil
}

// mountSys mounts sysfs at rootfs/sys, read-only unless privileged; where
// no sysfs can be mounted (a user namespace that does not own the pod's
// network namespace) the agent's own /sys is bound instead.
func mountSys(rootfs string, privileged bool) error {
	const nsx = unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC
	sysFlags := uintptr(nsx | unix.MS_RDONLY)
	if privileged {
		sysFlags = nsx
	}
	bound := false
	return mountIn(rootfs, "/sys", true, func(t string) error {
		err := unix.Mount("sysfs", t, "sysfs", sysFlags, "")
		if !errors.Is(err, unix.EPERM) {
			return err
		}
		// In a user namespace that does not own the pod's network
		// namespace (the pod's root is not the host's, its network was
		// made by the host) no sysfs can be mounted: the agent's own is
		// bound instead, read-only unless privileged.
		bound = true
		if err := unix.Mount("/sys", t, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
			return fmt.Errorf("bind /sys: %w", err)
		}
		return nil
	}, func(t string) error {
		if bound && sysFlags&unix.MS_RDONLY != 0 {
			return remountReadonly(t, true)
		}
		return nil
	})
}

// setupRoot builds the app's root in the fresh mount namespace and pivots
// into it.
func setupRoot(app *api.AppSpec, warn func(string, ...any)) error {
	// The clones of the rshared mounts' sources are closed when the root
	// is built.
	shared := map[int]int{}
	defer func() {
		for _, fd := range shared {
			unix.Close(fd)
		}
	}()
	if err := cloneSharedSources(app.Mounts, shared); err != nil {
		return err
	}
	// Nothing mounted from here on propagates back to the agent's namespace.
	if err := unix.Mount("", "/", "", unix.MS_SLAVE|unix.MS_REC, ""); err != nil {
		return fmt.Errorf("make / rslave: %w", err)
	}
	rootfs, err := bindRootfs(app.Rootfs)
	if err != nil {
		return err
	}
	if err := mountSystemFS(rootfs, app, warn); err != nil {
		return err
	}
	if err := mountCgroupView(rootfs, app, warn); err != nil {
		return err
	}
	if err := bindAppMounts(rootfs, app.Mounts, shared); err != nil {
		return err
	}
	if err := makeAppDevices(rootfs, app); err != nil {
		return err
	}
	if !app.Privileged {
		if err := maskPaths(app, rootfs); err != nil {
			return err
		}
	}
	if err := pivotRoot(rootfs); err != nil {
		return err
	}
	if app.ReadonlyRootfs {
		if err := remountReadonly("/", false); err != nil {
			return fmt.Errorf("read-only rootfs: %w", err)
		}
	}
	return nil
}

// cloneSharedSources clones the source of each bidirectional (rshared)
// mount into shared, by its index in mounts; the caller closes the clones,
// those made before a failure too.
//
// A bidirectional mount must be a peer of its source's mount, so that the
// app's mounts beneath it reach the source's other peers (the host's).
// This fresh namespace's copies of shared mounts are such peers: the
// sources are cloned before / turns rslave, and the copies with it.
func cloneSharedSources(mounts []api.Mount, shared map[int]int) error {
	for i, m := range mounts {
		if m.Propagation != "rshared" {
			continue
		}
		fd, err := unix.OpenTree(unix.AT_FDCWD, m.Source, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC|unix.AT_RECURSIVE)
		if err != nil {
			return failedPrecondition(fmt.Errorf("mount %s: clone its source %s: %w", m.Destination, m.Source, err))
		}
		shared[i] = fd
	}
	return nil
}

// bindRootfs resolves the app's rootfs to an absolute path without
// symbolic links and binds it onto itself, to become a mount that
// pivot_root takes. It returns the resolved path.
func bindRootfs(path string) (string, error) {
	rootfs, err := filepath.Abs(path)
	if err == nil {
		rootfs, err = filepath.EvalSymlinks(rootfs)
	}
	if err != nil {
		return "", failedPrecondition(fmt.Errorf("rootfs: %w", err))
	}
	if err := unix.Mount(rootfs, rootfs, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
		return "", fmt.Errorf("bind rootfs: %w", err)
	}
	return rootfs, nil
}

// mountSystemFS mounts /proc, /sys and /dev inside rootfs.
func mountSystemFS(rootfs string, app *api.AppSpec, warn func(string, ...any)) error {
	const nsx = unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC
	if err := mountIn(rootfs, "/proc", true, func(t string) error {
		return unix.Mount("proc", t, "proc", nsx, "")
	}); err != nil {
		return err
	}
	if err := mountSys(rootfs, app.Privileged); err != nil {
		return err
	}
	// A privileged app's /dev is made as anyone's: the host's devices
	// it is given, where its stage1 gives them, are among app.Devices;
	// the pod's own, elsewhere, PodDevices.
	return setupDev(rootfs, app.SELinuxMountLabel, warn)
}

// bindAppMounts binds the app's mounts inside rootfs, in order; shared
// holds, by index, the clones of the rshared mounts' sources to attach.
func bindAppMounts(rootfs string, mounts []api.Mount, shared map[int]int) error {
	for i, m := range mounts {
		tree, ok := shared[i]
		if !ok {
			tree = -1
		}
		if err := bindMount(rootfs, m, tree); err != nil {
			return err
		}
	}
	return nil
}

// makeAppDevices makes the app's device nodes inside rootfs: with
// PodDevices the pod's own (those of the agent's /dev) first, then the
// app's Devices.
func makeAppDevices(rootfs string, app *api.AppSpec) error {
	nodes := app.Devices
	if app.PodDevices {
		own, err := devices.Host("/dev")
		if err != nil {
			return fmt.Errorf("the pod's devices: %w", err)
		}
		nodes = append(own, nodes...)
	}
	for _, d := range nodes {
		if err := makeDevice(rootfs, d); err != nil {
			return err
		}
	}
	return nil
}

// setupDev mounts a minimal /dev: a tmpfs with the usual character devices
// bound from the agent's /dev, devpts, shm and mqueue. The file systems it
// makes get the SELinux mount label, where SELinux is enabled.
func setupDev(rootfs, mountLabel string, warn func(string, ...any)) error {
	if err := mountIn(rootfs, "/dev", true, func(t string) error {
		return unix.Mount("tmpfs", t, "tmpfs", unix.MS_NOSUID|unix.MS_STRICTATIME, lsm.MountData("mode=755,size=65536k", mountLabel))
	}); err != nil {
		return err
	}
	for _, name := range []string{"null", "zero", "full", "random", "urandom", "tty"} {
		src := "/dev/" + name
		if _, err := os.Stat(src); err != nil {
			warn("device %s not available: %v", src, err)
			continue
		}
		if err := lsm.LabelPodDevice(src, mountLabel); err != nil {
			return err
		}
		if err := mountIn(rootfs, src, false, func(t string) error {
			return unix.Mount(src, t, "", unix.MS_BIND, "")
		}); err != nil {
			return err
		}
	}
	if err := mountIn(rootfs, "/dev/pts", true, func(t string) error {
		return unix.Mount("devpts", t, "devpts", unix.MS_NOSUID|unix.MS_NOEXEC, lsm.MountData("newinstance,ptmxmode=0666,mode=0620,gid=5", mountLabel))
	}); err != nil {
		return err
	}
	if err := mountIn(rootfs, "/dev/shm", true, func(t string) error {
		return unix.Mount("shm", t, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, lsm.MountData("mode=1777,size=65536k", mountLabel))
	}); err != nil {
		return err
	}
	if err := mountIn(rootfs, "/dev/mqueue", true, func(t string) error {
		return unix.Mount("mqueue", t, "mqueue", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, lsm.MountData("", mountLabel))
	}); err != nil {
		warn("%v", err)
	}
	// The tmpfs is fresh and ours: plain joins are safe inside it, once
	// its own path is resolved inside the root (the image's /dev may be
	// a link).
	dev, err := securejoin.SecureJoin(rootfs, "/dev")
	if err != nil {
		return err
	}
	links := map[string]string{
		"ptmx":   "pts/ptmx",
		"fd":     "/proc/self/fd",
		"stdin":  "/proc/self/fd/0",
		"stdout": "/proc/self/fd/1",
		"stderr": "/proc/self/fd/2",
	}
	// As runc makes it, where the kernel has /proc/kcore (masked in an
	// unprivileged app).
	if _, err := os.Stat("/proc/kcore"); err == nil {
		links["core"] = "/proc/kcore"
	}
	for link, target := range links {
		if err := os.Symlink(target, filepath.Join(dev, link)); err != nil {
			return fmt.Errorf("/dev/%s: %w", link, err)
		}
	}
	return nil
}

// bindMount binds m.Source onto m.Destination inside rootfs, then applies
// read-only and propagation.
//
// tree, unless -1, is a detached clone of the source (open_tree) to attach
// instead of binding the source, keeping its peer group (rshared).
func bindMount(rootfs string, m api.Mount, tree int) error {
	st, err := os.Stat(m.Source)
	if err != nil {
		return failedPrecondition(fmt.Errorf("mount source: %w", err))
	}
	prop := uintptr(unix.MS_PRIVATE)
	switch m.Propagation {
	case "", "private":
	case "rslave":
		prop = unix.MS_SLAVE
	case "rshared":
		prop = unix.MS_SHARED
	default:
		return &childError{code: api.CodeInvalidArgument, err: fmt.Errorf("mount %s: unknown propagation %q", m.Destination, m.Propagation)}
	}
	steps := []func(string) error{func(t string) error {
		if tree >= 0 {
			// t is a /proc/self/fd link to the target, to follow.
			return unix.MoveMount(tree, "", unix.AT_FDCWD, t, unix.MOVE_MOUNT_F_EMPTY_PATH|unix.MOVE_MOUNT_T_SYMLINKS)
		}
		return unix.Mount(m.Source, t, "", unix.MS_BIND|unix.MS_REC, "")
	}}
	if f := mountFlags(m); f != 0 {
		steps = append(steps, func(t string) error { return remountWith(t, f) })
	}
	if m.Readonly {
		// Read-only covers the bound mount; the mounts beneath it only
		// when asked (recursive read-only, which has no fallback).
		steps = append(steps, func(t string) error {
			if m.RecursiveReadonly {
				return recursiveReadonly(t)
			}
			return remountReadonly(t, false)
		})
	}
	steps = append(steps, func(t string) error {
		return unix.Mount("", t, "", prop|unix.MS_REC, "")
	})
	return mountIn(rootfs, m.Destination, st.IsDir(), steps...)
}

// mountFlags are m's nosuid, nodev and noexec flags.
func mountFlags(m api.Mount) uintptr {
	var f uintptr
	if m.NoSuid {
		f |= unix.MS_NOSUID
	}
	if m.NoDev {
		f |= unix.MS_NODEV
	}
	if m.NoExec {
		f |= unix.MS_NOEXEC
	}
	return f
}

// remountWith adds flags to the bind mount at path, keeping the flags it
// has.
func remountWith(path string, flags uintptr) error {
	var sfs unix.Statfs_t
	if err := unix.Statfs(path, &sfs); err != nil {
		return err
	}
	keep := uintptr(sfs.Flags) & (unix.MS_RDONLY | unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC | unix.MS_NOATIME | unix.MS_NODIRATIME | unix.MS_RELATIME)
	if err := unix.Mount("", path, "", unix.MS_BIND|unix.MS_REMOUNT|keep|flags, ""); err != nil {
		return fmt.Errorf("remount %s: %w", path, err)
	}
	return nil
}

// remountReadonly makes the mount at path read-only, keeping its other
// flags; recursive covers the mounts beneath it too.
func remountReadonly(path string, recursive bool) error {
	if recursive {
		attr := &unix.MountAttr{Attr_set: unix.MOUNT_ATTR_RDONLY}
		err := unix.MountSetattr(unix.AT_FDCWD, path, unix.AT_RECURSIVE, attr)
		if err == nil {
			return nil
		}
		if !errors.Is(err, unix.ENOSYS) {
			return fmt.Errorf("mount_setattr %s: %w", path, err)
		}
	}
	var sfs unix.Statfs_t
	if err := unix.Statfs(path, &sfs); err != nil {
		return err
	}
	keep := uintptr(sfs.Flags) & (unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC | unix.MS_NOATIME | unix.MS_NODIRATIME | unix.MS_RELATIME)
	if err := unix.Mount("", path, "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY|keep, ""); err != nil {
		return fmt.Errorf("remount %s read-only: %w", path, err)
	}
	return nil
}

// recursiveReadonly makes the mount at path and every mount beneath it
// read-only; kernels without mount_setattr (before 5.12) cannot, and get
// an error rather than a mount that is writable underneath.
func recursiveReadonly(path string) error {
	attr := &unix.MountAttr{Attr_set: unix.MOUNT_ATTR_RDONLY}
	if err := unix.MountSetattr(unix.AT_FDCWD, path, unix.AT_RECURSIVE, attr); err != nil {
		return &childError{code: api.CodeFailedPrecondition, err: fmt.Errorf("recursive read-only mount: mount_setattr: %w", err)}
	}
	return nil
}

// DefaultMaskedPaths and DefaultReadonlyPaths are what an unprivileged
// app gets when its spec names none, as other container runtimes do.
var (
	DefaultMaskedPaths = []string{
		"/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
		"/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi",
		"/sys/firmware", "/sys/devices/virtual/powercap",
	}
	DefaultReadonlyPaths = []string{
		"/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger",
	}
)

// maskPaths hides the app's masked paths and makes its read-only paths
// read-only, beneath rootfs (paths resolved inside it); a path the root
// does not have is skipped. A path that exists but cannot be masked is an
// error: the app would see what it was promised not to.
func maskPaths(app *api.AppSpec, rootfs string) error {
	if app.Unmasked {
		return nil
	}
	masked, readonly := app.MaskedPaths, app.ReadonlyPaths
	if masked == nil {
		masked = DefaultMaskedPaths
	}
	if readonly == nil {
		readonly = DefaultReadonlyPaths
	}
	for _, p := range masked {
		err := atExisting(rootfs, p, func(dir bool) []func(string) error {
			if dir {
				return []func(string) error{func(t string) error {
					return unix.Mount("tmpfs", t, "tmpfs", unix.MS_RDONLY, lsm.MountData("size=0", app.SELinuxMountLabel))
				}}
			}
			return []func(string) error{func(t string) error { return unix.Mount("/dev/null", t, "", unix.MS_BIND, "") }}
		})
		if err != nil {
			return fmt.Errorf("mask %s: %w", p, err)
		}
	}
	for _, p := range readonly {
		err := atExisting(rootfs, p, func(bool) []func(string) error {
			// Each step opens the path anew: the second one reaches the
			// bind the first one made.
			return []func(string) error{
				func(t string) error { return unix.Mount(t, t, "", unix.MS_BIND|unix.MS_REC, "") },
				func(t string) error { return remountReadonly(t, true) },
			}
		})
		if err != nil {
			return fmt.Errorf("read-only %s: %w", p, err)
		}
	}
	return nil
}

// atExisting runs the steps for the target p resolves to inside rootfs,
// when it exists, each on the path opened anew; steps is told whether the
// target is a directory.
func atExisting(rootfs, p string, steps func(dir bool) []func(string) error) error {
	full, err := securejoin.SecureJoin(rootfs, p)
	if err != nil {
		return err
	}
	st, err := os.Lstat(full)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	} else if err != nil {
		return err
	}
	for _, step := range steps(st.IsDir()) {
		if err := atTarget(rootfs, full, step); err != nil {
			return err
		}
	}
	return nil
}

// pivotRoot makes rootfs the root and detaches the old one.
func pivotRoot(rootfs string) error {
	oldRoot, err := unix.Open("/", unix.O_DIRECTORY|unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(oldRoot)
	newRoot, err := unix.Open(rootfs, unix.O_DIRECTORY|unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(newRoot)
	if err := unix.Fchdir(newRoot); err != nil {
		return err
	}
	// pivot_root(".", ".") stacks the old root on top of the new one; it
	// is then unmounted from beneath.
	if err := unix.PivotRoot(".", "."); err != nil {
		return fmt.Errorf("pivot_root: %w", err)
	}
	if err := unix.Fchdir(oldRoot); err != nil {
		return err
	}
	if err := unix.Mount("", ".", "", unix.MS_SLAVE|unix.MS_REC, ""); err != nil {
		return fmt.Errorf("make old root rslave: %w", err)
	}
	if err := unix.Unmount(".", unix.MNT_DETACH); err != nil {
		return fmt.Errorf("unmount old root: %w", err)
	}
	return unix.Chdir("/")
}

// cloexecFrom marks every file descriptor >= first close-on-exec.
func cloexecFrom(first int) {
	if unix.CloseRange(uint(first), ^uint(0), unix.CLOSE_RANGE_CLOEXEC) == nil {
		return
	}
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return
	}
	for _, e := range ents {
		if fd, err := strconv.Atoi(e.Name()); err == nil && fd >= first {
			syscall.CloseOnExec(fd)
		}
	}
}
