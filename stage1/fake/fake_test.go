package fake

import (
	"context"
	"strings"
	"testing"

	"github.com/stagelet/stagelet/stage1"
	"github.com/stagelet/stagelet/stage1/stage1test"
)

// TestConformance runs the stage1 conformance suite against the fake, as
// against every real backend: without root, in make unit.
func TestConformance(t *testing.T) {
	b := New("fake")
	stage1test.Run(t, b, stage1test.Env{
		AgentBinary:  "fake",
		Rootfs:       func(t *testing.T) string { return t.TempDir() },
		CgroupParent: func(t *testing.T) string { return "fake" },
		RunDir:       func(t *testing.T) string { return t.TempDir() },
		KillPod: func(t *testing.T, state []byte) {
			if err := b.Kill(state); err != nil {
				t.Fatal(err)
			}
		},
		Procs: func(t *testing.T, spec *stage1.PodSpec) []string { return b.Running(spec.ID) },
		Leftovers: func(t *testing.T, spec *stage1.PodSpec) []string {
			if b.Pod(spec.ID) != nil {
				return []string{"pod " + spec.ID}
			}
			return nil
		},
	})
}

// TestShell: the toy shell runs what the suites ask of a busybox rootfs.
func TestShell(t *testing.T) {
	for _, tt := range []struct {
		args      []string
		stdin     string
		out, errs string
		code      int32
	}{
		{[]string{"echo", "x", "y"}, "", "x y\n", "", 0},
		{[]string{"/bin/sh", "-c", "echo hi; exit 3; echo no"}, "", "hi\n", "", 3},
		{[]string{"sh", "-c", "cat -"}, "in", "in", "", 0},
		{[]string{"/bin/true"}, "", "", "", 0},
		{[]string{"false"}, "", "", "", 1},
		{[]string{"sleep", "0"}, "", "", "", 0},
		{[]string{"nosuch"}, "", "", "nosuch: not found\n", 127},
		{[]string{"exit", "x"}, "", "", "exit: x: bad number\n", 2},
	} {
		var out, errs strings.Builder
		code := shell(context.Background(), tt.args, strings.NewReader(tt.stdin), &out, &errs)
		if code != tt.code || out.String() != tt.out || errs.String() != tt.errs {
			t.Errorf("%q: code %d out %q err %q, want %d %q %q", tt.args, code, out.String(), errs.String(), tt.code, tt.out, tt.errs)
		}
	}
	// A sleeping command ends with the context, as if killed.
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan int32)
	go func() {
		done <- shell(ctx, []string{"sh", "-c", "sleep 1000; echo no"}, nil, &strings.Builder{}, &strings.Builder{})
	}()
	cancel()
	if code := <-done; code != 137 {
		t.Errorf("killed sleep: code %d, want 137", code)
	}
}
