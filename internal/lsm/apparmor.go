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
	parser, err := exec.LookPath("apparmor_parser")
	if err != nil {
		return false, fmt.Errorf("AppArmor profile %s: apparmor_parser is not installed (Debian: apparmor): %w", name, err)
	}
	// -r adds or replaces, -K keeps it out of the parser's cache: the
	// text is ours, made at each start.
	cmd := exec.CommandContext(ctx, parser, "-Kr")
	cmd.Stdin = strings.NewReader(text)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return false, fmt.Errorf("AppArmor profile %s: apparmor_parser: %w: %s", name, err, strings.TrimSpace(out.String()))
	}
	if !AppArmorProfileLoaded(name) {
		return false, fmt.Errorf("AppArmor profile %s: apparmor_parser succeeded but the kernel does not list it: %s", name, strings.TrimSpace(out.String()))
	}
	if err := os.MkdirAll(filepath.Dir(stamp), 0o755); err != nil {
		return true, err
	}
	return true, os.WriteFile(stamp, []byte(want+"\n"), 0o644)
}
