package policy

import (
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"

	"gopkg.in/yaml.v3"

	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/stage1/caps"
)

const head = "version: 1\ndefault_stage1: nspawn\n"

// TestParseProblems covers every problem Parse finds without the node's
// stage1s, each with its file:line:column.
func TestParseProblems(t *testing.T) {
	tests := []struct {
		name, yaml string
		want       []string // the problems, exactly, in order
	}{
		{"unknown top-level key", head + "rulez: []\n",
			[]string{`t.yaml:3:1: policy: unknown key "rulez" (known keys: annotations, conflicts, default_stage1, handlers, rules, version)`}},
		{"unknown nested key", head + "rules:\n  - name: a\n    match:\n      namespace: [ci]\n    stage1: kvm\n",
			[]string{`t.yaml:6:7: rules[0].match: unknown key "namespace" (known keys: annotations, host_ipc, host_network, host_pid, labels, namespaces, not_namespaces, privileged, user_namespace)`}},
		{"unknown handler key", head + "handlers:\n  kvm: {stage1: kvm, memory: 1G}\n",
			[]string{`t.yaml:4:22: handlers.kvm: unknown key "memory" (known keys: namespaces, not_namespaces, options, privileged_without_host_devices, stage1)`}},
		{"unknown conflict key", head + "conflicts:\n  host_network: {fallback: fly, fallbak: x}\n",
			[]string{`t.yaml:4:33: conflicts.host_network: unknown key "fallbak" (known keys: fallback, refuse)`}},
		{"wrong type int", "version: one\ndefault_stage1: nspawn\n",
			[]string{`t.yaml:1:10: version: want an integer, found str "one"`}},
		{"wrong type bool", head + "rules:\n  - name: a\n    match: {host_network: \"yes\"}\n    stage1: kvm\n",
			[]string{`t.yaml:5:27: rules[0].match.host_network: want true or false, found str "yes"`}},
		{"wrong type list", head + "rules: {a: 1}\n",
			[]string{`t.yaml:3:8: rules: want a list of rules, found a mapping`}},
		{"wrong type string", head + "annotations:\n  allow: [[kvm]]\n",
			[]string{`t.yaml:4:11: annotations.allow[0]: want a string, found a list`}},
		{"wrong type mapping", head + "rules:\n  - name: a\n    match: {labels: [a]}\n    stage1: kvm\n",
			[]string{`t.yaml:5:21: rules[0].match.labels: want a mapping, found a list`}},
		{"duplicate key", head + "version: 1\n",
			[]string{`t.yaml:3:1: version: duplicate key "version" (first at line 1)`}},
		{"merge key", head + "handlers:\n  kvm:\n    <<: {stage1: kvm}\n",
			[]string{`t.yaml:5:5: handlers.kvm: merge keys (<<) are not supported; write the keys out`}},
		{"syntax error", "version: 1\n  default_stage1: [\n",
			[]string{`t.yaml:2: mapping values are not allowed in this context`}},
		{"two documents", head + "---\nversion: 1\n",
			[]string{`t.yaml:3:1: policy: a second YAML document; a policy file holds one`}},
		{"empty", "", []string{`t.yaml: policy: the file is empty`}},
		{"comments only", "# nothing\n", []string{`t.yaml: policy: the file is empty`}},
		{"not a mapping", "[1, 2]\n", []string{`t.yaml:1:1: policy: want a mapping, found a list`}},
		{"version", "version: 2\ndefault_stage1: nspawn\n",
			[]string{`t.yaml:1:10: version: 2 is not supported (this build reads version 1)`}},
		{"no version", "default_stage1: nspawn\n", []string{`t.yaml:1:1: version: missing; this build reads version 1`}},
		{"no default", "version: 1\n", []string{`t.yaml:1:1: default_stage1: must be set`}},
		{"bad stage1 name", "version: 1\ndefault_stage1: Nspawn\n",
			[]string{`t.yaml:2:17: default_stage1: "Nspawn" is not a stage1 name (lowercase letters, digits and '-')`}},
		{"unreachable", head + "rules:\n  - name: all\n    stage1: kvm\n  - name: late\n    match: {namespaces: [ci]}\n    stage1: nspawn\n",
			[]string{`t.yaml:6:5: rules[1] ("late"): unreachable: rule "all" (line 4) before it matches every pod`}},
		{"unreachable after star", head + "rules:\n  - name: all\n    match: {namespaces: [\"*\"]}\n    refuse: closed\n  - name: late\n    refuse: x\n",
			[]string{`t.yaml:7:5: rules[1] ("late"): unreachable: rule "all" (line 4) before it matches every pod`}},
		{"duplicate rule name", head + "rules:\n  - name: a\n    match: {namespaces: [ci]}\n    stage1: kvm\n  - name: a\n    match: {namespaces: [cd]}\n    stage1: kvm\n",
			[]string{`t.yaml:7:11: rules[1] ("a"): duplicate rule name "a" (first at line 4)`}},
		{"rule without name", head + "rules:\n  - match: {namespaces: [ci]}\n    stage1: kvm\n",
			[]string{`t.yaml:4:5: rules[0]: name: must be set (decisions and refusals cite it)`}},
		{"contradictory namespaces", head + "rules:\n  - name: a\n    match: {namespaces: [ci, web], not_namespaces: [\"c*\"]}\n    stage1: kvm\n",
			[]string{`t.yaml:5:26: rules[0].match: namespace "ci" is both included (namespaces) and excluded (not_namespaces: "c*")`}},
		{"same glob included and excluded", head + "handlers:\n  fly: {stage1: fly, namespaces: [\"kube-*\"], not_namespaces: [\"kube-*\"]}\n",
			[]string{`t.yaml:4:35: handlers.fly: namespace "kube-*" is both included (namespaces) and excluded (not_namespaces: "kube-*")`}},
		{"stage1 and refuse", head + "rules:\n  - name: a\n    match: {namespaces: [ci]}\n    stage1: kvm\n    refuse: no\n",
			[]string{`t.yaml:7:13: rules[0] ("a"): set stage1 or refuse, not both`}},
		{"neither stage1 nor refuse", head + "rules:\n  - name: b\n    match: {namespaces: [cd]}\n",
			[]string{`t.yaml:4:5: rules[0] ("b"): set stage1 (where matching pods go) or refuse (a message for them)`}},
		{"refuse rule extras", head + "rules:\n  - name: a\n    match: {namespaces: [\"ci-[\"], not_namespaces: [\"*\"]}\n    refuse: x\n    locked: true\n    options: {a: b}\n",
			[]string{
				`t.yaml:5:26: rules[0].match.namespaces[0]: "ci-[" is not a valid glob (use *, ? and [a-z])`,
				`t.yaml:5:52: rules[0].match.not_namespaces[0]: "*" excludes every namespace: nothing can match`,
				`t.yaml:7:13: rules[0] ("a"): locked means nothing on a refuse rule (a refusal is never overridden)`,
				`t.yaml:8:14: rules[0] ("a"): options mean nothing on a refuse rule`,
			}},
		{"bad namespace", head + "rules:\n  - name: a\n    match: {namespaces: [Kube_System]}\n    stage1: kvm\n",
			[]string{`t.yaml:5:26: rules[0].match.namespaces[0]: "Kube_System" is not a namespace name (a DNS label) nor a glob`}},
		{"bad handler", head + "handlers:\n  Fly: {stage1: fly}\n  x: {}\n",
			[]string{
				`t.yaml:4:3: handlers: "Fly" is not a RuntimeClass handler name (a DNS label: lowercase letters, digits and '-', at most 63)`,
				`t.yaml:5:6: handlers.x.stage1: must name a stage1`,
			}},
		{"empty handler", head + "handlers:\n  \"\": {stage1: fly}\n",
			[]string{`t.yaml:4:3: handlers: the empty handler cannot be mapped: it means the policy decides`}},
		{"bad per_namespace", head + "annotations:\n  per_namespace:\n    \"[\": [kvm]\n    Ci: [kvm]\n",
			[]string{
				`t.yaml:5:5: annotations.per_namespace: "[" is not a namespace name nor a valid glob`,
				`t.yaml:6:5: annotations.per_namespace: "Ci" is not a namespace name nor a valid glob`,
			}},
		{"conflict both and neither", head + "conflicts:\n  host_network: {fallback: fly, refuse: x}\n  host_pid: {}\n",
			[]string{
				`t.yaml:4:17: conflicts.host_network: set fallback or refuse, not both`,
				`t.yaml:5:13: conflicts.host_pid: set fallback (a stage1) or refuse (a message)`,
			}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p, err := Parse("t.yaml", []byte(tc.yaml))
			if err == nil {
				t.Fatalf("parsed: %+v", p)
			}
			if p != nil {
				t.Errorf("a policy with an error")
			}
			if !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Errorf("%v is not InvalidArgument", err)
			}
			if got := strings.Split(err.Error(), "\n"); !reflect.DeepEqual(got, tc.want) {
				t.Errorf("got\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(tc.want, "\n"))
			}
		})
	}
}

// TestValidateProblems covers the problems that need the node's stage1s.
func TestValidateProblems(t *testing.T) {
	tests := []struct {
		name, yaml string
		want       []string
		unknown    bool // the problems are ErrUnknownStage1
	}{
		{"unknown default", "version: 1\ndefault_stage1: gvisor\n",
			[]string{`v.yaml:2:17: default_stage1: unknown stage1 "gvisor" (this node has: fly, kvm, nspawn)`}, true},
		{"handler to unknown stage1", head + "handlers:\n  runsc: {stage1: gvisor}\n",
			[]string{`v.yaml:4:19: handlers.runsc.stage1: unknown stage1 "gvisor" (this node has: fly, kvm, nspawn)`}, true},
		{"rule to unknown stage1", head + "rules:\n  - name: a\n    match: {namespaces: [ci]}\n    stage1: firecracker\n",
			[]string{`v.yaml:6:13: rules[0].stage1: unknown stage1 "firecracker" (this node has: fly, kvm, nspawn)`}, true},
		{"allow unknown", head + "annotations:\n  allow: [kvm, qemu]\n  per_namespace:\n    ci: [xen]\n",
			[]string{
				`v.yaml:4:16: annotations.allow[1]: unknown stage1 "qemu" (this node has: fly, kvm, nspawn)`,
				`v.yaml:6:10: annotations.per_namespace.ci[0]: unknown stage1 "xen" (this node has: fly, kvm, nspawn)`,
			}, true},
		{"fallback unknown", head + "conflicts:\n  host_network: {fallback: host}\n",
			[]string{`v.yaml:4:28: conflicts.host_network.fallback: unknown stage1 "host" (this node has: fly, kvm, nspawn)`}, true},
		{"fallback lacks the capability", head + "conflicts:\n  host_network:\n    fallback: kvm\n",
			[]string{`v.yaml:5:15: conflicts.host_network.fallback: "kvm" declares no host network, so it cannot be the fallback for host_network`}, false},
		{"rule sends host pods to a VM", head + "rules:\n  - name: vm-daemons\n    match: {host_pid: true}\n    stage1: kvm\n",
			[]string{`v.yaml:6:13: rules[0] ("vm-daemons"): sends host_pid pods to "kvm", which declares no host PID namespace`}, false},
		{"misspelt option", head + "rules:\n  - name: tenant-vms\n    match: {namespaces: [tenant-a]}\n    stage1: kvm\n    options: {memroy: 2G, vcpus: \"2\"}\n",
			[]string{`v.yaml:7:15: rules[0] ("tenant-vms"): stage1 kvm: option "memroy": unknown (kvm takes: memory, vcpus)`}, false},
		{"bad option value", head + "handlers:\n  vm:\n    stage1: kvm\n    options:\n      vcpus: \"0\"\n      memory: lots\n",
			[]string{
				`v.yaml:7:14: handlers.vm: stage1 kvm: option "vcpus": value "0": want 1 to 64 (vcpus: the VM's vCPU count, 1 to 64)`,
				`v.yaml:8:15: handlers.vm: stage1 kvm: option "memory": value "lots": not a size (memory: the VM's memory: 512M, 2G)`,
			}, false},
		{"options for a stage1 that takes none", head + "handlers:\n  fly: {stage1: fly, options: {memory: 1G}}\nrules:\n  - name: hosty\n    match: {namespaces: [ops]}\n    stage1: fly\n    options: {cpus: \"1\"}\n",
			[]string{
				`v.yaml:4:32: handlers.fly: stage1 fly: option "memory": unknown (fly takes no options)`,
				`v.yaml:9:15: rules[0] ("hosty"): stage1 fly: option "cpus": unknown (fly takes no options)`,
			}, false},
		{"options of an unknown stage1 are not checked", head + "rules:\n  - name: a\n    match: {namespaces: [ci]}\n    stage1: gvisor\n    options: {platform: kvm}\n",
			[]string{`v.yaml:6:13: rules[0].stage1: unknown stage1 "gvisor" (this node has: fly, kvm, nspawn)`}, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p, err := Parse("v.yaml", []byte(tc.yaml))
			if err != nil {
				t.Fatalf("parse: %v", err)
			}
			err = p.Validate(stage1Caps)
			if err == nil {
				t.Fatal("validated")
			}
			if got := strings.Split(err.Error(), "\n"); !reflect.DeepEqual(got, tc.want) {
				t.Errorf("got\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(tc.want, "\n"))
			}
			if errors.Is(err, ErrUnknownStage1) != tc.unknown {
				t.Errorf("errors.Is(ErrUnknownStage1) = %v", !tc.unknown)
			}
			if !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Errorf("not InvalidArgument")
			}
		})
	}
}

// TestValidateUnregisteredDefault: the embedded default names stage1s a
// node may not have yet; the problems say so and nothing else.
func TestValidateUnregisteredDefault(t *testing.T) {
	err := Default().Validate(map[string]caps.Capabilities{"fly": stage1Caps["fly"]})
	var ps Problems
	if !errors.As(err, &ps) || len(ps) == 0 {
		t.Fatalf("err = %v", err)
	}
	for _, p := range ps {
		if !errors.Is(p, ErrUnknownStage1) || p.File != "embedded default" || p.Line == 0 {
			t.Errorf("problem %v: want an unknown stage1 with a position", p)
		}
	}
}

func TestAliases(t *testing.T) {
	p, err := Parse("a.yaml", []byte(head+`
handlers:
  fly: {stage1: fly, namespaces: &system [kube-system, kube-node-lease]}
rules:
  - name: system
    match: {namespaces: *system, host_network: true}
    stage1: fly
`))
	if err != nil {
		t.Fatal(err)
	}
	if got := p.Rules[0].Match.Namespaces; !reflect.DeepEqual(got, []string{"kube-system", "kube-node-lease"}) {
		t.Errorf("alias: %v", got)
	}

	// Aliases are expanded within a budget.
	text := head + "rules: [&r {name: a, stage1: kvm}" + strings.Repeat(", *r", maxAliases+1) + "]\n"
	_, err = Parse("many.yaml", []byte(text))
	if err == nil || !strings.Contains(err.Error(), fmt.Sprintf("rules[%d]: too many alias expansions (more than %d)", maxAliases+1, maxAliases)) {
		t.Errorf("alias budget: %.300v", err)
	}
}

// TestEmbedded decodes a policy as a section of another document, strictly,
// as the node config does.
func TestEmbedded(t *testing.T) {
	type nodeConfig struct {
		Version int     `yaml:"version"`
		Policy  *Policy `yaml:"policy"`
	}
	decode := func(text string, c *nodeConfig) error {
		dec := yaml.NewDecoder(strings.NewReader(text))
		dec.KnownFields(true)
		return dec.Decode(c)
	}
	c := nodeConfig{Policy: Default()}
	err := decode("version: 1\npolicy:\n  version: 1\n  default_stage1: kvm\n  rules:\n    - name: a\n      stage1: nspawn\n", &c)
	if err != nil {
		t.Fatal(err)
	}
	if c.Policy.DefaultStage1 != "kvm" || len(c.Policy.RuntimeHandlers) != 0 || len(c.Policy.Rules) != 1 || c.Policy.Annotations.Allow != nil {
		t.Errorf("the section did not replace the default: %+v", c.Policy)
	}
	c.Policy.Source = "node.yaml"
	if err := c.Policy.Validate(stage1Caps); err != nil {
		t.Errorf("validate: %v", err)
	}

	err = decode("version: 1\npolicy:\n  version: 1\n  default_stage1: kvm\n  handlers:\n    kvm: {stage1: kvm, vcpu: 2}\n", &nodeConfig{})
	if err == nil || err.Error() != `line 6, column 24: handlers.kvm: unknown key "vcpu" (known keys: namespaces, not_namespaces, options, privileged_without_host_devices, stage1)` {
		t.Errorf("embedded unknown key: %v", err)
	}
	var ps Problems
	if !errors.As(err, &ps) {
		t.Errorf("%T is not Problems", err)
	}

	c = nodeConfig{}
	if err := decode("version: 1\npolicy:\n  version: 1\n  default_stage1: gvisor\n", &c); err != nil {
		t.Fatal(err)
	}
	c.Policy.Source = "node.yaml"
	if err := c.Policy.Validate(stage1Caps); err == nil || !strings.HasPrefix(err.Error(), `node.yaml:4:19: default_stage1: unknown stage1 "gvisor"`) {
		t.Errorf("validate names the file: %v", err)
	}
}
