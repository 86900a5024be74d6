package rlimit

import (
	"encoding/json"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
)

// TestInheritedIsAChildsView: the limits Inherited reports are those a
// child started from here reads, the open files' soft limit the Go
// runtime restores for children included.
func TestInheritedIsAChildsView(t *testing.T) {
	got, err := Inherited()
	if err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("sh", "-c", "ulimit -Sn; ulimit -Hn").Output()
	if err != nil {
		t.Skipf("no shell to compare with: %v", err)
	}
	f := strings.Fields(string(out))
	for _, l := range got {
		if l.Type != "RLIMIT_NOFILE" {
			continue
		}
		if s := limitString(l.Soft); s != f[0] {
			t.Errorf("NOFILE soft %s, a child's %s", s, f[0])
		}
		if s := limitString(l.Hard); s != f[1] {
			t.Errorf("NOFILE hard %s, a child's %s", s, f[1])
		}
		return
	}
	t.Fatalf("no RLIMIT_NOFILE in %v", got)
}

func limitString(v uint64) string {
	if v == ^uint64(0) {
		return "unlimited"
	}
	return strconv.FormatUint(v, 10)
}

// TestApplyInChild: a child that applies limits runs with them; a hard
// limit it may not raise is kept at its own, with a warning, where the
// process lacks CAP_SYS_RESOURCE.
func TestApplyInChild(t *testing.T) {
	if os.Getenv("RLIMIT_TEST_CHILD") == "1" {
		var warned []string
		var own syscall.Rlimit
		if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &own); err != nil {
			os.Exit(2)
		}
		err := Apply([]Limit{{Type: "RLIMIT_NOFILE", Soft: 100, Hard: 200}, {Type: "RLIMIT_CORE", Soft: 0, Hard: 0}}, func(f string, a ...any) { warned = append(warned, f) })
		if err != nil {
			os.Exit(3)
		}
		out, _ := exec.Command("sh", "-c", "ulimit -Sn; ulimit -Hn; ulimit -Sc").Output()
		os.Stdout.Write(out)
		os.Exit(0)
	}
	cmd := exec.Command("/proc/self/exe", "-test.run", "^TestApplyInChild$")
	cmd.Env = append(os.Environ(), "RLIMIT_TEST_CHILD=1")
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("child: %v (%s)", err, out)
	}
	if f := strings.Fields(string(out)); len(f) < 3 || f[0] != "100" || f[1] != "200" || f[2] != "0" {
		t.Errorf("a child of the process that applied NOFILE 100/200 and CORE 0 reads %q", out)
	}
	if err := Check([]Limit{{Type: "RLIMIT_BOGUS"}}); err == nil {
		t.Error("an unknown limit passed the check")
	}
	if err := Check([]Limit{{Type: "RLIMIT_NOFILE", Soft: 2, Hard: 1}}); err == nil {
		t.Error("a soft limit above its hard one passed the check")
	}
}

// TestInheritedBelowRaised: a process started with fewer open files than
// its hard limit (the Go runtime then raises its own) reports the limit it
// was started with, which its children get.
func TestInheritedBelowRaised(t *testing.T) {
	if os.Getenv("RLIMIT_TEST_CHILD") == "probe" {
		ls, err := Inherited()
		if err != nil {
			os.Exit(2)
		}
		var own syscall.Rlimit
		_ = syscall.Getrlimit(syscall.RLIMIT_NOFILE, &own)
		for _, l := range ls {
			if l.Type == "RLIMIT_NOFILE" {
				os.Stdout.WriteString(strconv.FormatUint(l.Soft, 10) + " " + strconv.FormatUint(own.Cur, 10) + "\n")
			}
		}
		os.Exit(0)
	}
	var own syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &own); err != nil || own.Max <= 512 {
		t.Skipf("open files hard limit %d: no room below it", own.Max)
	}
	cmd := exec.Command("sh", "-c", `ulimit -Sn 512 && exec "$0" -test.run '^TestInheritedBelowRaised$'`, "/proc/self/exe")
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Args[len(cmd.Args)-1] = exe
	cmd.Env = append(os.Environ(), "RLIMIT_TEST_CHILD=probe")
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("child: %v (%s)", err, out)
	}
	f := strings.Fields(string(out))
	if len(f) != 2 || f[0] != "512" || f[1] == "512" {
		t.Errorf("a process started with 512 open files (its own raised) reports inherited/own %q, want 512 and its raised one", out)
	}
}

// TestLimitJSON: an unlimited value survives a JSON tool that holds
// numbers as doubles.
func TestLimitJSON(t *testing.T) {
	in := []Limit{{Type: "RLIMIT_CORE", Soft: 0, Hard: ^uint64(0)}, {Type: "RLIMIT_NOFILE", Soft: 1024, Hard: 524288}}
	b, err := json.Marshal(in)
	if err != nil {
		t.Fatal(err)
	}
	var generic any
	if err := json.Unmarshal(b, &generic); err != nil {
		t.Fatal(err)
	}
	b, _ = json.Marshal(generic)
	var out []Limit
	if err := json.Unmarshal(b, &out); err != nil || !slices.Equal(in, out) {
		t.Errorf("%s read back as %v, %v", b, out, err)
	}
}
