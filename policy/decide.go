package policy

import (
	"fmt"
	"maps"
	"sort"
	"strings"

	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/stage1/caps"
)

// Pod is what the policy knows of a pod when it decides.
type Pod struct {
	// Handler is the CRI runtime_handler (the RuntimeClass handler); ""
	// lets the policy decide.
	Handler     string
	Namespace   string
	Labels      map[string]string
	Annotations map[string]string
	// Privileged: any container of the pod is privileged (at sandbox time,
	// the sandbox's security context).
	Privileged  bool
	HostNetwork bool
	HostPID     bool
	HostIPC     bool
	// UserNS: the pod runs in a user namespace of its own (hostUsers:
	// false).
	UserNS bool
}

// Decision is the stage1 a pod gets, and why.
type Decision struct {
	Stage1 string `json:"stage1"`
	// Options are for the stage1 (e.g. memory, vcpus), from the handler or
	// rule that chose it; nil when none.
	Options map[string]string `json:"options,omitempty"`
	// Reasons say, in order, which handler, rule or default chose, which
	// annotation changed it, what was overridden, and capability fallbacks.
	Reasons []string `json:"reasons"`
	// Rule is the name of the rule that chose the base stage1, "" if none.
	Rule string `json:"rule,omitempty"`
	// ChosenBy names what chose Stage1 in the end, for messages about
	// the pod on it: `rule "x"`, `runtime handler "kvm"`,
	// "default_stage1", `annotation stagelet.io/stage1="kvm"`,
	// "conflicts.host_pid".
	ChosenBy string `json:"chosenBy,omitempty"`
	// PrivilegedWithoutHostDevices is the pod's runtime handler's switch.
	PrivilegedWithoutHostDevices bool `json:"privilegedWithoutHostDevices,omitempty"`
}

// Refusal is the error Decide returns. It unwraps to an errdefs class:
// errdefs.ErrPermissionDenied (the policy forbids it), ErrInvalidArgument
// (the request is malformed or impossible), or ErrFailedPrecondition (the
// chosen stage1 is not registered on this node).
type Refusal struct {
	// By names what refused: `rule "x"`, "handlers.fly",
	// "annotations.allow", "conflicts.host_network", ...
	By string
	// Rule is the name of the rule that refused or was in force, "" if none.
	Rule string
	// Reasons are the steps decided before the refusal.
	Reasons []string

	err error
}

// Error is the message for the pod's author or operator.
func (r *Refusal) Error() string { return r.err.Error() }

// Unwrap returns the classed error (errdefs.New).
func (r *Refusal) Unwrap() error { return r.err }

// Explain renders the refusal and the steps before it, for people.
func (r *Refusal) Explain() string {
	var b strings.Builder
	fmt.Fprintf(&b, "refused: %s\n", r.err)
	if r.By != "" {
		fmt.Fprintf(&b, "by:      %s\n", r.By)
	}
	writeReasons(&b, r.Reasons)
	return b.String()
}

// Explain renders a decision for people: the stage1, the rule, the options
// and each reason.
func (p *Policy) Explain(d Decision) string {
	var b strings.Builder
	fmt.Fprintf(&b, "stage1:  %s\n", d.Stage1)
	if d.Rule != "" {
		fmt.Fprintf(&b, "rule:    %s\n", d.Rule)
	}
	if len(d.Options) > 0 {
		fmt.Fprintf(&b, "options: %s\n", formatOptions(d.Options))
	}
	if p.Source != "" {
		fmt.Fprintf(&b, "policy:  %s\n", p.Source)
	}
	writeReasons(&b, d.Reasons)
	return b.String()
}

func writeReasons(b *strings.Builder, reasons []string) {
	if len(reasons) == 0 {
		return
	}
	b.WriteString("why:\n")
	for i, r := range reasons {
		fmt.Fprintf(b, "  %d. %s\n", i+1, r)
	}
}

func formatOptions(o map[string]string) string {
	keys := make([]string, 0, len(o))
	for k := range o {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for i, k := range keys {
		keys[i] = k + "=" + o[k]
	}
	return strings.Join(keys, ", ")
}

// decision carries the state of one Decide call.
type decision struct {
	Decision
	locked *Rule  // the matching locked rule, if any
	chosen string // what chose the current stage1, for messages
	asked  bool   // the pod itself asked for the current stage1 (handler or annotation)
}

func (d *decision) refuse(class error, by, rule, format string, args ...any) error {
	return &Refusal{By: by, Rule: rule, Reasons: d.Reasons, err: errdefs.New(class, format, args...)}
}

func (d *decision) because(format string, args ...any) {
	d.Reasons = append(d.Reasons, fmt.Sprintf(format, args...))
}

// Decide chooses the stage1 for pod, given the stage1s registered on this
// node (name → declared capabilities). It is pure: no I/O, p and the
// arguments are not modified, and it is safe for concurrent use.
//
// Precedence (see the package documentation): a matching refuse rule
// refuses; else the handler, if named, chooses (refused if unknown, outside
// its namespaces, or against a locked rule); else the first matching rule;
// else default_stage1. Then an annotation may change the stage1 within the
// allow-list, raise_only and locked rules. Last, the stage1's capabilities
// are checked against the pod's host namespaces and conflicts applies.
//
// On success the Decision names the stage1 and every reason. On failure it
// returns a zero Decision and a *Refusal whose class is
// errdefs.ErrPermissionDenied (a rule, handler limit, allow-list, lock or
// raise_only refused), errdefs.ErrInvalidArgument (unknown handler,
// unparseable annotation, or a capability the stage1 lacks), or
// errdefs.ErrFailedPrecondition (the stage1 is not registered); the message
// names the rule, handler mapping, allow-list or conflict setting.
func (p *Policy) Decide(pod Pod, declared map[string]caps.Capabilities) (Decision, error) {
	d := &decision{}

	// 1. Refuse rules refuse, wherever they are in the list.
	var rule *Rule
	for i := range p.Rules {
		r := &p.Rules[i]
		if !r.Match.matches(pod) {
			continue
		}
		if r.Refuse != "" {
			return Decision{}, d.refuse(errdefs.ErrPermissionDenied, fmt.Sprintf("rule %q", r.Name), r.Name,
				"refused by rule %q: %s", r.Name, r.Refuse)
		}
		if rule == nil {
			rule = r
		}
	}
	if rule != nil && rule.Locked {
		d.locked = rule
	}

	// 2. The base stage1: handler, else first rule, else default.
	switch {
	case pod.Handler != "":
		if err := p.byHandler(d, pod, rule); err != nil {
			return Decision{}, err
		}
	case rule != nil:
		d.Stage1, d.Options, d.Rule = rule.Stage1, cloneOptions(rule.Options), rule.Name
		d.chosen = fmt.Sprintf("rule %q", rule.Name)
		d.because("rule %q (%s) chose stage1 %q", rule.Name, rule.Match.describe(), rule.Stage1)
	default:
		if p.DefaultStage1 == "" {
			return Decision{}, d.refuse(errdefs.ErrFailedPrecondition, "default_stage1", "", "no rule matched and the policy sets no default_stage1")
		}
		d.Stage1, d.chosen = p.DefaultStage1, "default_stage1"
		d.because("no rule matched; default_stage1 is %q", p.DefaultStage1)
	}
	if _, ok := declared[d.Stage1]; !ok {
		return Decision{}, d.refuse(errdefs.ErrFailedPrecondition, d.chosen, d.Rule,
			"stage1 %q (chosen by %s) is not available on this node (available: %s)", d.Stage1, d.chosen, listOrNone(sortedKeys(declared)))
	}

	// 3. A pod annotation may change it, within the operator's limits.
	if err := p.annotation(d, pod, declared); err != nil {
		return Decision{}, err
	}

	// 4. Capabilities: what the pod needs against what the stage1 declares.
	if err := p.meetNeeds(d, pod, declared); err != nil {
		return Decision{}, err
	}
	d.ChosenBy = d.chosen
	return d.Decision, nil
}

// byHandler decides by the pod's runtime handler: refused when the node
// has no such handler, the pod's namespace may not use it, or a locked
// rule gives the pod another stage1.
func (p *Policy) byHandler(d *decision, pod Pod, rule *Rule) error {
	h, ok := p.RuntimeHandlers[pod.Handler]
	if !ok {
		return d.refuse(errdefs.ErrInvalidArgument, "handlers", "",
			"runtime handler %q is not configured on this node (handlers: %s)", pod.Handler, listOrNone(p.Handlers()))
	}
	by := "handlers." + pod.Handler
	if !namespaceIn(pod.Namespace, h.Namespaces, h.NotNamespaces) {
		return d.refuse(errdefs.ErrPermissionDenied, by, "",
			"runtime handler %q (%s → %s) is not allowed in namespace %q (%s)",
			pod.Handler, by, h.Stage1, pod.Namespace, describeNamespaces(h.Namespaces, h.NotNamespaces))
	}
	if d.locked != nil && d.locked.Stage1 != h.Stage1 {
		return d.refuse(errdefs.ErrPermissionDenied, fmt.Sprintf("rule %q", d.locked.Name), d.locked.Name,
			"runtime handler %q (%s → %s) cannot override locked rule %q, which gives this pod stage1 %q",
			pod.Handler, by, h.Stage1, d.locked.Name, d.locked.Stage1)
	}
	d.chosen, d.asked = fmt.Sprintf("runtime handler %q", pod.Handler), true
	d.PrivilegedWithoutHostDevices = h.PrivilegedWithoutHostDevices
	if d.locked != nil {
		// The locked rule decides, options included; the handler agrees.
		d.Stage1, d.Options, d.Rule = rule.Stage1, cloneOptions(rule.Options), rule.Name
		d.because("runtime handler %q (%s) asks for stage1 %q, which locked rule %q (%s) gives anyway",
			pod.Handler, by, h.Stage1, rule.Name, rule.Match.describe())
		return nil
	}
	d.Stage1, d.Options = h.Stage1, cloneOptions(h.Options)
	d.because("runtime handler %q chose stage1 %q (%s)", pod.Handler, h.Stage1, by)
	if rule != nil && rule.Stage1 != h.Stage1 {
		d.because("rule %q (stage1 %q) also matched; the runtime handler takes precedence", rule.Name, rule.Stage1)
	}
	return nil
}

// meetNeeds checks what the pod needs against what d's stage1 declares,
// following the conflicts' fallbacks (each stage1 once) or refusing.
func (p *Policy) meetNeeds(d *decision, pod Pod, declared map[string]caps.Capabilities) error {
	tried := map[string]bool{d.Stage1: true}
	for {
		c := declared[d.Stage1]
		missing := -1
		for i, n := range needs {
			if n.pod(pod) && !n.met(c) {
				missing = i
				break
			}
		}
		if missing < 0 {
			break
		}
		n := needs[missing]
		key := "conflicts." + n.key
		if d.asked {
			return d.refuse(errdefs.ErrInvalidArgument, d.chosen, d.Rule,
				"%s asks for stage1 %q, which declares no %s; the pod sets %s", d.chosen, d.Stage1, n.what, podFlag(n.key))
		}
		route := n.conf(&p.Conflicts)
		if route == nil || route.Fallback == "" {
			msg := fmt.Sprintf("stage1 %q (chosen by %s) declares no %s, which the pod needs (%s); ", d.Stage1, d.chosen, n.what, podFlag(n.key))
			if route != nil && route.Refuse != "" {
				msg += fmt.Sprintf("%s refuses: %s", key, route.Refuse)
			} else {
				msg += fmt.Sprintf("%s is not set, so such pods are refused", key)
			}
			return d.refuse(errdefs.ErrInvalidArgument, key, d.Rule, "%s", msg)
		}
		fc, ok := declared[route.Fallback]
		if !ok {
			return d.refuse(errdefs.ErrFailedPrecondition, key, d.Rule,
				"%s.fallback names stage1 %q, which is not available on this node (available: %s)", key, route.Fallback, listOrNone(sortedKeys(declared)))
		}
		if tried[route.Fallback] || !n.met(fc) {
			return d.refuse(errdefs.ErrInvalidArgument, key, d.Rule,
				"stage1 %q declares no %s, which the pod needs (%s), and %s.fallback %q cannot run the pod either", d.Stage1, n.what, podFlag(n.key), key, route.Fallback)
		}
		tried[route.Fallback] = true
		d.because("stage1 %q declares no %s, which the pod needs; %s falls back to %q", d.Stage1, n.what, key, route.Fallback)
		d.dropOptions(route.Fallback)
		d.Stage1, d.chosen = route.Fallback, key
	}
	return nil
}

// annotation applies the pod's stage1 annotation, if any, to d.
func (p *Policy) annotation(d *decision, pod Pod, declared map[string]caps.Capabilities) error {
	req, key, value, err := requestedStage1(pod.Annotations)
	if err != nil {
		return d.refuse(errdefs.ErrInvalidArgument, "annotation "+key, d.Rule, "%v", err)
	}
	if req == "" {
		return nil
	}
	ann := fmt.Sprintf("annotation %s=%q", key, value)
	if req == d.Stage1 {
		// Asking for what the policy gives anyway changes nothing.
		d.because("%s requests stage1 %q, which the pod already gets", ann, req)
		return nil
	}
	allowed, list := p.allowFor(pod.Namespace)
	if !contains(allowed, req) {
		return d.refuse(errdefs.ErrPermissionDenied, list, d.Rule,
			"%s requests stage1 %q, which %s does not allow in namespace %q (allowed: %s)", ann, req, list, pod.Namespace, listOrNone(allowed))
	}
	if d.locked != nil {
		return d.refuse(errdefs.ErrPermissionDenied, fmt.Sprintf("rule %q", d.locked.Name), d.locked.Name,
			"%s requests stage1 %q, but rule %q is locked: annotations cannot override it (it gives %q)", ann, req, d.locked.Name, d.locked.Stage1)
	}
	rc, ok := declared[req]
	if !ok {
		return d.refuse(errdefs.ErrFailedPrecondition, ann, d.Rule,
			"%s requests stage1 %q, which is not available on this node (available: %s)", ann, req, listOrNone(sortedKeys(declared)))
	}
	bc := declared[d.Stage1]
	verb := "changed"
	switch {
	case rc.Isolation > bc.Isolation:
		verb = "raised"
	case rc.Isolation < bc.Isolation && p.Annotations.raiseOnly():
		return d.refuse(errdefs.ErrPermissionDenied, "annotations.raise_only", d.Rule,
			"%s requests stage1 %q, which would lower isolation from %q (level %d, chosen by %s) to level %d; annotations.raise_only allows only raising",
			ann, req, d.Stage1, bc.Isolation, d.chosen, rc.Isolation)
	case rc.Isolation < bc.Isolation:
		verb = "lowered"
	}
	d.because("%s %s the stage1 from %q to %q (allowed by %s)", ann, verb, d.Stage1, req, list)
	d.dropOptions(req)
	d.Stage1, d.chosen, d.asked = req, ann, true
	return nil
}

// dropOptions forgets options meant for the stage1 being replaced.
func (d *decision) dropOptions(next string) {
	if len(d.Options) > 0 {
		d.because("options %s were for stage1 %q and are dropped for %q", formatOptions(d.Options), d.Stage1, next)
		d.Options = nil
	}
}

// allowFor returns the stage1s annotations may request in ns, and the name
// of the list that says so.
func (p *Policy) allowFor(ns string) ([]string, string) {
	a := &p.Annotations
	if l, ok := a.PerNamespace[ns]; ok && !hasMeta(ns) {
		return l, fmt.Sprintf("annotations.per_namespace[%q]", ns)
	}
	best := ""
	found := false
	for pat := range a.PerNamespace {
		if !hasMeta(pat) || !globMatch(pat, ns) {
			continue
		}
		if !found || len(pat) > len(best) || (len(pat) == len(best) && pat < best) {
			best, found = pat, true
		}
	}
	if found {
		return a.PerNamespace[best], fmt.Sprintf("annotations.per_namespace[%q]", best)
	}
	return a.Allow, "annotations.allow"
}

// requestedStage1 reads the pod's stage1 annotations. It returns the
// requested stage1 ("" if none), the key and value that asked, or an error
// (unparseable value, or the two keys disagreeing) naming the annotation.
func requestedStage1(ann map[string]string) (name, key, value string, err error) {
	v1, ok1 := ann[AnnotationStage1]
	v2, ok2 := ann[AnnotationRktStage1]
	var n1, n2 string
	if ok1 {
		if n1, err = ParseStage1Annotation(AnnotationStage1, v1); err != nil {
			return "", AnnotationStage1, v1, err
		}
	}
	if ok2 {
		if n2, err = ParseStage1Annotation(AnnotationRktStage1, v2); err != nil {
			return "", AnnotationRktStage1, v2, err
		}
	}
	switch {
	case ok1 && ok2 && n1 != n2:
		return "", AnnotationStage1, v1, fmt.Errorf("annotations %s=%q and %s=%q request different stage1s", AnnotationStage1, v1, AnnotationRktStage1, v2)
	case ok1:
		return n1, AnnotationStage1, v1, nil
	case ok2:
		return n2, AnnotationRktStage1, v2, nil
	}
	return "", "", "", nil
}

// rktFlavors maps rkt's stage1 image names to stagelet stage1s: rkt's
// systemd-nspawn flavors (coreos, src, host) to nspawn.
var rktFlavors = map[string]string{
	"stage1-coreos": "nspawn",
	"stage1-src":    "nspawn",
	"stage1-host":   "nspawn",
	"stage1-fly":    "fly",
	"stage1-kvm":    "kvm",
}

// ParseStage1Annotation returns the stage1 name a stage1 annotation
// requests. AnnotationStage1 takes a stage1 name. AnnotationRktStage1 takes
// a stage1 name or a rkt stage1 image, with optional path, version and
// ".aci": "coreos.com/rkt/stage1-kvm:1.30.0" → "kvm", "stage1-coreos" →
// "nspawn", "stage1-fly" → "fly". Anything else is an error of class
// errdefs.ErrInvalidArgument naming the annotation. It does not check that
// the policy allows the stage1 or that the node has it.
func ParseStage1Annotation(key, value string) (string, error) {
	bad := func(why string) (string, error) {
		return "", errdefs.New(errdefs.ErrInvalidArgument, "annotation %s=%q: %s", key, value, why)
	}
	switch key {
	case AnnotationStage1:
		if !dnsLabel.MatchString(value) {
			return bad("not a stage1 name")
		}
		return value, nil
	case AnnotationRktStage1:
		if dnsLabel.MatchString(value) {
			if s, ok := rktFlavors[value]; ok {
				return s, nil
			}
			return value, nil
		}
		img := value[strings.LastIndex(value, "/")+1:]
		img = strings.TrimSuffix(img, ".aci")
		if i := strings.IndexAny(img, ":@"); i >= 0 {
			img = img[:i]
		}
		if s, ok := rktFlavors[img]; ok {
			return s, nil
		}
		return bad("not a rkt stage1 image (stage1-coreos, stage1-fly, stage1-kvm) nor a stage1 name")
	}
	return bad("not a stage1 annotation")
}

func (m *Match) matches(pod Pod) bool {
	if len(m.Namespaces) > 0 || len(m.NotNamespaces) > 0 {
		if !namespaceIn(pod.Namespace, m.Namespaces, m.NotNamespaces) {
			return false
		}
	}
	for k, v := range m.Labels {
		if got, ok := pod.Labels[k]; !ok || got != v {
			return false
		}
	}
	for k, v := range m.Annotations {
		if got, ok := pod.Annotations[k]; !ok || got != v {
			return false
		}
	}
	flag := func(want *bool, got bool) bool { return want == nil || *want == got }
	return flag(m.Privileged, pod.Privileged) && flag(m.HostNetwork, pod.HostNetwork) &&
		flag(m.HostPID, pod.HostPID) && flag(m.HostIPC, pod.HostIPC) && flag(m.UserNamespace, pod.UserNS)
}

// describe summarizes a match for reasons: "namespaces [ci], host_network".
func (m *Match) describe() string {
	var parts []string
	if len(m.Namespaces) > 0 {
		parts = append(parts, fmt.Sprintf("namespaces %v", m.Namespaces))
	}
	if len(m.NotNamespaces) > 0 {
		parts = append(parts, fmt.Sprintf("not_namespaces %v", m.NotNamespaces))
	}
	if len(m.Labels) > 0 {
		parts = append(parts, "labels "+formatOptions(m.Labels))
	}
	if len(m.Annotations) > 0 {
		parts = append(parts, "annotations "+formatOptions(m.Annotations))
	}
	for _, f := range []struct {
		name string
		v    *bool
	}{{"privileged", m.Privileged}, {"host_network", m.HostNetwork}, {"host_pid", m.HostPID}, {"host_ipc", m.HostIPC}, {"user_namespace", m.UserNamespace}} {
		if f.v != nil {
			parts = append(parts, fmt.Sprintf("%s=%t", f.name, *f.v))
		}
	}
	if len(parts) == 0 {
		return "every pod"
	}
	return "match: " + strings.Join(parts, ", ")
}

// namespaceIn: ns matches one of incl (or incl is empty) and none of excl.
func namespaceIn(ns string, incl, excl []string) bool {
	in := len(incl) == 0
	for _, pat := range incl {
		if globMatch(pat, ns) {
			in = true
			break
		}
	}
	if !in {
		return false
	}
	for _, pat := range excl {
		if globMatch(pat, ns) {
			return false
		}
	}
	return true
}

func describeNamespaces(incl, excl []string) string {
	var parts []string
	if len(incl) > 0 {
		parts = append(parts, "namespaces: "+strings.Join(incl, ", "))
	}
	if len(excl) > 0 {
		parts = append(parts, "not_namespaces: "+strings.Join(excl, ", "))
	}
	return strings.Join(parts, "; ")
}

func podFlag(key string) string {
	switch key {
	case "host_network":
		return "hostNetwork"
	case "host_pid":
		return "hostPID"
	case "host_ipc":
		return "hostIPC"
	case "user_namespace":
		return "hostUsers: false"
	}
	return key
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

func listOrNone(l []string) string {
	if len(l) == 0 {
		return "none"
	}
	return strings.Join(l, ", ")
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

func cloneOptions(o map[string]string) map[string]string {
	if len(o) == 0 {
		return nil
	}
	return maps.Clone(o)
}
