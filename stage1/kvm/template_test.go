package kvm

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/stagelet/stagelet/errdefs"
)

// fakeTemplate writes guest assets and qemu (files only: nothing boots)
// and a complete template of vm booted from them in templates, and
// returns the tools and the template's directory.
func fakeTemplate(t *testing.T, templates string, vm vmInfo) (*tools, string) {
	t.Helper()
	assetsDir := t.TempDir()
	tl := &tools{qemu: filepath.Join(assetsDir, "qemu"), kernel: filepath.Join(assetsDir, "vmlinuz"), initrd: filepath.Join(assetsDir, "initrd")}
	for _, f := range []string{tl.qemu, tl.kernel, tl.initrd} {
		if err := os.WriteFile(f, []byte(filepath.Base(f)), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	assets, err := assetsFingerprint(tl)
	if err != nil {
		t.Fatal(err)
	}
	key := templateKey(assets, vm)
	dir := filepath.Join(templates, key)
	if err := os.MkdirAll(filepath.Join(dir, templateShare), 0o700); err != nil {
		t.Fatal(err)
	}
	info, err := json.Marshal(templateInfo{Key: key, Assets: assets, VM: vm})
	if err != nil {
		t.Fatal(err)
	}
	for f, b := range map[string][]byte{templateInfoFile: info, templateMemory: []byte("memory"), templateState: []byte("state")} {
		if err := os.WriteFile(filepath.Join(dir, f), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return tl, dir
}

func exists(t *testing.T, path string) bool {
	t.Helper()
	_, err := os.Stat(path)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	return err == nil
}

// TestTemplateHeldAcrossRemoval: a template a start holds is not removed
// when a failed restore discards it (a boot timeout) or when it turns
// stale (other guest assets): it is given to no new start, and removed
// when its last holder releases it. The next start then finds none.
func TestTemplateHeldAcrossRemoval(t *testing.T) {
	ctx := context.Background()
	vm := vmInfo{Accelerator: "tcg", Machine: "microvm", MemoryMiB: 128, VCPUs: 1}

	t.Run("discarded", func(t *testing.T) {
		templates := t.TempDir()
		tl, dir := fakeTemplate(t, templates, vm)
		b := New(testLogger(t), Config{TemplateDir: templates})
		first, err := b.template(ctx, tl, vm)
		if err != nil {
			t.Fatal(err)
		}
		second, err := b.template(ctx, tl, vm)
		if err != nil || second.dir != dir {
			t.Fatalf("a second start: %+v, %v; want the template in %s", second, err, dir)
		}
		b.discardTemplate(first, errors.New("restoring: deadline exceeded"))
		if !exists(t, filepath.Join(dir, templateState)) {
			t.Fatal("a template two starts hold was removed")
		}
		if tpl, err := b.template(ctx, tl, vm); !errors.Is(err, errdefs.ErrUnavailable) {
			t.Errorf("a discarded template held: template() = %+v, %v; want Unavailable", tpl, err)
		}
		if n := len(b.builds); n != 0 {
			t.Errorf("%d builds started while the discarded template is held", n)
		}
		b.releaseTemplate(first)
		if !exists(t, filepath.Join(dir, templateState)) {
			t.Fatal("removed while a start still holds it")
		}
		b.releaseTemplate(second)
		if exists(t, dir) {
			t.Error("the discarded template stayed after its last holder released it")
		}
		if n := len(b.templateUses); n != 0 {
			t.Errorf("%d template uses left", n)
		}
	})

	t.Run("stale", func(t *testing.T) {
		templates := t.TempDir()
		tl, dir := fakeTemplate(t, templates, vm)
		b := New(testLogger(t), Config{TemplateDir: templates})
		held, err := b.template(ctx, tl, vm)
		if err != nil {
			t.Fatal(err)
		}
		b.mu.Lock()
		b.removeStaleTemplates("other assets")
		b.mu.Unlock()
		if !exists(t, filepath.Join(dir, templateMemory)) {
			t.Fatal("a held template of other assets was removed")
		}
		b.releaseTemplate(held)
		if exists(t, dir) {
			t.Error("the stale template stayed after its holder released it")
		}
		// Not held: removed at once.
		_, dir = fakeTemplate(t, templates, vm)
		b.mu.Lock()
		b.removeStaleTemplates("other assets")
		b.mu.Unlock()
		if exists(t, dir) {
			t.Error("a stale template nobody holds stayed")
		}
		b.releaseTemplate(nil) // a start without a template
	})
}
