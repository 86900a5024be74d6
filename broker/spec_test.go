package broker

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/stagelet/stagelet/image"
)

func TestCommandLine(t *testing.T) {
	img := &image.ImageConfig{Entrypoint: []string{"/ep"}, Cmd: []string{"c1", "c2"}}
	tests := []struct {
		name          string
		command, args []string
		want          []string
	}{
		{"image only", nil, nil, []string{"/ep", "c1", "c2"}},
		{"args replace cmd", nil, []string{"a"}, []string{"/ep", "a"}},
		{"command replaces entrypoint and cmd", []string{"/bin/x"}, nil, []string{"/bin/x"}},
		{"command and args", []string{"/bin/x"}, []string{"a", "b"}, []string{"/bin/x", "a", "b"}},
	}
	for _, tc := range tests {
		if got := commandLine(img, tc.command, tc.args); !slices.Equal(got, tc.want) {
			t.Errorf("%s: got %v, want %v", tc.name, got, tc.want)
		}
	}
}

func TestMergeEnv(t *testing.T) {
	got := mergeEnv([]string{"PATH=/bin", "A=1"}, []KeyValue{{"A", "2"}, {"B", "x=y"}})
	want := []string{"PATH=/bin", "A=2", "B=x=y"}
	if !slices.Equal(got, want) {
		t.Fatalf("got %v, want %v", got, want)
	}
}

func TestCapabilities(t *testing.T) {
	tests := []struct {
		name     string
		sec      Security
		has, not []string
	}{
		{"default", Security{}, []string{"CAP_CHOWN", "CAP_KILL"}, []string{"CAP_SYS_ADMIN"}},
		{"add short name", Security{AddCapabilities: []string{"sys_admin"}}, []string{"CAP_SYS_ADMIN", "CAP_CHOWN"}, nil},
		{"drop", Security{DropCapabilities: []string{"CHOWN"}}, []string{"CAP_KILL"}, []string{"CAP_CHOWN"}},
		{"drop all add one", Security{DropCapabilities: []string{"ALL"}, AddCapabilities: []string{"NET_BIND_SERVICE"}}, []string{"CAP_NET_BIND_SERVICE"}, []string{"CAP_CHOWN", "CAP_KILL"}},
	}
	for _, tc := range tests {
		got := capabilities(&tc.sec, AllCapabilities)
		for _, c := range tc.has {
			if !slices.Contains(got, c) {
				t.Errorf("%s: missing %s in %v", tc.name, c, got)
			}
		}
		for _, c := range tc.not {
			if slices.Contains(got, c) {
				t.Errorf("%s: unexpected %s in %v", tc.name, c, got)
			}
		}
	}
}

func TestUserOf(t *testing.T) {
	u := int64(1000)
	g := int64(5)
	if got := userOf(&Security{RunAsUser: &u}, "app:grp"); got != "1000:grp" {
		t.Errorf("got %q", got)
	}
	if got := userOf(&Security{RunAsUser: &u, RunAsGroup: &g}, "app:grp"); got != "1000" {
		t.Errorf("got %q", got)
	}
	if got := userOf(&Security{RunAsUsername: "bob"}, "app"); got != "bob" {
		t.Errorf("got %q", got)
	}
	if got := userOf(&Security{}, "app"); got != "app" {
		t.Errorf("got %q", got)
	}
}

func TestAppUserGroupsPolicy(t *testing.T) {
	root := t.TempDir()
	if err := os.MkdirAll(filepath.Join(root, "etc"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "etc/passwd"), []byte("app:x:1000:1000::/:/bin/sh\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "etc/group"), []byte("app:x:1000:\nwheel:x:50:app\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	img := &image.Image{Config: image.ImageConfig{User: "app"}}
	for _, tc := range []struct {
		strict bool
		want   []uint32
	}{
		{false, []uint32{1000, 7, 50}}, // Merge: its group, the pod's, then the image's /etc/group's
		{true, []uint32{1000, 7}},      // Strict: its group and the pod's only
	} {
		sec := &Security{SupplementalGroups: []int64{7}, StrictGroups: tc.strict}
		u, err := appUser(sec, img, root)
		if err != nil {
			t.Fatal(err)
		}
		if u.UID != 1000 || u.GID != 1000 || !slices.Equal(u.AdditionalGIDs, tc.want) {
			t.Errorf("strict=%v: %+v, want 1000:1000 %v", tc.strict, u, tc.want)
		}
	}
}

// TestDefaultEnvHome: HOME is the user's home where the image and the
// container leave it unset or empty (runc's rule), and theirs otherwise.
func TestDefaultEnvHome(t *testing.T) {
	for _, tc := range []struct {
		env  []string
		want string
	}{
		{nil, "/home/app"},
		{[]string{"HOME="}, "/home/app"},
		{[]string{"HOME=/data"}, "/data"},
	} {
		env := defaultEnv(tc.env, "", "/home/app", false)
		var homes []string
		for _, kv := range env {
			if v, ok := strings.CutPrefix(kv, "HOME="); ok {
				homes = append(homes, v)
			}
		}
		if !slices.Equal(homes, []string{tc.want}) {
			t.Errorf("env %q: HOME %q, want only %q", tc.env, homes, tc.want)
		}
	}
}
