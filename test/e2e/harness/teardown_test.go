package harness

import "testing"

func TestUnescapeMountinfo(t *testing.T) {
	if got := unescapeMountinfo(`/tmp/a\040b\011c\134d`); got != "/tmp/a b\tc\\d" {
		t.Errorf("got %q", got)
	}
}
