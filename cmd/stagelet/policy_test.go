package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stagelet/stagelet/config"
	"github.com/stagelet/stagelet/test/testregistry"
)

func TestParsePodForPolicy(t *testing.T) {
	manifest := []byte(`apiVersion: v1
kind: Pod
metadata: {name: p, labels: {a: b}, annotations: {stagelet.io/stage1: kvm}}
spec:
  runtimeClassName: nspawn
  hostNetwork: true
  initContainers: [{name: i, securityContext: {privileged: true}}]
  containers: [{name: c}]
`)
	pp, err := parsePodForPolicy(manifest, "", 0)
	if err != nil {
		t.Fatal(err)
	}
	pod, title := pp.pod, pp.title
	if title != "default/p" || pod.Namespace != "default" || pod.Handler != "nspawn" || !pod.HostNetwork || !pod.Privileged ||
		pod.Labels["a"] != "b" || pod.Annotations["stagelet.io/stage1"] != "kvm" {
		t.Fatalf("pod = %+v, title %q", pod, title)
	}
	cri := []byte(`{"metadata": {"name": "x", "namespace": "ci", "uid": "u"},
		"linux": {"security_context": {"privileged": true, "namespace_options": {"network": 2}}}}`)
	pp, err = parsePodForPolicy(cri, "kvm", 0)
	if err != nil {
		t.Fatal(err)
	}
	pod, title = pp.pod, pp.title
	if title != "ci/x" || pod.Handler != "kvm" || !pod.HostNetwork || pod.HostPID || !pod.Privileged {
		t.Fatalf("pod = %+v", pod)
	}
	if _, err := parsePodForPolicy([]byte("kind: Deployment\n"), "", 0); err == nil || !strings.Contains(err.Error(), "Deployment") {
		t.Fatalf("err = %v", err)
	}
	if _, err := parsePodForPolicy([]byte(`{"metadata": {}, "bogus": 1}`), "", 0); err == nil {
		t.Fatal("a malformed CRI config was accepted")
	}
}

func TestPolicyCheck(t *testing.T) {
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad.yaml")
	os.WriteFile(bad, []byte("version: 1\ndefault_stage1: fly\nrulez: []\n"), 0o644)
	var out strings.Builder
	if rc := policyCheck([]string{bad}, &out); rc != 1 {
		t.Fatalf("rc = %d for a bad file:\n%s", rc, out.String())
	}
	if !strings.Contains(out.String(), bad+":3:1:") {
		t.Fatalf("output does not name line and column:\n%s", out.String())
	}
	good := filepath.Join(dir, "good.yaml")
	os.WriteFile(good, []byte("version: 1\ndefault_stage1: fly\n"), 0o644)
	out.Reset()
	if rc := policyCheck([]string{good}, &out); rc != 0 || !strings.Contains(out.String(), good+": ok") {
		t.Fatalf("rc = %d:\n%s", rc, out.String())
	}
}

// A manifest's limits as the kubelet sends them, and the limit it puts
// on the pod's cgroup: only when every container has one.
func TestManifestLimits(t *testing.T) {
	const mi = 1 << 20
	for _, tt := range []struct {
		name, spec string
		overhead   int64
		memory     int64
		cgroup     uint64
		quota      int64
		shares     int64
	}{
		{"every container limited", `
  containers:
  - {name: a, resources: {limits: {memory: 64Mi, cpu: 200m}, requests: {cpu: 100m}}}
  - {name: b, resources: {limits: {memory: 32Mi}}}`, 0, 96 * mi, 96 * mi, 20000, 102},
		{"one container without a limit", `
  containers:
  - {name: a, resources: {limits: {memory: 64Mi}}}
  - {name: b}`, 0, 64 * mi, 0, 0, 0},
		{"an init container larger than the rest, a sidecar", `
  initContainers:
  - {name: side, restartPolicy: Always, resources: {limits: {memory: 16Mi}}}
  - {name: init, resources: {limits: {memory: 200Mi}}}
  containers:
  - {name: a, resources: {limits: {memory: 64Mi}}}`, 0, 216 * mi, 216 * mi, 0, 0},
		{"pod-level limits", `
  resources: {limits: {memory: 128Mi}}
  containers:
  - {name: a}`, 0, 128 * mi, 128 * mi, 0, 0},
		{"the RuntimeClass overhead", `
  overhead: {memory: 192Mi}
  containers:
  - {name: a, resources: {limits: {memory: 64Mi}}}`, 0, 64 * mi, 256 * mi, 0, 0},
		{"--overhead", `
  containers:
  - {name: a, resources: {limits: {memory: 64Mi}}}`, 192 * mi, 64 * mi, 256 * mi, 0, 0},
	} {
		pp, err := parsePodForPolicy([]byte("kind: Pod\nmetadata: {name: p}\nspec:"+tt.spec+"\n"), "", tt.overhead)
		if err != nil {
			t.Errorf("%s: %v", tt.name, err)
			continue
		}
		if pp.res.MemoryLimit != tt.memory || pp.cgroupLimit != tt.cgroup || pp.res.CPUQuota != tt.quota || pp.res.CPUShares != tt.shares {
			t.Errorf("%s: limits %+v, cgroup %d; want memory %d, cgroup %d, quota %d, shares %d", tt.name, pp.res, pp.cgroupLimit, tt.memory, tt.cgroup, tt.quota, tt.shares)
		}
	}
	if _, err := parsePodForPolicy([]byte("kind: Pod\nmetadata: {name: p}\nspec: {containers: [{name: a, resources: {limits: {memory: lots}}}]}\n"), "", 0); err == nil ||
		!strings.Contains(err.Error(), "spec.containers[0].resources.limits.memory") {
		t.Errorf("a bad quantity: %v", err)
	}
}

// explain says how the stage1 the policy chose would run the pod, and
// when it cannot, refuses naming what chose it: the daemon's answer.
func TestPolicyExplainPlan(t *testing.T) {
	dir := t.TempDir()
	pod := filepath.Join(dir, "pod.yaml")
	os.WriteFile(pod, []byte(`kind: Pod
metadata: {name: web, namespace: tenant-a}
spec:
  containers:
  - {name: web, resources: {limits: {memory: 64Mi, cpu: 200m}}}
`), 0o644)
	node := func(placement string) string {
		f := filepath.Join(dir, "node-"+placement+".yaml")
		os.WriteFile(f, []byte(`version: 1
kvm: {placement: `+placement+`, accelerator: tcg}
policy:
  version: 1
  default_stage1: nspawn
  rules:
  - name: tenant-vms
    match: {namespaces: [tenant-a]}
    stage1: kvm
`), 0o644)
		return f
	}
	var out strings.Builder
	if rc := policyExplain([]string{"--config", node("auto"), pod}, &out); rc != 0 ||
		!strings.Contains(out.String(), "stage1:  kvm") ||
		!strings.Contains(out.String(), "plan:    a VM of 192 MiB and 1 vCPU(s); qemu runs in the overhead cgroup stagelet-vmm, capped at 256 MiB") {
		t.Errorf("auto placement: rc %d\n%s", rc, out.String())
	}
	out.Reset()
	if rc := policyExplain([]string{"--config", node("pod"), pod}, &out); rc != 1 ||
		!strings.Contains(out.String(), `refused: stage1 kvm (chosen by rule "tenant-vms") cannot run the pod: kvm: the pod's cgroup allows 64 MiB`) ||
		!strings.Contains(out.String(), "overhead.podFixed.memory of at least 192Mi") {
		t.Errorf("pod placement, no overhead: rc %d\n%s", rc, out.String())
	}
	out.Reset()
	if rc := policyExplain([]string{"--config", node("pod"), "--overhead", "192Mi", pod}, &out); rc != 0 ||
		!strings.Contains(out.String(), "qemu runs in the pod's cgroup (256 MiB holds the VM") {
		t.Errorf("pod placement with the overhead: rc %d\n%s", rc, out.String())
	}
}

func TestPolicyExplainImage(t *testing.T) {
	dir := t.TempDir()
	key := testregistry.NewKey(t)
	write := func(name, data string) string {
		p := filepath.Join(dir, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	sigPolicy := write("signature-policy.json", `{"default": [{"type": "insecureAcceptAnything"}],
 "transports": {"docker": {"registry.example.com": [{"type": "sigstoreSigned", "keyPath": "`+key.PubPath+`", "signedIdentity": {"type": "matchRepository"}}]}}}`)
	payments := write("signature-policy.d/payments.json", `{"default": [{"type": "reject"}]}`)
	node := write("node.yaml", "version: 1\nimages:\n  signature_policy: "+sigPolicy+"\n")
	pod := write("pod.yaml", `kind: Pod
metadata: {name: web, namespace: payments}
spec:
  containers:
  - {name: web, image: registry.example.com/web:1.4}
`)
	var out strings.Builder
	if rc := policyExplain([]string{"--config", node, "--image", "registry.example.com/team/web:1.4"}, &out); rc != 0 ||
		!strings.Contains(out.String(), "image:   registry.example.com/team/web:1.4 in namespace default") ||
		!strings.Contains(out.String(), "policy:   "+sigPolicy) ||
		!strings.Contains(out.String(), "scope:    registry.example.com\n") ||
		!strings.Contains(out.String(), "requires: sigstoreSigned (keys "+key.PubPath+"; identity matchRepository)") {
		t.Errorf("--image: rc %d\n%s", rc, out.String())
	}
	out.Reset()
	// The pod's namespace has a file of its own, which rejects everything.
	if rc := policyExplain([]string{"--config", node, pod}, &out); rc != 1 ||
		!strings.Contains(out.String(), "image:   registry.example.com/web:1.4 in namespace payments") ||
		!strings.Contains(out.String(), "policy:   "+payments) ||
		!strings.Contains(out.String(), "requires: reject") {
		t.Errorf("a pod in payments: rc %d\n%s", rc, out.String())
	}
}

// A misspelt or bad backend option is refused wherever the policy is
// read, in the same words: policy check, config check, the daemon's
// load and reload, and explain, which decides nothing under such a
// policy.
func TestPolicyRefusesBadOptions(t *testing.T) {
	dir := t.TempDir()
	write := func(name, data string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	const rules = `version: 1
default_stage1: nspawn
rules:
  - name: tenant-vms
    match: {namespaces: [tenant-a]}
    stage1: kvm
    options: {memroy: 2G, vcpus: "0"}
  - name: daemons
    match: {namespaces: [ops]}
    stage1: fly
    options: {memory: 1G}
`
	pol := write("policy.yaml", rules)
	node := write("node.yaml", "version: 1\npolicy:\n  "+strings.ReplaceAll(strings.TrimSpace(rules), "\n", "\n  ")+"\n")
	pod := write("pod.yaml", "kind: Pod\nmetadata: {name: web, namespace: tenant-a}\nspec: {containers: [{name: web}]}\n")
	// The problems, at the line of the first rule's options in file,
	// whose policy is indented by indent.
	want := func(file string, line, indent int) []string {
		return []string{
			fmt.Sprintf(`%s:%d:%d: rules[0] ("tenant-vms"): stage1 kvm: option "memroy": unknown (kvm takes: memory, vcpus)`, file, line, 15+indent),
			fmt.Sprintf(`%s:%d:%d: rules[0] ("tenant-vms"): stage1 kvm: option "vcpus": value "0": want 1 to 64 (vcpus: the VM's vCPU count, 1 to 64)`, file, line, 34+indent),
			fmt.Sprintf(`%s:%d:%d: rules[1] ("daemons"): stage1 fly: option "memory": unknown (fly takes no options)`, file, line+4, 15+indent),
		}
	}
	check := func(what string, rc, wantRC int, out string, lines []string) {
		t.Helper()
		if rc != wantRC {
			t.Errorf("%s: rc %d, want %d\n%s", what, rc, wantRC, out)
		}
		for _, l := range lines {
			if !strings.Contains(out, l+"\n") {
				t.Errorf("%s does not say\n%s\nit says\n%s", what, l, out)
			}
		}
	}

	var out, errOut strings.Builder
	check("policy check", policyCheck([]string{pol}, &out), 1, out.String(), append(want(pol, 7, 0), pol+": 3 problem(s)"))

	out.Reset()
	check("config check", configMain([]string{"check", node}, &out, &errOut), 1, errOut.String(), append(want(node, 9, 2), node+": the policy has 3 problem(s)"))

	cfg, err := config.Load(node)
	if err != nil {
		t.Fatal(err)
	}
	if _, err = loadPolicy(quietLog, cfg, capabilitiesOf(builtinBackends(quietLog, cfg, nil, true, ""))); err == nil {
		t.Fatal("the daemon loads the policy")
	}
	check("the daemon's load", 1, 1, err.Error()+"\n", want(node, 9, 2))

	for _, args := range [][]string{{"--policy", pol, pod}, {"--config", node, pod}} {
		out.Reset()
		file, line, indent := pol, 7, 0
		if args[0] == "--config" {
			file, line, indent = node, 9, 2
		}
		check("explain "+args[0], policyExplain(args, &out), 1, out.String(),
			append(want(file, line, indent), "refused: the policy ("+file+") has 3 problem(s): the daemon does not load it, so it decides no pod"))
		if strings.Contains(out.String(), "stage1:  kvm") {
			t.Errorf("explain %s decided under a policy that does not load:\n%s", args[0], out.String())
		}
	}

	// Spelt right, the same policy loads and explain decides.
	good := write("good.yaml", strings.NewReplacer("memroy", "memory", `vcpus: "0"`, `vcpus: "2"`, "    options: {memory: 1G}\n", "").Replace(rules))
	out.Reset()
	check("policy check, spelt right", policyCheck([]string{good}, &out), 0, out.String(), []string{good + ": ok"})
	out.Reset()
	check("explain, spelt right", policyExplain([]string{"--policy", good, pod}, &out), 0, out.String(), []string{"stage1:  kvm", "options: memory=2G, vcpus=2"})
}
