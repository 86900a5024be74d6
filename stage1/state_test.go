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
