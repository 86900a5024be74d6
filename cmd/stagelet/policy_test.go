package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestParsePodForPolicy(t *testing.T) {
	manifest := []byte(`apiVersion: v1
kind: Pod
metadata: {name: p, labels: {a: b}, annotations: {stagelet.io/stage1: kvm}}
spec:
  runtimeClassName: nspawn
  hostNetwork: true
  initContainers: [{name: i, securityContext: {privileged: true}}]
  containers: [{name: c}]
`)
	pod, title, err := parsePodForPolicy(manifest, "")
	if err != nil {
		t.Fatal(err)
	}
	if title != "default/p" || pod.Namespace != "default" || pod.Handler != "nspawn" || !pod.HostNetwork || !pod.Privileged ||
		pod.Labels["a"] != "b" || pod.Annotations["stagelet.io/stage1"] != "kvm" {
		t.Fatalf("pod = %+v, title %q", pod, title)
	}
	cri := []byte(`{"metadata": {"name": "x", "namespace": "ci", "uid": "u"},
		"linux": {"security_context": {"privileged": true, "namespace_options": {"network": 2}}}}`)
	pod, title, err = parsePodForPolicy(cri, "kvm")
	if err != nil {
		t.Fatal(err)
	}
	if title != "ci/x" || pod.Handler != "kvm" || !pod.HostNetwork || pod.HostPID || !pod.Privileged {
		t.Fatalf("pod = %+v", pod)
	}
	if _, _, err := parsePodForPolicy([]byte("kind: Deployment\n"), ""); err == nil || !strings.Contains(err.Error(), "Deployment") {
		t.Fatalf("err = %v", err)
	}
	if _, _, err := parsePodForPolicy([]byte(`{"metadata": {}, "bogus": 1}`), ""); err == nil {
		t.Fatal("a malformed CRI config was accepted")
	}
}

func TestPolicyCheck(t *testing.T) {
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad.yaml")
	os.WriteFile(bad, []byte("version: 1\ndefault_stage1: fly\nrulez: []\n"), 0o644)
	var out strings.Builder
	if rc := policyCheck([]string{bad}, &out); rc != 1 {
		t.Fatalf("rc = %d for a bad file:\n%s", rc, out.String())
	}
	if !strings.Contains(out.String(), bad+":3:1:") {
		t.Fatalf("output does not name line and column:\n%s", out.String())
	}
	good := filepath.Join(dir, "good.yaml")
	os.WriteFile(good, []byte("version: 1\ndefault_stage1: fly\n"), 0o644)
	out.Reset()
	if rc := policyCheck([]string{good}, &out); rc != 0 || !strings.Contains(out.String(), good+": ok") {
		t.Fatalf("rc = %d:\n%s", rc, out.String())
	}
}
