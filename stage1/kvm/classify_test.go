package kvm

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stagelet/stagelet/agent/api"
)

func TestClassifyMount(t *testing.T) {
	root := t.TempDir()
	kubelet := filepath.Join(root, "var/lib/kubelet")
	pod := filepath.Join(kubelet, "pods", "uid-1")
	runDir := filepath.Join(root, "run/pod")
	mkdir := func(p string) string {
		t.Helper()
		if err := os.MkdirAll(p, 0o755); err != nil {
			t.Fatal(err)
		}
		return p
	}
	file := func(p string) string {
		t.Helper()
		mkdir(filepath.Dir(p))
		if err := os.WriteFile(p, nil, 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	link := func(p, to string) string {
		t.Helper()
		mkdir(filepath.Dir(p))
		if err := os.Symlink(to, p); err != nil {
			t.Fatal(err)
		}
		return p
	}
	vol := func(kind, name string) string { return filepath.Join(pod, "volumes", "kubernetes.io~"+kind, name) }
	hostDir := mkdir(filepath.Join(root, "srv/data"))
	// The kubelet's root reached through a link is still the kubelet's.
	linkedRoot := link(filepath.Join(root, "kubelet-link"), kubelet)

	for _, tc := range []struct {
		name string
		m    api.Mount
		kind string
		file bool
	}{
		{"emptyDir", api.Mount{Source: mkdir(vol("empty-dir", "cache"))}, api.MountGuest, false},
		{"configMap", api.Mount{Source: mkdir(vol("configmap", "cfg")), Readonly: true}, api.MountCopy, false},
		{"writable configMap", api.Mount{Source: vol("configmap", "cfg")}, api.MountPath, false},
		{"secret", api.Mount{Source: mkdir(vol("secret", "token")), Readonly: true}, api.MountCopy, false},
		{"projected", api.Mount{Source: mkdir(vol("projected", "kube-api-access-x")), Readonly: true}, api.MountCopy, false},
		{"downwardAPI", api.Mount{Source: mkdir(vol("downward-api", "info")), Readonly: true}, api.MountCopy, false},
		{"etc-hosts", api.Mount{Source: file(filepath.Join(pod, "etc-hosts"))}, api.MountCopy, true},
		{"termination message", api.Mount{Source: file(filepath.Join(pod, "containers", "app", "4f2a"))}, api.MountMessage, true},
		{"daemon's resolv.conf", api.Mount{Source: file(filepath.Join(runDir, "etc", "resolv.conf"))}, api.MountCopy, true},
		{"daemon's hostname", api.Mount{Source: file(filepath.Join(runDir, "etc", "hostname"))}, api.MountCopy, true},
		{"through a linked kubelet root", api.Mount{Source: filepath.Join(linkedRoot, "pods/uid-1/volumes/kubernetes.io~configmap/cfg"), Readonly: true}, api.MountCopy, false},
		{"hostPath", api.Mount{Source: hostDir}, api.MountPath, false},
		{"PVC", api.Mount{Source: mkdir(vol("csi", "pvc-1/mount"))}, api.MountPath, false},
		{"local volume plugin", api.Mount{Source: mkdir(vol("local-volume", "pv"))}, api.MountPath, false},
		{"subPath", api.Mount{Source: mkdir(filepath.Join(pod, "volume-subpaths", "cfg", "app", "0"))}, api.MountPath, false},
		{"another file of the run dir", api.Mount{Source: file(filepath.Join(runDir, "etc", "passwd"))}, api.MountPath, false},
		{"emptyDir that is a file", api.Mount{Source: file(vol("empty-dir", "odd"))}, api.MountPath, false},
		{"etc-hosts that is a directory", api.Mount{Source: mkdir(filepath.Join(kubelet, "pods", "uid-2", "etc-hosts"))}, api.MountPath, false},
		{"emptyDir linked out of the pod", api.Mount{Source: link(vol("empty-dir", "escape"), hostDir)}, api.MountPath, false},
		{"configMap linked out of the pod", api.Mount{Source: link(vol("configmap", "escape"), hostDir), Readonly: true}, api.MountPath, false},
		{"etc-hosts linked to the host's", api.Mount{Source: link(filepath.Join(kubelet, "pods", "uid-3", "etc-hosts"), "/etc/hosts")}, api.MountPath, false},
		{"a link into a volume is that volume", api.Mount{Source: link(filepath.Join(root, "srv/cfg-link"), vol("configmap", "cfg")), Readonly: true}, api.MountCopy, false},
		{"missing", api.Mount{Source: vol("configmap", "gone")}, api.MountPath, false},
		{"relative", api.Mount{Source: "pods/x/volumes/kubernetes.io~configmap/c"}, api.MountPath, false},
		{"propagation", api.Mount{Source: vol("empty-dir", "cache"), Propagation: "rslave"}, api.MountPath, false},
		{"volume name beneath", api.Mount{Source: mkdir(filepath.Join(vol("configmap", "cfg"), "sub")), Readonly: true}, api.MountPath, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := classifyMount(tc.m, runDir)
			if w.Kind != tc.kind || w.File != tc.file && tc.kind != api.MountPath {
				t.Fatalf("got %+v, want kind %q file %v", w, tc.kind, tc.file)
			}
			if tc.kind != api.MountPath && (!api.ValidVolumeName(w.Name) || !strings.HasPrefix(w.Name, tc.kind+"-")) {
				t.Fatalf("volume name %q", w.Name)
			}
		})
	}
	a := classifyMount(api.Mount{Source: vol("empty-dir", "cache")}, runDir)
	b := classifyMount(api.Mount{Source: vol("empty-dir", "cache") + "/", Readonly: true}, runDir)
	if a.Name != b.Name {
		t.Fatalf("one source, two volumes: %s, %s", a.Name, b.Name)
	}
}
