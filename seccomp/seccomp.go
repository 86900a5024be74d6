// Package seccomp owns stagelet's system call filtering: the default
// profile a container gets for RuntimeDefault, loading Localhost profiles
// (OCI seccomp JSON), compiling a profile into a classic BPF program
// without libseccomp, and installing that program on the calling thread
// group.
//
// Profiles are the OCI runtime-spec type (specs.LinuxSeccomp), so a profile
// written for runc or containerd reads the same here. The compiled program
// filters x86_64 system calls; calls made through another ABI of the same
// machine (32-bit int 0x80, x32) kill the process, because the filter has no
// table to judge them by.
//
//go:generate go run gen_sysnum.go
package seccomp

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"

	specs "github.com/opencontainers/runtime-spec/specs-go"
)

// Profile is an OCI seccomp profile.
type Profile = specs.LinuxSeccomp

// fileProfile is what Load accepts: an OCI profile, plus the keys Docker's
// profile format adds that carry no filtering meaning here ("archMap",
// "comment", empty "includes"/"excludes").
type fileProfile struct {
	DefaultAction    specs.LinuxSeccompAction `json:"defaultAction"`
	DefaultErrnoRet  *uint                    `json:"defaultErrnoRet,omitempty"`
	Architectures    []specs.Arch             `json:"architectures,omitempty"`
	Flags            []specs.LinuxSeccompFlag `json:"flags,omitempty"`
	ListenerPath     string                   `json:"listenerPath,omitempty"`
	ListenerMetadata string                   `json:"listenerMetadata,omitempty"`
	ArchMap          []struct {
		Architecture     specs.Arch   `json:"architecture"`
		SubArchitectures []specs.Arch `json:"subArchitectures"`
	} `json:"archMap,omitempty"`
	Syscalls []fileSyscall `json:"syscalls,omitempty"`
}

type fileSyscall struct {
	Names    []string                 `json:"names,omitempty"`
	Name     string                   `json:"name,omitempty"` // Docker's older single-name form
	Action   specs.LinuxSeccompAction `json:"action"`
	ErrnoRet *uint                    `json:"errnoRet,omitempty"`
	Args     []specs.LinuxSeccompArg  `json:"args,omitempty"`
	Comment  string                   `json:"comment,omitempty"`
	Includes *condition               `json:"includes,omitempty"`
	Excludes *condition               `json:"excludes,omitempty"`
}

// condition is Docker's conditional inclusion of a rule; only the empty
// condition is accepted.
type condition struct {
	Caps      []string        `json:"caps,omitempty"`
	Arches    []string        `json:"arches,omitempty"`
	MinKernel json.RawMessage `json:"minKernel,omitempty"`
}

func (c *condition) empty() bool {
	return c == nil || len(c.Caps) == 0 && len(c.Arches) == 0 && (len(c.MinKernel) == 0 || string(c.MinKernel) == "null")
}

// Parse reads a profile from JSON and validates it. Unknown keys are
// errors (a misspelt key would otherwise silently weaken the filter).
func Parse(data []byte) (*Profile, error) {
	var fp fileProfile
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&fp); err != nil {
		return nil, fmt.Errorf("bad profile JSON: %w", err)
	}
	if dec.More() {
		return nil, errors.New("bad profile JSON: data after the profile")
	}
	p := &Profile{
		DefaultAction:    fp.DefaultAction,
		DefaultErrnoRet:  fp.DefaultErrnoRet,
		Architectures:    fp.Architectures,
		Flags:            fp.Flags,
		ListenerPath:     fp.ListenerPath,
		ListenerMetadata: fp.ListenerMetadata,
	}
	for _, am := range fp.ArchMap {
		p.Architectures = append(p.Architectures, am.Architecture)
		p.Architectures = append(p.Architectures, am.SubArchitectures...)
	}
	for i, s := range fp.Syscalls {
		if !s.Includes.empty() || !s.Excludes.empty() {
			return nil, fmt.Errorf("syscalls[%d]: conditional rules (includes/excludes) are not supported: list the rules that apply", i)
		}
		names := s.Names
		if s.Name != "" {
			names = append([]string{s.Name}, names...)
		}
		p.Syscalls = append(p.Syscalls, specs.LinuxSyscall{Names: names, Action: s.Action, ErrnoRet: s.ErrnoRet, Args: s.Args})
	}
	if err := Validate(p); err != nil {
		return nil, err
	}
	return p, nil
}

// Load reads and validates the profile at path (a Localhost profile).
func Load(path string) (*Profile, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("seccomp profile: %w", err)
	}
	p, err := Parse(data)
	if err != nil {
		return nil, fmt.Errorf("seccomp profile %s: %w", path, err)
	}
	return p, nil
}

// maxErrno is the largest errno a filter may return (the kernel's
// MAX_ERRNO).
const maxErrno = 4095

// Validate checks a profile without compiling it: known actions,
// operators, flags and architectures, argument indexes, errno values. Names
// of system calls are not checked: a name unknown here is skipped by
// Compile, as libseccomp skips names unknown on an architecture.
func Validate(p *Profile) error {
	if p == nil {
		return errors.New("no profile")
	}
	if err := checkAction(p.DefaultAction, p.DefaultErrnoRet); err != nil {
		return fmt.Errorf("defaultAction: %w", err)
	}
	if p.ListenerPath != "" || p.ListenerMetadata != "" {
		return errors.New("listenerPath: user notification (SCMP_ACT_NOTIFY) is not supported")
	}
	for _, f := range p.Flags {
		if _, ok := filterFlags[f]; !ok {
			return fmt.Errorf("flags: unsupported flag %q", f)
		}
	}
	for _, a := range p.Architectures {
		if !knownArches[a] {
			return fmt.Errorf("architectures: unknown architecture %q", a)
		}
	}
	for i, s := range p.Syscalls {
		if len(s.Names) == 0 {
			return fmt.Errorf("syscalls[%d]: no names", i)
		}
		for _, n := range s.Names {
			if n == "" {
				return fmt.Errorf("syscalls[%d]: empty name", i)
			}
		}
		if err := checkAction(s.Action, s.ErrnoRet); err != nil {
			return fmt.Errorf("syscalls[%d] (%s): %w", i, s.Names[0], err)
		}
		for j, a := range s.Args {
			if a.Index >= 6 {
				return fmt.Errorf("syscalls[%d] (%s): args[%d]: index %d out of range 0-5", i, s.Names[0], j, a.Index)
			}
			if !knownOps[a.Op] {
				return fmt.Errorf("syscalls[%d] (%s): args[%d]: unknown operator %q", i, s.Names[0], j, a.Op)
			}
		}
	}
	return nil
}

func checkAction(a specs.LinuxSeccompAction, errnoRet *uint) error {
	switch a {
	case specs.ActErrno, specs.ActTrace:
		if errnoRet != nil && *errnoRet > maxErrno {
			return fmt.Errorf("errno %d out of range 0-%d", *errnoRet, maxErrno)
		}
		return nil
	case specs.ActAllow, specs.ActKill, specs.ActKillThread, specs.ActKillProcess, specs.ActTrap, specs.ActLog:
	case specs.ActNotify:
		return errors.New("SCMP_ACT_NOTIFY (user notification) is not supported")
	case "":
		return errors.New("no action")
	default:
		return fmt.Errorf("unknown action %q", a)
	}
	if errnoRet != nil {
		return fmt.Errorf("errnoRet is only meaningful with SCMP_ACT_ERRNO and SCMP_ACT_TRACE, not %s", a)
	}
	return nil
}

var knownOps = map[specs.LinuxSeccompOperator]bool{
	specs.OpEqualTo: true, specs.OpNotEqual: true, specs.OpLessThan: true, specs.OpLessEqual: true,
	specs.OpGreaterThan: true, specs.OpGreaterEqual: true, specs.OpMaskedEqual: true,
}

var knownArches = map[specs.Arch]bool{
	specs.ArchX86: true, specs.ArchX86_64: true, specs.ArchX32: true, specs.ArchARM: true,
	specs.ArchAARCH64: true, specs.ArchMIPS: true, specs.ArchMIPS64: true, specs.ArchMIPS64N32: true,
	specs.ArchMIPSEL: true, specs.ArchMIPSEL64: true, specs.ArchMIPSEL64N32: true, specs.ArchPPC: true,
	specs.ArchPPC64: true, specs.ArchPPC64LE: true, specs.ArchS390: true, specs.ArchS390X: true,
	specs.ArchPARISC: true, specs.ArchPARISC64: true, specs.ArchRISCV64: true, specs.ArchLOONGARCH64: true,
	specs.ArchM68K: true, specs.ArchSH: true, specs.ArchSHEB: true,
}
