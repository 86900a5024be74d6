package devices

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/bindopts"
)

func writeSpec(t *testing.T, dir, name, text string) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(dir, name), []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestCDIResolve(t *testing.T) {
	static, dynamic := t.TempDir(), t.TempDir()
	writeSpec(t, static, "example.yaml", `cdiVersion: "0.7.0"
kind: example.com/dev
devices:
  - name: null0
    containerEdits:
      deviceNodes:
        - path: /dev/cdi-null
          hostPath: /dev/null
          permissions: rw
      env: [EXAMPLE_DEVICE=null0]
containerEdits:
  env: [EXAMPLE=1]
  additionalGids: [44]
  mounts:
    - hostPath: /usr/share
      containerPath: /opt/share
      options: [ro, nosuid, nodev, bind]
`)
	r := NewCDI([]string{static, dynamic})
	e, err := r.Resolve([]string{"example.com/dev=null0"}, "config.CDI_devices")
	if err != nil {
		t.Fatal(err)
	}
	if len(e.Nodes) != 1 || e.Nodes[0].Path != "/dev/cdi-null" || e.Nodes[0].Major != 1 || e.Nodes[0].Minor != 3 {
		t.Errorf("nodes: %+v", e.Nodes)
	}
	if len(e.Rules) != 1 || e.Rules[0].Access != "rw" || *e.Rules[0].Major != 1 || *e.Rules[0].Minor != 3 {
		t.Errorf("rules: %+v", e.Rules)
	}
	if !slices.Contains(e.Env, "EXAMPLE=1") || !slices.Contains(e.Env, "EXAMPLE_DEVICE=null0") {
		t.Errorf("env: %v", e.Env)
	}
	if !slices.Equal(e.GIDs, []uint32{44}) {
		t.Errorf("gids: %v", e.GIDs)
	}
	want := Mount{Host: "/usr/share", Container: "/opt/share", Flags: bindopts.Flags{Readonly: true, NoSuid: true, NoDev: true}}
	if len(e.Mounts) != 1 || e.Mounts[0] != want {
		t.Errorf("mounts: %+v, want %+v", e.Mounts, want)
	}

	// Specs are read again: a driver's spec written since is found.
	_, err = r.Resolve([]string{"example.com/gpu=0"}, "config.CDI_devices")
	if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "example.com/gpu=0") || !strings.Contains(err.Error(), "config.CDI_devices") {
		t.Errorf("an unknown device: %v, want InvalidArgument naming it and the field", err)
	}
	writeSpec(t, dynamic, "gpu.json", `{"cdiVersion":"0.7.0","kind":"example.com/gpu","devices":[{"name":"0","containerEdits":{"deviceNodes":[{"path":"/dev/gpu0","hostPath":"/dev/zero"}]}}]}`)
	if e, err := r.Resolve([]string{"example.com/gpu=0"}, "config.CDI_devices"); err != nil || len(e.Nodes) != 1 || e.Nodes[0].Minor != 5 {
		t.Errorf("a spec written later: %+v %v", e, err)
	}

	// What stagelet does not do is refused, naming the device.
	writeSpec(t, static, "hooks.yaml", `cdiVersion: "0.7.0"
kind: example.com/hooked
devices:
  - name: h
    containerEdits:
      hooks:
        - hookName: createContainer
          path: /bin/true
`)
	writeSpec(t, static, "tmpfs.yaml", `cdiVersion: "0.7.0"
kind: example.com/tmpfs
devices:
  - name: t
    containerEdits:
      mounts:
        - hostPath: tmpfs
          containerPath: /scratch
          type: tmpfs
`)
	for _, name := range []string{"example.com/hooked=h", "example.com/tmpfs=t"} {
		_, err := r.Resolve([]string{name}, "config.CDI_devices")
		if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), name) {
			t.Errorf("%s: %v, want InvalidArgument naming it", name, err)
		}
	}
}

func TestCDIAnnotations(t *testing.T) {
	names, err := FromAnnotations(map[string]string{
		"cdi.k8s.io/plugin_req1": "example.com/dev=a,example.com/dev=b",
		"other":                  "x",
	})
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(names)
	if !slices.Equal(names, []string{"example.com/dev=a", "example.com/dev=b"}) {
		t.Errorf("names: %v", names)
	}
	if _, err := FromAnnotations(map[string]string{"cdi.k8s.io/x": "not a device"}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("a malformed annotation: %v, want InvalidArgument", err)
	}
}
