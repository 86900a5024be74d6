package stage1

import (
	"errors"
	"testing"

	"github.com/stagelet/stagelet/errdefs"
)

func TestParseState(t *testing.T) {
	type st struct {
		Version int    `json:"version"`
		Unit    string `json:"unit"`
	}
	var s st
	if err := ParseState("test", MarshalState(st{Version: 2, Unit: "u"}), 2, &s); err != nil || s.Unit != "u" {
		t.Fatalf("ParseState = %+v, %v", s, err)
	}
	s = st{Unit: "kept"}
	if err := ParseState("test", nil, 2, &s); err != nil || s.Unit != "kept" {
		t.Errorf("empty state: %+v, %v", s, err)
	}
	for _, tc := range []struct {
		b    string
		want error
	}{
		{`{"version":3,"unit":"u"}`, ErrNewerState},
		{`{"version":1,"unit":"u"}`, errdefs.ErrInvalidArgument},
		{`{"version":2,"unit":`, errdefs.ErrInvalidArgument},
		{`{"version":2,"unit":7}`, errdefs.ErrInvalidArgument},
	} {
		if err := ParseState("test", []byte(tc.b), 2, &st{}); !errors.Is(err, tc.want) {
			t.Errorf("ParseState(%s) = %v, want %v", tc.b, err, tc.want)
		}
	}
}

// An older state is brought up one version at a time; a version with no
// migration up is refused, and so is a migration's failure.
func TestParseStateMigrates(t *testing.T) {
	type st struct {
		Version int    `json:"version"`
		Unit    string `json:"unit"`
		Cgroup  string `json:"cgroup"`
	}
	migrate := map[int]Migration{
		1: func(s map[string]any) error { // v2 renamed "name" to "unit"
			s["unit"] = s["name"]
			delete(s, "name")
			return nil
		},
		2: func(s map[string]any) error { // v3 added "cgroup"
			if s["unit"] == nil {
				return errors.New("no unit")
			}
			s["cgroup"] = "/stagelet/" + s["unit"].(string)
			return nil
		},
	}
	var s st
	if err := ParseState("test", []byte(`{"version":1,"name":"u"}`), 3, &s, migrate); err != nil {
		t.Fatal(err)
	}
	if s != (st{Version: 3, Unit: "u", Cgroup: "/stagelet/u"}) {
		t.Errorf("migrated from 1: %+v", s)
	}
	s = st{}
	if err := ParseState("test", []byte(`{"version":2,"unit":"v"}`), 3, &s, migrate); err != nil || s.Cgroup != "/stagelet/v" {
		t.Errorf("migrated from 2: %+v, %v", s, err)
	}
	for _, b := range []string{`{"version":0,"name":"u"}`, `{"version":2}`} {
		if err := ParseState("test", []byte(b), 3, &st{}, migrate); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("ParseState(%s) = %v, want InvalidArgument", b, err)
		}
	}
}
