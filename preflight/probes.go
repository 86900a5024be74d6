package preflight

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/cgroups"
	"github.com/stagelet/stagelet/internal/lsm"
	"github.com/stagelet/stagelet/trust"
)

// Cgroups checks the cgroup version and that pods' cgroups can get the
// controllers stagelet sets: beneath parent (the node's pod cgroup, or
// nil for the caller's own) on v2, mounted on v1.
func Cgroups(parent *cgroups.Cgroup) Prober {
	return func(context.Context) Check {
		c := Check{Name: "cgroups", Blocks: []string{"*"}}
		self, err := cgroups.Self()
		if err != nil {
			c.Status, c.Detail = Fail, err.Error()
			return c
		}
		if !cgroups.PureV2() {
			var missing []string
			for _, ctl := range []string{"cpu", "cpuacct", "cpuset", "memory", "pids", "freezer", "devices"} {
				if _, ok := self.Paths[ctl]; !ok {
					missing = append(missing, ctl)
				}
			}
			mode := "v1"
			if _, err := os.Stat("/sys/fs/cgroup/unified"); err == nil {
				mode = "v1 (hybrid: cgroup2 at /sys/fs/cgroup/unified, controllers on v1)"
			}
			if len(missing) > 0 {
				c.Status, c.Detail = Fail, mode+"; controllers not mounted: "+strings.Join(missing, ", ")
				return c
			}
			c.Status, c.Detail = OK, mode+"; cpu, cpuacct, cpuset, memory, pids, freezer and devices mounted"
			return c
		}
		if parent == nil {
			parent = self
		}
		dir := nearestDir(parent.Paths[cgroups.Unified])
		have := strings.Fields(readTrim(filepath.Join(dir, "cgroup.controllers")))
		var missing []string
		for _, ctl := range []string{"cpu", "memory", "pids", "cpuset"} {
			if !slices.Contains(have, ctl) {
				missing = append(missing, ctl)
			}
		}
		where := strings.TrimPrefix(dir, "/sys/fs/cgroup")
		if where == "" {
			where = "/"
		}
		if len(missing) > 0 {
			c.Status = Fail
			c.Detail = fmt.Sprintf("v2; the controllers %s are not delegated to %s (it has: %s): give the service Delegate=yes", strings.Join(missing, ", "), where, strings.Join(have, " "))
			return c
		}
		if unix.Access(dir, unix.W_OK) != nil {
			c.Status, c.Detail = Fail, "v2; "+where+" is not writable by this user"
			return c
		}
		c.Status, c.Detail = OK, fmt.Sprintf("v2 (unified); %s delegates %s", where, strings.Join(have, " "))
		return c
	}
}

// nearestDir is dir or its nearest existing ancestor.
func nearestDir(dir string) string {
	for dir != "/" && dir != "." && dir != "" {
		if _, err := os.Stat(dir); err == nil {
			return dir
		}
		dir = filepath.Dir(dir)
	}
	return dir
}

// Systemd checks whether systemd runs as PID 1 and which version; the
// systemd cgroup driver needs it (systemd: driver chosen).
func Systemd(driverSystemd bool) Prober {
	return func(ctx context.Context) Check {
		c := Check{Name: "systemd"}
		if _, err := os.Stat("/run/systemd/system"); err != nil {
			c.Status, c.Detail = Info, "not PID 1: pods start as plain processes, not transient units"
			if driverSystemd {
				c.Status, c.Blocks = Fail, []string{"*"}
				c.Detail = "not PID 1, and cgroup_driver is systemd: set cgroup_driver: cgroupfs, or run on a systemd host"
			}
			return c
		}
		out, err := command(ctx, 5*time.Second, "systemctl", "--version")
		if err != nil {
			c.Status, c.Detail = Warn, "PID 1, but systemctl --version failed: "+err.Error()
			return c
		}
		c.Status, c.Detail = OK, "PID 1, "+firstLine(out)
		if d, err := command(ctx, 5*time.Second, "systemctl", "show", "-p", "Delegate", "--value", "stagelet.service"); err == nil && strings.TrimSpace(d) != "" {
			c.Detail += "; stagelet.service Delegate=" + strings.TrimSpace(d)
		}
		return c
	}
}

// Tool checks that a program is on PATH and reports its version
// (versionArgs); a missing one blocks the stage1s in blocks, with the
// Debian package that has it.
func Tool(name, program, debPackage string, blocks []string, versionArgs ...string) Prober {
	return func(ctx context.Context) Check {
		c := Check{Name: name}
		path, err := exec.LookPath(program)
		if err != nil {
			c.Status, c.Blocks = Fail, blocks
			c.Detail = program + " is not installed (Debian: " + debPackage + ")"
			return c
		}
		out, err := command(ctx, 10*time.Second, path, versionArgs...)
		if err != nil {
			c.Status, c.Detail = Warn, path+": "+err.Error()
			return c
		}
		c.Status, c.Detail = OK, path+": "+firstLine(out)
		return c
	}
}

// KVMInfo is what the kvm stage1 says about this node (its NodeInfo).
type KVMInfo func(ctx context.Context) map[string]string

// KVM reports the kvm stage1's accelerator and why it was chosen: KVM
// when a guest boots under it, else software emulation (TCG) with the
// probe's reason; and where pods' qemu runs (the placement, the overhead
// cgroup and its cap). Missing guest assets or qemu block the stage1.
func KVM(info KVMInfo) Prober {
	return func(ctx context.Context) Check {
		c := Check{Name: "kvm"}
		if info == nil {
			c.Status, c.Blocks = Fail, []string{"kvm"}
			c.Detail = "the kvm stage1 is not offered: no guest kernel and initramfs (make guest, or the package's /usr/lib/stagelet/guest)"
			return c
		}
		in := info(ctx)
		if e := in["error"]; e != "" {
			c.Status, c.Blocks, c.Detail = Fail, []string{"kvm"}, e
			return c
		}
		detail := fmt.Sprintf("accelerator %s (%s); qemu %s; guest kernel %s; assets %s; qemu placement %s (overhead cgroup %s, its cap %s)",
			in["accelerator"], in["acceleratorReason"], in["qemu"], orUnknown(in["guestKernel"]), in["assetsDir"],
			orUnknown(in["placement"]), orUnknown(in["overheadCgroup"]), orUnknown(in["overheadMemoryMax"]))
		c.Status, c.Detail = OK, detail
		if in["accelerator"] != "kvm" {
			c.Status = Warn
			c.Detail = "software emulation (TCG), much slower: " + detail
		}
		return c
	}
}

func orUnknown(s string) string {
	if s == "" {
		return "unknown"
	}
	return s
}

// CNI reports whether pods can get their own network: ready says so, or
// why not, and describe which network; dirs are the configuration and
// plugin directories.
func CNI(ready func() (bool, string), describe func() string, confDir string, pluginDirs []string) Prober {
	return func(context.Context) Check {
		c := Check{Name: "cni"}
		ok, why := ready()
		where := fmt.Sprintf("config %s, plugins %s", confDir, strings.Join(pluginDirs, ":"))
		if !ok {
			c.Status, c.Detail = Warn, "pods outside the host network cannot run: "+why+" ("+where+"; `stagelet cni init` installs a default network)"
			return c
		}
		c.Status, c.Detail = OK, where
		if d := describe(); d != "" {
			c.Detail = d + "; " + where
		}
		return c
	}
}

// UserNamespaces reports whether pods with hostUsers: false can run: user
// namespaces enabled, and idmapped mounts (kernel 5.12, tmpfs 6.3).
func UserNamespaces() Prober {
	return func(context.Context) Check {
		c := Check{Name: "userns"}
		rel := kernelRelease()
		maj, min := kernelVersion(rel)
		if n := readTrim("/proc/sys/user/max_user_namespaces"); n == "0" {
			c.Status, c.Detail = Warn, "user namespaces are disabled (user.max_user_namespaces = 0): hostUsers: false pods are refused"
			return c
		}
		switch {
		case maj < 5 || maj == 5 && min < 12:
			c.Status, c.Detail = Warn, "kernel "+rel+" has no idmapped mounts (5.12): hostUsers: false pods are refused"
		case maj < 6 || maj == 6 && min < 3:
			c.Status, c.Detail = OK, "kernel "+rel+": idmapped mounts, but not of tmpfs before 6.3: a volume on tmpfs (emptyDir medium Memory) is bound unmapped, its files owned by the overflow ID"
		default:
			c.Status, c.Detail = OK, "kernel "+rel+": user namespaces, idmapped mounts, tmpfs included"
		}
		return c
	}
}

// LSM reports the security modules pods are confined by: whether
// AppArmor is enabled and the default container profile loaded (the
// daemon loads it at start), and SELinux's mode. Neither blocks a stage1:
// without them containers run unconfined by a module, as they ask.
func LSM() Prober {
	return func(context.Context) Check {
		c := Check{Name: "lsm", Status: Info}
		var parts []string
		switch {
		case lsm.AppArmorEnabled() && lsm.AppArmorProfileLoaded(lsm.DefaultAppArmorName):
			parts = append(parts, "AppArmor enabled, the default container profile "+lsm.DefaultAppArmorName+" loaded")
		case lsm.AppArmorEnabled():
			c.Status = Warn
			parts = append(parts, "AppArmor enabled, but the default container profile "+lsm.DefaultAppArmorName+" is not loaded (stagelet serve loads it with apparmor_parser, from the Debian package apparmor): containers are refused until it is")
		case lsm.AppArmorKernelEnabled():
			c.Status = Warn
			parts = append(parts, "AppArmor enabled in the kernel, but securityfs is not mounted at /sys/kernel/security: profiles can be neither listed nor loaded")
		default:
			parts = append(parts, "AppArmor not enabled")
		}
		switch typ := lsm.SELinuxContainerType(); {
		case !lsm.SELinuxEnabled():
			parts = append(parts, "SELinux disabled")
		case typ != "":
			parts = append(parts, "SELinux "+lsm.SELinuxMode()+", containers run as "+typ+" at a level of their pod's")
		default:
			c.Status = Warn
			parts = append(parts, "SELinux "+lsm.SELinuxMode()+", but the policy has no container contexts (lxc_contexts): containers run unlabelled, as the runtime does; contrib/selinux has a policy module and the contexts for Debian's policy")
		}
		if c.Status == Info && (lsm.AppArmorEnabled() || lsm.SELinuxEnabled()) {
			c.Status = OK
		}
		c.Detail = strings.Join(parts, "; ")
		return c
	}
}

func kernelRelease() string {
	var u unix.Utsname
	if err := unix.Uname(&u); err != nil {
		return "unknown"
	}
	return unix.ByteSliceToString(u.Release[:])
}

// kernelVersion parses "6.1.0-27-amd64" into 6, 1.
func kernelVersion(rel string) (int, int) {
	parts := strings.SplitN(rel, ".", 3)
	if len(parts) < 2 {
		return 0, 0
	}
	maj, _ := strconv.Atoi(parts[0])
	digits := parts[1]
	if i := strings.IndexFunc(digits, func(r rune) bool { return r < '0' || r > '9' }); i >= 0 {
		digits = digits[:i]
	}
	min, _ := strconv.Atoi(digits)
	return maj, min
}

// CDI lists the CDI spec directories and the devices they declare.
func CDI(dirs []string, list func() ([]string, error)) Prober {
	return func(context.Context) Check {
		c := Check{Name: "cdi", Status: Info}
		devs, err := list()
		var present []string
		for _, d := range dirs {
			if _, err := os.Stat(d); err == nil {
				present = append(present, d)
			}
		}
		c.Detail = fmt.Sprintf("spec dirs %s (present: %s); %d devices", strings.Join(dirs, ", "), orNone(present), len(devs))
		if len(devs) > 0 {
			c.Detail += ": " + strings.Join(devs, ", ")
		}
		if err != nil {
			c.Status = Warn
			c.Detail += "; specs that cannot be read: " + err.Error()
		}
		return c
	}
}

func orNone(s []string) string {
	if len(s) == 0 {
		return "none"
	}
	return strings.Join(s, ", ")
}

// SignaturePolicy checks that the signature policy and every namespace
// policy beside it load, their key files included (trust.CheckFiles). A
// node policy that does not load fails every stage1: the daemon does not
// start on it. A namespace's that does not load is a warning: that
// namespace's images are refused (or its last good policy stays in force
// in a running daemon).
func SignaturePolicy(file, dir string) Prober {
	return func(ctx context.Context) Check {
		c := Check{Name: "signature policy"}
		if file == "" && dir == "" {
			c.Status, c.Detail = Info, "none configured (images.signature_policy): every image runs unverified"
			return c
		}
		loaded, errs := trust.CheckFiles(file, dir)
		if len(errs) > 0 {
			msgs := make([]string, len(errs))
			c.Status = Warn
			for i, e := range errs {
				msgs[i] = e.Error()
				var le *trust.LoadError
				if errors.As(e, &le) && le.File == file {
					c.Status, c.Blocks = Fail, []string{"*"}
				}
			}
			c.Detail = strings.Join(msgs, "; ")
			return c
		}
		c.Status, c.Detail = OK, fmt.Sprintf("%s load, with every key file they name", strings.Join(loaded, ", "))
		if len(loaded) == 0 {
			c.Status, c.Detail = Info, fmt.Sprintf("no policy file in %s: every image runs unverified", dir)
		}
		return c
	}
}

// LocalCRIU is where scripts/build-criu.sh installs a criu built for
// kernels the packaged one does not know: looked at before PATH.
const LocalCRIU = "/usr/local/sbin/criu"

// CRIU reports whether checkpoints can be taken, and with which criu: as
// FindCRIU finds it.
func CRIU(configured string) Prober {
	return func(ctx context.Context) Check {
		c := Check{Name: "criu"}
		path, ver, why, err := FindCRIU(ctx, configured)
		switch {
		case err == nil:
			c.Status, c.Detail = OK, fmt.Sprintf("%s (%s): `criu check` passes; %s", ver, path, why)
		case errors.Is(err, exec.ErrNotFound):
			c.Status, c.Detail = Info, err.Error()+": containers cannot be checkpointed"
		default:
			c.Status, c.Detail = Warn, err.Error()
		}
		return c
	}
}

// FindCRIU is the criu that checkpoints on this node: configured (the
// configuration's checkpoint.criu) when given, else the first of LocalCRIU
// and criu on PATH whose `criu check` passes on this kernel. It returns
// its path, its version and why it is the one; the error says what each
// candidate lacks, and wraps exec.ErrNotFound when none is installed.
func FindCRIU(ctx context.Context, configured string) (path, version, why string, err error) {
	candidates, why := []string{configured}, "checkpoint.criu names it"
	if configured == "" {
		candidates, why = []string{LocalCRIU}, "the first of "+LocalCRIU+" and PATH that does"
		if p, err := exec.LookPath("criu"); err == nil && p != LocalCRIU {
			candidates = append(candidates, p)
		}
	}
	var fails []string
	for _, p := range candidates {
		if _, err := os.Stat(p); err != nil {
			if configured != "" {
				fails = append(fails, fmt.Sprintf("%s: %v", p, err))
			}
			continue
		}
		out, _ := command(ctx, 10*time.Second, p, "--version")
		ver := criuVersion(out)
		if out, err := command(ctx, 30*time.Second, p, "check"); err != nil {
			fails = append(fails, fmt.Sprintf("%s (%s): `criu check` fails on kernel %s: %s", p, ver, kernelRelease(), lastLine(out, err)))
			continue
		}
		return p, ver, why, nil
	}
	if len(fails) == 0 {
		return "", "", "", fmt.Errorf("criu is not installed (Debian: criu; for kernels it does not know yet, scripts/build-criu.sh): %w", exec.ErrNotFound)
	}
	return "", "", "", errors.New(strings.Join(fails, "; "))
}

// criuVersion is the version `criu --version` prints ("Version: 4.1.1"),
// else its first line.
func criuVersion(out string) string {
	for _, l := range strings.Split(out, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(l), "Version:"); ok {
			return strings.TrimSpace(v)
		}
	}
	return firstLine(out)
}

// Disk reports the free space of the file system holding dir; below
// 1 GiB or 5% pods and images will soon fail.
func Disk(dir string) Prober {
	return func(context.Context) Check {
		c := Check{Name: "disk"}
		var st unix.Statfs_t
		d := nearestDir(dir)
		if err := unix.Statfs(d, &st); err != nil {
			c.Status, c.Detail = Warn, err.Error()
			return c
		}
		free := st.Bavail * uint64(st.Bsize)
		total := st.Blocks * uint64(st.Bsize)
		pct := 0.0
		if total > 0 {
			pct = 100 * float64(free) / float64(total)
		}
		c.Detail = fmt.Sprintf("%s: %.1f GiB free of %.1f GiB (%.0f%%)", dir, gib(free), gib(total), pct)
		c.Status = OK
		if free < 1<<30 || pct < 5 {
			c.Status, c.Blocks = Fail, []string{"*"}
		} else if pct < 15 {
			c.Status = Warn
		}
		return c
	}
}

func gib(n uint64) float64 { return float64(n) / (1 << 30) }

// SetAside lists the records recovery set aside, with what each names:
// what they hold stays until `stagelet gc --set-aside` releases it.
func SetAside(list func(ctx context.Context) ([]string, error)) Prober {
	return func(ctx context.Context) Check {
		c := Check{Name: "set-aside"}
		lines, err := list(ctx)
		switch {
		case err != nil:
			c.Status, c.Detail = Warn, "reading the records: "+err.Error()
		case len(lines) == 0:
			c.Status, c.Detail = OK, "no set-aside records"
		default:
			c.Status = Warn
			c.Detail = fmt.Sprintf("%d set-aside records (stagelet gc --set-aside releases what they name): %s", len(lines), strings.Join(lines, "; "))
		}
		return c
	}
}

func command(ctx context.Context, timeout time.Duration, name string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	var out bytes.Buffer
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	if ctx.Err() != nil {
		err = fmt.Errorf("%s: no answer within %s", name, timeout)
	}
	return out.String(), err
}

func firstLine(s string) string {
	line, _, _ := strings.Cut(strings.TrimSpace(s), "\n")
	return line
}

func lastLine(s string, err error) string {
	s = strings.TrimSpace(s)
	if s == "" {
		return err.Error()
	}
	var last string
	sc := bufio.NewScanner(strings.NewReader(s))
	for sc.Scan() {
		if l := strings.TrimSpace(sc.Text()); l != "" {
			last = l
		}
	}
	return last
}

func readTrim(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}

// NRI reports how NRI plugins are hosted: off, or the socket they connect
// to, the plugins the daemon starts from pluginDir, and those connected
// now (connected; an error when the daemon cannot be asked). It never
// fails: plugins are optional.
func NRI(disabled bool, socket, pluginDir string, connected func(ctx context.Context) ([]string, error)) Prober {
	return func(ctx context.Context) Check {
		c := Check{Name: "nri"}
		if disabled {
			c.Status, c.Detail = Info, "off (nri.disable): no NRI plugin is hosted"
			return c
		}
		var parts []string
		parts = append(parts, "plugins connect to "+socket)
		if ents, err := os.ReadDir(pluginDir); err == nil {
			var names []string
			for _, e := range ents {
				if !e.IsDir() {
					names = append(names, e.Name())
				}
			}
			if len(names) > 0 {
				parts = append(parts, fmt.Sprintf("started from %s: %s", pluginDir, strings.Join(names, ", ")))
			}
		}
		c.Status = OK
		names, err := connected(ctx)
		switch {
		case err != nil:
			c.Status = Info
			parts = append(parts, "connected: unknown ("+err.Error()+")")
		case len(names) == 0:
			parts = append(parts, "connected: none")
		default:
			parts = append(parts, "connected: "+strings.Join(names, ", "))
		}
		c.Detail = strings.Join(parts, "; ")
		return c
	}
}
