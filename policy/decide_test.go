package policy

import (
	"errors"
	"os"
	"reflect"
	"strconv"
	"strings"
	"testing"

	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/stage1/caps"
)

// stage1Caps are the capabilities the three stage1s declare, options
// included; nspawn's devices option is the tests' own, for options that a
// stage1 other than kvm takes.
var stage1Caps = map[string]caps.Capabilities{
	"fly": {Isolation: caps.IsolationHost, HostNetwork: true, HostPID: true, HostIPC: true, Privileged: "host"},
	"nspawn": {Isolation: caps.IsolationNamespaces, HostNetwork: true, PodNetwork: true, HostPID: true, HostIPC: true,
		Privileged: "pod", UserNamespaces: true, Options: []caps.Option{{Name: "devices", Doc: "a device class"}}},
	"kvm": {Isolation: caps.IsolationKernel, KernelIsolated: true, PodNetwork: true, Privileged: "guest", Options: []caps.Option{
		{Name: "vcpus", Doc: "the VM's vCPU count, 1 to 64", Check: checkCount},
		{Name: "memory", Doc: "the VM's memory: 512M, 2G", Check: checkSize},
	}},
}

// checkCount and checkSize check option values as a backend would.
func checkCount(v string) error {
	if n, err := strconv.Atoi(v); err != nil || n < 1 || n > 64 {
		return errors.New("want 1 to 64")
	}
	return nil
}

func checkSize(v string) error {
	if n, err := strconv.Atoi(strings.TrimRight(v, "MG")); err != nil || n < 1 {
		return errors.New("not a size")
	}
	return nil
}

func mustPolicy(t testing.TB, name, text string) *Policy {
	t.Helper()
	p, err := Parse(name, []byte(text))
	if err != nil {
		t.Fatalf("parse %s:\n%v", name, err)
	}
	if err := p.Validate(stage1Caps); err != nil {
		t.Fatalf("validate %s:\n%v", name, err)
	}
	return p
}

// rulesPolicy has a rule of every kind.
const rulesPolicy = `
version: 1
default_stage1: nspawn
handlers:
  nspawn: {stage1: nspawn}
  kvm: {stage1: kvm, options: {memory: 512M}}
  fly: {stage1: fly, namespaces: ["kube-*"], not_namespaces: [kube-public]}
rules:
  - name: no-privileged-untrusted
    match: {namespaces: ["untrusted-*"], privileged: true}
    refuse: privileged pods are not allowed in untrusted namespaces
  - name: system-host-network
    match: {namespaces: [kube-system], host_network: true}
    stage1: fly
  - name: gpu
    match: {labels: {accel: gpu}, not_namespaces: ["untrusted-*"]}
    stage1: nspawn
    options: {devices: gpu}
  - name: sandbox-annotated
    match: {annotations: {example.com/sandbox: "true"}}
    stage1: kvm
  - name: ops-host-pid
    match: {namespaces: [ops], host_pid: true}
    stage1: fly
  - name: untrusted-vms
    match: {namespaces: ["untrusted-*"]}
    stage1: kvm
    options: {memory: 1024M}
    locked: true
  - name: refuse-ipc-late
    match: {host_ipc: true}
    refuse: no hostIPC here
annotations:
  allow: [nspawn, kvm]
  per_namespace:
    sandbox: [kvm]
    "team-*": [fly, nspawn, kvm]
    "team-a*": [nspawn]
    team-x: [kvm]
  raise_only: true
`

// conflictsPolicy defaults to VMs and routes capability conflicts.
const conflictsPolicy = `
version: 1
default_stage1: kvm
handlers:
  kvm: {stage1: kvm}
  nspawn: {stage1: nspawn}
rules:
  - name: ci
    match: {namespaces: [ci]}
    stage1: kvm
    options: {memory: 2G}
annotations:
  allow: [kvm, nspawn]
  raise_only: false
conflicts:
  host_network: {fallback: nspawn}
  host_pid: {refuse: "hostPID pods are not run here"}
`

type decideCase struct {
	name string
	pod  Pod
	// On success:
	stage1, rule string
	options      map[string]string
	reasons      []string // each must appear, in order, in some reason
	// On refusal:
	class error
	msg   []string // each must appear in the message
	by    string
}

func runDecide(t *testing.T, p *Policy, tests []decideCase) {
	t.Helper()
	runDecideCaps(t, p, stage1Caps, tests)
}

func runDecideCaps(t *testing.T, p *Policy, stage1Caps map[string]caps.Capabilities, tests []decideCase) {
	t.Helper()
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			d, err := p.Decide(tc.pod, stage1Caps)
			if tc.class != nil {
				if err == nil {
					t.Fatalf("got %+v, want a refusal", d)
				}
				if !errors.Is(err, tc.class) {
					t.Errorf("class: %v is not %v", err, tc.class)
				}
				var r *Refusal
				if !errors.As(err, &r) {
					t.Fatalf("%T is not a *Refusal", err)
				}
				for _, m := range tc.msg {
					if !strings.Contains(err.Error(), m) {
						t.Errorf("message %q lacks %q", err, m)
					}
				}
				if tc.by != "" && r.By != tc.by {
					t.Errorf("By = %q, want %q", r.By, tc.by)
				}
				if !reflect.DeepEqual(d, Decision{}) {
					t.Errorf("decision with a refusal: %+v", d)
				}
				return
			}
			if err != nil {
				t.Fatalf("refused: %v", err)
			}
			if d.Stage1 != tc.stage1 || d.Rule != tc.rule {
				t.Errorf("got stage1 %q rule %q, want %q %q\n%s", d.Stage1, d.Rule, tc.stage1, tc.rule, p.Explain(d))
			}
			if !reflect.DeepEqual(d.Options, tc.options) {
				t.Errorf("options = %v, want %v", d.Options, tc.options)
			}
			i := 0
			for _, r := range d.Reasons {
				if i < len(tc.reasons) && strings.Contains(r, tc.reasons[i]) {
					i++
				}
			}
			if i < len(tc.reasons) {
				t.Errorf("reasons %q lack %q (in order)", d.Reasons, tc.reasons[i])
			}
		})
	}
}

func ann(kv ...string) map[string]string {
	m := map[string]string{}
	for i := 0; i+1 < len(kv); i += 2 {
		m[kv[i]] = kv[i+1]
	}
	return m
}

func TestDecideRules(t *testing.T) {
	p := mustPolicy(t, "rules.yaml", rulesPolicy)
	runDecide(t, p, []decideCase{
		// Rule kinds and the default.
		{name: "default", pod: Pod{Namespace: "default"}, stage1: "nspawn", reasons: []string{`default_stage1 is "nspawn"`}},
		{name: "namespace and host_network", pod: Pod{Namespace: "kube-system", HostNetwork: true}, stage1: "fly", rule: "system-host-network",
			reasons: []string{`rule "system-host-network" (match: namespaces [kube-system], host_network=true) chose stage1 "fly"`}},
		{name: "host_network false does not match", pod: Pod{Namespace: "kube-system"}, stage1: "nspawn"},
		{name: "label", pod: Pod{Namespace: "default", Labels: ann("accel", "gpu")}, stage1: "nspawn", rule: "gpu",
			options: map[string]string{"devices": "gpu"}},
		{name: "label other value", pod: Pod{Namespace: "default", Labels: ann("accel", "cpu")}, stage1: "nspawn"},
		{name: "not_namespaces glob", pod: Pod{Namespace: "untrusted-1", Labels: ann("accel", "gpu")}, stage1: "kvm", rule: "untrusted-vms",
			options: map[string]string{"memory": "1024M"}},
		{name: "annotation matcher", pod: Pod{Namespace: "default", Annotations: ann("example.com/sandbox", "true")}, stage1: "kvm", rule: "sandbox-annotated"},
		{name: "annotation matcher other value", pod: Pod{Namespace: "default", Annotations: ann("example.com/sandbox", "false")}, stage1: "nspawn"},
		{name: "host_pid", pod: Pod{Namespace: "ops", HostPID: true}, stage1: "fly", rule: "ops-host-pid"},
		{name: "refuse privileged", pod: Pod{Namespace: "untrusted-7", Privileged: true},
			class: errdefs.ErrPermissionDenied, by: `rule "no-privileged-untrusted"`,
			msg: []string{`refused by rule "no-privileged-untrusted"`, "privileged pods are not allowed in untrusted namespaces"}},
		{name: "refuse beats handler", pod: Pod{Namespace: "untrusted-7", Privileged: true, Handler: "kvm"},
			class: errdefs.ErrPermissionDenied, msg: []string{`rule "no-privileged-untrusted"`}},
		{name: "refuse after stage1 rules still refuses", pod: Pod{Namespace: "untrusted-1", HostIPC: true},
			class: errdefs.ErrPermissionDenied, msg: []string{`refused by rule "refuse-ipc-late": no hostIPC here`}},

		// Handlers.
		{name: "handler", pod: Pod{Namespace: "default", Handler: "kvm"}, stage1: "kvm", options: map[string]string{"memory": "512M"},
			reasons: []string{`runtime handler "kvm" chose stage1 "kvm" (handlers.kvm)`}},
		{name: "unknown handler", pod: Pod{Namespace: "default", Handler: "runsc"},
			class: errdefs.ErrInvalidArgument, by: "handlers", msg: []string{`runtime handler "runsc" is not configured`, "handlers: fly, kvm, nspawn"}},
		{name: "handler in its namespace", pod: Pod{Namespace: "kube-system", Handler: "fly"}, stage1: "fly"},
		{name: "handler namespace glob", pod: Pod{Namespace: "kube-node-lease", Handler: "fly"}, stage1: "fly"},
		{name: "handler excluded namespace", pod: Pod{Namespace: "kube-public", Handler: "fly"},
			class: errdefs.ErrPermissionDenied, by: "handlers.fly",
			msg: []string{`runtime handler "fly" (handlers.fly → fly) is not allowed in namespace "kube-public"`, "not_namespaces: kube-public"}},
		{name: "handler outside namespaces", pod: Pod{Namespace: "default", Handler: "fly"},
			class: errdefs.ErrPermissionDenied, msg: []string{"handlers.fly", "namespaces: kube-*"}},
		{name: "handler against locked rule", pod: Pod{Namespace: "untrusted-1", Handler: "nspawn"},
			class: errdefs.ErrPermissionDenied, by: `rule "untrusted-vms"`, msg: []string{`cannot override locked rule "untrusted-vms"`}},
		{name: "handler agreeing with locked rule", pod: Pod{Namespace: "untrusted-1", Handler: "kvm"}, stage1: "kvm", rule: "untrusted-vms",
			options: map[string]string{"memory": "1024M"}, reasons: []string{`runtime handler "kvm" (handlers.kvm) asks for stage1 "kvm", which locked rule "untrusted-vms" (match: namespaces [untrusted-*]) gives anyway`}},
		{name: "handler over rule", pod: Pod{Namespace: "kube-system", HostNetwork: true, Handler: "nspawn"}, stage1: "nspawn",
			reasons: []string{`runtime handler "nspawn"`, `rule "system-host-network" (stage1 "fly") also matched; the runtime handler takes precedence`}},

		// Annotations.
		{name: "annotation raises", pod: Pod{Namespace: "default", Annotations: ann(AnnotationStage1, "kvm")}, stage1: "kvm",
			reasons: []string{"default_stage1", `annotation stagelet.io/stage1="kvm" raised the stage1 from "nspawn" to "kvm" (allowed by annotations.allow)`}},
		{name: "annotation same as base", pod: Pod{Namespace: "untrusted-1", Annotations: ann(AnnotationStage1, "kvm")}, stage1: "kvm", rule: "untrusted-vms",
			options: map[string]string{"memory": "1024M"}, reasons: []string{"which the pod already gets"}},
		{name: "annotation against locked rule", pod: Pod{Namespace: "untrusted-1", Annotations: ann(AnnotationStage1, "nspawn")},
			class: errdefs.ErrPermissionDenied, by: `rule "untrusted-vms"`, msg: []string{`rule "untrusted-vms" is locked`}},
		{name: "annotation never fly", pod: Pod{Namespace: "kube-system", Annotations: ann(AnnotationStage1, "fly")},
			class: errdefs.ErrPermissionDenied, by: "annotations.allow",
			msg: []string{`requests stage1 "fly", which annotations.allow does not allow in namespace "kube-system" (allowed: nspawn, kvm)`}},
		{name: "annotation raises from fly", pod: Pod{Namespace: "kube-system", HostNetwork: true, Annotations: ann(AnnotationStage1, "nspawn")},
			stage1: "nspawn", rule: "system-host-network", reasons: []string{`raised the stage1 from "fly" to "nspawn"`}},
		{name: "annotation asks for impossible", pod: Pod{Namespace: "kube-system", HostNetwork: true, Annotations: ann(AnnotationStage1, "kvm")},
			class: errdefs.ErrInvalidArgument, msg: []string{`annotation stagelet.io/stage1="kvm" asks for stage1 "kvm", which declares no host network; the pod sets hostNetwork`}},
		{name: "per-namespace exact", pod: Pod{Namespace: "sandbox", Annotations: ann(AnnotationStage1, "kvm")}, stage1: "kvm",
			reasons: []string{`annotations.per_namespace["sandbox"]`}},
		{name: "per-namespace denies", pod: Pod{Namespace: "sandbox", Annotations: ann(AnnotationStage1, "fly")},
			class: errdefs.ErrPermissionDenied, by: `annotations.per_namespace["sandbox"]`, msg: []string{`annotations.per_namespace["sandbox"] does not allow`}},
		{name: "fly allowed but raise-only", pod: Pod{Namespace: "team-b", Annotations: ann(AnnotationStage1, "fly")},
			class: errdefs.ErrPermissionDenied, by: "annotations.raise_only",
			msg: []string{`would lower isolation from "nspawn" (level 1, chosen by default_stage1) to level 0; annotations.raise_only`}},
		{name: "longest glob wins", pod: Pod{Namespace: "team-abc", Annotations: ann(AnnotationStage1, "kvm")},
			class: errdefs.ErrPermissionDenied, msg: []string{`annotations.per_namespace["team-a*"]`, "allowed: nspawn"}},
		{name: "exact wins over glob", pod: Pod{Namespace: "team-x", Annotations: ann(AnnotationStage1, "kvm")}, stage1: "kvm"},
		{name: "annotation after handler", pod: Pod{Namespace: "default", Handler: "nspawn", Annotations: ann(AnnotationStage1, "kvm")}, stage1: "kvm",
			reasons: []string{`runtime handler "nspawn"`, "raised"}},
		{name: "annotation lowers handler", pod: Pod{Namespace: "default", Handler: "kvm", Annotations: ann(AnnotationStage1, "nspawn")},
			class: errdefs.ErrPermissionDenied, msg: []string{`chosen by runtime handler "kvm"`, "raise_only"}},
		{name: "options dropped", pod: Pod{Namespace: "default", Labels: ann("accel", "gpu"), Annotations: ann(AnnotationStage1, "kvm")},
			stage1: "kvm", rule: "gpu", reasons: []string{"raised", `options devices=gpu were for stage1 "nspawn" and are dropped for "kvm"`}},
		{name: "bad annotation", pod: Pod{Namespace: "default", Annotations: ann(AnnotationStage1, "KVM")},
			class: errdefs.ErrInvalidArgument, msg: []string{`annotation stagelet.io/stage1="KVM": not a stage1 name`}},
		{name: "annotation for unknown stage1", pod: Pod{Namespace: "default", Annotations: ann(AnnotationStage1, "gvisor")},
			class: errdefs.ErrPermissionDenied, msg: []string{`stage1 "gvisor", which annotations.allow does not allow`}},

		// rktnetes' annotation.
		{name: "rkt kvm image", pod: Pod{Namespace: "default", Annotations: ann(AnnotationRktStage1, "coreos.com/rkt/stage1-kvm:1.30.0")}, stage1: "kvm",
			reasons: []string{`annotation rkt.alpha.kubernetes.io/stage1-name-override="coreos.com/rkt/stage1-kvm:1.30.0" raised`}},
		{name: "rkt coreos", pod: Pod{Namespace: "default", Annotations: ann(AnnotationRktStage1, "stage1-coreos")}, stage1: "nspawn"},
		{name: "rkt fly under the allow-list", pod: Pod{Namespace: "default", Annotations: ann(AnnotationRktStage1, "coreos.com/rkt/stage1-fly:1.30.0")},
			class: errdefs.ErrPermissionDenied, msg: []string{"rkt.alpha.kubernetes.io/stage1-name-override", `stage1 "fly"`, "annotations.allow"}},
		{name: "rkt unparseable", pod: Pod{Namespace: "default", Annotations: ann(AnnotationRktStage1, "quay.io/acme/stage1-weird:1")},
			class: errdefs.ErrInvalidArgument, msg: []string{`annotation rkt.alpha.kubernetes.io/stage1-name-override="quay.io/acme/stage1-weird:1"`}},
		{name: "both keys agree", pod: Pod{Namespace: "default", Annotations: ann(AnnotationStage1, "kvm", AnnotationRktStage1, "stage1-kvm")}, stage1: "kvm"},
		{name: "both keys disagree", pod: Pod{Namespace: "default", Annotations: ann(AnnotationStage1, "kvm", AnnotationRktStage1, "stage1-coreos")},
			class: errdefs.ErrInvalidArgument, msg: []string{"request different stage1s"}},
	})
}

func TestDecideConflicts(t *testing.T) {
	p := mustPolicy(t, "conflicts.yaml", conflictsPolicy)
	runDecide(t, p, []decideCase{
		{name: "no conflict", pod: Pod{Namespace: "default"}, stage1: "kvm"},
		{name: "fallback", pod: Pod{Namespace: "default", HostNetwork: true}, stage1: "nspawn",
			reasons: []string{"default_stage1", `stage1 "kvm" declares no host network, which the pod needs; conflicts.host_network falls back to "nspawn"`}},
		{name: "fallback drops options", pod: Pod{Namespace: "ci", HostNetwork: true}, stage1: "nspawn", rule: "ci",
			reasons: []string{`rule "ci"`, "falls back", `options memory=2G were for stage1 "kvm" and are dropped for "nspawn"`}},
		{name: "fallback satisfies the rest", pod: Pod{Namespace: "default", HostNetwork: true, HostIPC: true}, stage1: "nspawn"},
		{name: "operator refusal", pod: Pod{Namespace: "default", HostPID: true},
			class: errdefs.ErrInvalidArgument, by: "conflicts.host_pid",
			msg: []string{`stage1 "kvm" (chosen by default_stage1) declares no host PID namespace, which the pod needs (hostPID); conflicts.host_pid refuses: hostPID pods are not run here`}},
		{name: "unset refuses", pod: Pod{Namespace: "ci", HostIPC: true},
			class: errdefs.ErrInvalidArgument, by: "conflicts.host_ipc",
			msg: []string{`stage1 "kvm" (chosen by rule "ci") declares no host IPC namespace`, "conflicts.host_ipc is not set, so such pods are refused"}},
		{name: "handler asked for the impossible", pod: Pod{Namespace: "default", Handler: "kvm", HostNetwork: true},
			class: errdefs.ErrInvalidArgument, msg: []string{`runtime handler "kvm" asks for stage1 "kvm", which declares no host network`}},
		{name: "raise_only false lowers", pod: Pod{Namespace: "default", Annotations: ann(AnnotationStage1, "nspawn")}, stage1: "nspawn",
			reasons: []string{`lowered the stage1 from "kvm" to "nspawn"`}},
	})
}

func TestDecideNodeMismatch(t *testing.T) {
	only := map[string]caps.Capabilities{"fly": stage1Caps["fly"]}
	p := Default()
	_, err := p.Decide(Pod{Namespace: "default"}, only)
	if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), `stage1 "nspawn" (chosen by default_stage1) is not available on this node (available: fly)`) {
		t.Errorf("unregistered default: %v", err)
	}
	if d, err := p.Decide(Pod{Namespace: "kube-system", HostNetwork: true}, only); err != nil || d.Stage1 != "fly" {
		t.Errorf("fly pod on a fly-only node: %+v %v", d, err)
	}

	// A fallback that, on this node, cannot run the pod either.
	q := &Policy{Version: 1, DefaultStage1: "kvm", Conflicts: Conflicts{HostNetwork: &Conflict{Fallback: "kvm2"}}}
	two := map[string]caps.Capabilities{"kvm": stage1Caps["kvm"], "kvm2": stage1Caps["kvm"]}
	_, err = q.Decide(Pod{HostNetwork: true}, two)
	if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), `conflicts.host_network.fallback "kvm2" cannot run the pod either`) {
		t.Errorf("bad fallback: %v", err)
	}
	_, err = q.Decide(Pod{HostNetwork: true}, map[string]caps.Capabilities{"kvm": stage1Caps["kvm"]})
	if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), `fallback names stage1 "kvm2", which is not available`) {
		t.Errorf("missing fallback: %v", err)
	}
}

func TestDefaultPolicy(t *testing.T) {
	p := Default()
	if err := p.Validate(stage1Caps); err != nil {
		t.Fatalf("embedded default does not validate:\n%v", err)
	}
	if got := p.Handlers(); !reflect.DeepEqual(got, []string{"fly", "kvm", "nspawn"}) {
		t.Errorf("Handlers() = %v", got)
	}
	if p.Source != "embedded default" || p.DefaultStage1 != "nspawn" || !p.Annotations.raiseOnly() {
		t.Errorf("default: %+v", p)
	}
	if !reflect.DeepEqual(p.RuntimeHandlers["fly"].Namespaces, []string{"kube-system"}) {
		t.Errorf("fly handler not limited: %+v", p.RuntimeHandlers["fly"])
	}
	if b := DefaultYAML(); string(b) != string(defaultYAML) {
		t.Error("DefaultYAML differs from the embedded text")
	} else {
		b[0] = 0
		if defaultYAML[0] == 0 {
			t.Error("DefaultYAML returns the embedded slice itself")
		}
	}
	runDecide(t, p, []decideCase{
		{name: "default", pod: Pod{Namespace: "default"}, stage1: "nspawn"},
		{name: "system host network", pod: Pod{Namespace: "kube-system", HostNetwork: true}, stage1: "fly", rule: "system-host-network"},
		{name: "host network elsewhere", pod: Pod{Namespace: "monitoring", HostNetwork: true, HostPID: true}, stage1: "nspawn"},
		{name: "fly handler in kube-system", pod: Pod{Namespace: "kube-system", Handler: "fly"}, stage1: "fly"},
		{name: "fly handler elsewhere", pod: Pod{Namespace: "default", Handler: "fly"}, class: errdefs.ErrPermissionDenied,
			msg: []string{`runtime handler "fly" (handlers.fly → fly) is not allowed in namespace "default" (namespaces: kube-system)`}},
		{name: "kvm handler", pod: Pod{Namespace: "default", Handler: "kvm"}, stage1: "kvm"},
		{name: "empty handler means policy", pod: Pod{Namespace: "default", Handler: ""}, stage1: "nspawn"},
		{name: "annotation kvm", pod: Pod{Namespace: "default", Annotations: ann(AnnotationStage1, "kvm")}, stage1: "kvm"},
		{name: "annotation fly", pod: Pod{Namespace: "kube-system", Annotations: ann(AnnotationStage1, "fly")}, class: errdefs.ErrPermissionDenied,
			msg: []string{"annotations.allow"}},
		{name: "annotation lowers", pod: Pod{Namespace: "default", Handler: "kvm", Annotations: ann(AnnotationStage1, "nspawn")},
			class: errdefs.ErrPermissionDenied, msg: []string{"raise_only"}},
		{name: "hostNetwork VM", pod: Pod{Namespace: "default", HostNetwork: true, Annotations: ann(AnnotationStage1, "kvm")},
			class: errdefs.ErrInvalidArgument, msg: []string{"declares no host network"}},
	})
}

func TestExample(t *testing.T) {
	data, err := os.ReadFile("testdata/example.yaml")
	if err != nil {
		t.Fatal(err)
	}
	p := mustPolicy(t, "testdata/example.yaml", string(data))
	vm := map[string]string{"memory": "2048M", "vcpus": "2"}
	runDecide(t, p, []decideCase{
		{name: "ci runs in a VM", pod: Pod{Namespace: "ci"}, stage1: "kvm", rule: "ci-in-vms", options: vm},
		{name: "kube-system host network on the host", pod: Pod{Namespace: "kube-system", HostNetwork: true}, stage1: "fly", rule: "system-daemons-on-host"},
		{name: "kube-system otherwise", pod: Pod{Namespace: "kube-system"}, stage1: "nspawn"},
		{name: "everything else", pod: Pod{Namespace: "web"}, stage1: "nspawn"},
		{name: "raise to kvm", pod: Pod{Namespace: "web", Annotations: ann(AnnotationStage1, "kvm")}, stage1: "kvm"},
		{name: "rkt raise to kvm", pod: Pod{Namespace: "web", Annotations: ann(AnnotationRktStage1, "coreos.com/rkt/stage1-kvm:1.30.0")}, stage1: "kvm"},
		{name: "no nspawn by annotation", pod: Pod{Namespace: "web", Annotations: ann(AnnotationStage1, "nspawn")}, stage1: "nspawn",
			reasons: []string{"already gets"}},
		{name: "no fly by annotation", pod: Pod{Namespace: "web", Annotations: ann(AnnotationStage1, "fly")}, class: errdefs.ErrPermissionDenied,
			msg: []string{"annotations.allow does not allow", "(allowed: kvm)"}},
		{name: "privileged in ci", pod: Pod{Namespace: "ci", Privileged: true}, class: errdefs.ErrPermissionDenied,
			msg: []string{`refused by rule "no-privileged-in-ci": privileged pods do not run in ci`}},
		{name: "host network in ci", pod: Pod{Namespace: "ci", HostNetwork: true}, class: errdefs.ErrInvalidArgument,
			msg: []string{`stage1 "kvm" (chosen by rule "ci-in-vms") declares no host network`, "hostNetwork pods cannot run in a VM"}},
		{name: "ci cannot leave VMs by handler", pod: Pod{Namespace: "ci", Handler: "nspawn"}, class: errdefs.ErrPermissionDenied,
			msg: []string{`locked rule "ci-in-vms"`}},
		{name: "ci kvm handler", pod: Pod{Namespace: "ci", Handler: "kvm"}, stage1: "kvm", rule: "ci-in-vms", options: vm},
	})
}

func TestParseStage1Annotation(t *testing.T) {
	tests := []struct{ key, value, want string }{
		{AnnotationStage1, "kvm", "kvm"},
		{AnnotationStage1, "nspawn", "nspawn"},
		{AnnotationStage1, "coreos.com/rkt/stage1-kvm:1.30.0", ""},
		{AnnotationStage1, "", ""},
		{AnnotationRktStage1, "coreos.com/rkt/stage1-kvm:1.30.0", "kvm"},
		{AnnotationRktStage1, "coreos.com/rkt/stage1-coreos:1.30.0", "nspawn"},
		{AnnotationRktStage1, "coreos.com/rkt/stage1-fly", "fly"},
		{AnnotationRktStage1, "/usr/lib/rkt/stage1-images/stage1-kvm.aci", "kvm"},
		{AnnotationRktStage1, "coreos.com/rkt/stage1-src@sha512-abc", "nspawn"},
		{AnnotationRktStage1, "stage1-coreos", "nspawn"},
		{AnnotationRktStage1, "stage1-fly", "fly"},
		{AnnotationRktStage1, "stage1-kvm", "kvm"},
		{AnnotationRktStage1, "kvm", "kvm"},
		{AnnotationRktStage1, "coreos.com/rkt/stage1-qemu:1", ""},
		{AnnotationRktStage1, "", ""},
		{"example.com/other", "kvm", ""},
	}
	for _, tc := range tests {
		got, err := ParseStage1Annotation(tc.key, tc.value)
		if tc.want == "" {
			if err == nil || !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), tc.key) {
				t.Errorf("%s=%q: got %q, %v; want an InvalidArgument naming the annotation", tc.key, tc.value, got, err)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("%s=%q: got %q, %v; want %q", tc.key, tc.value, got, err, tc.want)
		}
	}
}

func TestExplain(t *testing.T) {
	p := mustPolicy(t, "rules.yaml", rulesPolicy)
	d, err := p.Decide(Pod{Namespace: "default", Labels: ann("accel", "gpu")}, stage1Caps)
	if err != nil {
		t.Fatal(err)
	}
	want := `stage1:  nspawn
rule:    gpu
options: devices=gpu
policy:  rules.yaml
why:
  1. rule "gpu" (match: not_namespaces [untrusted-*], labels accel=gpu) chose stage1 "nspawn"
`
	if got := p.Explain(d); got != want {
		t.Errorf("Explain:\n%s\nwant:\n%s", got, want)
	}
	_, err = p.Decide(Pod{Namespace: "default", Handler: "kvm", Annotations: ann(AnnotationStage1, "nspawn")}, stage1Caps)
	var r *Refusal
	if !errors.As(err, &r) {
		t.Fatalf("%v is not a *Refusal", err)
	}
	want = `refused: annotation stagelet.io/stage1="nspawn" requests stage1 "nspawn", which would lower isolation from "kvm" (level 2, chosen by runtime handler "kvm") to level 1; annotations.raise_only allows only raising
by:      annotations.raise_only
why:
  1. runtime handler "kvm" chose stage1 "kvm" (handlers.kvm)
`
	if got := r.Explain(); got != want {
		t.Errorf("Refusal.Explain:\n%s\nwant:\n%s", got, want)
	}
}

func TestDecideDoesNotModify(t *testing.T) {
	p := mustPolicy(t, "rules.yaml", rulesPolicy)
	d, err := p.Decide(Pod{Namespace: "untrusted-1"}, stage1Caps)
	if err != nil {
		t.Fatal(err)
	}
	d.Options["memory"] = "1T"
	if p.Rules[5].Options["memory"] != "1024M" {
		t.Error("the decision's options alias the rule's")
	}
}

// TestDefaultPolicyHostNamespaces: with the capabilities the built-in
// stage1s declare (nspawn keeps its own PID and IPC namespaces), the
// embedded default runs every pod admission let through on the most
// isolated stage1 that gives it what it asks for, says so in the reasons,
// and annotations still never lower isolation.
func TestDefaultPolicyHostNamespaces(t *testing.T) {
	real := map[string]caps.Capabilities{
		"fly":    {Isolation: caps.IsolationHost, HostNetwork: true, PodNetwork: true, HostPID: true, HostIPC: true, Privileged: "host"},
		"nspawn": {Isolation: caps.IsolationNamespaces, HostNetwork: true, PodNetwork: true, Privileged: "pod", UserNamespaces: true},
		"kvm":    {Isolation: caps.IsolationKernel, KernelIsolated: true, PodNetwork: true, Privileged: "guest", UserNamespaces: true},
	}
	p := Default()
	if err := p.Validate(real); err != nil {
		t.Fatalf("embedded default does not validate:\n%v", err)
	}
	fellBack := func(what string) []string {
		return []string{`stage1 "nspawn" declares no ` + what + `, which the pod needs; conflicts.`}
	}
	runDecideCaps(t, p, real, []decideCase{
		{name: "hostPID", pod: Pod{Namespace: "monitoring", HostPID: true}, stage1: "fly", reasons: fellBack("host PID namespace")},
		{name: "hostIPC", pod: Pod{Namespace: "default", HostIPC: true}, stage1: "fly", reasons: fellBack("host IPC namespace")},
		{name: "hostPID and hostNetwork", pod: Pod{Namespace: "default", HostPID: true, HostNetwork: true}, stage1: "fly"},
		{name: "hostNetwork stays on nspawn", pod: Pod{Namespace: "default", HostNetwork: true}, stage1: "nspawn"},
		{name: "privileged hostPID", pod: Pod{Namespace: "default", HostPID: true, Privileged: true}, stage1: "fly"},
		{name: "ordinary pod", pod: Pod{Namespace: "default"}, stage1: "nspawn"},
		// hostUsers: false: a rule's fly gives way to nspawn; asking for
		// a stage1 without user namespaces is refused.
		{name: "userns pod a rule puts on fly", pod: Pod{Namespace: "kube-system", HostNetwork: true, UserNS: true}, stage1: "nspawn", rule: "system-host-network",
			reasons: []string{`stage1 "fly" declares no user namespace of its own, which the pod needs; conflicts.`}},
		{name: "userns pod", pod: Pod{Namespace: "default", UserNS: true}, stage1: "nspawn"},
		{name: "userns with the fly handler", pod: Pod{Namespace: "kube-system", Handler: "fly", UserNS: true},
			class: errdefs.ErrInvalidArgument, msg: []string{`runtime handler "fly" asks for stage1 "fly", which declares no user namespace of its own`}},
		{name: "userns with the kvm handler", pod: Pod{Namespace: "default", Handler: "kvm", UserNS: true}, stage1: "kvm"},
		// Asking for a stage1 that cannot share the namespace refuses,
		// never moves the pod elsewhere.
		{name: "hostPID with the kvm handler", pod: Pod{Namespace: "default", Handler: "kvm", HostPID: true},
			class: errdefs.ErrInvalidArgument, msg: []string{`runtime handler "kvm" asks for stage1 "kvm", which declares no host PID namespace`}},
		{name: "hostIPC with the nspawn handler", pod: Pod{Namespace: "default", Handler: "nspawn", HostIPC: true},
			class: errdefs.ErrInvalidArgument, msg: []string{"declares no host IPC namespace"}},
		{name: "hostPID raised to kvm by annotation", pod: Pod{Namespace: "default", HostPID: true, Annotations: ann(AnnotationStage1, "kvm")},
			class: errdefs.ErrInvalidArgument, msg: []string{"declares no host PID namespace"}},
		// Annotations alone never lower isolation: fly is not theirs to
		// ask for, with or without host namespaces.
		{name: "annotation asks fly", pod: Pod{Namespace: "default", Annotations: ann(AnnotationStage1, "fly")},
			class: errdefs.ErrPermissionDenied, msg: []string{"annotations.allow"}},
		{name: "annotation asks fly for a hostPID pod", pod: Pod{Namespace: "default", HostPID: true, Annotations: ann(AnnotationStage1, "fly")},
			class: errdefs.ErrPermissionDenied, msg: []string{"annotations.allow"}},
		{name: "fly handler outside kube-system", pod: Pod{Namespace: "default", Handler: "fly", HostPID: true},
			class: errdefs.ErrPermissionDenied, msg: []string{`not allowed in namespace "default"`}},
	})

	// kvm as the node's default (or a rule's stage1): a hostNetwork pod
	// goes to nspawn, the most isolated stage1 that shares the host's
	// network, unless it asked for kvm itself.
	vms := mustPolicy(t, "vms.yaml", strings.Replace(string(DefaultYAML()), "default_stage1: nspawn", "default_stage1: kvm", 1))
	runDecideCaps(t, vms, real, []decideCase{
		{name: "ordinary pod in a VM", pod: Pod{Namespace: "default"}, stage1: "kvm"},
		{name: "hostNetwork pod falls back to nspawn", pod: Pod{Namespace: "default", HostNetwork: true}, stage1: "nspawn",
			reasons: []string{`default_stage1 is "kvm"`, `stage1 "kvm" declares no host network, which the pod needs; conflicts.host_network falls back to "nspawn"`}},
		{name: "system host network", pod: Pod{Namespace: "kube-system", HostNetwork: true}, stage1: "fly", rule: "system-host-network"},
		{name: "hostPID pod", pod: Pod{Namespace: "default", HostPID: true}, stage1: "fly"},
		{name: "hostNetwork with the kvm handler", pod: Pod{Namespace: "default", Handler: "kvm", HostNetwork: true},
			class: errdefs.ErrInvalidArgument, msg: []string{`runtime handler "kvm" asks for stage1 "kvm", which declares no host network`}},
	})

	// The operator can still refuse such pods with a rule of their own.
	strict := mustPolicy(t, "strict.yaml", strings.Replace(string(DefaultYAML()), "\nrules:\n", `
rules:
  - name: no-host-pid
    match: {host_pid: true}
    refuse: "hostPID pods are not allowed on this node"
`, 1))
	_, err := strict.Decide(Pod{Namespace: "default", HostPID: true}, real)
	if !errors.Is(err, errdefs.ErrPermissionDenied) || !strings.Contains(err.Error(), "no-host-pid") {
		t.Errorf("operator's refusal: %v", err)
	}
}

// ChosenBy names what chose the stage1 a pod ends on: messages about a
// pod its stage1 cannot run cite it.
func TestDecisionChosenBy(t *testing.T) {
	p := mustPolicy(t, "chosen.yaml", `
version: 1
default_stage1: nspawn
handlers:
  kvm: {stage1: kvm}
rules:
  - name: tenant-vms
    match: {namespaces: [tenant-a]}
    stage1: kvm
annotations:
  allow: [kvm]
conflicts:
  host_network: {fallback: nspawn}
`)
	for _, tt := range []struct {
		pod  Pod
		want string
	}{
		{Pod{Namespace: "default"}, "default_stage1"},
		{Pod{Namespace: "tenant-a"}, `rule "tenant-vms"`},
		{Pod{Namespace: "default", Handler: "kvm"}, `runtime handler "kvm"`},
		{Pod{Namespace: "default", Annotations: ann(AnnotationStage1, "kvm")}, `annotation stagelet.io/stage1="kvm"`},
		{Pod{Namespace: "tenant-a", HostNetwork: true}, "conflicts.host_network"},
	} {
		d, err := p.Decide(tt.pod, stage1Caps)
		if err != nil || d.ChosenBy != tt.want {
			t.Errorf("%+v: chosen by %q (%v), want %q", tt.pod, d.ChosenBy, err, tt.want)
		}
	}
}
