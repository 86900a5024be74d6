package lsm

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestDefaultAppArmorProfileCompiles compiles the default profile with
// Debian's apparmor_parser, without loading it (-Q: the kernel here need
// not run AppArmor), so a rule the parser refuses fails here and not at a
// node's start. scripts/install-deps.sh installs the parser.
func TestDefaultAppArmorProfileCompiles(t *testing.T) {
	text := DefaultAppArmorProfile("stagelet-test")
	if !strings.Contains(text, "profile stagelet-test flags=") || strings.Contains(text, "NAME") {
		t.Fatalf("the profile's name is not substituted:\n%s", text)
	}
	for _, rule := range []string{"audit deny mount,", "deny /proc/sysrq-trigger rwklx,", "deny /sys/kernel/security/** rwklx,", "signal (receive) peer=unconfined,"} {
		if !strings.Contains(text, rule) {
			t.Errorf("the profile lacks %q", rule)
		}
	}
	compiles(t, text)
}

// TestVMMAppArmorProfile: a VM pod's qemu profile names its own
// directories (written) and the guest's assets (read),
// nothing of another pod's, compiles, and refuses a path that would be
// read as a pattern.
func TestVMMAppArmorProfile(t *testing.T) {
	name := VMMAppArmorName("0123abcd")
	files := VMMFiles{
		QEMU: "/usr/bin/qemu-system-x86_64",
		Read: []string{"/usr/lib/stagelet/guest/vmlinuz", "/usr/lib/stagelet/guest/initrd.cpio"},
		Own:  []string{"/run/stagelet/pods/0123abcd/vm", "/run/stagelet/pods/0123abcd/mounts/"},
	}
	text, err := VMMAppArmorProfile(name, files)
	if err != nil {
		t.Fatal(err)
	}
	for _, rule := range []string{
		"profile stagelet-vm-0123abcd flags=(attach_disconnected) {",
		"signal (send,receive) peer=stagelet-vm-0123abcd,",
		`"/usr/bin/qemu-system-x86_64" mr,`,
		`"/usr/lib/stagelet/guest/vmlinuz" r,`,
		`"/run/stagelet/pods/0123abcd/vm/**" rwlkm,`,
		`"/run/stagelet/pods/0123abcd/mounts/" rw,`,
	} {
		if !strings.Contains(text, rule) {
			t.Errorf("the profile lacks %q:\n%s", rule, text)
		}
	}
	if strings.Contains(text, "/run/stagelet/pods/**") || strings.Contains(text, "/run/stagelet/** ") || strings.Contains(text, "kvm-templates") {
		t.Errorf("the profile reaches every pod's files:\n%s", text)
	}
	compiles(t, text)
	for _, bad := range []string{"/run/x/pods/*/vm", "relative/vm", `/run/"q"`, "/run/a\nb", "/run/{a,b}"} {
		f := files
		f.Own = []string{bad}
		if _, err := VMMAppArmorProfile(name, f); err == nil {
			t.Errorf("own path %q: no error", bad)
		}
	}
}

// compiles runs apparmor_parser on a profile's text without loading it
// (-Q: the kernel here need not run AppArmor), so that a rule the parser
// refuses fails here and not on a node. scripts/install-deps.sh installs
// the parser.
func compiles(t *testing.T, text string) {
	t.Helper()
	parser, err := exec.LookPath("apparmor_parser")
	if err != nil {
		if _, serr := os.Stat("/usr/sbin/apparmor_parser"); serr != nil {
			t.Skip("apparmor_parser is not installed (scripts/install-deps.sh installs it)")
		}
		parser = "/usr/sbin/apparmor_parser"
	}
	f := filepath.Join(t.TempDir(), "profile")
	if err := os.WriteFile(f, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(parser, "-Q", "-K", f).CombinedOutput()
	var said []string
	for _, l := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		// Where the kernel has no AppArmor the parser says so about its
		// cache, whatever it compiles.
		if l != "" && !strings.HasPrefix(l, "Cache read/write disabled") {
			said = append(said, l)
		}
	}
	if err != nil || len(said) > 0 {
		t.Fatalf("apparmor_parser -Q: %v\n%s\n%s", err, out, text)
	}
}

func TestAppArmorDisabledHere(t *testing.T) {
	dir := t.TempDir()
	defer func(p, f string) { appArmorEnabledPath, appArmorFSPath = p, f }(appArmorEnabledPath, appArmorFSPath)
	appArmorEnabledPath, appArmorFSPath = filepath.Join(dir, "enabled"), filepath.Join(dir, "fs")
	os.WriteFile(appArmorEnabledPath, []byte("Y\n"), 0o644)
	if !AppArmorKernelEnabled() || AppArmorEnabled() {
		t.Errorf("module on, no securityfs: kernel %v, enabled %v; want true, false", AppArmorKernelEnabled(), AppArmorEnabled())
	}
	os.MkdirAll(appArmorFSPath, 0o755)
	os.WriteFile(filepath.Join(appArmorFSPath, "profiles"), []byte("stagelet-default (enforce)\nother (complain)\n"), 0o644)
	if !AppArmorEnabled() || !AppArmorProfileLoaded("stagelet-default") || AppArmorProfileLoaded("stagelet") {
		t.Errorf("securityfs: enabled %v, loaded %v/%v", AppArmorEnabled(), AppArmorProfileLoaded("stagelet-default"), AppArmorProfileLoaded("stagelet"))
	}
}
