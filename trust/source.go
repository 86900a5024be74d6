package trust

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"
)

// Source holds the node's signature policy and the per-namespace ones, and
// rereads a file when it (or a key file it names) changes: a stat per file
// at each decision, no restart. A node file that stops loading leaves the
// last good policy in force, logged and shown by Status. A namespace file
// that is there (a directory entry of that name, whatever it is) and does
// not load refuses its namespace's images, from the first decision after
// it stopped loading (fail closed): an unreadable file, a dangling or
// looping link, a parse error, a key file missing. Only a namespace with
// no entry at all falls back to the node's policy.
type Source struct {
	file, dir string
	log       *slog.Logger

	mu     sync.Mutex
	global *entry
	ns     map[string]*entry
}

// entry is one policy file's state.
type entry struct {
	file     string
	policy   *Policy // the last good one; nil if it never loaded
	stamps   map[string]stamp
	loadedAt time.Time
	err      error            // the last failed load, if newer than policy
	failed   map[string]stamp // the stamps of that failed load
}

type stamp struct {
	exists bool
	size   int64
	mtime  int64
	ino    uint64
}

func statStamp(p string) stamp {
	fi, err := os.Stat(p)
	if err != nil {
		return stamp{}
	}
	st := stamp{exists: true, size: fi.Size(), mtime: fi.ModTime().UnixNano()}
	if s, ok := fi.Sys().(*syscall.Stat_t); ok {
		st.ino = s.Ino
	}
	return st
}

func changed(stamps map[string]stamp) bool {
	for p, s := range stamps {
		if statStamp(p) != s {
			return true
		}
	}
	return false
}

// NewSource loads file (none: accept anything) and watches dir for
// "<namespace>.json" files (none: no per-namespace policies). A file that
// does not load is an error here: the daemon does not start on a policy it
// cannot read.
func NewSource(file, dir string, log *slog.Logger) (*Source, error) {
	s := &Source{file: file, dir: dir, log: log, ns: map[string]*entry{}}
	if file != "" {
		e := &entry{file: file}
		if err := e.load(); err != nil {
			return nil, err
		}
		s.global = e
	}
	if dir != "" {
		if fi, err := os.Stat(dir); err == nil && !fi.IsDir() {
			return nil, fmt.Errorf("signature policy directory %s: not a directory", dir)
		}
	}
	return s, nil
}

// load (re)reads e's file; on failure e keeps its last good policy.
func (e *entry) load() error {
	stamps := map[string]stamp{}
	seen := func(p string) { stamps[p] = statStamp(p) }
	// Stat before reading: a write during the read shows up as a change
	// at the next decision.
	seen(e.file)
	p, err := Load(e.file, seen)
	if err != nil {
		e.err, e.failed = err, stamps
		return err
	}
	e.policy, e.stamps, e.err, e.failed, e.loadedAt = p, stamps, nil, nil, time.Now()
	return nil
}

// refresh reloads e when one of its files changed since it was last read
// (good or bad).
func (e *entry) refresh(ctx context.Context, log *slog.Logger) {
	last := e.stamps
	if e.failed != nil {
		last = e.failed
	}
	if !changed(last) {
		return
	}
	if err := e.load(); err != nil {
		log.ErrorContext(ctx, "signature policy does not load", "file", e.file, "err", err)
		return
	}
	log.InfoContext(ctx, "signature policy loaded", "file", e.file)
}

var namespaceRE = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]*[a-z0-9])?$`)

// Policy is the policy in force for namespace: its own file if the
// directory has one, else the node's. The error is a namespace file that
// does not load.
func (s *Source) Policy(ctx context.Context, namespace string) (*Policy, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.dir != "" && namespaceRE.MatchString(namespace) {
		if p, ok, err := s.namespacePolicyLocked(ctx, namespace); ok {
			return p, err
		}
	}
	if s.global == nil {
		return AcceptAnything, nil
	}
	s.global.refresh(ctx, s.log)
	return s.global.policy, nil
}

// namespacePolicyLocked is namespace's own policy; ok is false when the
// directory has no entry for it. An entry that does not load is an error,
// never the node's policy nor its own last good one. s.mu is held.
func (s *Source) namespacePolicyLocked(ctx context.Context, namespace string) (p *Policy, ok bool, err error) {
	file := filepath.Join(s.dir, namespace+".json")
	e := s.ns[namespace]
	_, err = os.Lstat(file)
	if errors.Is(err, os.ErrNotExist) {
		if e != nil {
			s.log.InfoContext(ctx, "namespace signature policy removed; the node's applies", "file", file)
			delete(s.ns, namespace)
		}
		return nil, false, nil
	}
	switch {
	case err != nil:
		// The entry cannot even be looked at (the directory is not
		// searchable, or no longer a directory).
		if e == nil {
			e = &entry{file: file}
			s.ns[namespace] = e
		}
		e.err, e.failed = &LoadError{File: file, Err: err}, map[string]stamp{file: {}}
	case e == nil:
		e = &entry{file: file}
		s.ns[namespace] = e
		if lerr := e.load(); lerr != nil {
			s.log.ErrorContext(ctx, "signature policy does not load", "file", file, "err", lerr)
		}
	default:
		e.refresh(ctx, s.log)
	}
	if e.err != nil {
		return nil, true, fmt.Errorf("the policy of namespace %s does not load: %w", namespace, e.err)
	}
	return e.policy, true, nil
}

// Decide is the requirements that apply to ref for namespace, with the
// file and scope that say so. A namespace policy that does not load gives a
// *Rejection.
func (s *Source) Decide(ctx context.Context, namespace string, ref Reference) (*Decision, error) {
	p, err := s.Policy(ctx, namespace)
	if err != nil {
		return nil, &Rejection{Image: ref.String(), Namespace: namespace, Reason: err.Error()}
	}
	scope, rs := p.Lookup(ref)
	return &Decision{File: p.File, Scope: scope, Requirements: rs, Namespace: namespace}, nil
}

// Decision is the requirements that apply to one image in one namespace.
type Decision struct {
	File, Scope, Namespace string
	Requirements           Requirements
}

// Check is Requirements.Check as a *Rejection naming the decision.
func (d *Decision) Check(img Image, sigs []Signature) error {
	if err := d.Requirements.Check(img, sigs); err != nil {
		return &Rejection{Image: img.Ref.String(), Digest: img.Digest, Namespace: d.Namespace, File: d.File, Scope: d.Scope, Required: d.Requirements.Describe(), Reason: err.Error()}
	}
	return nil
}

// FileStatus is the state of one policy file.
type FileStatus struct {
	File      string    `json:"file"`
	Namespace string    `json:"namespace,omitempty"`
	LoadedAt  time.Time `json:"loadedAt,omitzero"`
	// Error is the last failed load, when it is newer than the policy in
	// force (or there is none). A namespace file with an error refuses
	// its namespace's images; the node's file keeps its last good policy
	// in force (LoadedAt).
	Error string `json:"error,omitempty"`
}

// Status lists the node's policy file and every namespace file in the
// directory, each reread if it changed (so a namespace file no pod asked
// for yet shows its error too). A directory that cannot be listed is an
// entry with its error.
func (s *Source) Status(ctx context.Context) []FileStatus {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []FileStatus
	if s.global != nil {
		s.global.refresh(ctx, s.log)
		out = append(out, s.global.status(""))
	}
	if s.dir == "" {
		return out
	}
	names, _, err := namespaceFiles(s.dir)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		out = append(out, FileStatus{File: s.dir, Error: err.Error()})
	}
	for _, n := range names {
		_, _, _ = s.namespacePolicyLocked(ctx, n) // the entry keeps the error
	}
	ns := make([]string, 0, len(s.ns))
	for n := range s.ns {
		ns = append(ns, n)
	}
	sort.Strings(ns)
	for _, n := range ns {
		out = append(out, s.ns[n].status(n))
	}
	return out
}

func (e *entry) status(namespace string) FileStatus {
	f := FileStatus{File: e.file, Namespace: namespace, LoadedAt: e.loadedAt}
	if e.err != nil {
		f.Error = e.err.Error()
	}
	return f
}

// Files are the node's policy file and the directory of namespace files.
func (s *Source) Files() (file, dir string) { return s.file, s.dir }

// Namespaces are the namespaces that have a policy file of their own in
// the directory now; the error is a directory that cannot be listed.
func (s *Source) Namespaces() ([]string, error) {
	if s.dir == "" {
		return nil, nil
	}
	names, _, err := namespaceFiles(s.dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	return names, err
}

// namespaceFiles lists dir's "<namespace>.json" files by namespace, and
// the .json files not named after a namespace (never used).
func namespaceFiles(dir string) (names, stray []string, err error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, nil, err
	}
	for _, d := range ents {
		n, ok := strings.CutSuffix(d.Name(), ".json")
		switch {
		case !ok:
		case namespaceRE.MatchString(n):
			names = append(names, n)
		default:
			stray = append(stray, d.Name())
		}
	}
	return names, stray, nil
}

// CheckFiles loads the node's policy and every namespace file in the
// directory, as `stagelet doctor` does: it returns one error per file
// that does not load (a key file missing or unparsable among them).
func CheckFiles(file, dir string) (loaded []string, errs []error) {
	if file != "" {
		if _, err := Load(file, nil); err != nil {
			errs = append(errs, err)
		} else {
			loaded = append(loaded, file)
		}
	}
	if dir == "" {
		return loaded, errs
	}
	names, stray, err := namespaceFiles(dir)
	if errors.Is(err, os.ErrNotExist) {
		return loaded, errs
	}
	if err != nil {
		return loaded, append(errs, err)
	}
	for _, n := range stray {
		errs = append(errs, fmt.Errorf("%s: not named after a namespace (<namespace>.json): never used", filepath.Join(dir, n)))
	}
	for _, n := range names {
		p := filepath.Join(dir, n+".json")
		if _, err := Load(p, nil); err != nil {
			errs = append(errs, err)
		} else {
			loaded = append(loaded, p)
		}
	}
	return loaded, errs
}
