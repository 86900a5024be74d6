package cluster

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stagelet/stagelet/internal/testutil"
)

// moverPod is the pod whose container moves: the counter (test/cluster/
// counter) as the child of a shell, with a mark in its environment.
const moverPod = `
apiVersion: v1
kind: Pod
metadata:
  name: {{.Name}}{{if .Live}}
  annotations: {stagelet.io/checkpoint: live}{{end}}
spec:
  nodeName: {{.Node}}{{if .RuntimeClass}}
  runtimeClassName: {{.RuntimeClass}}{{end}}
  containers:
  - name: counter
    image: {{.Image}}
    command: [sh, -c, "/counter & wait"]
    env: [{name: MOVE_MARK, value: "{{.Mark}}"}]{{if .Memory}}
    resources:
      limits: {memory: {{.Memory}}}{{end}}
`

// restoredPod names the checkpoint image: the kubelet pulls it and
// CreateContainer restores the container it holds. Its own environment
// is not what the restored process sees.
const restoredPod = `
apiVersion: v1
kind: Pod
metadata: {name: {{.Name}}}
spec:
  nodeName: {{.Node}}{{if .RuntimeClass}}
  runtimeClassName: {{.RuntimeClass}}{{end}}
  containers:
  - name: counter
    image: {{.Image}}
    env: [{name: MOVE_MARK, value: "{{.Mark}}"}]{{if .Memory}}
    resources:
      limits: {memory: {{.Memory}}}{{end}}
`

// counterState is what the counter serves.
type counterState struct {
	Count    int64  `json:"count"`
	Token    string `json:"token"`
	PID      int    `json:"pid"`
	Parent   string `json:"parent"`
	MoveMark string `json:"moveMark"`
}

// mover is what moves: a container of a pod (CRIU) or a whole VM pod.
type mover struct {
	// name prefixes the pods' names.
	name string
	// runtimeClass and memory are the pods' ("": none).
	runtimeClass, memory string
	// stage1 is the stage1 both pods run under.
	stage1 string
	// live: the pod asks to move live (stagelet.io/checkpoint: live).
	live bool
}

// testMove: a running container moves to the other node, as Kubernetes
// moves one: the kubelet of node 1 checkpoints it (its checkpoint API),
// the archive becomes a checkpoint image pushed to the cluster's registry
// (stagelet checkpoint image), and a pod on node 2 naming that image has
// the container restored. Its counter goes on from the checkpointed value
// in the same process (the token drawn at its start in memory, its PID
// and its parent), with the checkpointed environment, at node 2's
// address, reached from a pod on node 1. The time of each step and the
// container's downtime (from the checkpoint to its first answer on node
// 2) are logged.
func (c *cluster) testMove(t *testing.T) {
	if c.env.criu == "" {
		t.Skip("no criu works on this host's kernel (scripts/build-criu.sh)")
	}
	c.move(t, mover{name: "mover", stage1: "nspawn"})
}

// testMoveVM: a kvm pod moves to the other node live, through the same
// flow: it asks to (stagelet.io/checkpoint: live), so the kubelet's
// checkpoint API gives an archive holding a ticket to node 1's daemon,
// and the pod runs on. The pod on node 2 naming its checkpoint image
// takes the ticket: node 1's daemon streams the VM with its memory
// (qemu's pre-copy migration) over the connection the two daemons
// authenticated, the guest pauses for the last round only, and runs on
// node 2 once node 1 stopped it, with node 2's pod network. The counter
// keeps its count, PID and token: the process was never restarted. The
// VM has 128 MiB for the guest beside the 128 MiB limit: 256 MiB.
func (c *cluster) testMoveVM(t *testing.T) {
	if c.env.guest == "" {
		t.Skip("no kvm guest (STAGELET_GUEST_ASSETS)")
	}
	c.move(t, mover{name: "vmmover", runtimeClass: "kvm", memory: "128Mi", stage1: "kvm", live: true})
}

// move moves m's counter from node 1 to node 2 and checks that it went
// on where it was.
func (c *cluster) move(t *testing.T, m mover) {
	from, to := c.nodes[0], c.nodes[1]
	var client podObj
	for _, p := range c.pods(t, "app=client") {
		if p.Spec.NodeName == from.name {
			client = p
		}
	}
	if client.Metadata.Name == "" {
		t.Fatalf("no client pod on %s", from.name)
	}
	live := ""
	if m.live {
		live = "true"
	}
	c.apply(t, moverPod, "Name", m.name, "Node", from.name, "Image", img.counter, "Mark", "set on "+from.name,
		"RuntimeClass", m.runtimeClass, "Memory", m.memory, "Live", live)
	var before counterState
	c.wait(t, 3*time.Minute, "the counter on "+from.name, func() (bool, error) {
		p, err := c.pod(m.name)
		if err != nil || p.Status.PodIP == "" {
			return false, err
		}
		before, err = c.counter(client, p.Status.PodIP)
		return err == nil && before.Count > 10, err
	})
	moved, _ := c.pod(m.name)

	start := time.Now()
	archive := c.checkpointContainer(t, from, "default", m.name, "counter")
	checkpointed := time.Now()
	tookCheckpoint := checkpointed.Sub(start)
	// The move: the container stops where it was. One moving live runs
	// on until the other node takes it.
	if !m.live {
		c.kubectl(t, "delete", "pod", m.name, "--wait=false")
	}

	start = time.Now()
	ref := c.registry + "/checkpoints/counter:" + m.name
	out, err := exec.Command(c.env.stagelet, "checkpoint", "image", "-insecure", archive, ref).CombinedOutput()
	if err != nil {
		t.Fatalf("stagelet checkpoint image: %v\n%s", err, out)
	}
	tookImage := time.Since(start)

	start = time.Now()
	movedName := m.name + "-moved"
	c.apply(t, restoredPod, "Name", movedName, "Node", to.name, "Image", ref, "Mark", "set on "+to.name,
		"RuntimeClass", m.runtimeClass, "Memory", m.memory)
	var after counterState
	var restored podObj
	c.wait(t, 3*time.Minute, "the restored counter on "+to.name, func() (bool, error) {
		p, err := c.pod(movedName)
		if err != nil || p.Status.PodIP == "" {
			return false, err
		}
		restored = *p
		after, err = c.counter(client, p.Status.PodIP)
		return err == nil, err
	})
	answered := time.Now()
	// Moved the other way, the container stopped at the checkpoint.
	gap := "downtime"
	if m.live {
		gap = "from the checkpoint (the pod running on) to the first answer"
	}
	t.Logf("moved %s/counter from %s (%s) to %s (%s): checkpoint %v (archive %s), image build and push %v, restore to its first answer %v; %s %v",
		m.name, from.name, moved.Status.PodIP, to.name, restored.Status.PodIP, tookCheckpoint.Round(time.Millisecond),
		sizeOf(archive), tookImage.Round(time.Millisecond), answered.Sub(start).Round(time.Millisecond), gap, answered.Sub(checkpointed).Round(time.Millisecond))
	if m.live {
		// The guest's pause, from node 1's clock to node 2's (one host's
		// here), and the bytes streamed: node 2's account of the move.
		line := c.lastLogLine(t, to, "container's whole pod taken from a live move")
		t.Logf("moved live: %s", line)
		d, err := time.ParseDuration(testutil.LogField(line, "downtime"))
		if err != nil {
			t.Errorf("node %s logged no downtime of the live move: %q", to.name, line)
		}
		t.Logf("live move of %s: downtime %v (the guest paused on %s to its agent answering on %s with its network), %s bytes streamed",
			m.name, d.Round(time.Millisecond), from.name, to.name, testutil.LogField(line, "bytes"))
		// The source's pod is done with: the kubelet would start it anew.
		c.kubectl(t, "delete", "pod", m.name, "--wait=false")
	}
	t.Logf("before: %+v; after: %+v", before, after)
	if after.Token != before.Token {
		t.Errorf("the counter on %s drew token %s, not the checkpointed process's %s: it started anew", to.name, after.Token, before.Token)
	}
	if after.Count < before.Count {
		t.Errorf("the counter on %s is at %d, below %d, read before the checkpoint", to.name, after.Count, before.Count)
	}
	if after.PID != before.PID || after.Parent != "sh" {
		t.Errorf("the restored process is PID %d under %q, the checkpointed one PID %d under %q", after.PID, after.Parent, before.PID, before.Parent)
	}
	if after.MoveMark != "set on "+from.name {
		t.Errorf("the restored process's MOVE_MARK is %q, not the checkpointed %q", after.MoveMark, "set on "+from.name)
	}
	if restored.Spec.NodeName != to.name || restored.Status.PodIP == moved.Status.PodIP {
		t.Errorf("the restored pod runs on %s at %s; the checkpointed one ran at %s", restored.Spec.NodeName, restored.Status.PodIP, moved.Status.PodIP)
	}
	c.expectStage1(t, movedName+"_default_", m.stage1)
	c.kubectl(t, "delete", "pod", movedName, "--wait=false")
}

// counter reads the counter's state at ip:8080 from the client pod cl.
func (c *cluster) counter(cl podObj, ip string) (counterState, error) {
	var s counterState
	out, err := c.kubectlErr("exec", cl.Metadata.Name, "--", "timeout", "10", "wget", "-qO-", "http://"+ip+":8080/")
	if err != nil {
		return s, fmt.Errorf("%v: %s", err, out)
	}
	if err := json.Unmarshal([]byte(out), &s); err != nil {
		return s, fmt.Errorf("%v: %q", err, out)
	}
	return s, nil
}

// checkpointContainer checkpoints container ctr of pod ns/pod through
// the checkpoint API of node n's kubelet, as the cluster's admin, and
// returns where the archive is on this host.
func (c *cluster) checkpointContainer(t *testing.T, n *node, ns, pod, ctr string) string {
	t.Helper()
	cert, err := tls.LoadX509KeyPair(c.pki.path("admin.crt"), c.pki.path("admin.key"))
	if err != nil {
		t.Fatal(err)
	}
	// The kubelet serves with the certificate it made itself.
	kl := filepath.Join(n.dir, "var-lib-kubelet")
	serving, err := os.ReadFile(filepath.Join(kl, "pki", "kubelet.crt"))
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(serving) {
		t.Fatalf("node %s: no certificate in the kubelet's kubelet.crt", n.name)
	}
	hc := &http.Client{Timeout: 3 * time.Minute, Transport: &http.Transport{
		TLSClientConfig: &tls.Config{Certificates: []tls.Certificate{cert}, RootCAs: roots, ServerName: n.name},
	}}
	resp, err := hc.Post(fmt.Sprintf("https://%s:10250/checkpoint/%s/%s/%s?timeout=120", n.ip, ns, pod, ctr), "", nil)
	if err != nil {
		t.Fatalf("the kubelet's checkpoint API on %s: %v", n.name, err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("the kubelet's checkpoint API on %s: %s: %s", n.name, resp.Status, body)
	}
	var r struct {
		Items []string `json:"items"`
	}
	if err := json.Unmarshal(body, &r); err != nil || len(r.Items) != 1 || !strings.HasPrefix(r.Items[0], "/var/lib/kubelet/") {
		t.Fatalf("the kubelet's checkpoint API on %s answered %s (%v)", n.name, body, err)
	}
	return filepath.Join(kl, strings.TrimPrefix(r.Items[0], "/var/lib/kubelet/"))
}

// sizeOf is the size of the file at path, for the log.
func sizeOf(path string) string {
	fi, err := os.Stat(path)
	if err != nil {
		return err.Error()
	}
	return fmt.Sprintf("%.1f MiB", float64(fi.Size())/(1<<20))
}

// lastLogLine is the last line of node n's stagelet log that holds msg.
func (c *cluster) lastLogLine(t *testing.T, n *node, msg string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(n.root, "var/log/stagelet.log"))
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(string(b), "\n")
	for i := len(lines) - 1; i >= 0; i-- {
		if strings.Contains(lines[i], msg) {
			return lines[i]
		}
	}
	t.Fatalf("node %s logged no %q", n.name, msg)
	return ""
}
