package supervisor

import (
	"errors"
	"testing"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/errdefs"
)

// TestSetupOnce: OpSetup runs the agent's setup once; a second call, and
// any call to an agent without one, is FailedPrecondition. (An Agent made
// with New reaps every child of the test process: this one is not.)
func TestSetupOnce(t *testing.T) {
	var got []string
	a := &Agent{setup: func(r *api.Request) error {
		got = append(got, r.Guest)
		return nil
	}}
	if err := a.runSetup(&api.Request{Op: api.OpSetup, Guest: "stagelet.hostname=h"}); err != nil {
		t.Fatalf("first setup: %v", err)
	}
	if err := a.runSetup(&api.Request{Op: api.OpSetup, Guest: "stagelet.hostname=x"}); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Errorf("second setup: %v, want FailedPrecondition", err)
	}
	if len(got) != 1 || got[0] != "stagelet.hostname=h" {
		t.Errorf("setup ran with %q", got)
	}
	if err := (&Agent{}).runSetup(&api.Request{Op: api.OpSetup}); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Errorf("setup of an agent without one: %v, want FailedPrecondition", err)
	}
}
