package cgroups

import (
	"errors"
	"fmt"
	"os"
	"strings"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/link"
	specs "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"
)

// checkDeviceRules checks rules are in the canonical form SetDevices
// applies: a first rule over every device (type "a", no numbers, "rwm")
// that allows or denies all, then, after a denial, rules that allow.
func checkDeviceRules(rules []specs.LinuxDeviceCgroup) error {
	if len(rules) == 0 {
		return errors.New("devices: no rules")
	}
	first := rules[0]
	if first.Type != "a" || first.Major != nil || first.Minor != nil || first.Access != "rwm" {
		return fmt.Errorf("devices: the first rule %+v is not one over every device", first)
	}
	if first.Allow && len(rules) > 1 {
		return errors.New("devices: rules after one allowing every device")
	}
	for _, r := range rules[1:] {
		if !r.Allow {
			return fmt.Errorf("devices: a denial %+v after the first rule", r)
		}
		if r.Type != "a" && r.Type != "c" && r.Type != "b" {
			return fmt.Errorf("devices: rule type %q", r.Type)
		}
		if r.Access == "" || strings.Trim(r.Access, "rwm") != "" {
			return fmt.Errorf("devices: rule access %q", r.Access)
		}
	}
	return nil
}

// SetDevices fences the devices the cgroup's processes may create and
// open: with cgroup v1 through the devices controller's lists, with v2
// through a BPF_PROG_TYPE_CGROUP_DEVICE program attached to the cgroup
// (as runc does, with BPF_F_ALLOW_MULTI: a program its ancestors have
// still applies). rules are in canonical form (see checkDeviceRules).
// Set once, before the cgroup holds a process.
func (c *Cgroup) SetDevices(rules []specs.LinuxDeviceCgroup) error {
	if err := checkDeviceRules(rules); err != nil {
		return err
	}
	if d, ok := c.Paths[Unified]; ok {
		return attachDeviceFilter(d, rules)
	}
	d, ok := c.Paths["devices"]
	if !ok {
		return errors.New("devices: no devices controller")
	}
	if rules[0].Allow {
		return writeFile(d, "devices.allow", "a")
	}
	if err := writeFile(d, "devices.deny", "a"); err != nil {
		return err
	}
	for _, r := range rules[1:] {
		if err := writeFile(d, "devices.allow", v1Rule(r)); err != nil {
			return fmt.Errorf("devices.allow %q: %w", v1Rule(r), err)
		}
	}
	return nil
}

// v1Rule is a rule as devices.allow takes it: "c 1:3 rwm", "*" for any
// number.
func v1Rule(r specs.LinuxDeviceCgroup) string {
	num := func(n *int64) string {
		if n == nil {
			return "*"
		}
		return fmt.Sprint(*n)
	}
	return fmt.Sprintf("%s %s:%s %s", r.Type, num(r.Major), num(r.Minor), r.Access)
}

// The kernel's struct bpf_cgroup_dev_ctx: access_type (the device type in
// the low 16 bits, the access in the high ones), major, minor.
const (
	devCtxAccessType = 0
	devCtxMajor      = 4
	devCtxMinor      = 8

	bpfDevcgDevBlock = 1
	bpfDevcgDevChar  = 2

	bpfDevcgAccMknod = 1
	bpfDevcgAccRead  = 2
	bpfDevcgAccWrite = 4
)

// DeviceProgram is the cgroup device program of rules (canonical form):
// each allow rule is tried in order, a match returns 1 (allow); what none
// matches gets the first rule's answer.
func DeviceProgram(rules []specs.LinuxDeviceCgroup) (asm.Instructions, error) {
	if err := checkDeviceRules(rules); err != nil {
		return nil, err
	}
	insns := asm.Instructions{
		asm.LoadMem(asm.R2, asm.R1, devCtxAccessType, asm.Word),
		asm.And.Imm(asm.R2, 0xffff), // type
		asm.LoadMem(asm.R3, asm.R1, devCtxAccessType, asm.Word),
		asm.RSh.Imm(asm.R3, 16), // access
		asm.LoadMem(asm.R4, asm.R1, devCtxMajor, asm.Word),
		asm.LoadMem(asm.R5, asm.R1, devCtxMinor, asm.Word),
	}
	for i, r := range rules[1:] {
		next := fmt.Sprintf("rule%d", i+1)
		var block asm.Instructions
		switch r.Type {
		case "c":
			block = append(block, asm.JNE.Imm(asm.R2, bpfDevcgDevChar, next))
		case "b":
			block = append(block, asm.JNE.Imm(asm.R2, bpfDevcgDevBlock, next))
		}
		var mask int32
		for _, a := range r.Access {
			switch a {
			case 'm':
				mask |= bpfDevcgAccMknod
			case 'r':
				mask |= bpfDevcgAccRead
			case 'w':
				mask |= bpfDevcgAccWrite
			}
		}
		if mask != bpfDevcgAccMknod|bpfDevcgAccRead|bpfDevcgAccWrite {
			// Allowed when the access asks nothing beyond the mask.
			block = append(block,
				asm.Mov.Reg32(asm.R6, asm.R3),
				asm.And.Imm32(asm.R6, ^mask),
				asm.JNE.Imm(asm.R6, 0, next))
		}
		if r.Major != nil {
			block = append(block, asm.JNE.Imm(asm.R4, int32(*r.Major), next))
		}
		if r.Minor != nil {
			block = append(block, asm.JNE.Imm(asm.R5, int32(*r.Minor), next))
		}
		block = append(block, asm.Mov.Imm(asm.R0, 1), asm.Return())
		if i > 0 {
			block[0] = block[0].WithSymbol(fmt.Sprintf("rule%d", i))
		}
		insns = append(insns, block...)
	}
	deflt := int32(0)
	if rules[0].Allow {
		deflt = 1
	}
	last := asm.Mov.Imm(asm.R0, deflt)
	if n := len(rules) - 1; n > 0 {
		last = last.WithSymbol(fmt.Sprintf("rule%d", n))
	}
	return append(insns, last, asm.Return()), nil
}

// attachDeviceFilter loads the device program of rules and attaches it to
// the cgroup directory dir. The attachment outlives the program's file
// descriptor: it goes with the cgroup.
func attachDeviceFilter(dir string, rules []specs.LinuxDeviceCgroup) error {
	insns, err := DeviceProgram(rules)
	if err != nil {
		return err
	}
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Type:         ebpf.CGroupDevice,
		Instructions: insns,
		License:      "Apache-2.0",
	})
	if err != nil {
		return fmt.Errorf("devices: load the device filter: %w", err)
	}
	defer prog.Close()
	f, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := link.RawAttachProgram(link.RawAttachProgramOptions{
		Target:  int(f.Fd()),
		Program: prog,
		Attach:  ebpf.AttachCGroupDevice,
		Flags:   unix.BPF_F_ALLOW_MULTI,
	}); err != nil {
		return fmt.Errorf("devices: attach the device filter to %s: %w", dir, err)
	}
	return nil
}
