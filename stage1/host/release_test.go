package host

import (
	"context"
	"errors"
	"fmt"
	"github.com/stagelet/stagelet/stage1"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stagelet/stagelet/cgroups"
	"github.com/stagelet/stagelet/errdefs"
)

// Release frees a pod's processes and cgroups before the backend's own
// steps run, goes on past a failed step, and is idempotent.
func TestRelease(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to create cgroups")
	}
	self, err := cgroups.Self()
	if err != nil {
		t.Skipf("no cgroups: %v", err)
	}
	cg := self.Child(fmt.Sprintf("stagelet-release-test-%d", os.Getpid()))
	if err := cg.Create(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cg.Kill(); _ = cg.Delete() })
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
	r := HostResources{
		Processes: []*Process{p, nil},
		Launched:  []string{"", "t"},
		Cgroups:   []*cgroups.Cgroup{cg, nil},
		Then: []ReleaseStep{
			{What: "first", Do: func() error {
				order = append(order, "first")
				if err := p.Signal(0); !errors.Is(err, ErrProcessGone) {
					return fmt.Errorf("the pod's process is still there: %v", err)
				}
				for _, d := range cg.Paths {
					if _, err := os.Stat(d); !os.IsNotExist(err) {
						return fmt.Errorf("its cgroup %s is still there: %v", d, err)
					}
				}
				return nil
			}},
			{What: "failing", Do: func() error { order = append(order, "failing"); return errors.New("boom") }},
			{What: "last", Do: func() error { order = append(order, "last"); return nil }},
		},
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err = Release(ctx, l, 5*time.Second, r)
	if err == nil || err.Error() != "failing: boom" {
		t.Errorf("Release: %v, want only the failing step's error", err)
	}
	if fmt.Sprint(order) != "[first failing last]" {
		t.Errorf("steps ran %v", order)
	}
	if err := stray.Wait(ctx); err != nil {
		t.Errorf("the process no record named: %v", err)
	}
	// Again: everything is gone, and that is fine.
	r.Then = nil
	if err := Release(ctx, l, 5*time.Second, r); err != nil {
		t.Errorf("a second Release: %v", err)
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
	if s, err := StateForRelease(log, "test", "p", []byte(`{"version":1,"unit":"u"}`), parse); err != nil || s.Unit != "u" {
		t.Errorf("a good state: %+v, %v", s, err)
	}
	if s, err := StateForRelease(log, "test", "p", []byte(`{"version":1,"un`), parse); err != nil || *s != (st{}) {
		t.Errorf("a torn state: %+v, %v; want the zero state", s, err)
	}
	if _, err := StateForRelease(log, "test", "p", []byte(`{"version":9}`), parse); !errors.Is(err, stage1.ErrNewerState) || !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Errorf("a newer state: %v, want stage1.ErrNewerState", err)
	}
}
