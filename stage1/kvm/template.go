package kvm

// Templates: a pod's VM is restored from a saved, booted VM instead of
// booting its kernel (as Kata Containers' VM factory does). A template is
// booted once per (guest assets, qemu, machine, memory, vCPUs,
// accelerator): its agent comes up without a pod's identity
// (guest.Config.Template), and the VM is saved with qemu's migration
// to a file while its memory lives in a file of its own (x-ignore-shared:
// the memory is not in the stream). A pod's qemu maps that memory file
// privately and loads the stream: the guest runs on from where the
// template stopped, every page it only reads is shared with every other
// VM of the template, and the agent then gets the pod's identity (clock,
// entropy, hostname, network, shared directory) from an OpSetup call.
//
// The shared directory is virtio-9p, served by qemu itself: virtio-fs
// needs the guest's memory shared with virtiofsd, which a private mapping
// of the template's memory cannot be, and Debian 12's qemu 7.2 refuses to
// save a VM holding a vhost-user-fs device.
//
// A template's files are never written once it is complete: a pod's VM
// maps the memory file privately, and a page it has not written yet is
// read from the file. A template is built in a directory of its own and
// renamed into place when complete; templates of other guest assets are
// removed (a running VM keeps its mapping of a removed file).

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"time"

	"github.com/stagelet/stagelet/internal/mountsafe"
	"github.com/stagelet/stagelet/stage1/host"

	"github.com/stagelet/stagelet/agent/guest"
	"github.com/stagelet/stagelet/errdefs"
)

// Files of a template directory.
const (
	templateMemory   = "memory"    // the guest's memory
	templateState    = "state"     // the migration stream (devices, CPUs)
	templateInfoFile = "info.json" // templateInfo
	templateShare    = "share"     // the (empty) directory the template exports over 9p
	templateFormat   = 1           // raised when the VM's devices change
	buildPrefix      = ".build-"   // a template being built
)

// TemplateBuildTimeout bounds a template's boot and save.
var TemplateBuildTimeout = 2 * time.Minute

// templateInfo describes a template (its directory's info.json).
type templateInfo struct {
	Key     string    `json:"key"`
	Assets  string    `json:"assets"`
	VM      vmInfo    `json:"vm"`
	Created time.Time `json:"created"`
	// Boot is how long the template took to boot to its agent.
	Boot time.Duration `json:"boot"`
}

// template is a complete template, held by the start that had it from
// Backend.template until that start calls Backend.releaseTemplate: a
// template is not removed while a start holds it.
type template struct {
	dir  string
	info templateInfo
}

// templateUse is how many starts hold one template's directory, and
// whether its removal was asked meanwhile (stale): a stale template is
// given to no new start, and removed when its last holder releases it.
// Guarded by Backend.mu.
type templateUse struct {
	holders int
	stale   bool
}

// assetsFingerprint identifies what a template was booted from: the guest
// assets and qemu (a saved VM loads only into the qemu that saved it).
func assetsFingerprint(t *tools) (string, error) {
	h := sha256.New()
	fmt.Fprintf(h, "format %d\n", templateFormat)
	for _, p := range []string{t.kernel, t.initrd, t.qemu} {
		fi, err := os.Stat(p)
		if err != nil {
			return "", err
		}
		fmt.Fprintf(h, "%s %d %d\n", p, fi.Size(), fi.ModTime().UnixNano())
	}
	if b, err := os.ReadFile(filepath.Join(filepath.Dir(t.kernel), "manifest")); err == nil {
		h.Write(b)
	}
	return hex.EncodeToString(h.Sum(nil))[:16], nil
}

// deviceSet names the devices qemuArgs gives a VM: a template saved with
// other devices cannot be restored with these, and gets another key.
// Change it with the devices.
const deviceSet = "scsi1"

// templateKey names the template of a VM shape booted from assets with
// the kernel command line it would boot with now and the devices of
// deviceSet.
func templateKey(assets string, vm vmInfo) string {
	h := sha256.New()
	fmt.Fprintf(h, "%s %s %s %d %d %d %q %s", assets, vm.Accelerator, vm.Machine, vm.MemoryMiB, vm.VCPUs, vm.TBSizeMiB, kernelArgs(vm.Machine), deviceSet)
	return hex.EncodeToString(h.Sum(nil))[:16]
}

// templateBuild is a template being built, waited on by every pod that
// needs it.
type templateBuild struct {
	done chan struct{}
	err  error
}

// template returns the template of vm (its Template field ignored),
// building it first when there is none; concurrent callers of one key
// share one build. The caller holds the template it got until it calls
// releaseTemplate. A template whose removal waits for its holders is
// given to nobody: Unavailable, and the next caller after its removal
// builds it again.
func (b *Backend) template(ctx context.Context, t *tools, vm vmInfo) (*template, error) {
	assets, err := assetsFingerprint(t)
	if err != nil {
		return nil, err
	}
	vm.Template = ""
	key := templateKey(assets, vm)
	dir := filepath.Join(b.cfg.TemplateDir, key)

	tpl, tb, err := b.findTemplate(ctx, t, vm, assets, key, dir)
	if tpl != nil || err != nil {
		return tpl, err
	}
	select {
	case <-tb.done:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	if tb.err != nil {
		return nil, tb.err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.holdTemplateLocked(key, dir)
}

// findTemplate is the complete template of key in dir, held, when there
// is one; else the build of it that is under way, or that it starts.
// Templates of other assets are removed first, once per assets
// fingerprint.
func (b *Backend) findTemplate(ctx context.Context, t *tools, vm vmInfo, assets, key, dir string) (*template, *templateBuild, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.templateGC != assets {
		b.templateGC = assets
		b.removeStaleTemplates(assets)
	}
	if info, err := readTemplateInfo(dir); err == nil && info.Key == key {
		tpl, err := b.holdTemplateLocked(key, dir)
		if err == nil {
			b.hits.Add(1)
		}
		return tpl, nil, err
	}
	b.misses.Add(1)
	tb, building := b.builds[key]
	if !building {
		tb = &templateBuild{done: make(chan struct{})}
		b.builds[key] = tb
		go func() {
			tb.err = b.buildTemplate(context.WithoutCancel(ctx), t, vm, assets, key, dir)
			if tb.err != nil {
				b.buildFailures.Add(1)
			} else {
				b.built.Add(1)
			}
			b.mu.Lock()
			delete(b.builds, key)
			b.mu.Unlock()
			close(tb.done)
		}()
	}
	return nil, tb, nil
}

// holdTemplateLocked holds the complete template of key in dir for a
// start: Unavailable when its removal waits for its holders, NotFound
// when there is none (removed since it was built). Called with b.mu held.
func (b *Backend) holdTemplateLocked(key, dir string) (*template, error) {
	use := b.templateUses[dir]
	if use != nil && use.stale {
		return nil, fmt.Errorf("kvm: the VM template %s is removed once the starts restoring from it end: %w", dir, errdefs.ErrUnavailable)
	}
	info, err := readTemplateInfo(dir)
	if err != nil || info.Key != key {
		return nil, fmt.Errorf("kvm: no VM template in %s: %w", dir, errdefs.ErrNotFound)
	}
	if use == nil {
		use = &templateUse{}
		b.templateUses[dir] = use
	}
	use.holders++
	return &template{dir: dir, info: *info}, nil
}

// releaseTemplate ends a start's hold of tpl (nil: none); a template
// whose removal was asked meanwhile is removed when its last holder
// releases it.
func (b *Backend) releaseTemplate(tpl *template) {
	if tpl == nil {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	use := b.templateUses[tpl.dir]
	if use == nil {
		return
	}
	if use.holders--; use.holders > 0 {
		return
	}
	delete(b.templateUses, tpl.dir)
	if use.stale {
		b.removeTemplateLocked(tpl.dir, "its last start ended")
	}
}

// removeTemplateLocked removes the template in dir, or, while a start
// holds it, marks it stale: its last holder removes it (releaseTemplate).
// why is logged. Called with b.mu held.
func (b *Backend) removeTemplateLocked(dir, why string) {
	if use := b.templateUses[dir]; use != nil {
		use.stale = true
		b.Log.Info("kvm: a VM template is removed once the starts restoring from it end", "dir", dir, "why", why, "starts", use.holders)
		return
	}
	if err := mountsafe.RemoveUnmounted(dir); err != nil {
		b.Log.Warn("kvm: removing a VM template", "dir", dir, "why", why, "err", err)
		return
	}
	b.Log.Info("kvm: removed a VM template", "dir", dir, "why", why)
}

func readTemplateInfo(dir string) (*templateInfo, error) {
	b, err := os.ReadFile(filepath.Join(dir, templateInfoFile))
	if err != nil {
		return nil, err
	}
	var info templateInfo
	if err := json.Unmarshal(b, &info); err != nil {
		return nil, err
	}
	for _, f := range []string{templateMemory, templateState} {
		if _, err := os.Stat(filepath.Join(dir, f)); err != nil {
			return nil, err
		}
	}
	return &info, nil
}

// removeStaleTemplates removes the templates of other guest assets and
// builds a daemon did not finish. Called with b.mu held.
func (b *Backend) removeStaleTemplates(assets string) {
	ents, err := os.ReadDir(b.cfg.TemplateDir)
	if err != nil {
		return
	}
	for _, e := range ents {
		dir := filepath.Join(b.cfg.TemplateDir, e.Name())
		if !e.IsDir() {
			continue
		}
		if key, ok := strings.CutPrefix(e.Name(), buildPrefix); ok {
			if key, _, _ = strings.Cut(key, "-"); b.builds[key] != nil {
				continue // this daemon's, under way
			}
			if err := mountsafe.RemoveUnmounted(dir); err != nil {
				b.Log.Warn("kvm: removing an unfinished VM template build", "dir", dir, "err", err)
			}
			continue
		}
		if info, err := readTemplateInfo(dir); err == nil && info.Assets == assets {
			continue
		}
		b.removeTemplateLocked(dir, "of other guest assets, or incomplete")
	}
}

// buildTemplate boots a template VM of shape vm, waits for its agent,
// saves it and moves it to dir.
func (b *Backend) buildTemplate(ctx context.Context, t *tools, vm vmInfo, assets, key, dir string) (retErr error) {
	// qemu gets SIGKILL when the thread that started it exits (the
	// daemon's death included): the thread stays this goroutine's until
	// qemu is gone.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	ctx, cancel := context.WithTimeout(ctx, TemplateBuildTimeout)
	defer cancel()
	start := time.Now()
	if err := os.MkdirAll(b.cfg.TemplateDir, 0o700); err != nil {
		return fmt.Errorf("kvm: template: %w", err)
	}
	tmp, err := os.MkdirTemp(b.cfg.TemplateDir, buildPrefix+key+"-")
	if err != nil {
		return fmt.Errorf("kvm: template: %w", err)
	}
	defer func() {
		if retErr != nil {
			if err := mountsafe.RemoveUnmounted(tmp); err != nil {
				b.Log.WarnContext(ctx, "kvm: removing a failed template build", "dir", tmp, "err", err)
			}
		}
	}()
	if err := os.Mkdir(filepath.Join(tmp, templateShare), 0o700); err != nil {
		return fmt.Errorf("kvm: template: %w", err)
	}
	gcfg := &guest.Config{Port: guest.DefaultPort, Template: true}
	console := filepath.Join(tmp, consoleName)
	args := qemuArgs(t, vmSpec{
		name:    "stagelet-template-" + key,
		vm:      vm,
		mem:     memTemplate,
		memDir:  tmp,
		cmdline: gcfg.Cmdline(),
		port:    gcfg.Port,
		console: console,
		ctl:     "ctl.sock",
		qmp:     "qmp.sock",
		share:   filepath.Join(tmp, templateShare),
	})
	alive, exited, stop, err := templateQEMU(t, tmp, args)
	if err != nil {
		return err
	}
	defer stop()
	if err := waitConsole(ctx, console, guest.Ready, alive); err != nil {
		return fmt.Errorf("kvm: template boot: %w (qemu: %s; console: %s)", err,
			lastLine(filepath.Join(tmp, qemuLogName)), lastLine(console))
	}
	boot := time.Since(start)
	q, err := dialQMP(ctx, filepath.Join(tmp, "qmp.sock"), alive)
	if err != nil {
		return fmt.Errorf("kvm: template: %w", err)
	}
	defer q.Close()
	if err := saveVM(ctx, q); err != nil {
		return err
	}
	q.run(ctx, "quit", nil) // the deferred kill ends it if this fails
	<-exited
	info := templateInfo{Key: key, Assets: assets, VM: vm, Created: time.Now().UTC(), Boot: boot}
	if err := publishTemplate(tmp, dir, info); err != nil {
		return err
	}
	b.Log.InfoContext(ctx, "kvm: VM template ready", "dir", dir, "boot", boot.Round(time.Millisecond),
		"total", time.Since(start).Round(time.Millisecond), "memoryMiB", vm.MemoryMiB, "vcpus", vm.VCPUs)
	return nil
}

// templateQEMU starts qemu with args for a template build in tmp, its
// output in tmp/qemu.log, killed with its starter thread (Pdeathsig).
// alive tells whether it runs, exited closes when it ends, and stop kills
// it and waits for it.
func templateQEMU(t *tools, tmp string, args []string) (alive func() bool, exited <-chan struct{}, stop func(), err error) {
	logf, err := os.Create(filepath.Join(tmp, qemuLogName))
	if err != nil {
		return nil, nil, nil, fmt.Errorf("kvm: template: %w", err)
	}
	cmd := exec.Command(t.qemu, args...)
	cmd.Dir = tmp
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return nil, nil, nil, fmt.Errorf("kvm: template: qemu: %w", err)
	}
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	alive = func() bool {
		select {
		case <-done:
			return false
		default:
			return true
		}
	}
	stop = func() {
		cmd.Process.Kill()
		<-done
		logf.Close()
	}
	return alive, done, stop, nil
}

// saveVM stops the VM and saves its state to templateState in its
// directory (qemu migration to a file), waiting for the save to end.
func saveVM(ctx context.Context, q *qmp) error {
	if err := q.ignoreShared(ctx); err != nil {
		return fmt.Errorf("kvm: template: %w", err)
	}
	if _, err := q.run(ctx, "stop", nil); err != nil {
		return fmt.Errorf("kvm: template: %w", err)
	}
	if _, err := q.run(ctx, "migrate", map[string]any{"uri": "exec:cat > " + templateState}); err != nil {
		return fmt.Errorf("kvm: template: %w", err)
	}
	for {
		st, desc, err := q.migrationStatus(ctx)
		if err != nil {
			return fmt.Errorf("kvm: template: %w", err)
		}
		if st == "completed" {
			return nil
		}
		if st == "failed" || st == "cancelled" {
			return fmt.Errorf("kvm: template: saving the VM %s: %s", st, desc)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("kvm: template: saving the VM: %w", ctx.Err())
		case <-time.After(5 * time.Millisecond): // polling qemu for the save's end
		}
	}
}

// publishTemplate writes info beside a built template in tmp and renames
// it to dir, replacing an incomplete directory of that name.
func publishTemplate(tmp, dir string, info templateInfo) error {
	ib, err := json.Marshal(info)
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(tmp, templateInfoFile), ib, 0o600); err != nil {
		return fmt.Errorf("kvm: template: %w", err)
	}
	if err := os.Rename(tmp, dir); err != nil {
		// A directory of this key that is no complete template (template
		// found none): replaced.
		if rerr := mountsafe.RemoveUnmounted(dir); rerr != nil {
			return fmt.Errorf("kvm: template: %w (removing the incomplete %s: %v)", err, dir, rerr)
		}
		if err := os.Rename(tmp, dir); err != nil {
			return fmt.Errorf("kvm: template: %w", err)
		}
	}
	return nil
}

// discardTemplate removes a template a VM could not be restored from
// (VMs restored from it keep their mappings), once no start holds it:
// the next pod builds it again.
func (b *Backend) discardTemplate(tpl *template, cause error) {
	b.Log.Warn("kvm: discarding a VM template no VM could be restored from; the next pod builds it again", "dir", tpl.dir, "cause", cause)
	b.mu.Lock()
	defer b.mu.Unlock()
	b.removeTemplateLocked(tpl.dir, "no VM could be restored from it")
}

// waitConsole waits until the console log at path holds want, while alive.
func waitConsole(ctx context.Context, path, want string, alive func() bool) error {
	delay := time.Millisecond
	for {
		if b, err := os.ReadFile(path); err == nil && bytes.Contains(b, []byte(want)) {
			return nil
		}
		if !alive() {
			return fmt.Errorf("qemu exited: %w", errdefs.ErrUnavailable)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("no %s: %w", want, errdefs.ErrDeadlineExceeded)
		case <-time.After(delay): // polling the console log
		}
		if delay < 20*time.Millisecond {
			delay *= 2
		}
	}
}

// restore loads the template's saved state into the pod's qemu, started
// with -incoming defer, and lets it run, within timeout (kvm.boot_timeout).
func restore(ctx context.Context, qmpPath string, qemu *host.Process, tpl *template, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	q, err := dialQMP(ctx, qmpPath, processAlive(qemu))
	if err != nil {
		return err
	}
	defer q.Close()
	if err := q.ignoreShared(ctx); err != nil {
		return err
	}
	return q.incoming(ctx, qemu, filepath.Join(tpl.dir, templateState), "the template "+tpl.dir)
}

// lastLine is the last non-empty line of the file at path, for errors.
func lastLine(path string) string {
	b, _ := os.ReadFile(path)
	s := strings.TrimSpace(string(b))
	if i := strings.LastIndexByte(s, '\n'); i >= 0 {
		s = s[i+1:]
	}
	return strings.TrimSpace(s)
}

// shellQuote quotes s for sh (qemu runs exec: URIs with sh -c).
func shellQuote(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }

// seed returns entropy for a restored guest.
func seed() []byte {
	b := make([]byte, 64)
	rand.Read(b) // never fails (crypto/rand)
	return b
}
