package seccomp

import (
	"errors"
	"fmt"
	"slices"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/net/bpf"
)

// Return values of a filter (SECCOMP_RET_* in linux/seccomp.h).
const (
	retKillProcess = 0x80000000
	retKillThread  = 0x00000000
	retTrap        = 0x00030000
	retErrno       = 0x00050000
	retTrace       = 0x7ff00000
	retLog         = 0x7ffc0000
	retAllow       = 0x7fff0000
)

// Filter flags (SECCOMP_FILTER_FLAG_*).
const (
	flagTSync     = 0x1
	flagLog       = 0x2
	flagSpecAllow = 0x4
)

var filterFlags = map[specs.LinuxSeccompFlag]uint{
	specs.LinuxSeccompFlagLog:       flagLog,
	specs.LinuxSeccompFlagSpecAllow: flagSpecAllow,
}

// The x86_64 ABI as the filter sees it.
const (
	auditArchX86_64 = 0xc000003e // AUDIT_ARCH_X86_64
	x32SyscallBit   = 0x40000000 // __X32_SYSCALL_BIT: x32 calls share AUDIT_ARCH_X86_64
)

// Offsets in struct seccomp_data: nr, arch, instruction_pointer, args[6].
// The args are 64-bit, little-endian on x86_64: the low half comes first.
const (
	offNr   = 0
	offArch = 4
	offArgs = 16
)

// maxInstructions is the kernel's limit on a classic BPF program
// (BPF_MAXINSNS).
const maxInstructions = 4096

// Filter is a compiled profile, ready for Install.
type Filter struct {
	// Program is the classic BPF program run on each system call.
	Program []bpf.RawInstruction
	// Flags are the SECCOMP_FILTER_FLAG_* the profile asks for.
	Flags uint
	// Notes say what was skipped: names of system calls unknown on x86_64,
	// architectures the filter does not cover.
	Notes []string
}

// rule is one profile entry for one system call.
type rule struct {
	ret  uint32
	args []specs.LinuxSeccompArg
}

// Compile turns a profile into a seccomp BPF program for x86_64. The
// program:
//
//   - kills the process for a call made through another ABI (i386, x32);
//   - for each system call the profile names, tries the entries with
//     argument comparisons in profile order (all comparisons of an entry
//     must hold; the first entry that holds decides), then the entry
//     without comparisons, if any;
//   - otherwise returns the default action.
//
// Comparisons are on the full 64-bit argument, unsigned, as libseccomp
// does on 64-bit architectures. Two entries without comparisons for the
// same call with different actions are an error, as in libseccomp; entries
// whose action is the default action and that have no comparisons are
// dropped. Names unknown on x86_64 are skipped with a note.
func Compile(p *Profile) (*Filter, error) {
	if err := Validate(p); err != nil {
		return nil, err
	}
	f := &Filter{}
	for _, fl := range p.Flags {
		f.Flags |= filterFlags[fl]
	}
	for _, a := range p.Architectures {
		switch a {
		case specs.ArchX86_64:
		case specs.ArchX86, specs.ArchX32:
			f.Notes = append(f.Notes, fmt.Sprintf("architecture %s: its system calls kill the process (only x86_64 calls are filtered)", a))
		default:
			f.Notes = append(f.Notes, fmt.Sprintf("architecture %s: not this machine's, skipped", a))
		}
	}
	defRet := actionRet(p.DefaultAction, p.DefaultErrnoRet)
	g, err := groupSyscalls(p, f)
	if err != nil {
		return nil, err
	}
	prog, err := program(g, defRet)
	if err != nil {
		return nil, err
	}
	raw, err := bpf.Assemble(prog)
	if err != nil {
		return nil, fmt.Errorf("assemble: %w", err)
	}
	f.Program = raw
	return f, nil
}

// syscallRules are a profile's entries by system call number, in order of
// first mention: the entries with argument comparisons, and the action of
// the one without, if any.
type syscallRules struct {
	order []uint32
	conds map[uint32][]rule
	plain map[uint32]*uint32
}

// groupSyscalls groups p's entries by system call number; names unknown on
// x86_64 are noted in f and skipped.
func groupSyscalls(p *Profile, f *Filter) (*syscallRules, error) {
	g := &syscallRules{conds: map[uint32][]rule{}, plain: map[uint32]*uint32{}}
	unknown := map[string]bool{}
	for _, s := range p.Syscalls {
		ret := actionRet(s.Action, s.ErrnoRet)
		for _, name := range s.Names {
			nr, ok := sysnumX86_64[name]
			if !ok {
				if !unknown[name] {
					unknown[name] = true
					f.Notes = append(f.Notes, fmt.Sprintf("system call %q is unknown on x86_64, skipped", name))
				}
				continue
			}
			if _, seen := g.conds[nr]; !seen && g.plain[nr] == nil {
				g.order = append(g.order, nr)
				g.conds[nr] = nil
			}
			if len(s.Args) > 0 {
				g.conds[nr] = append(g.conds[nr], rule{ret: ret, args: s.Args})
				continue
			}
			if prev := g.plain[nr]; prev != nil {
				if *prev != ret {
					return nil, fmt.Errorf("system call %q has two entries without argument comparisons and different actions", name)
				}
				continue
			}
			g.plain[nr] = &ret
		}
	}
	return g, nil
}

// program is the filter's code: the architecture check, then one test
// and body per system call, then the default action.
func program(g *syscallRules, defRet uint32) ([]bpf.Instruction, error) {
	var prog []bpf.Instruction
	prog = append(prog,
		bpf.LoadAbsolute{Off: offArch, Size: 4},
		bpf.JumpIf{Cond: bpf.JumpEqual, Val: auditArchX86_64, SkipTrue: 1},
		bpf.RetConstant{Val: retKillProcess},
		bpf.LoadAbsolute{Off: offNr, Size: 4},
		bpf.JumpIf{Cond: bpf.JumpGreaterOrEqual, Val: x32SyscallBit, SkipFalse: 1},
		bpf.RetConstant{Val: retKillProcess},
	)
	for _, nr := range g.order {
		final := defRet
		if r := g.plain[nr]; r != nil {
			final = *r
		}
		rules := g.conds[nr]
		if len(rules) == 0 && final == defRet {
			continue // the default decides anyway
		}
		var body []bpf.Instruction
		for _, r := range rules {
			code, err := ruleCode(r)
			if err != nil {
				return nil, err
			}
			body = append(body, code...)
		}
		body = append(body, bpf.RetConstant{Val: final})
		// A body always ends in a return: control never runs from one
		// body into the next test, which expects nr in the accumulator.
		if len(body) <= 255 {
			prog = append(prog, bpf.JumpIf{Cond: bpf.JumpEqual, Val: nr, SkipFalse: uint8(len(body))})
		} else {
			prog = append(prog,
				bpf.JumpIf{Cond: bpf.JumpEqual, Val: nr, SkipTrue: 1},
				bpf.Jump{Skip: uint32(len(body))})
		}
		prog = append(prog, body...)
	}
	prog = append(prog, bpf.RetConstant{Val: defRet})
	if len(prog) > maxInstructions {
		return nil, fmt.Errorf("the profile compiles to %d instructions, more than the kernel's %d", len(prog), maxInstructions)
	}
	return prog, nil
}

// actionRet is the filter return value for a (validated) action.
func actionRet(a specs.LinuxSeccompAction, errnoRet *uint) uint32 {
	data := uint32(1) // EPERM, as runc and containerd default
	if errnoRet != nil {
		data = uint32(*errnoRet)
	}
	switch a {
	case specs.ActAllow:
		return retAllow
	case specs.ActErrno:
		return retErrno | data
	case specs.ActTrace:
		return retTrace | data
	case specs.ActKill, specs.ActKillThread:
		return retKillThread
	case specs.ActKillProcess:
		return retKillProcess
	case specs.ActTrap:
		return retTrap
	case specs.ActLog:
		return retLog
	}
	panic("seccomp: unvalidated action " + string(a))
}

// Jump targets inside a rule's code.
type target int

const (
	tNext target = iota // the following instruction
	tPass               // the end of this comparison: the next comparison
	tFail               // past the rule's return: the next rule
)

// cinsn is an instruction of a comparison: a plain one, or a conditional
// jump to symbolic targets.
type cinsn struct {
	plain    bpf.Instruction
	cond     bpf.JumpTest
	val      uint32
	onT, onF target
	isJump   bool
}

func ld(off uint32) cinsn { return cinsn{plain: bpf.LoadAbsolute{Off: off, Size: 4}} }

func jmp(cond bpf.JumpTest, val uint32, t, f target) cinsn {
	return cinsn{isJump: true, cond: cond, val: val, onT: t, onF: f}
}

// compare is the code of one 64-bit comparison: it falls through (tPass)
// when the comparison holds and jumps to tFail when it does not.
func compare(a specs.LinuxSeccompArg) ([]cinsn, error) {
	hiOff := uint32(offArgs + 8*a.Index + 4)
	loOff := uint32(offArgs + 8*a.Index)
	vHi, vLo := uint32(a.Value>>32), uint32(a.Value)
	switch a.Op {
	case specs.OpEqualTo:
		return []cinsn{
			ld(hiOff), jmp(bpf.JumpEqual, vHi, tNext, tFail),
			ld(loOff), jmp(bpf.JumpEqual, vLo, tPass, tFail),
		}, nil
	case specs.OpNotEqual:
		return []cinsn{
			ld(hiOff), jmp(bpf.JumpEqual, vHi, tNext, tPass),
			ld(loOff), jmp(bpf.JumpEqual, vLo, tFail, tPass),
		}, nil
	case specs.OpGreaterThan, specs.OpGreaterEqual:
		// hi > vHi, or hi == vHi and lo > (>=) vLo.
		last := bpf.JumpGreaterThan
		if a.Op == specs.OpGreaterEqual {
			last = bpf.JumpGreaterOrEqual
		}
		return []cinsn{
			ld(hiOff), jmp(bpf.JumpGreaterThan, vHi, tPass, tNext),
			jmp(bpf.JumpEqual, vHi, tNext, tFail),
			ld(loOff), jmp(last, vLo, tPass, tFail),
		}, nil
	case specs.OpLessThan, specs.OpLessEqual:
		// Less than is not greater or equal; less or equal is not greater.
		last := bpf.JumpGreaterOrEqual
		if a.Op == specs.OpLessEqual {
			last = bpf.JumpGreaterThan
		}
		return []cinsn{
			ld(hiOff), jmp(bpf.JumpGreaterThan, vHi, tFail, tNext),
			jmp(bpf.JumpEqual, vHi, tNext, tPass),
			ld(loOff), jmp(last, vLo, tFail, tPass),
		}, nil
	case specs.OpMaskedEqual:
		// (arg & Value) == ValueTwo.
		mHi, mLo := vHi, vLo
		dHi, dLo := uint32(a.ValueTwo>>32), uint32(a.ValueTwo)
		return []cinsn{
			ld(hiOff), {plain: bpf.ALUOpConstant{Op: bpf.ALUOpAnd, Val: mHi}}, jmp(bpf.JumpEqual, dHi, tNext, tFail),
			ld(loOff), {plain: bpf.ALUOpConstant{Op: bpf.ALUOpAnd, Val: mLo}}, jmp(bpf.JumpEqual, dLo, tPass, tFail),
		}, nil
	}
	return nil, fmt.Errorf("unknown operator %q", a.Op)
}

// ruleCode is the code of one entry with comparisons: when every
// comparison holds it returns the entry's action; otherwise it falls
// through to what follows (the next entry, or the block's last return).
func ruleCode(r rule) ([]bpf.Instruction, error) {
	var cmps [][]cinsn
	total := 0
	for _, a := range r.args {
		c, err := compare(a)
		if err != nil {
			return nil, err
		}
		cmps = append(cmps, c)
		total += len(c)
	}
	// Layout: comparisons, then the return; tFail lands just past it.
	failAt := total + 1
	out := make([]bpf.Instruction, 0, total+1)
	for _, c := range cmps {
		end := len(out) + len(c)
		for _, in := range c {
			pos := len(out)
			if !in.isJump {
				out = append(out, in.plain)
				continue
			}
			skip := func(t target) (uint8, error) {
				var to int
				switch t {
				case tNext:
					return 0, nil
				case tPass:
					to = end
				case tFail:
					to = failAt
				}
				d := to - pos - 1
				if d < 0 || d > 255 {
					return 0, errors.New("an entry has too many argument comparisons")
				}
				return uint8(d), nil
			}
			st, err := skip(in.onT)
			if err != nil {
				return nil, err
			}
			sf, err := skip(in.onF)
			if err != nil {
				return nil, err
			}
			out = append(out, bpf.JumpIf{Cond: in.cond, Val: in.val, SkipTrue: st, SkipFalse: sf})
		}
	}
	out = append(out, bpf.RetConstant{Val: r.ret})
	return out, nil
}

// Decide runs a compiled program on one system call, as the kernel would,
// and returns the filter's return value. nr and args are as the x86_64 ABI
// passes them; arch is the AUDIT_ARCH_* value. It is for tests and for
// explaining a profile.
func (f *Filter) Decide(arch, nr uint32, args [6]uint64) (uint32, error) {
	vm, err := f.vm()
	if err != nil {
		return 0, err
	}
	return decide(vm, arch, nr, args)
}

// vm loads the program into a BPF interpreter, which can run it any
// number of times.
func (f *Filter) vm() (*bpf.VM, error) {
	insns, ok := bpf.Disassemble(f.Program)
	if !ok {
		return nil, errors.New("program does not disassemble")
	}
	return bpf.NewVM(insns)
}

func decide(vm *bpf.VM, arch, nr uint32, args [6]uint64) (uint32, error) {
	// The VM loads words big-endian; seccomp loads them in the machine's
	// order. Store each 32-bit word big-endian at the offset the kernel
	// reads it from.
	data := make([]byte, 64)
	put := func(off int, v uint32) {
		data[off], data[off+1], data[off+2], data[off+3] = byte(v>>24), byte(v>>16), byte(v>>8), byte(v)
	}
	put(offNr, nr)
	put(offArch, arch)
	for i, a := range args {
		put(offArgs+8*i, uint32(a))
		put(offArgs+8*i+4, uint32(a>>32))
	}
	n, err := vm.Run(data)
	if err != nil {
		return 0, err
	}
	return uint32(n), nil
}

// Call is a system call by name, with the arguments known in advance
// (argument index to value).
type Call struct {
	Name  string
	Fixed map[int]uint64
}

// Lets tells whether the filter lets every one of calls through (allows or
// only logs it) whatever its arguments, except the fixed ones: each other
// argument is tried as 0 and as all ones. It is conservative: a filter
// whose decision on a call depends on its free arguments does not let it
// through. An unknown name is an error.
func (f *Filter) Lets(calls ...Call) (bool, error) {
	vm, err := f.vm()
	if err != nil {
		return false, err
	}
	for _, c := range calls {
		nr, ok := SyscallNumber(c.Name)
		if !ok {
			return false, fmt.Errorf("seccomp: unknown system call %q", c.Name)
		}
		for _, free := range []uint64{0, ^uint64(0)} {
			var args [6]uint64
			for i := range args {
				args[i] = free
				if v, ok := c.Fixed[i]; ok {
					args[i] = v
				}
			}
			ret, err := decide(vm, auditArchX86_64, nr, args)
			if err != nil {
				return false, err
			}
			if ret != retAllow && ret != retLog {
				return false, nil
			}
		}
	}
	return true, nil
}

// SyscallNumber returns the x86_64 number of a system call name.
func SyscallNumber(name string) (uint32, bool) {
	nr, ok := sysnumX86_64[name]
	return nr, ok
}

// SyscallNames lists the x86_64 system call names the compiler knows.
func SyscallNames() []string {
	names := make([]string, 0, len(sysnumX86_64))
	for n := range sysnumX86_64 {
		names = append(names, n)
	}
	slices.Sort(names)
	return names
}
