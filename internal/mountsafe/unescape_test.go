package mountsafe

import "testing"

func TestUnescape(t *testing.T) {
	for in, want := range map[string]string{
		`/a\040b`:               "/a b",
		`/tmp/a\040b\011c\134d`: "/tmp/a b\tc\\d",
		`/a\0`:                  `/a\0`,
		`/plain`:                "/plain",
	} {
		if got := Unescape(in); got != want {
			t.Errorf("Unescape(%q) = %q, want %q", in, got, want)
		}
	}
}
