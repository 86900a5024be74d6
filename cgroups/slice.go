package cgroups

import "strings"

// The names of the systemd driver's cgroups: where systemd is the cgroup
// manager (the kubelet's systemd driver, a service unit's delegated
// subtree), a cgroup parent is a slice, named by a unit name whose dashes
// give its place in the tree.

// DefaultSlice is the systemd slice that holds the pods' units unless the
// node's configuration, a launcher or a launch names another.
const DefaultSlice = "stagelet.slice"

// ValidUnitName reports whether name+".service" is a unit name systemd
// accepts without escaping.
func ValidUnitName(name string) bool {
	if name == "" || len(name)+len(".service") > 255 {
		return false
	}
	for _, r := range name {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune(":_.-", r)) {
			return false
		}
	}
	return true
}

// ValidSlice reports whether name is a slice unit name systemd accepts
// without escaping ("kubepods-burstable-pod<uid>.slice").
func ValidSlice(name string) bool {
	base, ok := strings.CutSuffix(name, ".slice")
	return ok && base != "" && !strings.HasPrefix(base, "-") && !strings.HasSuffix(base, "-") &&
		!strings.Contains(base, "--") && ValidUnitName(base)
}

// SliceOf returns the slice a cgroup parent names for the systemd driver:
// a slice unit name ("kubepods-burstable-pod<uid>.slice"), or the cgroup
// path systemd gives it, as the kubelet sends it
// ("/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid>.slice");
// "" when parent is neither. A path must be the slice's own: a slice's
// place in the tree follows from its name, so a path that puts it
// elsewhere cannot be honoured.
func SliceOf(parent string) string {
	if ValidSlice(parent) {
		return parent
	}
	if !strings.HasPrefix(parent, "/") {
		return ""
	}
	name := parent[strings.LastIndexByte(parent, '/')+1:]
	if !ValidSlice(name) || SlicePath(name) != parent {
		return ""
	}
	return name
}

// SlicePath is the cgroup path of a valid slice name: each dash opens a
// level ("a-b.slice" is "/a.slice/a-b.slice").
func SlicePath(name string) string {
	base := strings.TrimSuffix(name, ".slice")
	var b strings.Builder
	for i := range base {
		if base[i] == '-' {
			b.WriteString("/" + base[:i] + ".slice")
		}
	}
	b.WriteString("/" + name)
	return b.String()
}
