package e2e

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/internal/testutil"
)

// kubeletPodDir lays out a pod's directory as the kubelet does, below
// root: a configMap volume written by the atomic writer, an emptyDir,
// etc-hosts and a container's termination message file.
type kubeletPodDir struct {
	t                                  *testing.T
	pod, configMap, emptyDir, etcHosts string
}

func newKubeletPodDir(t *testing.T, root string) *kubeletPodDir {
	pod := filepath.Join(root, "var/lib/kubelet/pods/5f0c8a1e-uid")
	k := &kubeletPodDir{t: t, pod: pod,
		configMap: filepath.Join(pod, "volumes/kubernetes.io~configmap/settings"),
		emptyDir:  filepath.Join(pod, "volumes/kubernetes.io~empty-dir/cache"),
		etcHosts:  filepath.Join(pod, "etc-hosts"),
	}
	for _, d := range []string{k.configMap, k.emptyDir} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Chmod(k.emptyDir, 0o777); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(k.etcHosts, []byte("127.0.0.1\tlocalhost\n10.9.8.7\tvolumes-pod\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	k.writeConfigMap("..2026_11_28_20_00_00.123", map[string]string{"greeting": "hello", "color": "blue"})
	return k
}

// writeConfigMap does what the kubelet's atomic writer does: the new
// data in a timestamped directory, ..data swapped to it by a rename,
// the keys' links made, those of removed keys and the old directory
// removed.
func (k *kubeletPodDir) writeConfigMap(ts string, data map[string]string) {
	t := k.t
	t.Helper()
	dir := k.configMap
	old, _ := os.Readlink(filepath.Join(dir, "..data"))
	if err := os.Mkdir(filepath.Join(dir, ts), 0o755); err != nil {
		t.Fatal(err)
	}
	for key, v := range data {
		if err := os.WriteFile(filepath.Join(dir, ts, key), []byte(v), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Symlink(ts, filepath.Join(dir, "..data_tmp")); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(filepath.Join(dir, "..data_tmp"), filepath.Join(dir, "..data")); err != nil {
		t.Fatal(err)
	}
	for key := range data {
		if _, err := os.Lstat(filepath.Join(dir, key)); os.IsNotExist(err) {
			if err := os.Symlink("..data/"+key, filepath.Join(dir, key)); err != nil {
				t.Fatal(err)
			}
		}
	}
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		if _, keep := data[e.Name()]; !keep && !strings.HasPrefix(e.Name(), "..") {
			os.Remove(filepath.Join(dir, e.Name()))
		}
	}
	if old != "" {
		if err := os.RemoveAll(filepath.Join(dir, old)); err != nil {
			t.Fatal(err)
		}
	}
}

// messageFile makes the kubelet's termination message file of container
// name and returns its path.
func (k *kubeletPodDir) messageFile(name string) string {
	p := filepath.Join(k.pod, "containers", name, "3c1d0e2f")
	if err := os.MkdirAll(filepath.Dir(p), 0o750); err != nil {
		k.t.Fatal(err)
	}
	if err := os.WriteFile(p, nil, 0o666); err != nil {
		k.t.Fatal(err)
	}
	return p
}

// TestKVMPodVolumesWithout9p: a kvm pod's kubelet volumes live in its
// guest: a configMap is a copy that follows the kubelet's updates on the
// host, an emptyDir a guest directory its containers share, etc-hosts a
// copy, a termination message reaches the host file before the
// container's status says it exited; a hostPath volume still goes over
// 9p, and the pod says so.
func TestKVMPodVolumesWithout9p(t *testing.T) {
	root := t.TempDir() // before the daemon: removed after its pods
	k := newKubeletPodDir(t, root)
	hostDir := filepath.Join(root, "srv/data")
	if err := os.MkdirAll(hostDir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(hostDir, "h"), []byte("from the host"), 0o644); err != nil {
		t.Fatal(err)
	}
	e := newKVMEnv(t)
	podCfg := e.netPodConfig("volumes", kvmStage1)
	pod := e.runStage1Pod(podCfg, kvmStage1)

	reader := e.netContainer(kvmStage1, "reader", "sleep", "1000")
	reader.Mounts = []*runtimeapi.Mount{
		{ContainerPath: "/cfg", HostPath: k.configMap, Readonly: true},
		{ContainerPath: "/cache", HostPath: k.emptyDir},
		{ContainerPath: "/etc/hosts", HostPath: k.etcHosts},
		{ContainerPath: "/host", HostPath: hostDir},
	}
	a := e.createAndStart(pod, podCfg, reader)
	other := e.netContainer(kvmStage1, "other", "sleep", "1000")
	other.Mounts = []*runtimeapi.Mount{{ContainerPath: "/cache", HostPath: k.emptyDir}}
	b := e.createAndStart(pod, podCfg, other)

	// The configMap, its atomic writer's layout kept, read-only.
	if got := e.execOK(a, "cat", "/cfg/greeting"); got != "hello" {
		t.Fatalf("/cfg/greeting = %q", got)
	}
	if got := strings.TrimSpace(e.execOK(a, "readlink", "/cfg/..data")); got != "..2026_11_28_20_00_00.123" {
		t.Errorf("/cfg/..data links to %q", got)
	}
	if r := e.execSync(a, "touch", "/cfg/new"); r.ExitCode == 0 {
		t.Error("a read-only configMap volume was written")
	}
	if got := e.execOK(a, "cat", "/etc/hosts"); !strings.Contains(got, "10.9.8.7\tvolumes-pod") {
		t.Errorf("/etc/hosts = %q", got)
	}

	// The emptyDir: shared by the pod's containers, in the guest.
	e.execOK(a, "sh", "-c", "echo 42 > /cache/shared")
	if got := strings.TrimSpace(e.execOK(b, "cat", "/cache/shared")); got != "42" {
		t.Errorf("the other container reads %q from the shared emptyDir", got)
	}
	if ents, _ := os.ReadDir(k.emptyDir); len(ents) != 0 {
		t.Errorf("the emptyDir's writes reached the host: %v", ents)
	}

	// hostPath: over 9p as before, both ways.
	if got := e.execOK(a, "cat", "/host/h"); got != "from the host" {
		t.Errorf("/host/h = %q", got)
	}
	e.execOK(a, "sh", "-c", "echo back > /host/back")
	if b, err := os.ReadFile(filepath.Join(hostDir, "back")); err != nil || string(b) != "back\n" {
		t.Errorf("the host reads %q, %v from a hostPath volume", b, err)
	}
	resp, err := e.rt().PodSandboxStatus(e.ctx(), &runtimeapi.PodSandboxStatusRequest{PodSandboxId: pod, Verbose: true})
	if err != nil {
		t.Fatal(err)
	}
	over9p := resp.Info["stage1.mountsOver9p"]
	if !strings.Contains(over9p, hostDir+" on /host") || strings.Contains(over9p, k.configMap) || strings.Contains(over9p, k.emptyDir) {
		t.Errorf("the pod's mounts over 9p: %q, want only %s on /host", over9p, hostDir)
	}

	// The kubelet updates the configMap: the container follows.
	start := time.Now()
	k.writeConfigMap("..2026_11_28_20_05_00.456", map[string]string{"greeting": "bonjour"})
	testutil.WaitFor(t, 30*time.Second, "the container seeing the configMap's update", func() (bool, string) {
		r := e.execSync(a, "cat", "/cfg/greeting")
		return string(r.Stdout) == "bonjour", string(r.Stdout) + string(r.Stderr)
	})
	t.Logf("a configMap update reached the container in %s", time.Since(start).Round(time.Millisecond))
	testutil.WaitFor(t, 30*time.Second, "the removed key gone", func() (bool, string) {
		r := e.execSync(a, "ls", "-a", "/cfg")
		return !strings.Contains(string(r.Stdout), "color") && !strings.Contains(string(r.Stdout), "..2026_11_28_20_00_00.123"), string(r.Stdout)
	})

	// A termination message: on the host before the exit is, also for a
	// container that exits after a restart of the daemon, which resumes
	// the copies' watches too.
	msgFile := k.messageFile("writer")
	writer := e.netContainer(kvmStage1, "writer", "sh", "-c", "while [ ! -e /cache/go ]; do sleep 0.1; done; printf 'all done' > /dev/termination-log; exit 3")
	writer.Mounts = []*runtimeapi.Mount{
		{ContainerPath: "/dev/termination-log", HostPath: msgFile},
		{ContainerPath: "/cache", HostPath: k.emptyDir},
	}
	w := e.createAndStart(pod, podCfg, writer)
	if err := e.d.Kill9(e.ctx()); err != nil {
		t.Fatal(err)
	}
	k.writeConfigMap("..2026_11_28_20_10_00.789", map[string]string{"greeting": "hallo"})
	if err := e.d.Restart(e.ctx()); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 60*time.Second, "the container seeing the update made while the daemon was down", func() (bool, string) {
		r, err := e.rt().ExecSync(e.ctx(), &runtimeapi.ExecSyncRequest{ContainerId: a, Cmd: []string{"cat", "/cfg/greeting"}, Timeout: 30})
		if err != nil {
			return false, err.Error()
		}
		return string(r.Stdout) == "hallo", string(r.Stdout) + string(r.Stderr)
	})
	e.execOK(a, "touch", "/cache/go")
	st := e.waitContainerState(w, runtimeapi.ContainerState_CONTAINER_EXITED, 60*time.Second)
	if b, err := os.ReadFile(msgFile); err != nil || string(b) != "all done" {
		t.Errorf("the termination message file holds %q, %v once the container exited (code %d)", b, err, st.ExitCode)
	}
}
