package preflight

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func probe(c Check) Prober { return func(context.Context) Check { return c } }

// TestRunBlocks: a failed check keeps the stage1s it names from running,
// "*" every one; warnings block nothing; the default stage1 decides the
// verdict.
func TestRunBlocks(t *testing.T) {
	for _, tc := range []struct {
		name    string
		checks  []Check
		def     string
		want    map[string]bool // stage1 → can run
		canRun  bool
		inText  []string
		infoKey string
	}{
		{
			name:   "all well",
			checks: []Check{{Name: "cgroups", Status: OK, Detail: "v2"}},
			def:    "nspawn",
			want:   map[string]bool{"nspawn": true, "fly": true, "kvm": true},
			canRun: true,
			inText: []string{"ok cgroups v2", "ok stage1 nspawn can run here (the default stage1)"},
		},
		{
			name:   "nspawn missing",
			checks: []Check{{Name: "nspawn", Status: Fail, Detail: "systemd-nspawn is not installed", Blocks: []string{"nspawn"}}, {Name: "kvm", Status: Warn, Detail: "tcg"}},
			def:    "nspawn",
			want:   map[string]bool{"nspawn": false, "fly": true, "kvm": true},
			inText: []string{"fail stage1 nspawn cannot run: nspawn: systemd-nspawn is not installed (the default stage1)", "warn kvm tcg"},
		},
		{
			name:   "kvm missing, default fly",
			checks: []Check{{Name: "qemu", Status: Fail, Detail: "no qemu", Blocks: []string{"kvm"}}},
			def:    "fly",
			want:   map[string]bool{"nspawn": true, "fly": true, "kvm": false},
			canRun: true,
		},
		{
			name:   "no cgroups",
			checks: []Check{{Name: "cgroups", Status: Fail, Detail: "none", Blocks: []string{"*"}}},
			def:    "fly",
			want:   map[string]bool{"nspawn": false, "fly": false, "kvm": false},
		},
		{
			name:   "unknown default",
			checks: nil,
			def:    "gvisor",
			want:   map[string]bool{"nspawn": true, "fly": true, "kvm": true, "gvisor": false},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var ps []Prober
			for _, c := range tc.checks {
				ps = append(ps, probe(c))
			}
			r := Run(t.Context(), []string{"fly", "kvm", "nspawn"}, tc.def, ps)
			for s, ok := range tc.want {
				if got := r.Stage1s[s] == ""; got != ok {
					t.Errorf("stage1 %s can run: %v (%q), want %v", s, got, r.Stage1s[s], ok)
				}
			}
			if r.CanRunDefault() != tc.canRun {
				t.Errorf("CanRunDefault = %v, want %v", r.CanRunDefault(), tc.canRun)
			}
			var buf bytes.Buffer
			if err := r.WriteText(&buf); err != nil {
				t.Fatal(err)
			}
			text := oneLine(buf.String())
			for _, want := range tc.inText {
				if !strings.Contains(text, want) {
					t.Errorf("text lacks %q:\n%s", want, buf.String())
				}
			}
			info := r.Info()
			for _, c := range tc.checks {
				if got := info["preflight."+c.Name]; got != string(c.Status)+": "+c.Detail {
					t.Errorf("info of %s: %q", c.Name, got)
				}
			}
		})
	}
}

func TestKernelVersion(t *testing.T) {
	for rel, want := range map[string][2]int{
		"6.1.0-27-amd64":    {6, 1},
		"6.18.44-fc-v595":   {6, 18},
		"5.12.0":            {5, 12},
		"4.19.0+":           {4, 19},
		"garbage":           {0, 0},
		"6.3rc1-something1": {6, 3},
	} {
		maj, min := kernelVersion(rel)
		if [2]int{maj, min} != want {
			t.Errorf("kernelVersion(%q) = %d.%d, want %d.%d", rel, maj, min, want[0], want[1])
		}
	}
}

// TestKVMCheck: TCG is a warning naming the probe's reason; an error
// from the backend blocks kvm; no backend blocks kvm with the fix.
func TestKVMCheck(t *testing.T) {
	tcg := KVM(func(context.Context) map[string]string {
		return map[string]string{"accelerator": "tcg", "acceleratorReason": "a guest does not boot under KVM: KVM internal error. Suberror: 1",
			"placement": "auto", "overheadCgroup": "stagelet-vmm", "overheadMemoryMax": "none"}
	})(t.Context())
	if tcg.Status != Warn || !strings.Contains(tcg.Detail, "KVM internal error") || !strings.Contains(tcg.Detail, "TCG") ||
		!strings.Contains(tcg.Detail, "qemu placement auto (overhead cgroup stagelet-vmm, its cap none)") {
		t.Errorf("tcg: %+v", tcg)
	}
	bad := KVM(func(context.Context) map[string]string { return map[string]string{"error": "qemu is not installed"} })(t.Context())
	if bad.Status != Fail || bad.Blocks[0] != "kvm" {
		t.Errorf("error: %+v", bad)
	}
	none := KVM(nil)(t.Context())
	if none.Status != Fail || !strings.Contains(none.Detail, "make guest") {
		t.Errorf("no backend: %+v", none)
	}
}

func TestSetAsideCheck(t *testing.T) {
	c := SetAside(func(context.Context) ([]string, error) { return []string{"pod a", "pod b"}, nil })(t.Context())
	if c.Status != Warn || !strings.Contains(c.Detail, "2 set-aside records") || !strings.Contains(c.Detail, "pod b") {
		t.Errorf("%+v", c)
	}
	c = SetAside(func(context.Context) ([]string, error) { return nil, nil })(t.Context())
	if c.Status != OK {
		t.Errorf("%+v", c)
	}
}

// FindCRIU takes the configured criu only when its check passes, and says
// which it is and why; the probe names the version first.
func TestFindCRIU(t *testing.T) {
	dir := t.TempDir()
	fake := func(name, check string) string {
		p := filepath.Join(dir, name)
		script := "#!/bin/sh\ncase $1 in --version) echo Version: 9.9.9;; check) " + check + ";; esac\n"
		if err := os.WriteFile(p, []byte(script), 0o755); err != nil {
			t.Fatal(err)
		}
		return p
	}
	good := fake("good", "echo Looks good.")
	bad := fake("bad", "echo 'Error: vdso bounds' >&2; exit 1")
	ctx := context.Background()
	path, ver, why, err := FindCRIU(ctx, good)
	if err != nil || path != good || ver != "9.9.9" || !strings.Contains(why, "checkpoint.criu") {
		t.Errorf("a working configured criu: %q %q %q %v", path, ver, why, err)
	}
	if c := CRIU(good)(ctx); c.Status != OK || !strings.HasPrefix(c.Detail, "9.9.9 ("+good+")") {
		t.Errorf("probe of a working criu: %+v", c)
	}
	if _, _, _, err := FindCRIU(ctx, bad); err == nil || !strings.Contains(err.Error(), "vdso bounds") {
		t.Errorf("a failing configured criu: %v", err)
	}
	if c := CRIU(bad)(ctx); c.Status != Warn {
		t.Errorf("probe of a failing criu: %+v", c)
	}
	if _, _, _, err := FindCRIU(ctx, filepath.Join(dir, "none")); err == nil {
		t.Error("a configured criu that does not exist was taken")
	}
}

func TestNRIProbe(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "10-a"), nil, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name      string
		disabled  bool
		connected func(context.Context) ([]string, error)
		status    Status
		want      string
	}{
		{"off", true, nil, Info, "off (nri.disable)"},
		{"plugins", false, func(context.Context) ([]string, error) { return []string{"10-a", "20-b"}, nil }, OK, "/s.sock; started from " + dir + ": 10-a; connected: 10-a, 20-b"},
		{"none", false, func(context.Context) ([]string, error) { return nil, nil }, OK, "connected: none"},
		{"no daemon", false, func(context.Context) ([]string, error) { return nil, errors.New("down") }, Info, "connected: unknown (down)"},
	} {
		c := NRI(tc.disabled, "/s.sock", dir, tc.connected)(context.Background())
		if c.Status != tc.status || !strings.Contains(c.Detail, tc.want) {
			t.Errorf("%s: %s %q, want %s with %q", tc.name, c.Status, c.Detail, tc.status, tc.want)
		}
	}
}
