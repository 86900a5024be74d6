package kvm

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/stagelet/stagelet/agent/guest"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/stage1"
)

// fsTag is the virtio-9p mount tag of a pod's shared directory.
const fsTag = "stagelet"

// Pod options read from the policy decision.
const (
	// OptionMemory is the VM's memory: a number of MiB, or with a suffix
	// M/Mi/G/Gi ("512", "512Mi", "1G").
	OptionMemory = "memory"
	// OptionVCPUs is the VM's vCPU count.
	OptionVCPUs = "vcpus"
)

// Bounds of the options. The guest kernel and initramfs boot in no less
// than 128 MiB (below it the kernel runs out of memory unpacking the
// initramfs).
const (
	minMemoryMiB = 128
	maxMemoryMiB = 64 * 1024
	maxVCPUs     = 64
)

// GuestBaseMiB is what the guest itself needs beside the pod's containers
// (kernel, initramfs, agent): a VM sized from the pod's memory limit gets
// the limit plus this.
const GuestBaseMiB = 128

// qemuOwnMiB is what qemu takes of the host's memory beside its guest's.
// The smaps of a running pod's qemu under TCG showed about 30 MiB
// anonymous, its translation cache included, and 20 MiB of its binary and
// libraries: 32 MiB, plus the translation cache's bound under TCG.
func qemuOwnMiB(vm vmInfo) int { return 32 + vm.TBSizeMiB }

// fitVM keeps a pod's VM within limit, the memory limit of the cgroup that
// holds its qemu (0: none): the guest's memory and qemu's own must fit in
// it, or the kernel kills qemu, and with it the pod, once the guest has
// touched enough (its page cache alone fills it in time). The kubelet sets
// that limit to the containers' limits plus the RuntimeClass overhead. A
// VM sized from the pod's resources shrinks to fit, down to minMemoryMiB;
// a VM the policy sizes (explicit) is not shrunk. What cannot fit is
// FailedPrecondition naming the overhead the pod's RuntimeClass needs.
func fitVM(vm *vmInfo, limit uint64, explicit bool, res stage1.PodResources) error {
	if limit == 0 {
		return nil
	}
	own := qemuOwnMiB(*vm)
	room := int(limit>>20) - own
	if vm.MemoryMiB <= room {
		return nil
	}
	if explicit {
		return errdefs.FailedPrecondition("kvm: the pod's cgroup allows %d MiB, and the policy gives its VM %d MiB of memory besides %d MiB for qemu: raise the RuntimeClass overhead (overhead.podFixed.memory) by %d Mi or lower the policy's %s option",
			limit>>20, vm.MemoryMiB, own, vm.MemoryMiB-room, OptionMemory)
	}
	if room < minMemoryMiB {
		containers := int((res.MemoryLimit + (1 << 20) - 1) >> 20)
		return errdefs.FailedPrecondition("kvm: the pod's cgroup allows %d MiB (its containers' limits, %d MiB, plus its RuntimeClass overhead, %d MiB), and a VM needs at least %d MiB of memory besides %d MiB for qemu: give the pod's RuntimeClass overhead.podFixed.memory of at least %dMi",
			limit>>20, containers, res.OverheadMemory>>20, minMemoryMiB, own, GuestBaseMiB+own)
	}
	vm.MemoryMiB = room
	return nil
}

// vmConfig is the VM a pod gets: the policy's options; else sized from the
// pod's resources (memory limit + GuestBaseMiB; vCPUs = the CPU quota
// rounded up); else the defaults. InvalidArgument for a malformed or
// out-of-range option.
func (b *Backend) vmConfig(opts map[string]string, res stage1.PodResources) (vmInfo, error) {
	vm := vmInfo{Machine: b.cfg.Machine, MemoryMiB: b.cfg.MemoryMiB, VCPUs: b.cfg.VCPUs}
	if res.MemoryLimit > 0 {
		vm.MemoryMiB = min(maxMemoryMiB, max(minMemoryMiB, int((res.MemoryLimit+(1<<20)-1)>>20)+GuestBaseMiB))
	}
	if res.CPUQuota > 0 && res.CPUPeriod > 0 {
		vm.VCPUs = min(maxVCPUs, max(1, int((res.CPUQuota+res.CPUPeriod-1)/res.CPUPeriod)))
	}
	if v, ok := opts[OptionMemory]; ok {
		m, err := parseMemory(v)
		if err != nil {
			return vm, errdefs.InvalidArgument("kvm: option %s=%q: %w", OptionMemory, v, err)
		}
		vm.MemoryMiB = m
	}
	if v, ok := opts[OptionVCPUs]; ok {
		n, err := parseVCPUs(v)
		if err != nil {
			return vm, errdefs.InvalidArgument("kvm: option %s=%q: %w", OptionVCPUs, v, err)
		}
		vm.VCPUs = n
	}
	return vm, nil
}

// podOptions are the options kvm's Capabilities declare: the ones
// vmConfig reads, each checked by the parse vmConfig uses.
var podOptions = []stage1.Option{
	{Name: OptionMemory, Doc: fmt.Sprintf("the VM's memory in MiB, or a size with M, Mi, G or Gi such as 512Mi or 1G; %d MiB to %d GiB", minMemoryMiB, maxMemoryMiB/1024),
		Check: func(v string) error { _, err := parseMemory(v); return err }},
	{Name: OptionVCPUs, Doc: fmt.Sprintf("the VM's vCPU count, 1 to %d", maxVCPUs),
		Check: func(v string) error { _, err := parseVCPUs(v); return err }},
}

// parseVCPUs reads a vCPU count.
func parseVCPUs(s string) (int, error) {
	n, err := strconv.Atoi(s)
	if err != nil || n < 1 || n > maxVCPUs {
		return 0, fmt.Errorf("want 1 to %d", maxVCPUs)
	}
	return n, nil
}

// parseMemory reads a memory size in MiB.
func parseMemory(s string) (int, error) {
	num, mult := s, 1
	for _, suf := range []struct {
		s string
		m int
	}{{"Gi", 1024}, {"G", 1024}, {"Mi", 1}, {"M", 1}} {
		if n, ok := strings.CutSuffix(s, suf.s); ok {
			num, mult = n, suf.m
			break
		}
	}
	n, err := strconv.Atoi(num)
	if err != nil {
		return 0, fmt.Errorf("not a size")
	}
	n *= mult
	if n < minMemoryMiB || n > maxMemoryMiB {
		return 0, fmt.Errorf("want %d MiB to %d MiB", minMemoryMiB, maxMemoryMiB)
	}
	return n, nil
}

// tapFD is the file descriptor qemu inherits its tap device on.
const tapFD = 3

// kernelArgs is the guest kernel's command line before stagelet's own
// parameters. panic=-1 with qemu's -no-reboot turns a dead init into a
// qemu exit; tsc_early_khz lets the microvm guest (no PIT, no HPET) skip
// TSC calibration, without which its boot stalls now and then.
//
// tsc=reliable where the host's TSC is invariant (constant and nonstop),
// as Kata's guests have it: the guest's TSC is then steady too (under
// TCG it reads the host's, under KVM it runs at the host's rate).
// Without it the guest kernel's clocksource watchdog checks the TSC
// against jiffies, and when a busy host delays the guest's ticks it
// marks the TSC unstable and falls back to refined-jiffies: a clock that
// moves in 4 ms steps, and timers as coarse, for the life of the pod.
// Three VMs booted while three host threads spun all fell back within
// seconds (their clocks stepped by 8-12 ms).
func kernelArgs(machine string) []string {
	args := []string{"console=ttyS0", "quiet", "loglevel=4", "panic=-1", "reboot=t",
		"random.trust_cpu=on", "cryptomgr.notests", "8250.nr_uarts=1"}
	tsc := hostTSC()
	if tsc.invariant {
		args = append(args, "tsc=reliable")
	}
	if machine == "microvm" && tsc.kHz > 0 {
		args = append(args, "tsc_early_khz="+strconv.Itoa(tsc.kHz))
	}
	return args
}

// memKind is how a VM's memory is backed.
type memKind int

const (
	// memAnonymous: private anonymous memory (a cold boot).
	memAnonymous memKind = iota
	// memTemplate: the file memPath, shared, so that qemu writes the
	// template VM's memory into it.
	memTemplate
	// memRestored: the template's file mapped privately: pages the guest
	// only reads stay the template's, shared by every VM restored from
	// it; pages it writes become its own. Such a VM has no
	// virtio-balloon (free page reporting): qemu 7.2 discards a reported
	// page of a file-backed RAM block by punching a hole in the file
	// (ram_block_discard_range), private mapping or not, which would
	// zero that page of the template under every other VM.
	memRestored
)

// vmSpec is one qemu process's VM. Template, restored and cold-booted VMs
// have the same devices in the same order (qemuArgs renders them all),
// which restoring a saved VM requires.
type vmSpec struct {
	name   string
	vm     vmInfo
	mem    memKind
	memDir string // memTemplate, memRestored: the template directory
	// cmdline is the guest's stagelet.* parameters; nil for a restored VM,
	// which is not booted (no -kernel, -initrd, -append).
	cmdline []string
	port    string // the agent's virtio-serial port name
	// console, ctl and qmp are paths (relative to qemu's working
	// directory) of the console log and the control and QMP sockets.
	console, ctl, qmp string
	// share is the directory exported to the guest over virtio-9p.
	share string
	// tap: "" (no network: the NIC has no backend), "fd" (inherited as
	// tapFD) or "name" (tapName, opened in qemu's network namespace).
	tap, tapName, mac string
	// incoming: wait for the VM's state on QMP (-incoming defer).
	incoming bool
	// paused: the VM does not run until continued on QMP (-S); a VM
	// loaded from a live move waits for its source to stop for good.
	paused bool
}

// qemuArgs is the qemu command line of a VM.
func qemuArgs(t *tools, s vmSpec) []string {
	vm := s.vm
	mem := strconv.Itoa(vm.MemoryMiB) + "M"
	args := []string{
		"-name", s.name,
		"-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
	}
	switch vm.Machine {
	case "q35":
		args = append(args, "-M", "q35,memory-backend=mem")
	default:
		args = append(args, "-M", "microvm,memory-backend=mem,rtc=on",
			"-global", "virtio-mmio.force-legacy=false")
	}
	args = append(args, accelArgs(vm.Accelerator, vm.TBSizeMiB)...)
	args = append(args, "-m", mem, "-smp", strconv.Itoa(vm.VCPUs))
	switch s.mem {
	case memTemplate:
		args = append(args, "-object", "memory-backend-file,id=mem,size="+mem+",mem-path="+filepath.Join(s.memDir, templateMemory)+",share=on")
	case memRestored:
		args = append(args, "-object", "memory-backend-file,id=mem,size="+mem+",mem-path="+filepath.Join(s.memDir, templateMemory)+",share=off")
	case memAnonymous:
		args = append(args, "-object", "memory-backend-ram,id=mem,size="+mem)
	}
	if s.cmdline != nil {
		args = append(args,
			"-kernel", t.kernel,
			"-initrd", t.initrd,
			"-append", strings.Join(append(append(kernelArgs(vm.Machine), s.cmdline...), "--", "agent", "guest"), " "),
		)
	}
	args = append(args,
		"-chardev", "file,id=con,path="+s.console,
		"-serial", "chardev:con",
		"-chardev", "socket,id=ctl,path="+s.ctl+",server=on,wait=off",
		"-qmp", "unix:"+s.qmp+",server=on,wait=off",
		"-object", "rng-random,id=rng,filename=/dev/urandom",
		"-fsdev", "local,id=fs,path="+s.share+",security_model=passthrough,multidevs=remap",
	)
	dev := func(microvm, pci string) string {
		if vm.Machine == "q35" {
			return pci
		}
		return microvm
	}
	nic := dev("virtio-net-device", "virtio-net-pci") + ",id=nic0"
	switch s.tap {
	case "fd":
		args = append(args, "-netdev", "tap,id=net0,fd="+strconv.Itoa(tapFD)+",vhost=off")
	case "name":
		args = append(args, "-netdev", "tap,id=net0,ifname="+s.tapName+",script=no,downscript=no,vhost=off")
	}
	if s.tap != "" {
		nic += ",netdev=net0"
	}
	if s.mac != "" {
		nic += ",mac=" + s.mac
	}
	args = append(args,
		"-device", dev("virtio-serial-device", "virtio-serial-pci")+",max_ports=2",
		"-device", "virtserialport,chardev=ctl,name="+s.port,
		"-device", dev("virtio-9p-device", "virtio-9p-pci")+",fsdev=fs,mount_tag="+fsTag,
		"-device", dev("virtio-rng-device", "virtio-rng-pci")+",rng=rng",
		"-device", nic,
		// Containers' image disks are plugged here at run time (disks.go).
		"-device", dev("virtio-scsi-device", "virtio-scsi-pci")+",id="+scsiController,
	)
	if s.incoming {
		args = append(args, "-incoming", "defer")
	}
	if s.paused {
		args = append(args, "-S")
	}
	return args
}

// accelArgs selects the accelerator; under TCG tbSizeMiB (0: qemu's
// default) bounds the translation cache, qemu's largest private memory.
func accelArgs(accel string, tbSizeMiB int) []string {
	if accel == "kvm" {
		return []string{"-accel", "kvm", "-cpu", "host"}
	}
	if tbSizeMiB > 0 {
		return []string{"-accel", "tcg,tb-size=" + strconv.Itoa(tbSizeMiB)}
	}
	return []string{"-accel", "tcg"}
}

// tscFacts are what /proc/cpuinfo says of the host's TSC.
type tscFacts struct {
	// kHz is its frequency (the guest's TSC runs at the host's under
	// both KVM and TCG); 0 when unknown.
	kHz int
	// invariant: it ticks at one rate whatever the CPU's frequency and
	// sleep states (the constant_tsc and nonstop_tsc flags).
	invariant bool
}

// hostTSC reads the host's TSC facts once.
var hostTSC = sync.OnceValue(func() tscFacts {
	b, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		return tscFacts{}
	}
	return parseTSC(string(b))
})

// parseTSC reads the TSC facts of the first CPU in cpuinfo.
func parseTSC(cpuinfo string) tscFacts {
	var t tscFacts
	sawMHz, sawFlags := false, false
	for _, line := range strings.Split(cpuinfo, "\n") {
		k, v, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		switch strings.TrimSpace(k) {
		case "cpu MHz":
			if !sawMHz {
				sawMHz = true
				if mhz, err := strconv.ParseFloat(strings.TrimSpace(v), 64); err == nil && mhz > 0 {
					t.kHz = int(mhz * 1000)
				}
			}
		case "flags":
			if !sawFlags {
				sawFlags = true
				f := strings.Fields(v)
				t.invariant = slices.Contains(f, "constant_tsc") && slices.Contains(f, "nonstop_tsc")
			}
		}
	}
	return t
}

// accelerator returns the accelerator pods use in this daemon run: the
// configured one, or the result of a probe run once (KVM when a guest
// boots to its agent under KVM within ProbeTimeout, else TCG).
func (b *Backend) accelerator(ctx context.Context, t *tools) string {
	b.accelOnce.Do(func() {
		defer func() { a := b.accel; b.chosen.Store(&a) }()
		if a := b.cfg.Accelerator; a != "" {
			b.accel = a
			b.accelReason = "set by kvm.accelerator in the configuration"
			b.Log.InfoContext(ctx, "kvm: accelerator from the configuration", "accelerator", a)
			return
		}
		start := time.Now()
		err := probeKVM(ctx, t, b.cfg.Machine, b.cfg.ProbeTimeout)
		if err == nil {
			b.accel = "kvm"
			b.accelReason = "a guest boots under KVM"
			b.Log.InfoContext(ctx, "kvm: a guest boots under KVM: using KVM", "accelerator", "kvm", "probe", time.Since(start).Round(time.Millisecond))
			return
		}
		b.accel = "tcg"
		b.accelReason = "a guest does not boot under KVM: " + err.Error()
		b.Log.WarnContext(ctx, "kvm: a guest does not boot under KVM: using software emulation (TCG), which is much slower",
			"accelerator", "tcg", "reason", err, "probe", time.Since(start).Round(time.Millisecond))
	})
	return b.accel
}

// Accelerator probes (once) and returns the accelerator pods get: "kvm"
// or "tcg". The daemon may call it at start so that the first pod does not
// wait for the probe; it fails (FailedPrecondition) when qemu or the guest
// assets are missing.
func (b *Backend) Accelerator(ctx context.Context) (string, error) {
	t, err := b.resolveTools()
	if err != nil {
		return "", err
	}
	return b.accelerator(ctx, t), nil
}

// probeKVM boots the guest under KVM in probe mode (the agent prints
// guest.Ready once it found its port, then powers off) and waits for
// that line on the console. Any failure (no /dev/kvm, qemu refusing the
// CPU, a boot that hangs) is an error.
func probeKVM(ctx context.Context, t *tools, machine string, timeout time.Duration) error {
	if _, err := os.Stat("/dev/kvm"); err != nil {
		return fmt.Errorf("no /dev/kvm")
	}
	return bootProbe(ctx, t, "kvm", machine, timeout)
}

// bootProbe boots the guest in probe mode under accel and returns once the
// agent printed guest.Ready; an error when qemu exits first or
// timeout passes.
func bootProbe(ctx context.Context, t *tools, accel, machine string, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	gcfg := &guest.Config{Port: guest.DefaultPort, Probe: true}
	m := "microvm"
	if machine == "q35" {
		m = "q35"
	}
	serial, dev := "virtio-serial-device", "virtserialport"
	if m == "q35" {
		serial = "virtio-serial-pci"
	}
	args := []string{"-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
		"-M", m}
	args = append(args, accelArgs(accel, 0)...)
	args = append(args,
		"-m", "128M", "-smp", "1",
		"-kernel", t.kernel, "-initrd", t.initrd,
		"-append", strings.Join(append(append(kernelArgs(m), gcfg.Cmdline()...), "--", "agent", "guest"), " "),
		"-serial", "stdio",
		"-chardev", "null,id=ctl",
		"-device", serial,
		"-device", dev+",chardev=ctl,name="+gcfg.Port,
	)
	cmd := exec.Command(t.qemu, args...)
	cmd.Stdin = nil
	out, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	cmd.Stderr = cmd.Stdout
	// The probe dies with the daemon: killed mid-probe (SIGKILL leaves no
	// time to clean up), it would leave a VM that hangs under KVM on a
	// host where the guest faults, paused and holding its memory, at every
	// start. The goroutine starting it is not locked to its thread, so the
	// thread outlives the probe.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return err
	}
	found := make(chan bool, 1)
	var tail strings.Builder
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			line := sc.Text()
			if strings.Contains(line, guest.Ready) {
				found <- true
				io.Copy(io.Discard, out)
				return
			}
			if tail.Len() < 4096 {
				tail.WriteString(line + "\n")
			}
		}
		found <- false
	}()
	var ok, got bool
	select {
	case ok = <-found:
		got = true
	case <-ctx.Done():
	}
	cmd.Process.Kill()
	cmd.Wait()
	if !got {
		ok = <-found // the pipe closed with qemu: the reader is done
	}
	if ok {
		return nil
	}
	msg := telling(tail.String())
	if ctx.Err() != nil {
		if msg == "" {
			msg = "the console stayed silent"
		}
		return fmt.Errorf("no guest agent after %s under %s (console: %s)", timeout, accel, msg)
	}
	return fmt.Errorf("qemu exited under %s: %s", accel, msg)
}

// telling picks from a console's tail the line that says most about a
// failed boot: qemu's own complaint (an assertion, an error), else the
// guest kernel's (a panic, an oops and its cause), else the last line.
func telling(out string) string {
	lines := strings.Split(strings.TrimSpace(out), "\n")
	for _, marks := range [][]string{
		{"Assertion", "qemu-system", "KVM internal error", "error"},
		{"Kernel panic", "invalid opcode", "general protection", "BUG:", "Oops", "unchecked MSR", "RIP:"},
	} {
		for _, m := range marks {
			for i := len(lines) - 1; i >= 0; i-- {
				if strings.Contains(lines[i], m) {
					return strings.TrimSpace(lines[i])
				}
			}
		}
	}
	return strings.TrimSpace(lines[len(lines)-1])
}
