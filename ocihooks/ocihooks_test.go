package ocihooks

import (
	"errors"
	"strings"
	"testing"

	"github.com/stagelet/stagelet/errdefs"
)

func intp(i int) *int { return &i }

func TestValidate(t *testing.T) {
	for _, tc := range []struct {
		name  string
		hooks *Hooks
		want  string // "" when valid
	}{
		{"nil", nil, ""},
		{"empty", &Hooks{}, ""},
		//lint:ignore SA1019 deprecated, and accepted as runc accepts it
		{"prestart accepted as runc does", &Hooks{Prestart: []Hook{{Path: "/bin/true"}}}, ""},
		{"absolute, timeout", &Hooks{Poststop: []Hook{{Path: "/missing/is/not/checked", Timeout: intp(3)}}}, ""},
		{"relative", &Hooks{CreateRuntime: []Hook{{Path: "/bin/true"}, {Path: "bin/true"}}}, "hooks.createRuntime[1]"},
		{"empty path", &Hooks{StartContainer: []Hook{{}}}, "hooks.startContainer[0]"},
		{"zero timeout", &Hooks{Poststart: []Hook{{Path: "/bin/true", Timeout: intp(0)}}}, "hooks.poststart[0]: timeout 0"},
		{"negative timeout", &Hooks{CreateContainer: []Hook{{Path: "/bin/true", Timeout: intp(-1)}}}, "hooks.createContainer[0]: timeout -1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := Validate(tc.hooks)
			if tc.want == "" {
				if err != nil {
					t.Fatalf("Validate: %v", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) || !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Fatalf("Validate = %v, want InvalidArgument containing %q", err, tc.want)
			}
		})
	}
}

func TestStages(t *testing.T) {
	h := &Hooks{
		//lint:ignore SA1019 deprecated, and still run as runc runs it
		Prestart:        []Hook{{Path: "/p"}},
		CreateRuntime:   []Hook{{Path: "/cr"}},
		CreateContainer: []Hook{{Path: "/cc"}},
		StartContainer:  []Hook{{Path: "/sc"}},
		Poststart:       []Hook{{Path: "/ps"}},
		Poststop:        []Hook{{Path: "/pst"}},
	}
	want := []struct {
		path        string
		fatal, inCt bool
	}{{"/p", true, false}, {"/cr", true, false}, {"/cc", true, true}, {"/sc", true, true}, {"/ps", true, false}, {"/pst", false, false}}
	for i, s := range Stages {
		got := s.Of(h)
		if len(got) != 1 || got[0].Path != want[i].path || s.Fatal() != want[i].fatal || s.InContainer() != want[i].inCt {
			t.Errorf("%s: hooks %v fatal %v in container %v, want %+v", s, got, s.Fatal(), s.InContainer(), want[i])
		}
		if s.Of(nil) != nil {
			t.Errorf("%s of nil hooks", s)
		}
	}
}

func TestTail(t *testing.T) {
	var tl tail
	tl.Write([]byte(strings.Repeat("a", outputTail)))
	tl.Write([]byte("bc"))
	got := tl.String()
	if len(got) != outputTail || !strings.HasSuffix(got, "abc") {
		t.Fatalf("tail kept %d bytes ending %q", len(got), got[len(got)-3:])
	}
	tl.Write([]byte(strings.Repeat("z", 3*outputTail)))
	if got := tl.String(); got != strings.Repeat("z", outputTail) {
		t.Fatalf("a write longer than the tail: kept %d bytes", len(got))
	}
}
