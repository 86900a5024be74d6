package supervisor

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/moby/sys/capability"

	"github.com/stagelet/stagelet/agent/api"
)

func TestParseCaps(t *testing.T) {
	tests := []struct {
		in      []string
		want    []capability.Cap
		wantErr string
	}{
		{nil, nil, ""},
		{[]string{"CAP_CHOWN", "CAP_NET_BIND_SERVICE"}, []capability.Cap{capability.CAP_CHOWN, capability.CAP_NET_BIND_SERVICE}, ""},
		{[]string{"kill", "cap_sys_admin", " Cap_Kill "}, []capability.Cap{capability.CAP_KILL, capability.CAP_SYS_ADMIN}, ""},
		{[]string{"CAP_BPF"}, []capability.Cap{capability.CAP_BPF}, ""},
		{[]string{"CAP_NOPE"}, nil, `unknown capability "CAP_NOPE"`},
		{[]string{""}, nil, `unknown capability ""`},
	}
	for _, tt := range tests {
		got, err := parseCaps(tt.in)
		if tt.wantErr != "" {
			if err == nil || err.Error() != tt.wantErr {
				t.Errorf("parseCaps(%q) error = %v, want %q", tt.in, err, tt.wantErr)
			}
			continue
		}
		if err != nil {
			t.Errorf("parseCaps(%q): %v", tt.in, err)
			continue
		}
		if len(got) != len(tt.want) {
			t.Errorf("parseCaps(%q) = %v, want %v", tt.in, got, tt.want)
			continue
		}
		for i := range got {
			if got[i] != tt.want[i] {
				t.Errorf("parseCaps(%q) = %v, want %v", tt.in, got, tt.want)
			}
		}
	}
	if capName(capability.CAP_SYS_ADMIN) != "CAP_SYS_ADMIN" {
		t.Errorf("capName = %q", capName(capability.CAP_SYS_ADMIN))
	}
}

func TestEnvValue(t *testing.T) {
	env := []string{"A=1", "PATH=/x", "B", "PATH=/y:/z", "C=a=b"}
	if v, ok := envValue(env, "PATH"); !ok || v != "/y:/z" {
		t.Errorf("PATH = %q %v", v, ok)
	}
	if v, ok := envValue(env, "C"); !ok || v != "a=b" {
		t.Errorf("C = %q %v", v, ok)
	}
	if _, ok := envValue(env, "B"); ok {
		t.Error("B without = counted as set")
	}
}

func TestLookPath(t *testing.T) {
	dir := t.TempDir()
	bin1, bin2 := filepath.Join(dir, "bin1"), filepath.Join(dir, "bin2")
	for _, d := range []string{bin1, bin2, filepath.Join(bin1, "adir")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	write := func(p string, mode os.FileMode) {
		if err := os.WriteFile(p, []byte("#!/bin/sh\n"), mode); err != nil {
			t.Fatal(err)
		}
	}
	write(filepath.Join(bin1, "noexec"), 0o644)
	write(filepath.Join(bin2, "noexec"), 0o755)
	write(filepath.Join(bin2, "tool"), 0o755)
	write(filepath.Join(bin1, "tool2"), 0o700)
	env := []string{"PATH=" + bin1 + ":" + bin2}

	tests := []struct {
		file, want, wantErr string
	}{
		{"tool", filepath.Join(bin2, "tool"), ""},
		{"noexec", filepath.Join(bin2, "noexec"), ""}, // not executable in bin1: skipped
		{"tool2", filepath.Join(bin1, "tool2"), ""},
		{"adir", "", `exec: "adir": executable file not found in $PATH`},
		{"nosuch", "", `exec: "nosuch": executable file not found in $PATH`},
		{filepath.Join(bin2, "tool"), filepath.Join(bin2, "tool"), ""},
		{filepath.Join(bin1, "nosuch"), "", "no such file or directory"},
		{filepath.Join(bin1, "noexec"), "", "permission denied"},
		{"", "", `exec: "": executable file not found in $PATH`},
	}
	for _, tt := range tests {
		got, err := lookPath(tt.file, env)
		if tt.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Errorf("lookPath(%q) = %q, %v; want error containing %q", tt.file, got, err, tt.wantErr)
			}
			continue
		}
		if err != nil || got != tt.want {
			t.Errorf("lookPath(%q) = %q, %v; want %q", tt.file, got, err, tt.want)
		}
	}
	// Without PATH in the environment the default path is searched.
	if p, err := lookPath("sh", nil); err != nil || !strings.HasSuffix(p, "/sh") {
		t.Errorf("lookPath(sh) with default PATH = %q, %v", p, err)
	}
}

func TestValidID(t *testing.T) {
	for _, id := range []string{"a", "abc-DEF_0.9", strings.Repeat("x", 128)} {
		if err := validID(id); err != nil {
			t.Errorf("validID(%q): %v", id, err)
		}
	}
	for _, id := range []string{"", ".", "..", ".hidden", "a/b", "a b", strings.Repeat("x", 129), "a\x00"} {
		if err := validID(id); err == nil {
			t.Errorf("validID(%q) accepted", id)
		}
	}
}

func TestStateRecords(t *testing.T) {
	dir := t.TempDir()
	st := &api.AppStatus{ID: "a1", State: api.StateExited, ExitCode: 3, Reason: api.ReasonError,
		CreatedAt: time.Unix(100, 0).UTC(), FinishedAt: time.Unix(200, 0).UTC()}
	if err := writeState(dir, st); err != nil {
		t.Fatal(err)
	}
	st.ExitCode = 4
	if err := writeState(dir, st); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "bad.json"), []byte("{"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "other.json"), []byte(`{"id":"notother"}`), 0o600); err != nil {
		t.Fatal(err)
	}
	sts, bad := readStates(dir)
	if len(sts) != 1 || sts[0].ID != "a1" || sts[0].ExitCode != 4 || !sts[0].FinishedAt.Equal(st.FinishedAt) {
		t.Errorf("records = %+v", sts)
	}
	if len(bad) != 2 {
		t.Errorf("bad records = %v, want 2", bad)
	}
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		if strings.HasSuffix(e.Name(), ".tmp") {
			t.Errorf("temporary file left: %s", e.Name())
		}
	}
}
