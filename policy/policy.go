package policy

import (
	"bytes"
	_ "embed"
	"sort"
)

// Version is the policy format version this build reads.
const Version = 1

// The pod annotations through which a pod may request a stage1, within the
// policy's annotations section.
const (
	// AnnotationStage1 takes a stage1 name: "kvm".
	AnnotationStage1 = "stagelet.io/stage1"
	// AnnotationRktStage1 is rktnetes' key. It takes a rkt stage1 image
	// ("coreos.com/rkt/stage1-kvm:1.30.0", "stage1-coreos", "stage1-fly")
	// or a stage1 name.
	AnnotationRktStage1 = "rkt.alpha.kubernetes.io/stage1-name-override"
)

// Policy is the operator's isolation policy: the `policy:` section of the
// node config, or a file of its own. The yaml tags document the format; it
// is decoded strictly by Parse and UnmarshalYAML, never by reflection.
//
// A Policy is not modified by Decide and may be shared between goroutines
// once decoded.
type Policy struct {
	// Version must be 1.
	Version int `yaml:"version"`
	// DefaultStage1 is the stage1 of pods no handler and no rule decides.
	DefaultStage1 string `yaml:"default_stage1"`
	// RuntimeHandlers maps RuntimeClass handler names to stage1s.
	RuntimeHandlers map[string]Handler `yaml:"handlers"`
	// Rules are tried in order; see the package documentation.
	Rules []Rule `yaml:"rules"`
	// Annotations says which stage1s a pod annotation may request.
	Annotations Annotations `yaml:"annotations"`
	// Conflicts says what happens to a pod the chosen stage1 cannot run.
	Conflicts Conflicts `yaml:"conflicts"`

	// Source names where the policy came from (a path, "embedded default");
	// problems found by Validate name it as their file.
	Source string `yaml:"-"`

	// pos maps a key path ("rules[1].stage1") to where its value was.
	pos map[string]position
}

// Handler maps one RuntimeClass handler to a stage1.
type Handler struct {
	Stage1 string `yaml:"stage1"`
	// Namespaces, if set, limits the handler to pods in these namespaces
	// (exact names or globs such as "kube-*"). NotNamespaces excludes
	// namespaces. Pods elsewhere naming the handler are refused.
	Namespaces    []string `yaml:"namespaces"`
	NotNamespaces []string `yaml:"not_namespaces"`
	// Options are handed to the stage1 (e.g. memory, vcpus).
	Options map[string]string `yaml:"options"`
	// PrivilegedWithoutHostDevices: privileged containers of the
	// handler's pods do not get the host's devices (containerd's switch
	// of the same name); they may still use any device they are given.
	PrivilegedWithoutHostDevices bool `yaml:"privileged_without_host_devices"`
}

// Rule is one ordered rule: pods it matches get Stage1 (with Options), or
// are refused with the Refuse message. Exactly one of Stage1 and Refuse is
// set.
type Rule struct {
	// Name is cited by decisions and refusals; unique, required.
	Name    string            `yaml:"name"`
	Match   Match             `yaml:"match"`
	Stage1  string            `yaml:"stage1"`
	Options map[string]string `yaml:"options"`
	Refuse  string            `yaml:"refuse"`
	// Locked: neither an annotation nor a RuntimeClass handler can give a
	// pod this rule matches another stage1.
	Locked bool `yaml:"locked"`
}

// Match selects pods. Every condition set must hold; an empty Match
// matches every pod.
type Match struct {
	// Namespaces: the pod's namespace is one of these (names or globs).
	Namespaces []string `yaml:"namespaces"`
	// NotNamespaces: the pod's namespace is none of these.
	NotNamespaces []string `yaml:"not_namespaces"`
	// Labels and Annotations: the pod has each key with exactly this value.
	// Pod authors set both; see the package documentation.
	Labels      map[string]string `yaml:"labels"`
	Annotations map[string]string `yaml:"annotations"`
	// Privileged, HostNetwork, HostPID, HostIPC, UserNamespace: when set,
	// the pod's flag equals this value (UserNamespace: the pod runs in a
	// user namespace of its own, hostUsers: false).
	Privileged    *bool `yaml:"privileged"`
	HostNetwork   *bool `yaml:"host_network"`
	HostPID       *bool `yaml:"host_pid"`
	HostIPC       *bool `yaml:"host_ipc"`
	UserNamespace *bool `yaml:"user_namespace"`
}

// Annotations says which stage1s pods may request by annotation.
type Annotations struct {
	// Allow lists the stage1s an annotation may request. Empty: none.
	Allow []string `yaml:"allow"`
	// PerNamespace replaces Allow for matching namespaces (names or globs).
	// An exact name wins over globs; among globs the longest wins.
	PerNamespace map[string][]string `yaml:"per_namespace"`
	// RaiseOnly (default true): an annotation may only keep or raise the
	// isolation level of the stage1 the policy chose, never lower it.
	RaiseOnly *bool `yaml:"raise_only"`
}

// Conflicts routes pods whose needs the chosen stage1's capabilities lack.
// A nil entry refuses such pods.
type Conflicts struct {
	HostNetwork *Conflict `yaml:"host_network"`
	HostPID     *Conflict `yaml:"host_pid"`
	HostIPC     *Conflict `yaml:"host_ipc"`
	// UserNamespace: a pod in a user namespace of its own (hostUsers:
	// false) on a stage1 that cannot give it one.
	UserNamespace *Conflict `yaml:"user_namespace"`
}

// Conflict is one route: a Fallback stage1, or a refusal with the
// operator's Refuse message. Exactly one is set.
type Conflict struct {
	Fallback string `yaml:"fallback"`
	Refuse   string `yaml:"refuse"`
}

//go:embed default.yaml
var defaultYAML []byte

// DefaultYAML returns the text of the embedded default policy.
func DefaultYAML() []byte { return bytes.Clone(defaultYAML) }

// Default returns the embedded default policy, decoded and statically
// checked; Source is "embedded default". Each call returns a new Policy.
// It panics if the embedded file is broken (a build defect the tests catch).
func Default() *Policy {
	p, err := Parse("embedded default", defaultYAML)
	if err != nil {
		panic("policy: embedded default is invalid: " + err.Error())
	}
	return p
}

// Handlers returns the configured RuntimeClass handler names, sorted, for
// the CRI Status call.
func (p *Policy) Handlers() []string {
	names := make([]string, 0, len(p.RuntimeHandlers))
	for n := range p.RuntimeHandlers {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// raiseOnly reports the effective raise_only setting (default true).
func (a *Annotations) raiseOnly() bool { return a.RaiseOnly == nil || *a.RaiseOnly }
