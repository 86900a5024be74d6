package bindopts

import (
	"errors"
	"testing"
)

func TestParse(t *testing.T) {
	for _, tc := range []struct {
		typ  string
		opts []string
		want Flags
	}{
		{"bind", nil, Flags{}},
		{"", []string{"rbind", "ro", "nosuid", "nodev", "noexec", "rslave"}, Flags{Readonly: true, NoSuid: true, NoDev: true, NoExec: true, Propagation: "rslave"}},
		{"none", []string{"bind", "rro"}, Flags{Readonly: true, RecursiveReadonly: true}},
		// Later options override earlier ones.
		{"bind", []string{"rro", "rw", "nosuid", "suid", "noexec", "exec", "nodev", "dev", "rshared", "private"}, Flags{}},
		{"bind", []string{"shared"}, Flags{Propagation: "rshared"}},
	} {
		got, err := Parse(tc.typ, tc.opts)
		if err != nil || got != tc.want {
			t.Errorf("Parse(%q, %q) = %+v, %v; want %+v", tc.typ, tc.opts, got, err, tc.want)
		}
	}
	for _, tc := range []struct {
		typ  string
		opts []string
	}{
		{"tmpfs", nil},
		{"", []string{"ro"}},
		{"bind", []string{"size=1m"}},
		{"bind", []string{"relatime"}},
	} {
		if _, err := Parse(tc.typ, tc.opts); !errors.Is(err, ErrUnsupported) {
			t.Errorf("Parse(%q, %q): %v, want ErrUnsupported", tc.typ, tc.opts, err)
		}
	}
}
