package cgroups

import "testing"

func TestValidUnitName(t *testing.T) {
	for name, want := range map[string]bool{
		"stagelet-pod-0123abcd": true,
		"a:b_c.d-e":             true,
		"":                      false,
		"bad/name":              false,
		"with space":            false,
		"ünicode":               false,
	} {
		if got := ValidUnitName(name); got != want {
			t.Errorf("ValidUnitName(%q) = %v, want %v", name, got, want)
		}
	}
}

func TestValidSlice(t *testing.T) {
	for name, want := range map[string]bool{
		"kubepods-burstable-pod0c7d0a3b_8c7d_4a5e_9f0e_123456789abc.slice": true,
		"stagelet.slice":  true,
		"stagelet":        false,
		"/kubepods/pod1":  false,
		".slice":          false,
		"-a.slice":        false,
		"a--b.slice":      false,
		"a-.slice":        false,
		"a/b.slice":       false,
		"kubepods.slice ": false,
	} {
		if got := ValidSlice(name); got != want {
			t.Errorf("ValidSlice(%q) = %v, want %v", name, got, want)
		}
	}
}

func TestSliceOf(t *testing.T) {
	for parent, want := range map[string]string{
		"stagelet.slice": "stagelet.slice",
		// The kubelet's systemd driver sends the slice's cgroup path.
		"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod0c7d_8c7d.slice": "kubepods-burstable-pod0c7d_8c7d.slice",
		"/test.slice": "test.slice",
		// A path that puts the slice where its name does not.
		"/kubepods.slice/kubepods-pod1.slice/kubepods-burstable-pod1.slice": "",
		"/a.slice/b.slice":         "",
		"/kubepods/burstable/pod1": "",
		"stagelet":                 "",
		"/":                        "",
	} {
		if got := SliceOf(parent); got != want {
			t.Errorf("SliceOf(%q) = %q, want %q", parent, got, want)
		}
	}
}
