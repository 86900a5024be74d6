package policy

import (
	"fmt"
	"path"
	"regexp"
	"sort"
	"strings"

	"github.com/stagelet/stagelet/stage1/caps"
)

// Validate checks the policy against the stage1s registered on this node
// (name → declared capabilities) and returns Problems (class
// errdefs.ErrInvalidArgument), each naming Source:line:column when known, or
// nil. It finds: a version other than 1; unknown stage1 names (these also
// match ErrUnknownStage1); handlers mapping to unknown stage1s or with bad
// names; rules without a name, with a duplicate name, with both or neither of
// stage1 and refuse, after a rule that matches every pod (unreachable), with
// contradictory matchers (a namespace both included and excluded), or sending
// pods that need a host namespace to a stage1 that lacks it; options of a
// rule or handler that its stage1 does not declare (caps.Option), or whose
// value the option's check refuses; bad namespace globs; and conflict
// fallbacks that cannot satisfy the need they are the fallback for. It
// does not modify p.
func (p *Policy) Validate(known map[string]caps.Capabilities) error {
	return p.check(known, true)
}

type checker struct {
	p        *Policy
	known    map[string]caps.Capabilities
	withCaps bool
	probs    Problems
}

// check runs the checks; withCaps false skips those that need the node's
// stage1s (Parse and UnmarshalYAML run it so).
func (p *Policy) check(known map[string]caps.Capabilities, withCaps bool) error {
	c := &checker{p: p, known: known, withCaps: withCaps}
	c.version()
	c.defaultStage1()
	c.handlers()
	c.rules()
	c.annotations()
	c.conflicts()
	return c.probs.err()
}

// where returns the position recorded for path, or for its nearest parent.
func (c *checker) where(key string) position {
	for {
		if pos, ok := c.p.pos[key]; ok {
			return pos
		}
		i := strings.LastIndexAny(key, ".[")
		if i < 0 {
			if pos, ok := c.p.pos[""]; ok {
				return pos
			}
			return position{}
		}
		key = key[:i]
	}
}

func (c *checker) errf(key, format string, args ...any) {
	pos := c.where(key)
	c.probs = append(c.probs, Problem{File: c.p.Source, Line: pos.line, Column: pos.col, Msg: fmt.Sprintf(format, args...)})
}

func (c *checker) version() {
	switch c.p.Version {
	case Version:
	case 0:
		c.errf("version", "version: missing; this build reads version %d", Version)
	default:
		c.errf("version", "version: %d is not supported (this build reads version %d)", c.p.Version, Version)
	}
}

var dnsLabel = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$`)

// stage1 checks a stage1 name at key: its form always, and that the node
// has it when checking with capabilities. It reports whether the name is
// usable for capability checks.
func (c *checker) stage1(key, name string) bool {
	if name == "" {
		c.errf(key, "%s: must name a stage1", key)
		return false
	}
	if !dnsLabel.MatchString(name) {
		c.errf(key, "%s: %q is not a stage1 name (lowercase letters, digits and '-')", key, name)
		return false
	}
	if !c.withCaps {
		return false
	}
	if _, ok := c.known[name]; !ok {
		pos := c.where(key)
		c.probs = append(c.probs, Problem{
			File: c.p.Source, Line: pos.line, Column: pos.col, unknownStage1: true,
			Msg: fmt.Sprintf("%s: unknown stage1 %q (this node has: %s)", key, name, c.knownNames()),
		})
		return false
	}
	return true
}

func (c *checker) knownNames() string {
	if len(c.known) == 0 {
		return "none"
	}
	names := make([]string, 0, len(c.known))
	for n := range c.known {
		names = append(names, n)
	}
	sort.Strings(names)
	return strings.Join(names, ", ")
}

func (c *checker) defaultStage1() {
	if c.p.DefaultStage1 == "" {
		c.errf("default_stage1", "default_stage1: must be set")
		return
	}
	c.stage1("default_stage1", c.p.DefaultStage1)
}

func (c *checker) handlers() {
	for _, name := range c.p.Handlers() {
		h := c.p.RuntimeHandlers[name]
		key := "handlers." + name
		switch {
		case name == "":
			c.errf(key+"#key", "handlers: the empty handler cannot be mapped: it means the policy decides")
			continue
		case !dnsLabel.MatchString(name):
			c.errf(key+"#key", "handlers: %q is not a RuntimeClass handler name (a DNS label: lowercase letters, digits and '-', at most 63)", name)
		}
		usable := c.stage1(key+".stage1", h.Stage1)
		c.namespaces(key, h.Namespaces, h.NotNamespaces)
		c.options(key+".options", h.Options)
		if usable {
			c.declaredOptions(key+".options", key, h.Stage1, h.Options)
		}
	}
}

func (c *checker) options(key string, opts map[string]string) {
	for k := range opts {
		if k == "" {
			c.errf(key, "%s: an option needs a name", key)
		}
	}
}

// declaredOptions checks the options at key, of the rule or handler
// label, against those stage1 declares: a key it does not take, and a
// value its check refuses, are problems naming label, stage1 and key.
func (c *checker) declaredOptions(key, label, stage1 string, opts map[string]string) {
	declared := c.known[stage1]
	names := make([]string, 0, len(opts))
	for k := range opts {
		names = append(names, k)
	}
	sort.Strings(names)
	for _, k := range names {
		if k == "" {
			continue // options reported it
		}
		at := key + "." + k
		o, ok := declared.Option(k)
		switch {
		case !ok:
			c.errf(at+"#key", "%s: stage1 %s: option %q: unknown (%s)", label, stage1, k, takes(stage1, declared))
		case o.Check != nil:
			if err := o.Check(opts[k]); err != nil {
				c.errf(at, "%s: stage1 %s: option %q: value %q: %v (%s: %s)", label, stage1, k, opts[k], err, k, o.Doc)
			}
		}
	}
}

// takes says which options stage1 declares.
func takes(stage1 string, declared caps.Capabilities) string {
	if len(declared.Options) == 0 {
		return stage1 + " takes no options"
	}
	names := make([]string, len(declared.Options))
	for i, o := range declared.Options {
		names[i] = o.Name
	}
	sort.Strings(names)
	return stage1 + " takes: " + strings.Join(names, ", ")
}

// namespaces checks include and exclude patterns under key and their
// contradictions.
func (c *checker) namespaces(key string, incl, excl []string) {
	for i, pat := range incl {
		c.pattern(fmt.Sprintf("%s.namespaces[%d]", key, i), pat)
	}
	for i, pat := range excl {
		k := fmt.Sprintf("%s.not_namespaces[%d]", key, i)
		if c.pattern(k, pat) && pat == "*" {
			c.errf(k, "%s: %q excludes every namespace: nothing can match", k, pat)
		}
	}
	for i, in := range incl {
		for _, ex := range excl {
			if in == ex || (!hasMeta(in) && globMatch(ex, in)) {
				c.errf(fmt.Sprintf("%s.namespaces[%d]", key, i),
					"%s: namespace %q is both included (namespaces) and excluded (not_namespaces: %q)", key, in, ex)
				break
			}
		}
	}
}

// pattern checks one namespace name or glob; it reports whether it is valid.
func (c *checker) pattern(key, pat string) bool {
	if pat == "" {
		c.errf(key, "%s: empty namespace", key)
		return false
	}
	if !hasMeta(pat) {
		if !dnsLabel.MatchString(pat) {
			c.errf(key, "%s: %q is not a namespace name (a DNS label) nor a glob", key, pat)
			return false
		}
		return true
	}
	if _, err := path.Match(pat, ""); err != nil {
		c.errf(key, "%s: %q is not a valid glob (use *, ? and [a-z])", key, pat)
		return false
	}
	return true
}

func hasMeta(s string) bool { return strings.ContainsAny(s, `*?[\`) }

// globMatch matches a namespace against a name or glob; invalid globs match
// nothing.
func globMatch(pat, ns string) bool {
	ok, err := path.Match(pat, ns)
	return err == nil && ok
}

// needs are the capabilities a pod may need, in the order they are checked.
var needs = []struct {
	key  string // the conflicts key and match key
	what string // for messages
	pod  func(Pod) bool
	met  func(caps.Capabilities) bool
	rule func(Match) *bool
	conf func(*Conflicts) *Conflict
}{
	{"host_network", "host network", func(p Pod) bool { return p.HostNetwork },
		func(c caps.Capabilities) bool { return c.HostNetwork },
		func(m Match) *bool { return m.HostNetwork }, func(c *Conflicts) *Conflict { return c.HostNetwork }},
	{"host_pid", "host PID namespace", func(p Pod) bool { return p.HostPID },
		func(c caps.Capabilities) bool { return c.HostPID },
		func(m Match) *bool { return m.HostPID }, func(c *Conflicts) *Conflict { return c.HostPID }},
	{"host_ipc", "host IPC namespace", func(p Pod) bool { return p.HostIPC },
		func(c caps.Capabilities) bool { return c.HostIPC },
		func(m Match) *bool { return m.HostIPC }, func(c *Conflicts) *Conflict { return c.HostIPC }},
	{"user_namespace", "user namespace of its own", func(p Pod) bool { return p.UserNS },
		func(c caps.Capabilities) bool { return c.UserNamespaces },
		func(m Match) *bool { return m.UserNamespace }, func(c *Conflicts) *Conflict { return c.UserNamespace }},
}

func (m *Match) catchAll() bool {
	allNS := len(m.Namespaces) == 0
	for _, ns := range m.Namespaces {
		if ns == "*" {
			allNS = true
		}
	}
	return allNS && len(m.NotNamespaces) == 0 && len(m.Labels) == 0 && len(m.Annotations) == 0 &&
		m.Privileged == nil && m.HostNetwork == nil && m.HostPID == nil && m.HostIPC == nil && m.UserNamespace == nil
}

func (c *checker) rules() {
	names := map[string]int{}
	catchAll := -1
	for i := range c.p.Rules {
		r := &c.p.Rules[i]
		key := fmt.Sprintf("rules[%d]", i)
		label := key
		if r.Name != "" {
			label = fmt.Sprintf("%s (%q)", key, r.Name)
		}
		switch first, dup := names[r.Name]; {
		case r.Name == "":
			c.errf(key, "%s: name: must be set (decisions and refusals cite it)", key)
		case dup:
			c.errf(key+".name", "%s: duplicate rule name %q (first at line %d)", label, r.Name, c.where(fmt.Sprintf("rules[%d].name", first)).line)
		default:
			names[r.Name] = i
		}
		if catchAll >= 0 {
			c.errf(key, "%s: unreachable: rule %q (line %d) before it matches every pod", label,
				c.p.Rules[catchAll].Name, c.where(fmt.Sprintf("rules[%d]", catchAll)).line)
		}
		if r.Match.catchAll() && catchAll < 0 {
			catchAll = i
		}
		c.namespaces(key+".match", r.Match.Namespaces, r.Match.NotNamespaces)
		for k := range r.Match.Labels {
			if k == "" {
				c.errf(key+".match.labels", "%s: match.labels: empty key", label)
			}
		}
		for k := range r.Match.Annotations {
			if k == "" {
				c.errf(key+".match.annotations", "%s: match.annotations: empty key", label)
			}
		}
		c.options(key+".options", r.Options)
		switch {
		case r.Stage1 != "" && r.Refuse != "":
			c.errf(key+".refuse", "%s: set stage1 or refuse, not both", label)
			continue
		case r.Stage1 == "" && r.Refuse == "":
			c.errf(key, "%s: set stage1 (where matching pods go) or refuse (a message for them)", label)
			continue
		case r.Refuse != "":
			if len(r.Options) > 0 {
				c.errf(key+".options", "%s: options mean nothing on a refuse rule", label)
			}
			if r.Locked {
				c.errf(key+".locked", "%s: locked means nothing on a refuse rule (a refusal is never overridden)", label)
			}
			continue
		}
		if !c.stage1(key+".stage1", r.Stage1) {
			continue
		}
		c.declaredOptions(key+".options", label, r.Stage1, r.Options)
		declared := c.known[r.Stage1]
		for _, n := range needs {
			if b := n.rule(r.Match); b != nil && *b && !n.met(declared) {
				c.errf(key+".stage1", "%s: sends %s pods to %q, which declares no %s", label, n.key, r.Stage1, n.what)
			}
		}
	}
}

func (c *checker) annotations() {
	a := &c.p.Annotations
	for i, name := range a.Allow {
		c.stage1(fmt.Sprintf("annotations.allow[%d]", i), name)
	}
	pats := make([]string, 0, len(a.PerNamespace))
	for pat := range a.PerNamespace {
		pats = append(pats, pat)
	}
	sort.Strings(pats)
	for _, pat := range pats {
		key := "annotations.per_namespace." + pat
		if pat == "" {
			c.errf(key+"#key", "annotations.per_namespace: empty namespace")
		} else if !dnsLabel.MatchString(pat) {
			if _, err := path.Match(pat, ""); err != nil || !hasMeta(pat) {
				c.errf(key+"#key", "annotations.per_namespace: %q is not a namespace name nor a valid glob", pat)
			}
		}
		for i, name := range a.PerNamespace[pat] {
			c.stage1(fmt.Sprintf("%s[%d]", key, i), name)
		}
	}
}

func (c *checker) conflicts() {
	for _, n := range needs {
		r := n.conf(&c.p.Conflicts)
		if r == nil {
			continue
		}
		key := "conflicts." + n.key
		switch {
		case r.Fallback != "" && r.Refuse != "":
			c.errf(key, "%s: set fallback or refuse, not both", key)
		case r.Fallback == "" && r.Refuse == "":
			c.errf(key, "%s: set fallback (a stage1) or refuse (a message)", key)
		case r.Fallback != "":
			if c.stage1(key+".fallback", r.Fallback) && !n.met(c.known[r.Fallback]) {
				c.errf(key+".fallback", "%s.fallback: %q declares no %s, so it cannot be the fallback for %s", key, r.Fallback, n.what, n.key)
			}
		}
	}
}
