package kvm

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/stagelet/stagelet/agent"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/stage1"
)

// fsTag is the virtio-fs tag of a pod's shared directory.
const fsTag = "stagelet"

// Pod options read from the policy decision.
const (
	// OptionMemory is the VM's memory: a number of MiB, or with a suffix
	// M/Mi/G/Gi ("512", "512Mi", "1G").
	OptionMemory = "memory"
	// OptionVCPUs is the VM's vCPU count.
	OptionVCPUs = "vcpus"
)

// Bounds of the options.
const (
	minMemoryMiB = 64
	maxMemoryMiB = 64 * 1024
	maxVCPUs     = 64
)

// GuestBaseMiB is what the guest itself needs beside the pod's containers
// (kernel, initramfs, agent): a VM sized from the pod's memory limit gets
// the limit plus this.
const GuestBaseMiB = 128

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
			return vm, errdefs.InvalidArgument("kvm: option %s=%q: %v", OptionMemory, v, err)
		}
		vm.MemoryMiB = m
	}
	if v, ok := opts[OptionVCPUs]; ok {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > maxVCPUs {
			return vm, errdefs.InvalidArgument("kvm: option %s=%q: want 1 to %d", OptionVCPUs, v, maxVCPUs)
		}
		vm.VCPUs = n
	}
	return vm, nil
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
func kernelArgs(machine string) []string {
	args := []string{"console=ttyS0", "quiet", "loglevel=4", "panic=-1", "reboot=t",
		"random.trust_cpu=on", "cryptomgr.notests", "8250.nr_uarts=1"}
	if machine == "microvm" {
		if khz := tscKHz(); khz > 0 {
			args = append(args, "tsc_early_khz="+strconv.Itoa(khz))
		}
	}
	return args
}

// qemuArgs is the qemu command line of a pod's VM. tap says how qemu finds
// the pod's tap device: "" (no network), "fd" (inherited as tapFD) or
// "name" (opened by its name in the network namespace qemu runs in).
func qemuArgs(t *tools, st *state, guest *agent.GuestConfig, tap string, podID string) []string {
	vm := st.VM
	mem := strconv.Itoa(vm.MemoryMiB) + "M"
	args := []string{
		"-name", "stagelet-" + podID,
		"-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
	}
	switch vm.Machine {
	case "q35":
		args = append(args, "-M", "q35,memory-backend=mem")
	default:
		// Modern virtio-mmio: vhost-user (virtiofsd) refuses legacy
		// devices.
		args = append(args, "-M", "microvm,memory-backend=mem,rtc=on",
			"-global", "virtio-mmio.force-legacy=false")
	}
	args = append(args, accelArgs(vm.Accelerator)...)
	args = append(args,
		"-m", mem,
		"-smp", strconv.Itoa(vm.VCPUs),
		// vhost-user (virtiofsd) needs the guest memory shared.
		"-object", "memory-backend-memfd,id=mem,size="+mem+",share=on",
		"-kernel", t.kernel,
		"-initrd", t.initrd,
		"-append", strings.Join(append(append(kernelArgs(vm.Machine), guest.Cmdline()...), "--", "agent", "guest"), " "),
		"-chardev", "file,id=con,path="+st.Dir+"/console.log",
		"-serial", "chardev:con",
		// Relative to the working directory, st.sockDir().
		"-chardev", "socket,id=ctl,path="+st.sockName(ctlSocketName)+",server=on,wait=off",
		"-chardev", "socket,id=fs,path="+st.sockName(fsSocketName),
		"-object", "rng-random,id=rng,filename=/dev/urandom",
	)
	dev := func(microvm, pci string) string {
		if vm.Machine == "q35" {
			return pci
		}
		return microvm
	}
	args = append(args,
		"-device", dev("virtio-serial-device", "virtio-serial-pci")+",max_ports=2",
		"-device", "virtserialport,chardev=ctl,name="+guest.Port,
		"-device", dev("vhost-user-fs-device", "vhost-user-fs-pci")+",chardev=fs,tag="+fsTag,
		"-device", dev("virtio-rng-device", "virtio-rng-pci")+",rng=rng",
	)
	if tap != "" {
		netdev := "tap,id=net0,fd=" + strconv.Itoa(tapFD) + ",vhost=off"
		if tap == "name" {
			netdev = "tap,id=net0,ifname=" + st.Tap + ",script=no,downscript=no,vhost=off"
		}
		args = append(args,
			"-netdev", netdev,
			"-device", dev("virtio-net-device", "virtio-net-pci")+",netdev=net0,mac="+guest.MAC.String(),
		)
	}
	return args
}

func accelArgs(accel string) []string {
	if accel == "kvm" {
		return []string{"-accel", "kvm", "-cpu", "host"}
	}
	return []string{"-accel", "tcg"}
}

// virtiofsdArgs is virtiofsd's command line: it exports the pod's shared
// directory. In its own mount namespace (sandbox=namespace) it is a slave
// of the shared mount, so binds made beneath it on the host later appear.
//
// Submounts are not announced: the guest then sees one file system, not
// one superblock per host bind (each container's rootfs, log directory
// and volumes). With them, a container's rootfs was a superblock only its
// mount namespace held, torn down when its last process exited, and the
// 6.1 guest kernel hit "Busy inodes after unmount of virtiofs" there (a
// BUG that kills the VM) now and then. File serial numbers are then the
// host's across its file systems, which may repeat between two volumes.
func virtiofsdArgs(st *state) []string {
	return []string{
		"--socket-path=" + st.sockName(fsSocketName), // relative to st.sockDir()
		"-o", "source=" + st.Mounts,
		"-o", "cache=auto",
		"-o", "sandbox=namespace",
		"-o", "log_level=warn",
	}
}

// tscKHz is the host's TSC frequency, read from /proc/cpuinfo (the
// guest's TSC runs at the host's under both KVM and TCG); 0 when unknown.
func tscKHz() int {
	f, err := os.Open("/proc/cpuinfo")
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if ok && strings.TrimSpace(k) == "cpu MHz" {
			mhz, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			if err == nil && mhz > 0 {
				return int(mhz * 1000)
			}
		}
	}
	return 0
}

// accelerator returns the accelerator pods use in this daemon run: the
// configured one, or the result of a probe run once (KVM when a guest
// boots to its agent under KVM within ProbeTimeout, else TCG).
func (b *Backend) accelerator(ctx context.Context, t *tools) string {
	b.accelOnce.Do(func() {
		if a := b.cfg.Accelerator; a != "" {
			b.accel = a
			b.log.Info("kvm: accelerator from the configuration", "accelerator", a)
			return
		}
		start := time.Now()
		err := probeKVM(ctx, t, b.cfg.Machine, b.cfg.ProbeTimeout)
		if err == nil {
			b.accel = "kvm"
			b.log.Info("kvm: a guest boots under KVM: using KVM", "accelerator", "kvm", "probe", time.Since(start).Round(time.Millisecond))
			return
		}
		b.accel = "tcg"
		b.log.Warn("kvm: a guest does not boot under KVM: using software emulation (TCG), which is much slower",
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
// agent.GuestReady once it found its port, then powers off) and waits for
// that line on the console. Any failure (no /dev/kvm, qemu refusing the
// CPU, a boot that hangs) is an error.
func probeKVM(ctx context.Context, t *tools, machine string, timeout time.Duration) error {
	if _, err := os.Stat("/dev/kvm"); err != nil {
		return fmt.Errorf("no /dev/kvm")
	}
	return bootProbe(ctx, t, "kvm", machine, timeout)
}

// bootProbe boots the guest in probe mode under accel and returns once the
// agent printed agent.GuestReady; an error when qemu exits first or
// timeout passes.
func bootProbe(ctx context.Context, t *tools, accel, machine string, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	guest := &agent.GuestConfig{Port: agent.DefaultGuestPort, Probe: true}
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
	args = append(args, accelArgs(accel)...)
	args = append(args,
		"-m", "128M", "-smp", "1",
		"-kernel", t.kernel, "-initrd", t.initrd,
		"-append", strings.Join(append(append(kernelArgs(m), guest.Cmdline()...), "--", "agent", "guest"), " "),
		"-serial", "stdio",
		"-chardev", "null,id=ctl",
		"-device", serial,
		"-device", dev+",chardev=ctl,name="+guest.Port,
	)
	cmd := exec.Command(t.qemu, args...)
	cmd.Stdin = nil
	out, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	cmd.Stderr = cmd.Stdout
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		return err
	}
	found := make(chan bool, 1)
	var tail strings.Builder
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			line := sc.Text()
			if strings.Contains(line, agent.GuestReady) {
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
	if ctx.Err() != nil {
		return fmt.Errorf("no guest agent after %s under %s", timeout, accel)
	}
	msg := strings.TrimSpace(tail.String())
	if i := strings.LastIndexByte(msg, '\n'); i >= 0 {
		msg = msg[i+1:]
	}
	return fmt.Errorf("qemu exited under %s: %s", accel, msg)
}
