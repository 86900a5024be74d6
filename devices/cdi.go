package devices

import (
	"fmt"
	"reflect"
	"slices"
	"strings"
	"sync"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"tags.cncf.io/container-device-interface/pkg/cdi"

	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/bindopts"
)

// DefaultCDISpecDirs are where CDI specs are read from unless configured
// otherwise: the static and the dynamic (drivers') directory.
var DefaultCDISpecDirs = []string{"/etc/cdi", "/var/run/cdi"}

// CDI resolves fully qualified CDI device names ("vendor.com/class=name")
// through the specs in its directories, read again for each resolution
// (drivers write theirs while the node runs).
type CDI struct {
	dirs []string
	mu   sync.Mutex // serialises refreshes and injections
	c    *cdi.Cache
}

// NewCDI returns a resolver reading the spec directories dirs
// (DefaultCDISpecDirs when empty).
func NewCDI(dirs []string) *CDI {
	if len(dirs) == 0 {
		dirs = DefaultCDISpecDirs
	}
	c, _ := cdi.NewCache(cdi.WithSpecDirs(dirs...), cdi.WithAutoRefresh(false))
	return &CDI{dirs: slices.Clone(dirs), c: c}
}

// SpecDirs are the directories the specs are read from.
func (r *CDI) SpecDirs() []string { return slices.Clone(r.dirs) }

// Mount is a bind mount a CDI spec asks for.
type Mount struct {
	Host, Container string
	bindopts.Flags
}

// Edits are what CDI devices make of a container: device nodes and their
// cgroup rules, bind mounts, environment variables and supplementary
// groups.
type Edits struct {
	Set
	Mounts []Mount
	Env    []string
	GIDs   []uint32
}

// FromAnnotations are the CDI device names of a container's cdi.k8s.io/*
// annotations (how device plugins name them). InvalidArgument for a
// malformed one.
func FromAnnotations(annotations map[string]string) ([]string, error) {
	_, names, err := cdi.ParseAnnotations(annotations)
	if err != nil {
		return nil, errdefs.InvalidArgument("config.annotations: %w", err)
	}
	return names, nil
}

// Resolve reads the specs anew and returns the edits of the devices
// named (field names them in errors). An unknown or unresolvable device,
// or one whose spec asks for what stagelet does not do (OCI hooks, network
// devices, Intel RDT, a mount that is not a bind mount), is InvalidArgument
// naming it.
func (r *CDI) Resolve(names []string, field string) (Edits, error) {
	if len(names) == 0 {
		return Edits{}, nil
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	refreshErr := r.c.Refresh()
	spec := &specs.Spec{Process: &specs.Process{}, Linux: &specs.Linux{}}
	unresolved, err := r.c.InjectDevices(spec, names...)
	if len(unresolved) > 0 {
		msg := fmt.Sprintf("%s: unknown CDI device %s (spec directories: %s)", field, strings.Join(unresolved, ", "), strings.Join(r.dirs, ", "))
		if refreshErr != nil {
			msg += fmt.Sprintf("; specs that could not be read: %v", refreshErr)
		}
		return Edits{}, errdefs.InvalidArgument("%s", msg)
	}
	if err != nil {
		return Edits{}, errdefs.InvalidArgument("%s: CDI devices %s: %w", field, strings.Join(names, ", "), err)
	}
	what := fmt.Sprintf("%s: CDI devices %s", field, strings.Join(names, ", "))
	if h := spec.Hooks; h != nil && !reflect.DeepEqual(*h, specs.Hooks{}) {
		return Edits{}, errdefs.InvalidArgument("%s: their specs ask for OCI hooks, which stagelet does not run", what)
	}
	if len(spec.Linux.NetDevices) > 0 {
		return Edits{}, errdefs.InvalidArgument("%s: their specs move network devices into the container, which stagelet does not do", what)
	}
	if spec.Linux.IntelRdt != nil {
		return Edits{}, errdefs.InvalidArgument("%s: their specs ask for Intel RDT, which stagelet does not set", what)
	}
	e := Edits{Set: Set{Nodes: spec.Linux.Devices}, Env: spec.Process.Env, GIDs: spec.Process.User.AdditionalGids}
	if res := spec.Linux.Resources; res != nil {
		for _, d := range res.Devices {
			if d.Access == "" {
				continue // a node made but not to be opened: nothing allowed
			}
			e.Rules = append(e.Rules, d)
		}
	}
	for _, m := range spec.Mounts {
		bm, err := bindMount(m)
		if err != nil {
			return Edits{}, errdefs.InvalidArgument("%s: mount %s: %w", what, m.Destination, err)
		}
		e.Mounts = append(e.Mounts, bm)
	}
	return e, nil
}

// bindMount reads a CDI spec's mount, which must be a bind mount with
// options the agent applies.
func bindMount(m specs.Mount) (Mount, error) {
	f, err := bindopts.Parse(m.Type, m.Options)
	if err != nil {
		return Mount{}, err
	}
	return Mount{Host: m.Source, Container: m.Destination, Flags: f}, nil
}

// Devices reads the spec directories again and lists the fully qualified
// names of the devices they declare, with what could not be read.
func (r *CDI) Devices() ([]string, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.c == nil {
		return nil, fmt.Errorf("CDI: no cache for %s", strings.Join(r.dirs, ", "))
	}
	err := r.c.Refresh()
	return r.c.ListDevices(), err
}
