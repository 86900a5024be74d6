package lsm

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// DefaultAppArmorName is the name of the profile RuntimeDefault means
// where AppArmor is enabled (DefaultAppArmorProfile is its text).
const DefaultAppArmorName = "stagelet-default"

// Paths AppArmor is read from; variables for tests.
var (
	appArmorEnabledPath = "/sys/module/apparmor/parameters/enabled"
	appArmorFSPath      = "/sys/kernel/security/apparmor"
)

// AppArmorKernelEnabled tells whether the kernel runs AppArmor. It is what
// the agent asks inside a pod, where securityfs is not mounted: changing
// profile at exec needs only /proc.
func AppArmorKernelEnabled() bool {
	b, err := os.ReadFile(appArmorEnabledPath)
	return err == nil && strings.HasPrefix(string(b), "Y")
}

// AppArmorEnabled tells whether AppArmor is enabled and its interface
// (securityfs) mounted, as the daemon sees the node: profiles can be
// listed and loaded.
func AppArmorEnabled() bool {
	if !AppArmorKernelEnabled() {
		return false
	}
	_, err := os.Stat(appArmorFSPath)
	return err == nil
}

// AppArmorProfileLoaded tells whether the kernel holds a profile named
// name.
func AppArmorProfileLoaded(name string) bool {
	b, err := os.ReadFile(appArmorFSPath + "/profiles")
	if err != nil {
		return false
	}
	for _, line := range strings.Split(string(b), "\n") {
		// "name (mode)"
		if n, _, ok := strings.Cut(line, " ("); ok && n == name {
			return true
		}
	}
	return false
}

// ErrAppArmorDisabled says a profile was asked for where AppArmor is not
// enabled.
var ErrAppArmorDisabled = errors.New("AppArmor is not enabled on this node")

// SetAppArmorExec makes the next execve of the calling thread change to
// the AppArmor profile. The caller must be locked to the thread that
// executes.
func SetAppArmorExec(profile string) error {
	if profile == "" {
		return nil
	}
	if !AppArmorKernelEnabled() {
		return fmt.Errorf("AppArmor profile %s requested: %w", profile, ErrAppArmorDisabled)
	}
	data := []byte("exec " + profile)
	var err error
	// The per-module interface first (Linux 5.8+), then the shared one.
	for _, p := range []string{"/proc/thread-self/attr/apparmor/exec", "/proc/thread-self/attr/exec"} {
		var f *os.File
		if f, err = os.OpenFile(p, os.O_WRONLY, 0); err != nil {
			continue
		}
		_, err = f.Write(data)
		f.Close()
		if err == nil {
			return nil
		}
	}
	return fmt.Errorf("AppArmor profile %s: %w", profile, err)
}

// DefaultAppArmorProfile is the text of the profile a container gets
// where AppArmor is enabled and it asks for none or for RuntimeDefault:
// everything a container's own namespaces and capabilities allow, except
// what reaches past them into the node — mounting, the kernel's knobs in
// /proc and /sys beyond the few a pod may set, the firmware and security
// interfaces, and tracing or signalling processes of other profiles. The
// rules follow what containerd and CRI-O's default profiles deny. Paths
// are the container's own (chroot_relative): fly's apps are chrooted.
func DefaultAppArmorProfile(name string) string {
	return strings.ReplaceAll(`# stagelet's default AppArmor profile for containers, loaded by
# stagelet serve where AppArmor is enabled; regenerated at each start.
profile NAME flags=(attach_disconnected,mediate_deleted,chroot_relative) {
  file,
  network,
  capability,
  umount,

  # The container's processes among themselves, and the runtime's
  # (unconfined) signals to them.
  signal (send,receive) peer=NAME,
  signal (receive) peer=unconfined,
  ptrace (trace,read,tracedby,readby) peer=NAME,

  # Audited: a container that tries to mount shows in the node's audit
  # log (the kernel's, or the journal's audit transport).
  audit deny mount,
  audit deny pivot_root,

  # /proc: no write to its top-level files (sysrq-trigger, …) or to what
  # is not a process directory; in /proc/sys only kernel.shm* (IPC
  # sysctls a pod may set).
  deny /proc/* w,
  deny /proc/{[^1-9],[^1-9][^0-9],[^1-9s][^0-9y][^0-9s],[^1-9][^0-9][^0-9][^0-9/]*}/** w,
  deny /proc/sys/[^k]** w,
  deny /proc/sys/kernel/{?,??,[^s][^h][^m]**} w,
  deny /proc/sysrq-trigger rwklx,
  deny /proc/kcore rwklx,
  deny /proc/kmsg rwklx,

  # /sys: nothing written outside the cgroup file system; firmware and
  # the security modules' interfaces not even read.
  deny /sys/[^f]*/** wklx,
  deny /sys/f[^s]*/** wklx,
  deny /sys/fs/[^c]*/** wklx,
  deny /sys/fs/c[^g]*/** wklx,
  deny /sys/fs/cg[^r]*/** wklx,
  deny /sys/firmware/** rwklx,
  deny /sys/kernel/security/** rwklx,
}
`, "NAME", name)
}

// EnsureAppArmorProfile makes sure the kernel holds the profile name with
// the given text: loaded with apparmor_parser when it is not, replaced
// when stamp (a file under a tmpfs such as /run, so it goes with the
// kernel's profiles at a reboot) records another text, left as it is
// otherwise. It reports whether it loaded the profile.
func EnsureAppArmorProfile(ctx context.Context, name, text, stamp string) (bool, error) {
	sum := sha256.Sum256([]byte(text))
	want := hex.EncodeToString(sum[:])
	if AppArmorProfileLoaded(name) {
		if b, err := os.ReadFile(stamp); err == nil && strings.TrimSpace(string(b)) == want {
			return false, nil
		}
	}
	if err := LoadAppArmorProfile(ctx, name, text); err != nil {
		return false, err
	}
	if err := os.MkdirAll(filepath.Dir(stamp), 0o755); err != nil {
		return true, err
	}
	return true, os.WriteFile(stamp, []byte(want+"\n"), 0o644)
}

// LoadAppArmorProfile loads the profile name, whose text is text, with
// apparmor_parser, replacing one of that name.
func LoadAppArmorProfile(ctx context.Context, name, text string) error {
	parser, err := exec.LookPath("apparmor_parser")
	if err != nil {
		return fmt.Errorf("AppArmor profile %s: apparmor_parser is not installed (Debian: apparmor): %w", name, err)
	}
	// -r adds or replaces, -K keeps it out of the parser's cache: the
	// text is ours, made each time.
	cmd := exec.CommandContext(ctx, parser, "-Kr")
	cmd.Stdin = strings.NewReader(text)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("AppArmor profile %s: apparmor_parser: %w: %s", name, err, strings.TrimSpace(out.String()))
	}
	if !AppArmorProfileLoaded(name) {
		return fmt.Errorf("AppArmor profile %s: apparmor_parser succeeded but the kernel does not list it: %s", name, strings.TrimSpace(out.String()))
	}
	return nil
}

// RemoveAppArmorProfile unloads the profile name from the kernel; one
// the kernel does not hold is not an error. The processes it confined
// then run unconfined: it is removed once they are gone.
func RemoveAppArmorProfile(name string) error {
	if !AppArmorProfileLoaded(name) {
		return nil
	}
	if err := os.WriteFile(appArmorFSPath+"/.remove", []byte(name), 0); err != nil && AppArmorProfileLoaded(name) {
		return fmt.Errorf("AppArmor profile %s: unload: %w", name, err)
	}
	return nil
}

// VMMAppArmorName is the name of the AppArmor profile of the qemu of the
// VM pod podID (VMMAppArmorProfile).
func VMMAppArmorName(podID string) string { return "stagelet-vm-" + podID }

// VMMFiles are the files a VM pod's qemu may reach: its binary, what it
// reads (the guest's kernel and initramfs) and the pod's own directories,
// which it writes (its sockets, console and log; the directory it exports
// to the guest with everything mounted beneath it).
type VMMFiles struct {
	QEMU string
	Read []string
	Own  []string
}

// VMMAppArmorProfile is the text of the AppArmor profile name that a VM
// pod's qemu runs under where AppArmor is enabled, as libvirt confines
// each guest's qemu with a profile of its own: besides the libraries,
// firmware and devices every VM uses, only the files f names, so that a
// guest that took over its qemu still cannot reach another pod's root,
// volumes or logs. Paths holding AppArmor's pattern characters or quotes
// are refused.
func VMMAppArmorProfile(name string, f VMMFiles) (string, error) {
	var b strings.Builder
	rule := func(path, suffix, perms string) error {
		if path == "" || !filepath.IsAbs(path) || strings.ContainsAny(path, "\"\\\n*?[]{}^") {
			return fmt.Errorf("AppArmor profile %s: path %q cannot be put in a profile", name, path)
		}
		fmt.Fprintf(&b, "  \"%s%s\" %s,\n", filepath.Clean(path), suffix, perms)
		return nil
	}
	b.WriteString(strings.ReplaceAll(vmmProfileHead, "NAME", name))
	b.WriteString("\n  # This VM's own files.\n")
	if err := rule(f.QEMU, "", "mr"); err != nil {
		return "", err
	}
	for _, p := range f.Read {
		if err := rule(p, "", "r"); err != nil {
			return "", err
		}
	}
	for _, p := range f.Own {
		if err := rule(p, "/", "rw"); err != nil {
			return "", err
		}
		if err := rule(p, "/**", "rwlkm"); err != nil {
			return "", err
		}
	}
	b.WriteString("}\n")
	return b.String(), nil
}

// vmmProfileHead is what every VM's qemu may do: load its libraries and
// firmware, use the KVM and tap devices, read its own process's and the
// machine's facts, and, for the guest's 9p share with
// security_model=passthrough, own and create files as root would.
const vmmProfileHead = `# stagelet's profile for one VM pod's qemu, loaded when the pod starts
# and removed when it goes.
profile NAME flags=(attach_disconnected) {
  capability chown,
  capability dac_override,
  capability dac_read_search,
  capability fowner,
  capability fsetid,
  capability mknod,
  capability setgid,
  capability setuid,
  capability sys_resource,
  network unix,
  network netlink raw,
  signal (receive) peer=unconfined,
  signal (send,receive) peer=NAME,

  /etc/ld.so.cache r,
  /etc/ld.so.preload r,
  /etc/localtime r,
  /usr/share/zoneinfo/** r,
  /{usr/,}lib{,32,64,x32}/** mr,
  /usr/share/qemu/** r,
  /usr/share/seabios/** r,
  /usr/lib/ipxe/** r,

  /dev/null rw,
  /dev/zero rw,
  /dev/full rw,
  /dev/urandom r,
  /dev/random r,
  /dev/kvm rw,
  /dev/net/tun rw,
  /dev/shm/ r,
  owner /dev/shm/** rwk,
  owner /proc/*/** r,
  /proc/sys/vm/overcommit_memory r,
  /proc/sys/kernel/** r,
  /proc/cpuinfo r,
  /proc/meminfo r,
  /proc/filesystems r,
  /sys/devices/system/** r,
  /sys/kernel/mm/transparent_hugepage/** r,
`
