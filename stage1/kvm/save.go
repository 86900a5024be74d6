package kvm

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"time"

	"github.com/stagelet/stagelet/agent/client"
	"github.com/stagelet/stagelet/agent/guest"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/internal/atomicfile"
	"github.com/stagelet/stagelet/stage1"
	"github.com/stagelet/stagelet/stage1/host"
)

// A kvm pod is saved whole: qemu migrates its VM, memory and devices,
// into a file (pre-copy, so the guest pauses only for the last round) and
// the VM runs on. Another pod of this stage1, on this node or another,
// whose VM has the same machine, size and devices, takes it in place of
// its own: its qemu is started again with -incoming defer on its own tap
// and cgroup, loads the file, and the guest takes the pod's network
// (api.OpNetwork). The guest's apps run on with their PIDs, memory and
// records; their agent answers on the new pod's serial port.

var (
	_ stage1.PodSaver    = (*Pod)(nil)
	_ stage1.PodRestorer = (*Pod)(nil)
)

// Files of a saved VM, in the directory SavePod is given.
const (
	savedVMName    = "vm.json"
	savedStateName = "vm.state"
)

// savedVMVersion is the version of savedVM; a restore refuses another.
const savedVMVersion = 1

// savedVM describes a saved VM: what the VM that loads it must have, and
// how the save went.
type savedVM struct {
	Version int    `json:"version"`
	VM      vmInfo `json:"vm"`
	// Migration is the save's figures.
	Migration migration `json:"migration"`
	// Disks are the image disks plugged into the VM: the VM that loads
	// it gets the same bytes (found by image ID, checked by SHA-256) at
	// the same addresses first.
	Disks []PluggedDisk `json:"disks,omitempty"`
}

// SavePod implements stage1.PodSaver: the VM's state goes to
// dir/vm.state, its description to dir/vm.json; the VM runs on.
// FailedPrecondition: the guest mounted the 9p share (moveBlocker), a
// container was given a host PCI device, qemu runs confined (it could
// not write dir), or qemu refused to migrate (its reason).
func (p *Pod) SavePod(ctx context.Context, dir string) (*stage1.PodSaved, error) {
	if err := p.movable(); err != nil {
		return nil, err
	}
	disks, err := p.Disks()
	if err != nil {
		return nil, err
	}
	q, err := p.outgoingQMP(ctx)
	if err != nil {
		return nil, err
	}
	defer q.Close()
	start := time.Now()
	m, err := q.migrateOut(ctx, "exec:cat > "+shellQuote(filepath.Join(dir, savedStateName)))
	// The VM runs on, as a checkpointed container does; a failed
	// migration leaves it running already.
	if st, serr := q.status(ctx); serr == nil && st != "running" {
		if _, cerr := q.run(ctx, "cont", nil); cerr != nil {
			err = errors.Join(err, fmt.Errorf("kvm: resuming the saved VM: %w", cerr))
		}
	}
	if err != nil {
		return nil, err
	}
	if err := writeSavedVM(dir, savedVM{Version: savedVMVersion, VM: p.st.VM, Migration: m, Disks: disks}); err != nil {
		return nil, err
	}
	fi, err := os.Stat(filepath.Join(dir, savedStateName))
	if err != nil {
		return nil, fmt.Errorf("kvm: %w", err)
	}
	p.log.InfoContext(ctx, "kvm: VM saved", "dir", dir, "bytes", fi.Size(), "downtime", m.Downtime, "took", time.Since(start))
	return &stage1.PodSaved{Bytes: fi.Size(), Total: m.Total, Downtime: m.Downtime}, nil
}

// outgoingQMP dials the pod's QMP for a migration of its VM out.
func (p *Pod) outgoingQMP(ctx context.Context) (*qmp, error) {
	q, err := p.dialQMP(ctx)
	if err != nil {
		return nil, err
	}
	// A VM restored from a template loaded it with x-ignore-shared on:
	// off, the stream carries all its memory, which the target, with
	// memory of its own, needs.
	if _, err := q.run(ctx, "migrate-set-capabilities", map[string]any{
		"capabilities": []map[string]any{{"capability": "x-ignore-shared", "state": false}},
	}); err != nil {
		q.Close()
		return nil, fmt.Errorf("kvm: %w", err)
	}
	return q, nil
}

// writeSavedVM writes sv into dir/vm.json.
func writeSavedVM(dir string, sv savedVM) error {
	b, err := json.Marshal(sv)
	if err != nil {
		return err
	}
	if err := atomicfile.Write(filepath.Join(dir, savedVMName), b, 0o600); err != nil {
		return fmt.Errorf("kvm: %w", err)
	}
	return nil
}

// movable says why the pod's VM cannot be saved or loaded: the share,
// a passed-through device, a confined qemu. Nil when it can be.
func (p *Pod) movable() error {
	if err := p.moveBlocker(); err != nil {
		return err
	}
	p.vfio.mu.Lock()
	n := len(p.vfio.ids)
	p.vfio.mu.Unlock()
	if n > 0 {
		return errdefs.FailedPrecondition("kvm: pod cannot move: its VM was given host PCI devices")
	}
	if _, ok := p.st.Get(roleAppArmor); ok || p.spec.SELinuxProcessLabel != "" {
		return errdefs.FailedPrecondition("kvm: pod cannot move: its qemu runs confined (SELinux or AppArmor), and would neither write nor read a saved VM")
	}
	return nil
}

// readSavedVM reads and checks the description of the VM saved in dir
// against the pod's VM: the same machine, memory, vCPUs and accelerator.
func (p *Pod) readSavedVM(dir string) (*savedVM, error) {
	b, err := os.ReadFile(filepath.Join(dir, savedVMName))
	if err != nil {
		return nil, errdefs.NotFound("kvm: no saved VM in %s: %w", dir, err)
	}
	var sv savedVM
	if err := json.Unmarshal(b, &sv); err != nil {
		return nil, errdefs.InvalidArgument("kvm: saved VM %s: %w", dir, err)
	}
	if sv.Version != savedVMVersion {
		return nil, errdefs.FailedPrecondition("kvm: saved VM %s is of version %d; this stagelet loads version %d", dir, sv.Version, savedVMVersion)
	}
	have, want := p.st.VM, sv.VM
	if have.Machine != want.Machine || have.MemoryMiB != want.MemoryMiB || have.VCPUs != want.VCPUs || have.Accelerator != want.Accelerator {
		return nil, errdefs.FailedPrecondition("kvm: the saved VM is a %s of %d MiB and %d vCPUs under %s; this pod's is a %s of %d MiB and %d vCPUs under %s: give the pod the saved VM's size",
			want.Machine, want.MemoryMiB, want.VCPUs, want.Accelerator, have.Machine, have.MemoryMiB, have.VCPUs, have.Accelerator)
	}
	if want.Kernel != "" && have.Kernel != "" && want.Kernel != have.Kernel {
		p.log.Warn("kvm: the saved VM ran another guest kernel; its memory holds it", "saved", want.Kernel, "here", have.Kernel)
	}
	return &sv, nil
}

// RestorePod implements stage1.PodRestorer: the pod's VM, and whatever
// ran in it, is replaced by the VM saved in dir. The caller keeps the
// pod's other calls away while it runs and persists State after it.
// FailedPrecondition before anything changed: another VM size, a saved
// VM of another version, a pod that could not move itself. Once the
// pod's qemu was stopped, a failure leaves the pod without a VM
// (Unavailable, from its agent, after).
func (p *Pod) RestorePod(ctx context.Context, dir string) (*stage1.PodRestored, error) {
	sv, err := p.readSavedVM(dir)
	if err != nil {
		return nil, err
	}
	disks, err := p.localDisks(ctx, sv.Disks)
	if err != nil {
		return nil, err
	}
	if err := p.canLoad(); err != nil {
		return nil, err
	}
	state := filepath.Join(dir, savedStateName)
	if _, err := os.Stat(state); err != nil {
		return nil, errdefs.FailedPrecondition("kvm: %s holds no saved VM state (a live move's checkpoint is taken from its source): %w", dir, err)
	}
	res, err := p.b.resolveTools()
	if err != nil {
		return nil, err
	}
	if err := p.stopVM(ctx); err != nil {
		return nil, err
	}
	start := time.Now()
	if err := p.loadVM(ctx, res, state, disks); err != nil {
		return nil, fmt.Errorf("%w (the pod's own VM was stopped)", err)
	}
	return &stage1.PodRestored{Load: time.Since(start)}, nil
}

// localDisks finds this node's disks of the saved VM's images, by image
// ID, with the bytes the saved VM read (FailedPrecondition when the
// SHA-256 differs, or this node makes no image disks), and returns the
// record the loaded VM is to have: the saved disks at their addresses,
// used by the containers of both pods.
func (p *Pod) localDisks(ctx context.Context, saved []PluggedDisk) (*diskRecord, error) {
	r := &diskRecord{Version: disksVersion}
	if len(saved) == 0 {
		return r, nil
	}
	if p.b.cfg.ImageDisks == nil {
		return nil, errdefs.FailedPrecondition("kvm: the saved VM reads %d image disks, and this node makes none", len(saved))
	}
	own, err := p.Disks()
	if err != nil {
		return nil, err
	}
	for _, d := range saved {
		// The saved VM's account comes from another node: its qemu IDs
		// and serial must be the ones its target and checksum give.
		node, dev := diskIDs(d.Target)
		if d.Target < 0 || d.Target > maxSCSITarget || d.Node != node || d.Device != dev || d.Serial != diskSerial(d.SHA256) {
			return nil, errdefs.InvalidArgument("kvm: the saved VM's disk of image %s: target %d, IDs %q %q, serial %q do not agree", d.ImageID, d.Target, d.Node, d.Device, d.Serial)
		}
		path, sum, err := p.b.cfg.ImageDisks(ctx, d.ImageID)
		if err != nil {
			return nil, fmt.Errorf("kvm: the saved VM's disk of image %s: %w", d.ImageID, err)
		}
		if sum != d.SHA256 {
			return nil, errdefs.FailedPrecondition("kvm: the disk of image %s here has SHA-256 %s, and the saved VM read one of %s: its guest's page cache holds blocks of that one", d.ImageID, sum, d.SHA256)
		}
		d.Path = path
		for _, o := range own {
			if o.ImageID == d.ImageID {
				d.Users = append(d.Users, o.Users...)
			}
		}
		r.Disks = append(r.Disks, d)
		r.Next = max(r.Next, (d.Target+1)%(maxSCSITarget+1))
	}
	return r, nil
}

// replugDisks plugs disks into the pod's qemu, waiting for a saved VM's
// state, at the addresses the saved VM had them, and records them.
func (p *Pod) replugDisks(ctx context.Context, r *diskRecord) error {
	p.disks.mu.Lock()
	defer p.disks.mu.Unlock()
	if err := p.saveDisks(r); err != nil {
		return err
	}
	for i := range r.Disks {
		if err := p.plugDisk(ctx, &r.Disks[i]); err != nil {
			return err
		}
	}
	return nil
}

// stopVM kills the pod's qemu and ends its serial session.
func (p *Pod) stopVM(ctx context.Context) error {
	qemu := p.st.qemu()
	if err := qemu.Signal(syscall.SIGKILL); err != nil && !errors.Is(err, host.ErrProcessGone) {
		return fmt.Errorf("kvm: stop the pod's VM: %w", err)
	}
	wctx, cancel := context.WithTimeout(ctx, ExitGrace)
	defer cancel()
	if err := qemu.Wait(wctx); err != nil {
		return fmt.Errorf("kvm: the pod's qemu (pid %d) did not exit: %w", qemu.PID, err)
	}
	p.b.dialer(p.st.ctlSocket()).Close()
	return nil
}

// loadVM starts the pod's qemu again, waiting for the state at path
// (-incoming defer) on the pod's tap and in its cgroup, loads it, and
// gives the guest the pod's network once its agent answers.
func (p *Pod) loadVM(ctx context.Context, res *tools, path string, disks *diskRecord) error {
	qemu, gcfg, logPath, err := p.startIncoming(ctx, res, disks, false)
	if err != nil {
		return err
	}
	if err := loadState(ctx, p.st.qmpSocket(), qemu, path, p.b.bootTimeout()); err != nil {
		return fmt.Errorf("kvm: loading the saved VM (qemu log %s): %w", logPath, err)
	}
	return p.takeNetwork(ctx, qemu, gcfg)
}

// startIncoming starts the pod's qemu again, waiting for a saved VM's
// state (-incoming defer), on the pod's tap and in its cgroup, with the
// saved VM's disks plugged. paused: the loaded VM stays paused until
// continued (-S). It returns qemu, the guest's network and qemu's log.
func (p *Pod) startIncoming(ctx context.Context, res *tools, disks *diskRecord, paused bool) (*host.Process, *guest.Config, string, error) {
	spec, st := p.spec, p.st
	unitLaunch := p.b.UnitLaunch()
	gcfg := guestConfig(spec)
	var tap *os.File
	tapMode := ""
	if spec.NetNSPath != "" {
		// The tap and its redirects are made afresh: a tap qemu held
		// went with it.
		if err := teardownTap(spec.NetNSPath, tapName); err != nil {
			return nil, nil, "", fmt.Errorf("kvm: pod network: %w", err)
		}
		nc, t, err := setupTap(spec.NetNSPath, tapName, unitLaunch)
		if err != nil {
			return nil, nil, "", fmt.Errorf("kvm: pod network: %w", err)
		}
		defer t.Close()
		gcfg.MAC, gcfg.IPs, gcfg.Routes, gcfg.MTU = nc.MAC, nc.IPs, nc.Routes, nc.MTU
		p.stMu.Lock()
		st.VM.MAC = nc.MAC.String()
		p.stMu.Unlock()
		tap, tapMode = t, "fd"
		if unitLaunch {
			tapMode = "name"
		}
	}
	vs := podVMSpec(spec, st, gcfg, nil, tapMode)
	vs.incoming, vs.paused = true, paused
	p.stMu.Lock()
	st.VM.Template = ""
	p.stMu.Unlock()
	launch := qemuLaunch(spec, st, res, vs, st.cgroup(), tap, unitLaunch)
	if st.VM.Overhead {
		launch.MemoryMax = int64(st.VM.CapMiB) << 20
		launch.CPUShares = spec.Resources.CPUShares
		if unitLaunch {
			launch.Slice = p.b.cfg.OverheadCgroup
		}
	}
	qemu, err := p.b.Launcher.Launch(ctx, launch)
	if err != nil {
		return nil, nil, "", fmt.Errorf("kvm: qemu: %w", err)
	}
	p.stMu.Lock()
	st.Record(host.Resource{Kind: host.KindProcess, Role: roleQemu, Process: qemu})
	p.stMu.Unlock()
	if err := p.replugDisks(ctx, disks); err != nil {
		return nil, nil, "", err
	}
	return qemu, gcfg, launch.LogPath, nil
}

// takeNetwork gives the loaded guest, running, the pod's network once
// its agent answers.
func (p *Pod) takeNetwork(ctx context.Context, qemu *host.Process, gcfg *guest.Config) error {
	if err := host.WaitAgentReady(ctx, p, qemu, p.b.bootTimeout(), "qemu"); err != nil {
		return fmt.Errorf("kvm: the loaded guest's agent: %w", err)
	}
	if err := client.NewClient(p.dial).Network(ctx, gcfg.Cmdline()); err != nil {
		return fmt.Errorf("kvm: giving the loaded guest the pod's network: %w", err)
	}
	// The loaded guest never mounted the share (SavePod's source could
	// move): what this pod's own guest did is gone with it.
	p.share.mu.Lock()
	p.share.use = nil
	p.share.mu.Unlock()
	if err := os.Remove(filepath.Join(p.st.dir(), shareUseName)); err != nil && !errors.Is(err, os.ErrNotExist) {
		p.log.WarnContext(ctx, "kvm: removing the record of the 9p share's use", "err", err)
	}
	return nil
}

// loadState loads the VM state at path into qemu, started with -incoming
// defer, and lets it run, within timeout.
func loadState(ctx context.Context, qmpPath string, qemu *host.Process, path string, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	q, err := dialQMP(ctx, qmpPath, processAlive(qemu))
	if err != nil {
		return err
	}
	defer q.Close()
	return q.incoming(ctx, qemu, path, path)
}

// incoming loads the VM state saved at path into qemu's VM, started with
// -incoming defer, and lets it run: a VM saved stopped (a template) is
// continued. what names the state in errors.
func (q *qmp) incoming(ctx context.Context, qemu *host.Process, path, what string) error {
	if _, err := q.run(ctx, "migrate-incoming", map[string]any{"uri": "exec:cat " + shellQuote(path)}); err != nil {
		return err
	}
	for delay := time.Millisecond; ; delay = min(2*delay, 10*time.Millisecond) {
		st, err := q.status(ctx)
		if err != nil {
			if !qemu.Alive() {
				return fmt.Errorf("qemu exited while loading %s: %w", what, errdefs.ErrUnavailable)
			}
			return err
		}
		switch st {
		case "running":
			return nil
		case "paused", "postmigrate":
			if _, err := q.run(ctx, "cont", nil); err != nil {
				return err
			}
			continue
		case "inmigrate":
		default:
			return fmt.Errorf("loading %s: the VM is %s", what, st)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("loading %s: %w", what, errdefs.ErrDeadlineExceeded)
		case <-time.After(delay): // polling qemu for the load's end
		}
	}
}
