package cluster

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/test/testregistry"
)

// nriDaemonSet runs containerd/nri's ulimit-adjuster and logger, as an
// operator deploys NRI plugins: a DaemonSet whose containers connect to
// their node's NRI socket through a hostPath of its directory, as root
// and unprivileged. logger prints what the node synchronizes it with.
const nriDaemonSet = `
apiVersion: apps/v1
kind: DaemonSet
metadata: {name: nri-plugins}
spec:
  selector: {matchLabels: {app: nri-plugins}}
  template:
    metadata: {labels: {app: nri-plugins}}
    spec:
      terminationGracePeriodSeconds: 1
      containers:
      - name: ulimit
        image: {{.Image}}
        command: [ulimit-adjuster, -idx, "10", -name, ulimit, -socket, /var/run/nri/nri.sock, -verbose]
        volumeMounts: [{name: nri, mountPath: /var/run/nri}]
      - name: logger
        image: {{.Image}}
        command: [logger, -idx, "20", -socket-path, /var/run/nri/nri.sock]
        volumeMounts: [{name: nri, mountPath: /var/run/nri}]
      volumes:
      - name: nri
        hostPath: {path: /var/run/nri, type: Directory}
`

// sleepPod is a busybox pod on node Node that sleeps, stopped at once
// when deleted.
const sleepPod = `
apiVersion: v1
kind: Pod
metadata: {name: {{.Name}}}
spec:
  nodeName: {{.Node}}
  terminationGracePeriodSeconds: 1
  containers:
  - name: sleep
    image: {{.Busybox}}
    command: [sleep, "3600"]
`

// ulimitPod is a busybox pod whose container limits prints its open
// files limits, soft then hard, which its annotation asks ulimit-adjuster
// to set.
const ulimitPod = `
apiVersion: v1
kind: Pod
metadata:
  name: {{.Name}}
  annotations:
    ulimits.noderesource.dev/container.limits: '[{"type": "RLIMIT_NOFILE", "soft": 1234, "hard": 4321}]'
spec:
  terminationGracePeriodSeconds: 1
  containers:
  - name: limits
    image: {{.Busybox}}
    command: [sh, -c, "ulimit -Sn; ulimit -Hn; exec sleep 3600"]
`

// The plugins as the nodes' stagelet names them: index and name.
var nriPluginNames = []string{"10-ulimit", "20-logger"}

// testNRIDaemonSet: containerd/nri's ulimit-adjuster and logger,
// unmodified, deployed as a DaemonSet through the kubelets, connect to
// every node's stagelet from their nspawn pods; each node synchronizes
// them with the pods it already runs (logger prints the pod that ran
// before it), a new pod's container gets the open files limits its
// annotation asks ulimit-adjuster for, and the plugins disconnect when
// the DaemonSet goes.
func (c *cluster) testNRIDaemonSet(t *testing.T) {
	image := c.pushNRIPlugins(t)
	t.Cleanup(func() {
		for _, what := range []string{"daemonset/nri-plugins", "pod/nri-early", "pod/nri-limits"} {
			if _, err := c.kubectlErr("delete", what, "--ignore-not-found", "--wait", "--timeout=2m"); err != nil {
				t.Error(err)
			}
		}
	})
	// A pod that runs before the plugins connect.
	early := c.nodes[0]
	c.apply(t, sleepPod, "Name", "nri-early", "Node", early.name)
	var earlyUID string
	c.wait(t, 2*time.Minute, "nri-early running", func() (bool, error) {
		p, err := c.pod("nri-early")
		if err != nil {
			return false, err
		}
		earlyUID = p.Metadata.UID
		st := p.container("sleep")
		return st != nil && st.State.Running != nil, fmt.Errorf("phase %s, %+v", p.Status.Phase, st)
	})

	c.apply(t, nriDaemonSet, "Image", image)
	c.rollout(t, "default", "daemonset/nri-plugins")
	for _, n := range c.nodes {
		c.waitNRIPlugins(t, n, nriPluginNames)
	}
	// The node lists a plugin once it synchronized it; logger shows
	// what with: the pod that ran before it.
	for _, p := range c.pods(t, "app=nri-plugins") {
		if p.Spec.NodeName != early.name {
			continue
		}
		c.wait(t, time.Minute, "logger on "+early.name+" synchronized with nri-early", func() (bool, error) {
			out, err := c.kubectlErr("logs", p.Metadata.Name, "-c", "logger")
			return syncedPod(out, earlyUID), fmt.Errorf("logger's log:\n%s (%v)", out, err)
		})
	}

	c.apply(t, ulimitPod, "Name", "nri-limits")
	c.wait(t, 2*time.Minute, "nri-limits printing its limits", func() (bool, error) {
		out, err := c.kubectlErr("logs", "nri-limits")
		return len(strings.Fields(out)) >= 2, fmt.Errorf("log %q (%v)", out, err)
	})
	if got := strings.Fields(c.kubectl(t, "logs", "nri-limits")); !slices.Equal(got, []string{"1234", "4321"}) {
		t.Errorf("nri-limits's open files limits, soft and hard: %q, want 1234 4321", got)
	}

	// Gone with the DaemonSet: no plugin left on any node for the
	// subtests that follow.
	c.kubectl(t, "delete", "daemonset/nri-plugins", "pod/nri-early", "pod/nri-limits", "--wait", "--timeout=2m")
	for _, n := range c.nodes {
		c.waitNRIPlugins(t, n, nil)
	}
}

// syncedPod tells whether logger's log shows a Synchronize whose pods
// hold the pod of uid.
func syncedPod(log, uid string) bool {
	for _, line := range strings.Split(log, "\n") {
		if strings.Contains(line, "Synchronize: ") && strings.Contains(line, "uid: "+uid) {
			return true
		}
	}
	return false
}

// waitNRIPlugins waits until node n's stagelet lists exactly the NRI
// plugins want as connected, in its verbose Status.
func (c *cluster) waitNRIPlugins(t *testing.T, n *node, want []string) {
	t.Helper()
	c.wait(t, time.Minute, fmt.Sprintf("NRI plugins %v on %s", want, n.name), func() (bool, error) {
		info, err := c.nodeStatus(n)
		if err != nil {
			return false, err
		}
		var st struct {
			Plugins []struct{ Name string }
		}
		if err := json.Unmarshal([]byte(info["nri"]), &st); err != nil {
			return false, fmt.Errorf("nri %q: %w", info["nri"], err)
		}
		var have []string
		for _, p := range st.Plugins {
			have = append(have, p.Name)
		}
		return slices.Equal(have, want), fmt.Errorf("nri %s", info["nri"])
	})
}

// nodeStatus is the verbose CRI Status info of node n's stagelet, asked
// on its socket through the root of the node's init.
func (c *cluster) nodeStatus(n *node) (map[string]string, error) {
	pid, err := c.nodeInit(n)
	if err != nil {
		return nil, err
	}
	conn, err := grpc.NewClient("unix:///proc/"+pid+"/root/run/stagelet/stagelet.sock",
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := runtimeapi.NewRuntimeServiceClient(conn).Status(ctx, &runtimeapi.StatusRequest{Verbose: true})
	if err != nil {
		return nil, fmt.Errorf("node %s: Status: %w", n.name, err)
	}
	return resp.Info, nil
}

// nriPluginsDir is where ../shared/nri/build.sh built containerd/nri's
// plugins (it caches them).
var nriPluginsDir = sync.OnceValues(func() (string, error) {
	out, err := exec.Command(filepath.Join(moduleRoot(), "..", "shared", "nri", "build.sh")).Output()
	if err != nil {
		return "", fmt.Errorf("../shared/nri/build.sh: %w", err)
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	return lines[len(lines)-1], nil
})

// pushNRIPlugins pushes an image of containerd/nri's ulimit-adjuster and
// logger (static binaries, on its PATH) to the cluster's registry and
// returns its reference.
func (c *cluster) pushNRIPlugins(t *testing.T) string {
	t.Helper()
	dir, err := nriPluginsDir()
	if err != nil {
		t.Fatalf("containerd/nri's plugins: %v", err)
	}
	files := map[string]string{}
	for _, p := range []string{"ulimit-adjuster", "logger"} {
		if _, err := os.Stat(filepath.Join(dir, p)); err != nil {
			t.Fatal(err)
		}
		files["usr/local/bin/"+p] = filepath.Join(dir, p)
	}
	ref := c.registry + "/nri-plugins:test"
	tag, err := name.NewTag(ref, name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.Write(tag, scratch(t, testregistry.Layer(t, fileEntries(t, files)...))); err != nil {
		t.Fatalf("push %s: %v", ref, err)
	}
	return ref
}
