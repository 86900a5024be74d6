package cluster

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"text/template"
	"time"

	"github.com/stagelet/stagelet/policy"
	"github.com/stagelet/stagelet/stage1/caps"
)

// workloads are the test's own objects, in the default namespace.
const workloads = `
apiVersion: apps/v1
kind: Deployment
metadata: {name: web}
spec:
  replicas: 6
  selector: {matchLabels: {app: web}}
  template:
    metadata: {labels: {app: web}}
    spec:
      topologySpreadConstraints:
      - {maxSkew: 1, topologyKey: kubernetes.io/hostname, whenUnsatisfiable: ScheduleAnyway, labelSelector: {matchLabels: {app: web}}}
      containers:
      - name: web
        image: {{.Agnhost}}
        args: [netexec, --http-port=8080]
        readinessProbe:
          httpGet: {path: /healthz, port: 8080}
          periodSeconds: 2
---
apiVersion: v1
kind: Service
metadata: {name: web}
spec:
  selector: {app: web}
  ports: [{port: 80, targetPort: 8080}]
---
apiVersion: apps/v1
kind: DaemonSet
metadata: {name: client}
spec:
  selector: {matchLabels: {app: client}}
  template:
    metadata: {labels: {app: client}}
    spec:
      containers:
      - name: client
        image: {{.Agnhost}}
        args: [netexec, --http-port=8080]
---
apiVersion: v1
kind: Pod
metadata: {name: liveness}
spec:
  containers:
  - name: liveness
    image: {{.Agnhost}}
    # Healthy for 10 seconds, then failing its probe: the kubelet restarts it.
    args: [liveness]
    livenessProbe:
      httpGet: {path: /healthz, port: 8080}
      initialDelaySeconds: 2
      periodSeconds: 2
      failureThreshold: 1
---
apiVersion: v1
kind: Pod
metadata: {name: readiness}
spec:
  containers:
  - name: readiness
    image: {{.Busybox}}
    command: [sh, -c, "exec sleep 3600"]
    readinessProbe:
      exec: {command: [cat, /tmp/ready]}
      periodSeconds: 1
---
apiVersion: batch/v1
kind: Job
metadata: {name: done}
spec:
  completions: 2
  parallelism: 2
  template:
    spec:
      restartPolicy: Never
      containers:
      - name: done
        image: {{.Busybox}}
        command: [sh, -c, "echo done"]
`

// pinnedPod is an ordinary pod on a given node.
const pinnedPod = `
apiVersion: v1
kind: Pod
metadata: {name: {{.Name}}}
spec:
  nodeName: {{.Node}}
  containers:
  - name: web
    image: {{.Agnhost}}
    args: [netexec, --http-port=8080]
    readinessProbe:
      httpGet: {path: /healthz, port: 8080}
      periodSeconds: 2
`

// vmPod is a pod in its own VM, beside the others. Its memory limit and
// the RuntimeClass overhead make the pod cgroup that holds qemu 256 MiB:
// room for the VM (the limit plus the guest's own 128 MiB) and qemu.
const vmPod = `
apiVersion: v1
kind: Pod
metadata: {name: vm}
spec:
  runtimeClassName: kvm
  containers:
  - name: vm
    image: {{.Agnhost}}
    args: [netexec, --http-port=8080]
    resources:
      limits: {memory: 64Mi}
`

// vmWorkloads run in the namespace the nodes' policy sends to kvm, with
// memory limits and no RuntimeClass, so no overhead: a Deployment spread
// over the nodes behind a Service, and a pod whose second container
// allocates past its limit, over and over.
const vmWorkloads = `
apiVersion: v1
kind: Namespace
metadata: {name: {{.NS}}}
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: vmweb, namespace: {{.NS}}}
spec:
  replicas: 3
  selector: {matchLabels: {app: vmweb}}
  template:
    metadata: {labels: {app: vmweb}}
    spec:
      topologySpreadConstraints:
      - {maxSkew: 1, topologyKey: kubernetes.io/hostname, whenUnsatisfiable: DoNotSchedule, labelSelector: {matchLabels: {app: vmweb}}}
      containers:
      - name: web
        image: {{.Agnhost}}
        args: [netexec, --http-port=8080]
        resources:
          limits: {memory: 64Mi, cpu: 200m}
        readinessProbe:
          httpGet: {path: /healthz, port: 8080}
          periodSeconds: 2
---
apiVersion: v1
kind: Service
metadata: {name: vmweb, namespace: {{.NS}}}
spec:
  selector: {app: vmweb}
  ports: [{port: 80, targetPort: 8080}]
---
apiVersion: v1
kind: Pod
metadata: {name: hog, namespace: {{.NS}}}
spec:
  containers:
  - name: web
    image: {{.Agnhost}}
    args: [netexec, --http-port=8080]
    resources:
      limits: {memory: 64Mi, cpu: 200m}
  - name: hog
    image: {{.Busybox}}
    command: [sh, -c, "sleep 3; exec dd if=/dev/zero of=/dev/null bs=64M"]
    resources:
      limits: {memory: 32Mi}
`

func TestCluster(t *testing.T) {
	e := loadEnv(t)
	c := startCluster(t, e, "node1", "node2")
	t.Cleanup(func() {
		if t.Failed() {
			c.dumpLogs()
		}
	})

	if !t.Run("add-ons", func(t *testing.T) {
		c.rollout(t, "kube-system", "daemonset/kube-proxy")
		c.rollout(t, "kube-system", "daemonset/podnet")
		c.rollout(t, "kube-system", "deployment/coredns")
		// The policy put kube-system's host-network pods on fly and
		// CoreDNS on nspawn: each node's stagelet says which.
		c.expectStage1(t, "kube-proxy-", "fly")
		c.expectStage1(t, "podnet-", "fly")
		c.expectStage1(t, "coredns-", "nspawn")
	}) {
		return
	}
	c.apply(t, workloads)
	if !t.Run("deployment spread over the nodes", func(t *testing.T) {
		c.rollout(t, "default", "deployment/web")
		c.rollout(t, "default", "daemonset/client")
		nodes := map[string]bool{}
		for _, p := range c.pods(t, "app=web") {
			nodes[p.Spec.NodeName] = true
		}
		if len(nodes) != len(c.nodes) {
			t.Errorf("web's 6 pods run on %v, want every node", nodes)
		}
	}) {
		return
	}
	t.Run("one trace from the kubelet into the pod", c.testTrace)
	t.Run("service by DNS name from every node", func(t *testing.T) {
		c.reachAll(t, c.nodeNames())
	})
	t.Run("liveness probe restarts a failing container", func(t *testing.T) {
		c.wait(t, 3*time.Minute, "liveness restarted", func() (bool, error) {
			p, err := c.pod("liveness")
			if err != nil {
				return false, err
			}
			st := p.Status.ContainerStatuses
			return len(st) == 1 && st[0].RestartCount >= 1 && st[0].State.Running != nil, nil
		})
	})
	t.Run("readiness probe", func(t *testing.T) {
		c.wait(t, 2*time.Minute, "readiness running", func() (bool, error) {
			p, err := c.pod("readiness")
			return err == nil && p.Status.Phase == "Running", err
		})
		if p, err := c.pod("readiness"); err != nil || p.ready() {
			t.Fatalf("readiness is ready before its file exists (%v)", err)
		}
		c.kubectl(t, "exec", "readiness", "--", "touch", "/tmp/ready")
		c.wait(t, time.Minute, "readiness ready", func() (bool, error) {
			p, err := c.pod("readiness")
			return err == nil && p.ready(), err
		})
	})
	t.Run("job completes", func(t *testing.T) {
		c.kubectl(t, "wait", "--for=condition=complete", "job/done", "--timeout=3m")
		out := c.kubectl(t, "logs", "job/done")
		if strings.TrimSpace(out) != "done" {
			t.Errorf("job's log %q, want done", out)
		}
	})
	t.Run("signature policy of a namespace", c.testSignaturePolicy)
	t.Run("kvm pod beside them", func(t *testing.T) {
		if e.guest == "" {
			t.Skip("no kvm guest (STAGELET_GUEST_ASSETS)")
		}
		c.apply(t, vmPod)
		c.wait(t, 5*time.Minute, "vm ready", func() (bool, error) {
			p, err := c.pod("vm")
			return err == nil && p.ready(), err
		})
		c.expectStage1(t, "vm_default_", "kvm")
		hostKernel, err := exec.Command("uname", "-r").Output()
		if err != nil {
			t.Fatal(err)
		}
		if k := strings.TrimSpace(c.kubectl(t, "exec", "vm", "--", "uname", "-r")); k == strings.TrimSpace(string(hostKernel)) {
			t.Errorf("the vm pod runs the host's kernel %s", k)
		}
		// The VM is its limit plus the guest's own 128 MiB, within the
		// pod cgroup (limit + overhead) that holds qemu.
		var totalKiB int
		mi := c.kubectl(t, "exec", "vm", "--", "grep", "MemTotal:", "/proc/meminfo")
		t.Logf("the VM: %s", strings.TrimSpace(mi))
		if _, err := fmt.Sscanf(mi, "MemTotal: %d kB", &totalKiB); err != nil || totalKiB > 192<<10 || totalKiB < 160<<10 {
			t.Errorf("the VM's memory: %q, want 64 + 128 MiB less what its kernel keeps", mi)
		}
		// Its RuntimeClass overhead makes room for the VM and qemu in
		// the pod's cgroup: everything of it stays there.
		c.expectPlacement(t, "vm_default_", "pod")
		vm, _ := c.pod("vm")
		// From a pod on the other node, to the VM's address (its server
		// listens once its container's program got that far).
		for _, cl := range c.pods(t, "app=client") {
			if cl.Spec.NodeName == vm.Spec.NodeName {
				continue
			}
			c.reach(t, cl, vm.Status.PodIP, "vm")
		}
	})
	t.Run("kvm by an operator's rule, with limits and no overhead", func(t *testing.T) {
		if e.guest == "" {
			t.Skip("no kvm guest (STAGELET_GUEST_ASSETS)")
		}
		c.testVMNamespace(t)
	})
	t.Run("device plugin", c.testDevicePlugin)
	t.Run("an NRI plugin deployed as a DaemonSet", c.testNRIDaemonSet)
	t.Run("a container moves to the other node", c.testMove)
	t.Run("a VM pod moves to the other node", c.testMoveVM)
	t.Run("drain moves pods to the other node", func(t *testing.T) {
		drained, kept := c.nodes[1].name, c.nodes[0].name
		c.kubectl(t, "drain", drained, "--ignore-daemonsets", "--delete-emptydir-data", "--force", "--timeout=4m")
		defer c.kubectl(t, "uncordon", drained)
		c.rollout(t, "default", "deployment/web")
		for _, p := range c.pods(t, "app=web") {
			if p.Spec.NodeName != kept {
				t.Errorf("after draining %s, %s runs on %s", drained, p.Metadata.Name, p.Spec.NodeName)
			}
		}
		c.reachAll(t, []string{kept})
	})
	t.Run("stagelet restarts with its pods kept", func(t *testing.T) {
		n := c.nodes[0]
		before := c.containers(t, n.name)
		if len(before) == 0 {
			t.Fatalf("no pods on %s", n.name)
		}
		pid := c.nodeExec(t, n, "systemctl", "show", "-P", "MainPID", "stagelet")
		c.nodeExec(t, n, "systemctl", "restart", "stagelet")
		if after := c.nodeExec(t, n, "systemctl", "show", "-P", "MainPID", "stagelet"); after == pid || after == "0" {
			t.Fatalf("stagelet's main PID %s before the restart, %s after", pid, after)
		}
		// Give the kubelet time to relist through the new daemon: the
		// pods must be the same containers, never restarted.
		c.wait(t, time.Minute, "stagelet answering the kubelet", func() (bool, error) {
			out, err := c.kubectlErr("get", "node", n.name, "-o", `jsonpath={.status.conditions[?(@.type=="Ready")].status}`)
			return strings.TrimSpace(out) == "True", err
		})
		// Through several of the kubelet's relists, the pods stay the
		// same containers, never restarted.
		for end := time.Now().Add(15 * time.Second); time.Now().Before(end); time.Sleep(time.Second) {
			after := c.containers(t, n.name)
			for name, id := range before {
				if after[name] != id {
					t.Fatalf("%s: container %s before stagelet's restart, %s after", name, id, after[name])
				}
			}
		}
		c.reachAll(t, []string{n.name})
		// The restarted daemon runs new pods too.
		c.apply(t, pinnedPod, "Name", "after-restart", "Node", n.name)
		c.wait(t, 3*time.Minute, "a new pod after the restart", func() (bool, error) {
			p, err := c.pod("after-restart")
			return err == nil && p.ready(), err
		})
	})
}

type podObj struct {
	Metadata struct {
		Name      string `json:"name"`
		Namespace string `json:"namespace"`
		UID       string `json:"uid"`
	} `json:"metadata"`
	Spec struct {
		NodeName string `json:"nodeName"`
	} `json:"spec"`
	Status struct {
		Phase      string `json:"phase"`
		PodIP      string `json:"podIP"`
		Conditions []struct {
			Type   string `json:"type"`
			Status string `json:"status"`
		} `json:"conditions"`
		ContainerStatuses []containerStatus `json:"containerStatuses"`
	} `json:"status"`
}

type containerStatus struct {
	Name         string `json:"name"`
	ContainerID  string `json:"containerID"`
	RestartCount int    `json:"restartCount"`
	State        struct {
		Running *struct{} `json:"running"`
		Waiting *struct {
			Reason  string `json:"reason"`
			Message string `json:"message"`
		} `json:"waiting"`
	} `json:"state"`
	LastState struct {
		Terminated struct {
			Reason string `json:"reason"`
		} `json:"terminated"`
	} `json:"lastState"`
}

// container is the status of the pod's container name, nil without one.
func (p *podObj) container(name string) *containerStatus {
	for i := range p.Status.ContainerStatuses {
		if c := &p.Status.ContainerStatuses[i]; c.Name == name {
			return c
		}
	}
	return nil
}

func (p *podObj) ready() bool {
	for _, c := range p.Status.Conditions {
		if c.Type == "Ready" {
			return c.Status == "True"
		}
	}
	return false
}

func (c *cluster) pod(name string) (*podObj, error) { return c.podIn("default", name) }

func (c *cluster) podIn(ns, name string) (*podObj, error) {
	out, err := c.kubectlErr("-n", ns, "get", "pod", name, "-o", "json")
	if err != nil {
		return nil, err
	}
	var p podObj
	return &p, json.Unmarshal([]byte(out), &p)
}

func (c *cluster) pods(t *testing.T, selector string) []podObj {
	t.Helper()
	return c.podsIn(t, "default", selector)
}

func (c *cluster) podsIn(t *testing.T, ns, selector string) []podObj {
	t.Helper()
	var l struct {
		Items []podObj `json:"items"`
	}
	if err := json.Unmarshal([]byte(c.kubectl(t, "-n", ns, "get", "pods", "-l", selector, "-o", "json")), &l); err != nil {
		t.Fatal(err)
	}
	return l.Items
}

// containers are the container IDs and restart counts of the running
// containers on node, in every namespace (the add-ons' fly and nspawn pods
// among them), by namespace, pod and container; the liveness pod, whose
// container the kubelet restarts by design, is left out.
func (c *cluster) containers(t *testing.T, node string) map[string]string {
	t.Helper()
	out := c.kubectl(t, "get", "pods", "-A", "--field-selector", "spec.nodeName="+node, "-o", "json")
	var l struct {
		Items []podObj `json:"items"`
	}
	if err := json.Unmarshal([]byte(out), &l); err != nil {
		t.Fatal(err)
	}
	ids := map[string]string{}
	for _, p := range l.Items {
		if p.Metadata.Name == "liveness" {
			continue
		}
		for _, s := range p.Status.ContainerStatuses {
			if s.State.Running != nil {
				ids[p.Metadata.Namespace+"/"+p.Metadata.Name+"/"+s.Name] = s.ContainerID + " restarts " + strconv.Itoa(s.RestartCount)
			}
		}
	}
	return ids
}

func (c *cluster) nodeNames() []string {
	var out []string
	for _, n := range c.nodes {
		out = append(out, n.name)
	}
	return out
}

// apply applies manifest, a template of the test's images and the extra
// key, value pairs kv.
func (c *cluster) apply(t *testing.T, manifest string, kv ...string) {
	t.Helper()
	vals := map[string]string{"Agnhost": img.agnhost, "Busybox": img.busybox}
	for i := 0; i+1 < len(kv); i += 2 {
		vals[kv[i]] = kv[i+1]
	}
	var b bytes.Buffer
	if err := template.Must(template.New("m").Parse(manifest)).Execute(&b, vals); err != nil {
		t.Fatal(err)
	}
	if _, err := c.kubectlIn(b.String(), "apply", "-f", "-"); err != nil {
		t.Fatal(err)
	}
}

func (c *cluster) rollout(t *testing.T, ns, what string) {
	t.Helper()
	c.kubectl(t, "-n", ns, "rollout", "status", what, "--timeout=5m")
}

func (c *cluster) wait(t *testing.T, timeout time.Duration, what string, cond func() (bool, error)) {
	t.Helper()
	if err := c.waitFor(timeout, what, cond); err != nil {
		t.Fatal(err)
	}
}

// dial asks client's netexec to send tries HTTP requests for its hostname
// to host:port (a name is looked up in the cluster's DNS from the client
// pod), through kubectl exec, and returns the answers.
func (c *cluster) dial(t *testing.T, client, host, port string, tries int) []string {
	t.Helper()
	q := url.Values{"request": {"hostname"}, "protocol": {"http"}, "host": {host}, "port": {port}, "tries": {strconv.Itoa(tries)}}
	out, err := c.kubectlErr("exec", client, "--", "wget", "-qO-", "http://127.0.0.1:8080/dial?"+q.Encode())
	if err != nil {
		t.Logf("dial from %s: %v", client, err)
		return nil
	}
	var r struct {
		Responses []string `json:"responses"`
		Errors    []string `json:"errors"`
	}
	if err := json.Unmarshal([]byte(out), &r); err != nil {
		t.Logf("dial from %s: %v: %q", client, err, out)
	}
	if len(r.Errors) > 0 {
		t.Logf("dial from %s to %s:%s: %d errors, first: %s", client, host, port, len(r.Errors), r.Errors[0])
	}
	return r.Responses
}

// reachAll checks that the client pod on each of nodes reaches every web
// pod through the web Service, by its DNS name.
func (c *cluster) reachAll(t *testing.T, nodes []string) {
	t.Helper()
	want := map[string]bool{}
	for _, p := range c.pods(t, "app=web") {
		want[p.Metadata.Name] = true
	}
	for _, cl := range c.pods(t, "app=client") {
		if !slices.Contains(nodes, cl.Spec.NodeName) {
			continue
		}
		seen := map[string]bool{}
		c.wait(t, 2*time.Minute, fmt.Sprintf("%s on %s reaching all %d web pods", cl.Metadata.Name, cl.Spec.NodeName, len(want)), func() (bool, error) {
			for _, r := range c.dial(t, cl.Metadata.Name, "web.default.svc.cluster.local", "80", 30) {
				seen[r] = true
			}
			for w := range want {
				if !seen[w] {
					return false, fmt.Errorf("answered so far: %v", seen)
				}
			}
			return true, nil
		})
	}
}

// expectStage1 checks, in the stagelet logs of every node, that the pods
// whose sandbox name starts with prefix were started on stage1.
func (c *cluster) expectStage1(t *testing.T, prefix, stage1 string) {
	t.Helper()
	found := 0
	for _, n := range c.nodes {
		b, err := os.ReadFile(filepath.Join(n.root, "var/log/stagelet.log"))
		if err != nil {
			t.Fatal(err)
		}
		for _, line := range strings.Split(string(b), "\n") {
			if !strings.Contains(line, `msg="pod started"`) || !strings.Contains(line, " name="+prefix) {
				continue
			}
			found++
			if !strings.Contains(line, " stage1="+stage1+" ") {
				t.Errorf("node %s: %s", n.name, line)
			}
		}
	}
	if found == 0 {
		t.Errorf("no pod %s* started on any node", prefix)
	}
}

// nodeExec runs a command in a node's namespaces (as machinectl shell
// would) and returns its trimmed output.
func (c *cluster) nodeExec(t *testing.T, n *node, args ...string) string {
	t.Helper()
	pid, err := c.nodeInit(n)
	if err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("nsenter", append([]string{"-t", pid, "-m", "-u", "-i", "-n", "-p", "-C"}, args...)...).CombinedOutput()
	if err != nil {
		t.Fatalf("node %s: %s: %v\n%s", n.name, strings.Join(args, " "), err, out)
	}
	return strings.TrimSpace(string(out))
}

// nodeInit is the PID of node n's init, the leader of its namespaces.
func (c *cluster) nodeInit(n *node) (string, error) {
	leader, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", n.proc.cmd.Process.Pid, n.proc.cmd.Process.Pid))
	if err != nil || len(strings.Fields(string(leader))) == 0 {
		return "", fmt.Errorf("node %s: its init: %v", n.name, err)
	}
	return strings.Fields(string(leader))[0], nil
}

// testVMNamespace: pods the nodes' policy sends to kvm by an operator's
// rule, with memory limits and no RuntimeClass overhead, run: their qemu
// in stagelet's overhead cgroup. The Deployment's pods answer through
// their Service from the other node; a container past its limit is
// OOM-killed inside its VM and restarted, while the VM and the pod's
// other container live on.
func (c *cluster) testVMNamespace(t *testing.T) {
	c.apply(t, vmWorkloads, "NS", vmsNamespace)
	c.rollout(t, vmsNamespace, "deployment/vmweb")
	c.expectStage1(t, "vmweb-", "kvm")
	c.expectPlacement(t, "vmweb-", "overhead")
	replicas := c.podsIn(t, vmsNamespace, "app=vmweb")
	byNode := map[string][]string{}
	for _, p := range replicas {
		byNode[p.Spec.NodeName] = append(byNode[p.Spec.NodeName], p.Metadata.Name)
	}
	if len(byNode) != len(c.nodes) {
		t.Errorf("vmweb's pods run on %v, want every node", byNode)
	}
	// From the client pod on each node, the Service reaches the replicas
	// on the other node.
	for _, cl := range c.pods(t, "app=client") {
		seen := map[string]bool{}
		c.wait(t, 2*time.Minute, fmt.Sprintf("%s on %s reaching vmweb's pods on the other node", cl.Metadata.Name, cl.Spec.NodeName), func() (bool, error) {
			for _, r := range c.dial(t, cl.Metadata.Name, "vmweb."+vmsNamespace+".svc.cluster.local", "80", 20) {
				seen[r] = true
			}
			for node, names := range byNode {
				if node == cl.Spec.NodeName {
					continue
				}
				for _, n := range names {
					if !seen[n] {
						return false, fmt.Errorf("answered so far: %v", seen)
					}
				}
			}
			return true, nil
		})
	}

	var oomed *podObj
	c.wait(t, 5*time.Minute, "hog OOM-killed in its VM and restarted", func() (bool, error) {
		p, err := c.podIn(vmsNamespace, "hog")
		if err != nil {
			return false, err
		}
		oomed = p
		hog, web := p.container("hog"), p.container("web")
		if hog == nil || web == nil {
			return false, fmt.Errorf("containers %+v", p.Status.ContainerStatuses)
		}
		return hog.RestartCount >= 1 && hog.LastState.Terminated.Reason == "OOMKilled" && web.State.Running != nil, nil
	})
	c.expectPlacement(t, "hog_", "overhead")
	// The VM and its other container lived on: the same sandbox (its
	// address) and the same web container, never restarted, answering.
	web := oomed.container("web")
	if web.RestartCount != 0 {
		t.Errorf("the hog's neighbour restarted %d times", web.RestartCount)
	}
	c.reach(t, c.pods(t, "app=client")[0], oomed.Status.PodIP, "hog")
	after, err := c.podIn(vmsNamespace, "hog")
	if err != nil {
		t.Fatal(err)
	}
	if w := after.container("web"); after.Status.PodIP != oomed.Status.PodIP || w == nil || w.ContainerID != web.ContainerID {
		t.Errorf("the hog pod's VM or web container changed: %s %+v, was %s %+v", after.Status.PodIP, w, oomed.Status.PodIP, web)
	}
	// The hog restarts by design, and the drain and restart tests that
	// follow count restarts and reschedule pods: the namespace goes, its
	// VMs stopped and removed.
	c.kubectl(t, "delete", "namespace", vmsNamespace, "--wait", "--timeout=3m")
}

// reach waits until the client pod cl's netexec gets the hostname want
// from port 8080 of ip.
func (c *cluster) reach(t *testing.T, cl podObj, ip, want string) {
	t.Helper()
	c.wait(t, time.Minute, fmt.Sprintf("%s on %s reaching %s at %s:8080", cl.Metadata.Name, cl.Spec.NodeName, want, ip), func() (bool, error) {
		got := c.dial(t, cl.Metadata.Name, ip, "8080", 3)
		if !slices.Contains(got, want) {
			return false, fmt.Errorf("answers %v", got)
		}
		return true, nil
	})
}

// expectPlacement checks, in the stagelet logs of every node, that the kvm
// pods whose sandbox name starts with prefix run their qemu where
// placement says: "overhead" (stagelet's overhead cgroup, capped) or "pod"
// (the kubelet's pod cgroup).
func (c *cluster) expectPlacement(t *testing.T, prefix, placement string) {
	t.Helper()
	found := 0
	for _, n := range c.nodes {
		b, err := os.ReadFile(filepath.Join(n.root, "var/log/stagelet.log"))
		if err != nil {
			t.Fatal(err)
		}
		lines := strings.Split(string(b), "\n")
		for _, line := range lines {
			if !strings.Contains(line, `msg="pod started"`) || !strings.Contains(line, " name="+prefix) {
				continue
			}
			_, rest, _ := strings.Cut(line, " pod=")
			id, _, _ := strings.Cut(rest, " ")
			for _, l := range lines {
				if !strings.Contains(l, `msg="kvm pod started"`) || !strings.Contains(l, " pod="+id+" ") {
					continue
				}
				found++
				if overhead := !strings.Contains(l, " overheadCapMiB=0 "); overhead != (placement == "overhead") {
					t.Errorf("node %s: pod %s: qemu not in the %s cgroup: %s", n.name, id, placement, l)
				}
			}
		}
	}
	if found == 0 {
		t.Errorf("no kvm pod %s* started on any node", prefix)
	}
}

// The nodes' policy is the embedded default and the operator's rule:
// what the cluster test relies on, checked without a cluster.
func TestNodePolicy(t *testing.T) {
	p, err := policy.Parse("node policy", []byte(nodePolicy()))
	if err != nil {
		t.Fatal(err)
	}
	caps := map[string]caps.Capabilities{
		"fly":    {Isolation: caps.IsolationHost, HostNetwork: true, PodNetwork: true, HostPID: true, HostIPC: true},
		"nspawn": {Isolation: caps.IsolationNamespaces, HostNetwork: true, PodNetwork: true},
		"kvm":    {Isolation: caps.IsolationKernel, KernelIsolated: true, PodNetwork: true},
	}
	for _, tt := range []struct {
		pod  policy.Pod
		want string
	}{
		{policy.Pod{Namespace: vmsNamespace}, "kvm"},
		{policy.Pod{Namespace: "default"}, "nspawn"},
		{policy.Pod{Namespace: "kube-system", HostNetwork: true}, "fly"},
		{policy.Pod{Namespace: "default", Handler: "kvm"}, "kvm"},
	} {
		if d, err := p.Decide(tt.pod, caps); err != nil || d.Stage1 != tt.want {
			t.Errorf("%+v: %s, %v; want %s", tt.pod, d.Stage1, err, tt.want)
		}
	}
}
