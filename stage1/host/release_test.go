package host

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/stagelet/stagelet/stage1"

	"github.com/stagelet/stagelet/cgroups"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/testutil"
)

// A ledger's Release first ends the pod's processes (those its records
// name and those only its cgroup holds), then releases the rest in the
// reverse order of taking, goes on past a failure, and is idempotent.
func TestLedgerRelease(t *testing.T) {
	testutil.NeedRoot(t, "creates cgroups")
	self, err := cgroups.Self()
	if err != nil {
		t.Skipf("no cgroups: %v", err)
	}
	cg := self.Child(fmt.Sprintf("stagelet-release-test-%d", os.Getpid()))
	if err := cg.Create(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cg.Kill(); _ = cg.Delete() })
	dir := filepath.Join(t.TempDir(), "pod")
	if err := os.MkdirAll(filepath.Join(dir, "sub"), 0o700); err != nil {
		t.Fatal(err)
	}
	l := &PlainLauncher{}
	p, err := l.Launch(context.Background(), LaunchSpec{
		Name: "t", Path: "/bin/sleep", Args: []string{"1000"},
		LogPath: filepath.Join(t.TempDir(), "log"), Cgroup: cg,
	})
	if err != nil {
		t.Fatal(err)
	}
	// A second process, in the cgroup only: no record names it.
	stray, err := l.Launch(context.Background(), LaunchSpec{
		Name: "stray", Path: "/bin/sleep", Args: []string{"1000"},
		LogPath: filepath.Join(t.TempDir(), "log"), Cgroup: cg,
	})
	if err != nil {
		t.Fatal(err)
	}
	var order []string
	var ledger Ledger
	ledger.Record(Resource{Kind: "check", Role: "first taken"})
	ledger.Record(Resource{Kind: KindCgroup, Role: "pod cgroup", Cgroup: cg})
	ledger.Record(Resource{Kind: KindDir, Role: "dir", Path: dir})
	ledger.Record(Resource{Kind: "fail", Role: "failing"})
	ledger.Record(Resource{Kind: KindUnit, Role: "unit", Name: "t"})
	ledger.Record(Resource{Kind: KindProcess, Role: "process", Process: p})
	rel := Releaser{Launcher: l, Grace: 5 * time.Second, Custom: map[Kind]func(context.Context, Resource) error{
		"check": func(context.Context, Resource) error {
			order = append(order, "check")
			if err := p.Signal(0); !errors.Is(err, ErrProcessGone) {
				return fmt.Errorf("the pod's process is still there: %v", err)
			}
			for _, d := range append(slices.Collect(maps.Values(cg.Paths)), dir) {
				if _, err := os.Stat(d); !os.IsNotExist(err) {
					return fmt.Errorf("%s, taken later, is still there: %v", d, err)
				}
			}
			return nil
		},
		"fail": func(context.Context, Resource) error { order = append(order, "failing"); return errors.New("boom") },
	}}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err = ledger.Release(ctx, rel)
	if err == nil || err.Error() != "failing: boom" {
		t.Errorf("Release: %v, want only the failing resource's error", err)
	}
	if fmt.Sprint(order) != "[failing check]" {
		t.Errorf("released %v, want the reverse order of taking", order)
	}
	if err := stray.Wait(ctx); err != nil {
		t.Errorf("the process no record named: %v", err)
	}
	// Again: everything is gone, and that is fine.
	ledger.Resources = slices.DeleteFunc(ledger.Resources, func(r Resource) bool { return r.Kind == "fail" })
	if err := ledger.Release(ctx, rel); err != nil {
		t.Errorf("a second Release: %v", err)
	}
}

// Taking a role again replaces its resource in place; Default adds only
// what the ledger lacks; a kind nothing releases is an error, not skipped.
func TestLedger(t *testing.T) {
	var l Ledger
	saved := 0
	save := func() error { saved++; return nil }
	if err := l.Take(Resource{Kind: KindDir, Role: "a", Path: "/a"}, save); err != nil {
		t.Fatal(err)
	}
	l.Record(Resource{Kind: KindFile, Role: "b", Path: "/b"})
	if err := l.Take(Resource{Kind: KindDir, Role: "a", Path: "/a2"}, save); err != nil {
		t.Fatal(err)
	}
	l.Default(Resource{Kind: KindFile, Role: "b", Path: "/other"})
	l.Default(Resource{Kind: KindFile, Role: "c", Path: "/c"})
	l.Default(Resource{Kind: KindFile, Role: "d"}) // nothing to release: not recorded
	var got []string
	for _, r := range l.Resources {
		got = append(got, r.Role+"="+r.Path)
	}
	if fmt.Sprint(got) != "[a=/a2 b=/b c=/c]" || saved != 2 || l.Path("a") != "/a2" || l.Process("a") != nil {
		t.Errorf("ledger %v (saved %d times)", got, saved)
	}
	l = Ledger{Resources: []Resource{{Kind: "unknown", Role: "x"}}}
	if err := l.Release(context.Background(), Releaser{}); err == nil {
		t.Error("a kind with no releaser was skipped")
	}
}

// ToLedger moves a state's fields into its ledger in the order given.
func TestToLedger(t *testing.T) {
	m := map[string]any{"version": 1.0, "dir": "/d", "empty": "", "proc": map[string]any{"pid": 1.0}, "cg": nil, "keep": "k"}
	err := ToLedger(
		LegacyField{Field: "proc", Kind: KindProcess, Role: "p"},
		LegacyField{Field: "cg", Kind: KindCgroup, Role: "c"},
		LegacyField{Field: "dir", Kind: KindDir, Role: "d"},
		LegacyField{Field: "empty", Kind: KindFile, Role: "e"},
	)(m)
	if err != nil {
		t.Fatal(err)
	}
	res := m["resources"].([]any)
	if len(res) != 2 || res[0].(map[string]any)["role"] != "p" || res[1].(map[string]any)["path"] != "/d" || m["keep"] != "k" {
		t.Errorf("migrated %v", m)
	}
	for _, f := range []string{"dir", "proc", "cg", "empty"} {
		if _, ok := m[f]; ok {
			t.Errorf("field %s left beside the ledger", f)
		}
	}
	if err := ToLedger(LegacyField{Field: "dir", Kind: KindDir, Role: "d"})(map[string]any{"dir": 3.0}); err == nil {
		t.Error("a number taken for a path")
	}
}

func TestStateForRelease(t *testing.T) {
	type st struct {
		Version int    `json:"version"`
		Unit    string `json:"unit"`
	}
	parse := func(b []byte) (*st, error) {
		var s st
		if err := stage1.ParseState("test", b, 1, &s); err != nil {
			return nil, err
		}
		return &s, nil
	}
	log := slog.New(slog.DiscardHandler)
	if s, err := StateForRelease(t.Context(), log, "test", "p", []byte(`{"version":1,"unit":"u"}`), parse); err != nil || s.Unit != "u" {
		t.Errorf("a good state: %+v, %v", s, err)
	}
	if s, err := StateForRelease(t.Context(), log, "test", "p", []byte(`{"version":1,"un`), parse); err != nil || *s != (st{}) {
		t.Errorf("a torn state: %+v, %v; want the zero state", s, err)
	}
	if _, err := StateForRelease(t.Context(), log, "test", "p", []byte(`{"version":9}`), parse); !errors.Is(err, stage1.ErrNewerState) || !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Errorf("a newer state: %v, want stage1.ErrNewerState", err)
	}
}
