package policy

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"regexp"
	"sort"
	"strconv"
	"strings"

	"gopkg.in/yaml.v3"

	"github.com/stagelet/stagelet/errdefs"
)

// ErrUnknownStage1 marks the problems that name a stage1 the node does not
// have, so that a caller can tell them from mistakes in the file itself:
// errors.Is(err, ErrUnknownStage1).
var ErrUnknownStage1 = errors.New("unknown stage1")

// A Problem is one thing wrong with a policy, at a place in its file when
// that place is known. It is of class errdefs.ErrInvalidArgument.
type Problem struct {
	File   string // the file's name; "" when the policy was embedded in another document
	Line   int    // 1-based; 0 when unknown
	Column int    // 1-based; 0 when unknown
	Msg    string // what is wrong, starting with the key's path ("rules[2].stage1: ...")

	unknownStage1 bool
}

// Error renders the problem as "file:line:column: msg", or
// "line L, column C: msg" when the file is not named.
func (p Problem) Error() string {
	var at string
	switch {
	case p.File != "" && p.Line > 0 && p.Column > 0:
		at = fmt.Sprintf("%s:%d:%d: ", p.File, p.Line, p.Column)
	case p.File != "" && p.Line > 0:
		at = fmt.Sprintf("%s:%d: ", p.File, p.Line)
	case p.File != "":
		at = p.File + ": "
	case p.Line > 0 && p.Column > 0:
		at = fmt.Sprintf("line %d, column %d: ", p.Line, p.Column)
	case p.Line > 0:
		at = fmt.Sprintf("line %d: ", p.Line)
	}
	return at + p.Msg
}

// Unwrap returns the problem's classes: errdefs.ErrInvalidArgument, and
// ErrUnknownStage1 when the problem is a stage1 name the node does not have.
func (p Problem) Unwrap() []error {
	if p.unknownStage1 {
		return []error{errdefs.ErrInvalidArgument, ErrUnknownStage1}
	}
	return []error{errdefs.ErrInvalidArgument}
}

// Problems is every problem found in a policy, in file order. It is the
// error Parse, UnmarshalYAML and Validate return.
type Problems []Problem

// Error renders one problem a line.
func (ps Problems) Error() string {
	lines := make([]string, len(ps))
	for i, p := range ps {
		lines[i] = p.Error()
	}
	return strings.Join(lines, "\n")
}

// Unwrap returns each problem, so errors.Is and errors.As see through.
func (ps Problems) Unwrap() []error {
	errs := make([]error, len(ps))
	for i, p := range ps {
		errs[i] = p
	}
	return errs
}

func (ps Problems) sorted() Problems {
	sort.SliceStable(ps, func(i, j int) bool {
		if ps[i].Line != ps[j].Line {
			return ps[i].Line < ps[j].Line
		}
		return ps[i].Column < ps[j].Column
	})
	return ps
}

func (ps Problems) err() error {
	if len(ps) == 0 {
		return nil
	}
	return ps.sorted()
}

// position is where a key or value was in the file.
type position struct{ line, col int }

// maxAliases bounds alias expansion, so that a small file cannot make the
// decoder walk an exponentially large tree.
const maxAliases = 1000

// decoder turns a yaml.Node tree into a Policy, strictly: unknown keys,
// duplicate keys and wrong types are problems with their line and column.
type decoder struct {
	file    string
	probs   Problems
	pos     map[string]position
	aliases int
}

func (d *decoder) errf(n *yaml.Node, format string, args ...any) {
	p := Problem{File: d.file, Msg: fmt.Sprintf(format, args...)}
	if n != nil {
		p.Line, p.Column = n.Line, n.Column
	}
	d.probs = append(d.probs, p)
}

// resolve follows aliases; it returns nil once the alias budget is spent.
func (d *decoder) resolve(n *yaml.Node, path string) *yaml.Node {
	for n != nil && n.Kind == yaml.AliasNode {
		d.aliases++
		if d.aliases > maxAliases {
			if d.aliases == maxAliases+1 {
				d.errf(n, "%s: too many alias expansions (more than %d)", path, maxAliases)
			}
			return nil
		}
		n = n.Alias
	}
	return n
}

func isNull(n *yaml.Node) bool {
	return n == nil || (n.Kind == yaml.ScalarNode && n.ShortTag() == "!!null")
}

func kindName(n *yaml.Node) string {
	switch n.Kind {
	case yaml.MappingNode:
		return "a mapping"
	case yaml.SequenceNode:
		return "a list"
	case yaml.ScalarNode:
		return fmt.Sprintf("%s %q", strings.TrimPrefix(n.ShortTag(), "!!"), n.Value)
	}
	return "something else"
}

func join(path, key string) string {
	if path == "" {
		return key
	}
	return path + "." + key
}

// entry is one key of a mapping, with the nodes of key and value.
type entry struct {
	name       string
	key, value *yaml.Node
}

// entries returns the mapping's keys in file order, reporting non-scalar,
// duplicate and merge keys. A null node is an empty mapping.
func (d *decoder) entries(n *yaml.Node, path string) ([]entry, bool) {
	n = d.resolve(n, path)
	if isNull(n) {
		return nil, n != nil
	}
	if n.Kind != yaml.MappingNode {
		d.errf(n, "%s: want a mapping, found %s", orTop(path), kindName(n))
		return nil, false
	}
	var out []entry
	seen := map[string]*yaml.Node{}
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, v := n.Content[i], n.Content[i+1]
		if k.Kind == yaml.ScalarNode && k.ShortTag() == "!!merge" {
			d.errf(k, "%s: merge keys (<<) are not supported; write the keys out", orTop(path))
			continue
		}
		if k.Kind != yaml.ScalarNode {
			d.errf(k, "%s: keys must be plain strings, found %s", orTop(path), kindName(k))
			continue
		}
		if first, dup := seen[k.Value]; dup {
			d.errf(k, "%s: duplicate key %q (first at line %d)", join(path, k.Value), k.Value, first.Line)
			continue
		}
		seen[k.Value] = k
		out = append(out, entry{name: k.Value, key: k, value: v})
	}
	return out, true
}

func orTop(path string) string {
	if path == "" {
		return "policy"
	}
	return path
}

// fields decodes a mapping whose keys are fixed: each known key's value is
// handed to its function, every other key is a problem naming the known ones.
func (d *decoder) fields(n *yaml.Node, path string, known map[string]func(v *yaml.Node, path string)) {
	d.at(n, path)
	es, _ := d.entries(n, path)
	for _, e := range es {
		f, ok := known[e.name]
		if !ok {
			names := make([]string, 0, len(known))
			for k := range known {
				names = append(names, k)
			}
			sort.Strings(names)
			d.errf(e.key, "%s: unknown key %q (known keys: %s)", orTop(path), e.name, strings.Join(names, ", "))
			continue
		}
		p := join(path, e.name)
		d.at(e.value, p)
		f(e.value, p)
	}
}

// at records where the value at path is.
func (d *decoder) at(n *yaml.Node, path string) {
	if n != nil && n.Line > 0 {
		d.pos[path] = position{n.Line, n.Column}
	}
}

func (d *decoder) str(n *yaml.Node, path string) string {
	n = d.resolve(n, path)
	if isNull(n) {
		return ""
	}
	if n.Kind != yaml.ScalarNode {
		d.errf(n, "%s: want a string, found %s", path, kindName(n))
		return ""
	}
	return n.Value
}

func (d *decoder) boolean(n *yaml.Node, path string) bool {
	b := d.boolPtr(n, path)
	return b != nil && *b
}

func (d *decoder) boolPtr(n *yaml.Node, path string) *bool {
	n = d.resolve(n, path)
	if isNull(n) {
		return nil
	}
	if n.Kind != yaml.ScalarNode || n.ShortTag() != "!!bool" {
		d.errf(n, "%s: want true or false, found %s", path, kindName(n))
		return nil
	}
	var b bool
	if err := n.Decode(&b); err != nil {
		d.errf(n, "%s: %v", path, err)
		return nil
	}
	return &b
}

func (d *decoder) integer(n *yaml.Node, path string) int {
	n = d.resolve(n, path)
	if isNull(n) {
		return 0
	}
	if n.Kind != yaml.ScalarNode || n.ShortTag() != "!!int" {
		d.errf(n, "%s: want an integer, found %s", path, kindName(n))
		return 0
	}
	i, err := strconv.ParseInt(n.Value, 0, 32)
	if err != nil {
		d.errf(n, "%s: want an integer, found %q", path, n.Value)
		return 0
	}
	return int(i)
}

func (d *decoder) strList(n *yaml.Node, path string) []string {
	n = d.resolve(n, path)
	if isNull(n) {
		return nil
	}
	if n.Kind != yaml.SequenceNode {
		d.errf(n, "%s: want a list, found %s", path, kindName(n))
		return nil
	}
	out := make([]string, 0, len(n.Content))
	for i, item := range n.Content {
		p := fmt.Sprintf("%s[%d]", path, i)
		d.at(item, p)
		out = append(out, d.str(item, p))
	}
	return out
}

func (d *decoder) strMap(n *yaml.Node, path string) map[string]string {
	es, ok := d.entries(n, path)
	if !ok || len(es) == 0 {
		return nil
	}
	out := make(map[string]string, len(es))
	for _, e := range es {
		p := join(path, e.name)
		d.pos[p+"#key"] = position{e.key.Line, e.key.Column}
		d.at(e.value, p)
		out[e.name] = d.str(e.value, p)
	}
	return out
}

// decode fills p from n, which is the policy mapping (or a document node
// holding it). p is reset first: a policy is always replaced as a whole.
func (d *decoder) decode(n *yaml.Node, p *Policy) {
	if n != nil && n.Kind == yaml.DocumentNode {
		if len(n.Content) == 0 {
			d.errf(n, "policy: the document is empty")
			return
		}
		n = n.Content[0]
	}
	*p = Policy{pos: d.pos}
	if isNull(d.resolve(n, "")) {
		d.errf(n, "policy: the document is empty")
		return
	}
	d.fields(n, "", map[string]func(*yaml.Node, string){
		"version":        func(v *yaml.Node, path string) { p.Version = d.integer(v, path) },
		"default_stage1": func(v *yaml.Node, path string) { p.DefaultStage1 = d.str(v, path) },
		"handlers":       func(v *yaml.Node, path string) { p.RuntimeHandlers = d.handlers(v, path) },
		"rules":          func(v *yaml.Node, path string) { p.Rules = d.rules(v, path) },
		"annotations":    func(v *yaml.Node, path string) { p.Annotations = d.annotations(v, path) },
		"conflicts":      func(v *yaml.Node, path string) { p.Conflicts = d.conflicts(v, path) },
	})
}

func (d *decoder) handlers(n *yaml.Node, path string) map[string]Handler {
	es, ok := d.entries(n, path)
	if !ok || len(es) == 0 {
		return nil
	}
	out := make(map[string]Handler, len(es))
	for _, e := range es {
		p := join(path, e.name)
		d.pos[p+"#key"] = position{e.key.Line, e.key.Column}
		var h Handler
		d.fields(e.value, p, map[string]func(*yaml.Node, string){
			"stage1":         func(v *yaml.Node, path string) { h.Stage1 = d.str(v, path) },
			"namespaces":     func(v *yaml.Node, path string) { h.Namespaces = d.strList(v, path) },
			"not_namespaces": func(v *yaml.Node, path string) { h.NotNamespaces = d.strList(v, path) },
			"options":        func(v *yaml.Node, path string) { h.Options = d.strMap(v, path) },
			"privileged_without_host_devices": func(v *yaml.Node, path string) {
				h.PrivilegedWithoutHostDevices = d.boolean(v, path)
			},
		})
		out[e.name] = h
	}
	return out
}

func (d *decoder) rules(n *yaml.Node, path string) []Rule {
	n = d.resolve(n, path)
	if isNull(n) {
		return nil
	}
	if n.Kind != yaml.SequenceNode {
		d.errf(n, "%s: want a list of rules, found %s", path, kindName(n))
		return nil
	}
	out := make([]Rule, 0, len(n.Content))
	for i, item := range n.Content {
		p := fmt.Sprintf("%s[%d]", path, i)
		var r Rule
		d.fields(item, p, map[string]func(*yaml.Node, string){
			"name":    func(v *yaml.Node, path string) { r.Name = d.str(v, path) },
			"match":   func(v *yaml.Node, path string) { r.Match = d.match(v, path) },
			"stage1":  func(v *yaml.Node, path string) { r.Stage1 = d.str(v, path) },
			"options": func(v *yaml.Node, path string) { r.Options = d.strMap(v, path) },
			"refuse":  func(v *yaml.Node, path string) { r.Refuse = d.str(v, path) },
			"locked":  func(v *yaml.Node, path string) { r.Locked = d.boolean(v, path) },
		})
		out = append(out, r)
	}
	return out
}

func (d *decoder) match(n *yaml.Node, path string) Match {
	var m Match
	d.fields(n, path, map[string]func(*yaml.Node, string){
		"namespaces":     func(v *yaml.Node, path string) { m.Namespaces = d.strList(v, path) },
		"not_namespaces": func(v *yaml.Node, path string) { m.NotNamespaces = d.strList(v, path) },
		"labels":         func(v *yaml.Node, path string) { m.Labels = d.strMap(v, path) },
		"annotations":    func(v *yaml.Node, path string) { m.Annotations = d.strMap(v, path) },
		"privileged":     func(v *yaml.Node, path string) { m.Privileged = d.boolPtr(v, path) },
		"host_network":   func(v *yaml.Node, path string) { m.HostNetwork = d.boolPtr(v, path) },
		"host_pid":       func(v *yaml.Node, path string) { m.HostPID = d.boolPtr(v, path) },
		"host_ipc":       func(v *yaml.Node, path string) { m.HostIPC = d.boolPtr(v, path) },
		"user_namespace": func(v *yaml.Node, path string) { m.UserNamespace = d.boolPtr(v, path) },
	})
	return m
}

func (d *decoder) annotations(n *yaml.Node, path string) Annotations {
	var a Annotations
	d.fields(n, path, map[string]func(*yaml.Node, string){
		"allow": func(v *yaml.Node, path string) { a.Allow = d.strList(v, path) },
		"per_namespace": func(v *yaml.Node, path string) {
			es, ok := d.entries(v, path)
			if !ok || len(es) == 0 {
				return
			}
			a.PerNamespace = make(map[string][]string, len(es))
			for _, e := range es {
				p := join(path, e.name)
				d.pos[p+"#key"] = position{e.key.Line, e.key.Column}
				d.at(e.value, p)
				a.PerNamespace[e.name] = d.strList(e.value, p)
			}
		},
		"raise_only": func(v *yaml.Node, path string) { a.RaiseOnly = d.boolPtr(v, path) },
	})
	return a
}

func (d *decoder) conflicts(n *yaml.Node, path string) Conflicts {
	var c Conflicts
	one := func(v *yaml.Node, path string) *Conflict {
		if isNull(d.resolve(v, path)) {
			return nil
		}
		var r Conflict
		d.fields(v, path, map[string]func(*yaml.Node, string){
			"fallback": func(v *yaml.Node, path string) { r.Fallback = d.str(v, path) },
			"refuse":   func(v *yaml.Node, path string) { r.Refuse = d.str(v, path) },
		})
		return &r
	}
	d.fields(n, path, map[string]func(*yaml.Node, string){
		"host_network":   func(v *yaml.Node, path string) { c.HostNetwork = one(v, path) },
		"host_pid":       func(v *yaml.Node, path string) { c.HostPID = one(v, path) },
		"host_ipc":       func(v *yaml.Node, path string) { c.HostIPC = one(v, path) },
		"user_namespace": func(v *yaml.Node, path string) { c.UserNamespace = one(v, path) },
	})
	return c
}

var yamlLine = regexp.MustCompile(`^yaml: line (\d+): (.*)$`)

// Parse decodes a standalone policy file strictly and runs the checks that
// need no knowledge of the node (see Validate for the rest); name is used in
// messages. It returns Problems, each naming name:line:column, or a policy
// whose Source is name. Call Validate with the node's stage1s before use.
func Parse(name string, data []byte) (*Policy, error) {
	dec := yaml.NewDecoder(bytes.NewReader(data))
	var doc yaml.Node
	if err := dec.Decode(&doc); err != nil {
		if errors.Is(err, io.EOF) {
			return nil, Problems{{File: name, Msg: "policy: the file is empty"}}
		}
		return nil, Problems{syntaxProblem(name, err)}
	}
	var extra yaml.Node
	if err := dec.Decode(&extra); err == nil {
		return nil, Problems{{File: name, Line: extra.Line, Column: extra.Column, Msg: "policy: a second YAML document; a policy file holds one"}}
	} else if !errors.Is(err, io.EOF) {
		return nil, Problems{syntaxProblem(name, err)}
	}
	d := &decoder{file: name, pos: map[string]position{}}
	p := &Policy{}
	d.decode(&doc, p)
	p.Source = name
	if len(d.probs) > 0 {
		return nil, d.probs.err()
	}
	if err := p.check(nil, false); err != nil {
		return nil, err
	}
	return p, nil
}

func syntaxProblem(name string, err error) Problem {
	msg := strings.TrimPrefix(err.Error(), "yaml: ")
	if m := yamlLine.FindStringSubmatch(err.Error()); m != nil {
		line, _ := strconv.Atoi(m[1])
		return Problem{File: name, Line: line, Msg: m[2]}
	}
	return Problem{File: name, Msg: msg}
}

// UnmarshalYAML decodes a policy embedded in another YAML document (the
// node config's `policy:` section) with the same strictness as Parse, and
// runs the same checks. The policy is replaced as a whole, never merged with
// what p held. Problems name line and column but no file (the embedding
// document's loader names it); set Source before Validate so that its
// problems name the file.
func (p *Policy) UnmarshalYAML(node *yaml.Node) error {
	d := &decoder{pos: map[string]position{}}
	d.decode(node, p)
	if len(d.probs) > 0 {
		return d.probs.err()
	}
	return p.check(nil, false)
}
