package seccomp

import (
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"
)

func u(v uint) *uint { return &v }

func nr(t *testing.T, name string) uint32 {
	t.Helper()
	n, ok := SyscallNumber(name)
	if !ok {
		t.Fatalf("no number for %s", name)
	}
	return n
}

type call struct {
	name string
	arch uint32
	args [6]uint64
	want uint32
}

func check(t *testing.T, p *Profile, calls []call) {
	t.Helper()
	f, err := Compile(p)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range calls {
		arch := c.arch
		if arch == 0 {
			arch = auditArchX86_64
		}
		var n uint32
		if strings.HasPrefix(c.name, "#") {
			v, _ := json.Number(c.name[1:]).Int64()
			n = uint32(v)
		} else {
			n = nr(t, c.name)
		}
		got, err := f.Decide(arch, n, c.args)
		if err != nil {
			t.Fatal(err)
		}
		if got != c.want {
			t.Errorf("%s%v arch %#x: got %#x, want %#x", c.name, c.args, arch, got, c.want)
		}
	}
}

func TestTable(t *testing.T) {
	for name, want := range map[string]uint32{"read": 0, "write": 1, "mkdir": 83, "mkdirat": 258, "clone3": 435, "newfstatat": 262} {
		if got := nr(t, name); got != want {
			t.Errorf("%s = %d, want %d", name, got, want)
		}
	}
	if n := len(SyscallNames()); n < 360 {
		t.Errorf("only %d system calls known", n)
	}
}

func TestActions(t *testing.T) {
	p := &Profile{
		DefaultAction: specs.ActAllow,
		Syscalls: []specs.LinuxSyscall{
			{Names: []string{"mkdir", "mkdirat"}, Action: specs.ActErrno, ErrnoRet: u(uint(unix.EACCES))},
			{Names: []string{"rmdir"}, Action: specs.ActErrno},
			{Names: []string{"reboot"}, Action: specs.ActKill},
			{Names: []string{"kexec_load"}, Action: specs.ActKillProcess},
			{Names: []string{"swapon"}, Action: specs.ActKillThread},
			{Names: []string{"acct"}, Action: specs.ActTrap},
			{Names: []string{"ptrace"}, Action: specs.ActTrace, ErrnoRet: u(7)},
			{Names: []string{"uname"}, Action: specs.ActLog},
			{Names: []string{"no_such_call"}, Action: specs.ActErrno},
		},
	}
	check(t, p, []call{
		{name: "mkdir", want: retErrno | uint32(unix.EACCES)},
		{name: "mkdirat", want: retErrno | uint32(unix.EACCES)},
		{name: "rmdir", want: retErrno | uint32(unix.EPERM)},
		{name: "reboot", want: retKillThread},
		{name: "kexec_load", want: retKillProcess},
		{name: "swapon", want: retKillThread},
		{name: "acct", want: retTrap},
		{name: "ptrace", want: retTrace | 7},
		{name: "uname", want: retLog},
		{name: "read", want: retAllow},
		// Other ABIs of the machine are killed.
		{name: "read", arch: 0x40000003 /* AUDIT_ARCH_I386 */, want: retKillProcess},
		{name: "#1073741824" /* x32 read */, want: retKillProcess},
	})
	f, _ := Compile(p)
	if len(f.Notes) != 1 || !strings.Contains(f.Notes[0], "no_such_call") {
		t.Errorf("notes: %q", f.Notes)
	}
}

func TestDefaultErrno(t *testing.T) {
	check(t, &Profile{DefaultAction: specs.ActErrno, DefaultErrnoRet: u(uint(unix.ENOSYS)),
		Syscalls: []specs.LinuxSyscall{{Names: []string{"read"}, Action: specs.ActAllow}}},
		[]call{{name: "read", want: retAllow}, {name: "write", want: retErrno | uint32(unix.ENOSYS)}})
	check(t, &Profile{DefaultAction: specs.ActErrno},
		[]call{{name: "write", want: retErrno | uint32(unix.EPERM)}})
}

func TestArgComparisons(t *testing.T) {
	const big = 0x1_0000_0005 // hi 1, lo 5
	errno := retErrno | uint32(unix.EPERM)
	rule := func(op specs.LinuxSeccompOperator, v, v2 uint64) *Profile {
		return &Profile{DefaultAction: specs.ActErrno, Syscalls: []specs.LinuxSyscall{
			{Names: []string{"ioctl"}, Action: specs.ActAllow, Args: []specs.LinuxSeccompArg{{Index: 1, Value: v, ValueTwo: v2, Op: op}}},
		}}
	}
	a := func(v uint64) [6]uint64 { return [6]uint64{0, v} }
	tests := []struct {
		op     specs.LinuxSeccompOperator
		v, v2  uint64
		allow  []uint64
		refuse []uint64
	}{
		{specs.OpEqualTo, big, 0, []uint64{big}, []uint64{5, 0x2_0000_0005, big + 1, 0x1_0000_0000}},
		{specs.OpNotEqual, big, 0, []uint64{5, 0x2_0000_0005, big - 1, 0}, []uint64{big}},
		{specs.OpGreaterThan, big, 0, []uint64{big + 1, 0x2_0000_0000, ^uint64(0)}, []uint64{big, 6, 0x1_0000_0004, 0}},
		{specs.OpGreaterEqual, big, 0, []uint64{big, big + 1, 0x2_0000_0000}, []uint64{big - 1, 0xffff_ffff, 0}},
		{specs.OpLessThan, big, 0, []uint64{big - 1, 0xffff_ffff, 6, 0}, []uint64{big, big + 1, 0x2_0000_0000}},
		{specs.OpLessEqual, big, 0, []uint64{big, big - 1, 0xffff_ffff, 0}, []uint64{big + 1, 0x2_0000_0000, 0x1_0000_0006}},
		// Low 32 bits only.
		{specs.OpLessThan, 10, 0, []uint64{9, 0}, []uint64{10, 0x1_0000_0000, 0x1_0000_0001}},
		{specs.OpGreaterThan, 10, 0, []uint64{11, 0x1_0000_0000}, []uint64{10, 0}},
		// (arg & mask) == value, across both halves.
		{specs.OpMaskedEqual, 0xff00_0000_00ff, 0x1200_0000_0034, []uint64{0x1200_0000_0034, 0x1200_abcd_ef34, 0x1212_0000_0034}, []uint64{0x1300_0000_0034, 0x1200_0000_0035, 0}},
	}
	for _, tc := range tests {
		var calls []call
		for _, v := range tc.allow {
			calls = append(calls, call{name: "ioctl", args: a(v), want: retAllow})
		}
		for _, v := range tc.refuse {
			calls = append(calls, call{name: "ioctl", args: a(v), want: errno})
		}
		t.Run(string(tc.op), func(t *testing.T) { check(t, rule(tc.op, tc.v, tc.v2), calls) })
	}
}

func TestRuleOrder(t *testing.T) {
	// Comparisons of an entry all hold (AND); entries with comparisons
	// come before the one without, in profile order.
	p := &Profile{DefaultAction: specs.ActAllow, Syscalls: []specs.LinuxSyscall{
		{Names: []string{"kill"}, Action: specs.ActErrno, ErrnoRet: u(uint(unix.ESRCH))},
		{Names: []string{"kill"}, Action: specs.ActAllow, Args: []specs.LinuxSeccompArg{
			{Index: 0, Value: 100, Op: specs.OpGreaterEqual}, {Index: 0, Value: 200, Op: specs.OpLessThan}}},
		{Names: []string{"kill"}, Action: specs.ActErrno, ErrnoRet: u(uint(unix.EACCES)), Args: []specs.LinuxSeccompArg{
			{Index: 1, Value: 9, Op: specs.OpEqualTo}}},
	}}
	check(t, p, []call{
		{name: "kill", args: [6]uint64{150, 9}, want: retAllow},
		{name: "kill", args: [6]uint64{250, 9}, want: retErrno | uint32(unix.EACCES)},
		{name: "kill", args: [6]uint64{250, 15}, want: retErrno | uint32(unix.ESRCH)},
		{name: "kill", args: [6]uint64{99, 15}, want: retErrno | uint32(unix.ESRCH)},
		{name: "write", want: retAllow},
	})
	p.Syscalls = append(p.Syscalls, specs.LinuxSyscall{Names: []string{"kill"}, Action: specs.ActAllow})
	if _, err := Compile(p); err == nil {
		t.Error("two plain entries with different actions compiled")
	}
}

func TestLongBody(t *testing.T) {
	// More than 255 instructions for one call: the long jump form.
	p := &Profile{DefaultAction: specs.ActErrno}
	for i := range 60 {
		p.Syscalls = append(p.Syscalls, specs.LinuxSyscall{Names: []string{"socket"}, Action: specs.ActAllow,
			Args: []specs.LinuxSeccompArg{{Index: 0, Value: uint64(i * 2), Op: specs.OpEqualTo}}})
	}
	p.Syscalls = append(p.Syscalls, specs.LinuxSyscall{Names: []string{"read"}, Action: specs.ActAllow})
	check(t, p, []call{
		{name: "socket", args: [6]uint64{118}, want: retAllow},
		{name: "socket", args: [6]uint64{0}, want: retAllow},
		{name: "socket", args: [6]uint64{3}, want: retErrno | 1},
		{name: "read", want: retAllow},
		{name: "write", want: retErrno | 1},
	})
}

func TestRuntimeDefault(t *testing.T) {
	eperm := retErrno | uint32(unix.EPERM)
	check(t, RuntimeDefault(), []call{
		{name: "read", want: retAllow},
		{name: "execve", want: retAllow},
		{name: "mkdirat", want: retAllow},
		{name: "keyctl", want: eperm},
		{name: "unshare", want: eperm},
		{name: "mount", want: eperm},
		{name: "chroot", want: eperm},
		{name: "clone", args: [6]uint64{uint64(unix.SIGCHLD)}, want: retAllow},
		{name: "clone", args: [6]uint64{unix.CLONE_NEWUSER | uint64(unix.SIGCHLD)}, want: eperm},
		{name: "clone3", want: retErrno | uint32(unix.ENOSYS)},
		{name: "socket", args: [6]uint64{unix.AF_INET}, want: retAllow},
		{name: "socket", args: [6]uint64{unix.AF_VSOCK}, want: eperm},
		{name: "socket", args: [6]uint64{unix.AF_ALG}, want: eperm},
		{name: "personality", args: [6]uint64{0x0008}, want: retAllow},
		{name: "personality", args: [6]uint64{0x0040000}, want: eperm}, // ADDR_COMPAT_LAYOUT
		{name: "read", arch: 0x40000003, want: retKillProcess},
	})
	check(t, RuntimeDefault("CAP_SYS_ADMIN", "CAP_SYS_CHROOT"), []call{
		{name: "unshare", want: retAllow},
		{name: "mount", want: retAllow},
		{name: "chroot", want: retAllow},
		{name: "clone", args: [6]uint64{unix.CLONE_NEWUSER}, want: retAllow},
		{name: "keyctl", want: eperm},
	})
}

func TestParse(t *testing.T) {
	good := `{
		"defaultAction": "SCMP_ACT_ALLOW",
		"archMap": [{"architecture": "SCMP_ARCH_X86_64", "subArchitectures": ["SCMP_ARCH_X86", "SCMP_ARCH_X32"]}],
		"syscalls": [
			{"names": ["mkdir", "mkdirat"], "action": "SCMP_ACT_ERRNO", "errnoRet": 1, "comment": "no dirs", "includes": {}, "excludes": {}},
			{"name": "rmdir", "action": "SCMP_ACT_ERRNO"}
		]
	}`
	p, err := Parse([]byte(good))
	if err != nil {
		t.Fatal(err)
	}
	if len(p.Architectures) != 3 || len(p.Syscalls) != 2 || p.Syscalls[1].Names[0] != "rmdir" {
		t.Errorf("parsed %+v", p)
	}
	bad := map[string]string{
		"unknown key":     `{"defaultAction": "SCMP_ACT_ALLOW", "defaultaction2": 1}`,
		"no action":       `{"syscalls": []}`,
		"bad action":      `{"defaultAction": "SCMP_ACT_MAYBE"}`,
		"notify":          `{"defaultAction": "SCMP_ACT_NOTIFY"}`,
		"listener":        `{"defaultAction": "SCMP_ACT_ALLOW", "listenerPath": "/run/x"}`,
		"bad op":          `{"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [{"names": ["read"], "action": "SCMP_ACT_ERRNO", "args": [{"index": 0, "value": 1, "op": "SCMP_CMP_ABOUT"}]}]}`,
		"bad index":       `{"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [{"names": ["read"], "action": "SCMP_ACT_ERRNO", "args": [{"index": 6, "value": 1, "op": "SCMP_CMP_EQ"}]}]}`,
		"no names":        `{"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [{"action": "SCMP_ACT_ERRNO"}]}`,
		"errno on allow":  `{"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [{"names": ["read"], "action": "SCMP_ACT_ALLOW", "errnoRet": 1}]}`,
		"errno too big":   `{"defaultAction": "SCMP_ACT_ERRNO", "defaultErrnoRet": 5000}`,
		"bad arch":        `{"defaultAction": "SCMP_ACT_ALLOW", "architectures": ["SCMP_ARCH_Z80"]}`,
		"bad flag":        `{"defaultAction": "SCMP_ACT_ALLOW", "flags": ["SECCOMP_FILTER_FLAG_MAGIC"]}`,
		"conditional":     `{"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [{"names": ["mount"], "action": "SCMP_ACT_ALLOW", "includes": {"caps": ["CAP_SYS_ADMIN"]}}]}`,
		"not json":        `defaultAction: SCMP_ACT_ALLOW`,
		"trailing object": `{"defaultAction": "SCMP_ACT_ALLOW"} {}`,
	}
	for name, doc := range bad {
		if _, err := Parse([]byte(doc)); err == nil {
			t.Errorf("%s: parsed", name)
		} else {
			t.Logf("%s: %v", name, err)
		}
	}
	if _, err := Load(filepath.Join(t.TempDir(), "missing.json")); err == nil || !strings.Contains(err.Error(), "missing.json") {
		t.Errorf("missing file: %v", err)
	}
}

// childEnv makes the test binary, re-executed, install a filter and report
// what mkdir and other calls do.
const childEnv = "STAGELET_SECCOMP_TEST_CHILD"

func TestMain(m *testing.M) {
	if dir := os.Getenv(childEnv); dir != "" {
		os.Exit(child(dir))
	}
	os.Exit(m.Run())
}

// child installs a profile denying mkdir and mkdirat with EPERM, then tries
// them and a few permitted calls. Exit codes tell the parent what failed.
func child(dir string) int {
	runtime.LockOSThread()
	p := &Profile{DefaultAction: specs.ActAllow, Syscalls: []specs.LinuxSyscall{
		{Names: []string{"mkdir", "mkdirat"}, Action: specs.ActErrno, ErrnoRet: u(uint(unix.EPERM))},
	}}
	f, err := Compile(p)
	if err != nil {
		os.Stderr.WriteString(err.Error())
		return 10
	}
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return 11
	}
	if err := Install(f); err != nil {
		os.Stderr.WriteString(err.Error())
		return 12
	}
	if err := os.Mkdir(filepath.Join(dir, "denied"), 0o755); !errors.Is(err, syscall.EPERM) {
		os.Stderr.WriteString("mkdir: " + errString(err))
		return 13
	}
	// Other calls work, on other threads too.
	done := make(chan error)
	go func() {
		runtime.LockOSThread() // a thread of its own, not the one Install ran on
		done <- os.WriteFile(filepath.Join(dir, "file"), []byte("ok"), 0o644)
	}()
	if err := <-done; err != nil {
		return 14
	}
	go func() {
		runtime.LockOSThread()
		done <- unix.Mkdirat(unix.AT_FDCWD, filepath.Join(dir, "denied2"), 0o755)
	}()
	if err := <-done; !errors.Is(err, syscall.EPERM) {
		os.Stderr.WriteString("mkdirat on another thread: " + errString(err))
		return 15
	}
	// A program executed after Install keeps the filter.
	out, err := exec.Command("/bin/sh", "-c", "mkdir "+filepath.Join(dir, "denied3")+" 2>&1; echo rc=$?").CombinedOutput()
	if err != nil || !strings.Contains(string(out), "rc=1") {
		os.Stderr.WriteString("exec'd mkdir: " + string(out) + errString(err))
		return 16
	}
	return 0
}

func errString(err error) string {
	if err == nil {
		return "no error"
	}
	return err.Error()
}

func TestInstall(t *testing.T) {
	if runtime.GOARCH != "amd64" {
		t.Skip("filters are compiled for x86_64")
	}
	if !Supported() {
		t.Skip("the kernel has no seccomp")
	}
	// no_new_privs makes this work without root.
	dir := t.TempDir()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"="+dir)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("child: %v: %s", err, out)
	}
	if _, err := os.Stat(filepath.Join(dir, "file")); err != nil {
		t.Errorf("write under the filter: %v", err)
	}
	for _, d := range []string{"denied", "denied2", "denied3"} {
		if _, err := os.Stat(filepath.Join(dir, d)); err == nil {
			t.Errorf("%s was created under the filter", d)
		}
	}
}

// TestLets: a call is let through only when the filter allows it whatever
// its free arguments.
func TestLets(t *testing.T) {
	f, err := Compile(RuntimeDefault())
	if err != nil {
		t.Fatal(err)
	}
	vfork := map[int]uint64{0: unix.CLONE_VM | unix.CLONE_VFORK | uint64(unix.SIGCHLD)}
	for _, c := range []struct {
		name  string
		fixed map[int]uint64
		want  bool
	}{
		{"read", nil, true},
		{"clone", vfork, true},
		// All ones sets the namespace flags the profile refuses.
		{"clone", nil, false},
		{"clone", map[int]uint64{0: unix.CLONE_NEWNS}, false},
		{"clone3", nil, false},
		{"mount", nil, false},
	} {
		got, err := f.Lets(Call{Name: c.name, Fixed: c.fixed})
		if err != nil || got != c.want {
			t.Errorf("Lets(%s, %v) = %v, %v; want %v", c.name, c.fixed, got, err, c.want)
		}
	}
	// Several calls: all must be let through.
	if ok, err := f.Lets(Call{Name: "read"}, Call{Name: "mount"}); ok || err != nil {
		t.Errorf("Lets(read, mount) = %v, %v; want false", ok, err)
	}
	if ok, err := f.Lets(Call{Name: "read"}, Call{Name: "write"}); !ok || err != nil {
		t.Errorf("Lets(read, write) = %v, %v; want true", ok, err)
	}
	if _, err := f.Lets(Call{Name: "nosuchcall"}); err == nil {
		t.Errorf("Lets of an unknown call: no error")
	}
}
