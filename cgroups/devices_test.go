package cgroups

import (
	"os"
	"os/exec"
	"strings"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/stagelet/stagelet/internal/testutil"
)

func allow(typ string, major, minor int64, access string) specs.LinuxDeviceCgroup {
	r := specs.LinuxDeviceCgroup{Allow: true, Type: typ, Access: access}
	if major >= 0 {
		r.Major = &major
	}
	if minor >= 0 {
		r.Minor = &minor
	}
	return r
}

func TestDeviceRulesCanonical(t *testing.T) {
	all := specs.LinuxDeviceCgroup{Type: "a", Access: "rwm"}
	allowAll := all
	allowAll.Allow = true
	for _, tc := range []struct {
		name  string
		rules []specs.LinuxDeviceCgroup
		ok    bool
	}{
		{"deny all, allow some", []specs.LinuxDeviceCgroup{all, allow("c", 1, 3, "rwm")}, true},
		{"allow all", []specs.LinuxDeviceCgroup{allowAll}, true},
		{"none", nil, false},
		{"first not over every device", []specs.LinuxDeviceCgroup{allow("c", 1, 3, "rwm")}, false},
		{"rules after allowing all", []specs.LinuxDeviceCgroup{allowAll, allow("c", 1, 3, "r")}, false},
		{"a later denial", []specs.LinuxDeviceCgroup{all, {Type: "c", Access: "r"}}, false},
		{"bad access", []specs.LinuxDeviceCgroup{all, allow("c", 1, 3, "x")}, false},
		{"bad type", []specs.LinuxDeviceCgroup{all, allow("p", 1, 3, "r")}, false},
	} {
		_, err := DeviceProgram(tc.rules)
		if (err == nil) != tc.ok {
			t.Errorf("%s: DeviceProgram: %v, want ok=%v", tc.name, err, tc.ok)
		}
		if got := v1Rule(allow("c", 136, -1, "rw")); got != "c 136:* rw" {
			t.Errorf("v1Rule: %q", got)
		}
	}
}

// TestSetDevices fences a real cgroup, by each mechanism this host has,
// and checks what a shell in it may open: /dev/null (allowed), /dev/full
// (given read-only: reading works, opening to write does not) and
// /dev/kmsg (not given).
func TestSetDevices(t *testing.T) {
	testutil.NeedRoot(t, "creates cgroups and attaches device filters")
	e, err := loadEnv()
	if err != nil {
		t.Skipf("cgroups: %v", err)
	}
	type where struct{ name, dir string }
	var places []where
	if e.v2 {
		if self, err := e.self(); err == nil {
			places = append(places, where{"v2 BPF", self.Paths[Unified]})
		}
	} else {
		if self, err := e.self(); err == nil && self.Paths["devices"] != "" {
			places = append(places, where{"v1 devices", self.Paths["devices"]})
		}
		// The hybrid unified hierarchy takes device programs too.
		for _, m := range e.mounts {
			if m.fstype == "cgroup2" {
				places = append(places, where{"hybrid BPF", dirFor(m, e.procs[""])})
			}
		}
	}
	if len(places) == 0 {
		t.Skip("no devices controller and no cgroup2 hierarchy")
	}
	rules := []specs.LinuxDeviceCgroup{
		{Type: "a", Access: "rwm"},
		allow("c", 1, 3, "rwm"), // null
		allow("c", 1, 7, "r"),   // full, read only
	}
	for _, p := range places {
		t.Run(p.name, func(t *testing.T) {
			dir, err := os.MkdirTemp(p.dir, "devtest-")
			if err != nil {
				t.Skipf("cannot create a cgroup beneath %s: %v", p.dir, err)
			}
			t.Cleanup(func() {
				if err := os.Remove(dir); err != nil {
					t.Errorf("remove the test cgroup: %v", err)
				}
			})
			key := "devices"
			if p.name != "v1 devices" {
				key = Unified
			}
			cg := &Cgroup{Paths: map[string]string{key: dir}}
			if err := cg.SetDevices(rules); err != nil {
				t.Fatal(err)
			}
			script := `echo $$ > "$1/cgroup.procs" || exit 9
head -c 1 /dev/full >/dev/null && echo read-full
echo x >/dev/null && echo write-null
(echo x >/dev/full) 2>&1
head -c 1 /dev/kmsg 2>&1 >/dev/null
exit 0`
			out, err := exec.Command("/bin/sh", "-c", script, "sh", dir).CombinedOutput()
			if err != nil {
				t.Fatalf("%v: %s", err, out)
			}
			got := string(out)
			for _, want := range []string{"read-full", "write-null"} {
				if !strings.Contains(got, want) {
					t.Errorf("%s missing: the filter denies what it allows:\n%s", want, got)
				}
			}
			if n := strings.Count(got, "Operation not permitted"); n != 2 {
				t.Errorf("%d denials, want 2 (write /dev/full, read /dev/kmsg):\n%s", n, got)
			}
		})
	}
}
