package devices

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/testutil"
)

func TestResolve(t *testing.T) {
	s, err := Resolve([]Request{
		{Host: "/dev/null", Container: "/dev/mynull", Permissions: "rw"},
		{Host: "/dev/full"}, // the host's path, every access
	}, "config.devices")
	if err != nil {
		t.Fatal(err)
	}
	if len(s.Nodes) != 2 || len(s.Rules) != 2 {
		t.Fatalf("got %+v", s)
	}
	n := s.Nodes[0]
	if n.Path != "/dev/mynull" || n.Type != "c" || n.Major != 1 || n.Minor != 3 || n.FileMode == nil || *n.FileMode != 0o666 || *n.UID != 0 {
		t.Errorf("/dev/null as /dev/mynull: %+v", n)
	}
	if r := s.Rules[0]; !r.Allow || r.Type != "c" || *r.Major != 1 || *r.Minor != 3 || r.Access != "rw" {
		t.Errorf("rule of /dev/null: %+v", r)
	}
	if n := s.Nodes[1]; n.Path != "/dev/full" || n.Minor != 7 || s.Rules[1].Access != "rwm" {
		t.Errorf("/dev/full: %+v %+v", n, s.Rules[1])
	}

	file := filepath.Join(t.TempDir(), "file")
	if err := os.WriteFile(file, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		req   Request
		field string
	}{
		{Request{Host: "/dev/null", Permissions: "rwx"}, "config.devices[0].permissions"},
		{Request{Host: "/dev/null", Permissions: "rr"}, "config.devices[0].permissions"},
		{Request{Host: "dev/null"}, "config.devices[0].host_path"},
		{Request{Host: "/dev/null", Container: "null"}, "config.devices[0].container_path"},
		{Request{Host: "/dev/no-such-device"}, "config.devices[0].host_path"},
		{Request{Host: file}, "config.devices[0].host_path"},
		{Request{Host: t.TempDir()}, "config.devices[0].host_path"}, // holds no node
	} {
		_, err := Resolve([]Request{tc.req}, "config.devices")
		if !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("%+v: %v, want InvalidArgument", tc.req, err)
		} else if !strings.Contains(err.Error(), tc.field) {
			t.Errorf("%+v: %q does not name %s", tc.req, err, tc.field)
		}
	}
}

// A fake /dev: nodes, a symbolic link, the console, ptmx, and the
// directories a privileged container does not take from the host.
func fakeDev(t *testing.T) string {
	testutil.NeedRoot(t, "makes device nodes")
	root := t.TempDir()
	mk := func(rel string, typ uint32, major, minor uint32, mode uint32) {
		p := filepath.Join(root, rel)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := unix.Mknod(p, typ|mode, int(unix.Mkdev(major, minor))); err != nil {
			t.Fatal(err)
		}
		if err := os.Chown(p, 7, 8); err != nil {
			t.Fatal(err)
		}
		if err := unix.Chmod(p, mode); err != nil { // past the umask
			t.Fatal(err)
		}
	}
	mk("null", unix.S_IFCHR, 1, 3, 0o666)
	mk("loop0", unix.S_IFBLK, 7, 0, 0o660)
	mk("dri/card0", unix.S_IFCHR, 226, 0, 0o660)
	mk("console", unix.S_IFCHR, 5, 1, 0o600)
	mk("ptmx", unix.S_IFCHR, 5, 2, 0o666)
	mk("pts/0", unix.S_IFCHR, 136, 0, 0o620)
	mk("shm/x", unix.S_IFCHR, 1, 3, 0o666)
	if err := os.Symlink("null", filepath.Join(root, "link")); err != nil {
		t.Fatal(err)
	}
	return root
}

func TestHost(t *testing.T) {
	root := fakeDev(t)
	got, err := Host(root)
	if err != nil {
		t.Fatal(err)
	}
	var paths []string
	for _, n := range got {
		paths = append(paths, n.Path)
		if *n.UID != 7 || *n.GID != 8 {
			t.Errorf("%s: owner %d:%d, want the host node's 7:8", n.Path, *n.UID, *n.GID)
		}
	}
	slices.Sort(paths)
	if want := []string{"/dev/dri/card0", "/dev/loop0", "/dev/null"}; !slices.Equal(paths, want) {
		t.Errorf("host devices %v, want %v", paths, want)
	}
}

func TestResolveDirectory(t *testing.T) {
	root := fakeDev(t)
	s, err := Resolve([]Request{{Host: filepath.Join(root, "dri"), Container: "/dev/dri", Permissions: "rw"}}, "config.devices")
	if err != nil {
		t.Fatal(err)
	}
	want := specs.LinuxDevice{Path: "/dev/dri/card0", Type: "c", Major: 226, Minor: 0}
	if len(s.Nodes) != 1 || s.Nodes[0].Path != want.Path || s.Nodes[0].Major != want.Major || *s.Nodes[0].FileMode != 0o660 {
		t.Errorf("a directory's nodes: %+v", s.Nodes)
	}
	if len(s.Rules) != 1 || s.Rules[0].Type != "c" || *s.Rules[0].Major != 226 || s.Rules[0].Access != "rw" {
		t.Errorf("a directory's rules: %+v", s.Rules)
	}
}

func TestDefaultRules(t *testing.T) {
	r := DefaultRules()
	if r[0].Allow || r[0].Type != "a" || r[0].Access != "rwm" {
		t.Errorf("first rule %+v: want one denying every device", r[0])
	}
	opens := map[[2]int64]bool{}
	for _, x := range r[1:] {
		if x.Major != nil && x.Minor != nil {
			opens[[2]int64{*x.Major, *x.Minor}] = true
		}
		if x.Type == "b" && x.Access != "m" {
			t.Errorf("a block device may be opened by default: %+v", x)
		}
	}
	for _, d := range [][2]int64{{1, 3}, {1, 5}, {1, 7}, {1, 8}, {1, 9}, {5, 0}, {5, 2}} {
		if !opens[d] {
			t.Errorf("device %d:%d is not in the default allow list", d[0], d[1])
		}
	}
}
