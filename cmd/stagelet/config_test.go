package main

import (
	"bytes"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/stagelet/stagelet/config"
)

// TestConfigDefault: what `stagelet config default` prints is a valid
// configuration file, the same as the embedded default, commented.
func TestConfigDefault(t *testing.T) {
	var out, errOut bytes.Buffer
	if rc := configMain([]string{"default"}, &out, &errOut); rc != 0 {
		t.Fatalf("rc %d: %s", rc, errOut.String())
	}
	if !strings.Contains(out.String(), "# ") {
		t.Error("the default configuration has no comments")
	}
	f := filepath.Join(t.TempDir(), "config.yaml")
	if err := os.WriteFile(f, out.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	c, err := config.Load(f)
	if err != nil {
		t.Fatal(err)
	}
	want := config.Default()
	c.Source, want.Source = "", ""
	if !reflect.DeepEqual(c, want) {
		t.Errorf("the printed default loads as %+v, want %+v", c, want)
	}
	out.Reset()
	if rc := configMain([]string{"check", f}, &out, &errOut); rc != 0 || !strings.Contains(out.String(), f+": ok") {
		t.Errorf("check of the default: rc %d, %s %s", rc, out.String(), errOut.String())
	}
}

func TestConfigCheck(t *testing.T) {
	bad := filepath.Join(t.TempDir(), "bad.yaml")
	if err := os.WriteFile(bad, []byte("version: 1\nkvm: {machine: pc}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	var out, errOut bytes.Buffer
	if rc := configMain([]string{"check", bad}, &out, &errOut); rc != 1 || !strings.Contains(errOut.String(), "kvm.machine") {
		t.Errorf("check of a bad file: rc %d, %q", rc, errOut.String())
	}
	if rc := configMain(nil, &out, &errOut); rc != 2 {
		t.Errorf("no command: rc %d", rc)
	}
	if rc := configMain([]string{"frobnicate"}, &out, &errOut); rc != 2 {
		t.Errorf("an unknown command: rc %d", rc)
	}
}

func TestConfigCheckLoadsTheSignaturePolicy(t *testing.T) {
	dir := t.TempDir()
	policy := filepath.Join(dir, "signature-policy.json")
	if err := os.WriteFile(policy, []byte(`{"default": [{"type": "sigstoreSigned", "keyPath": "/nonexistent/key.pub"}]}`), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg := filepath.Join(dir, "node.yaml")
	if err := os.WriteFile(cfg, []byte("version: 1\nimages:\n  signature_policy: "+policy+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	var out, errOut bytes.Buffer
	if rc := configMain([]string{"check", cfg}, &out, &errOut); rc != 1 || !strings.Contains(errOut.String(), "keyPath /nonexistent/key.pub") {
		t.Errorf("check with a signature policy naming a missing key: rc %d, %q", rc, errOut.String())
	}
	if err := os.WriteFile(policy, []byte(`{"default": [{"type": "insecureAcceptAnything"}]}`), 0o644); err != nil {
		t.Fatal(err)
	}
	out.Reset()
	errOut.Reset()
	if rc := configMain([]string{"check", cfg}, &out, &errOut); rc != 0 {
		t.Errorf("check with a good signature policy: rc %d, %q", rc, errOut.String())
	}
}
