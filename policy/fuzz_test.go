package policy

import (
	"errors"
	"os"
	"strings"
	"testing"

	"github.com/stagelet/stagelet/errdefs"
)

// FuzzParse: the loader never panics; what it accepts validates or fails
// with Problems, and decides or refuses without panicking.
func FuzzParse(f *testing.F) {
	f.Add(defaultYAML)
	f.Add([]byte(rulesPolicy))
	f.Add([]byte(conflictsPolicy))
	if b, err := os.ReadFile("testdata/example.yaml"); err == nil {
		f.Add(b)
	}
	f.Add([]byte(""))
	f.Add([]byte("version: 1\ndefault_stage1: nspawn\nrules: [&r {name: a, stage1: kvm}, *r]\n"))
	f.Add([]byte("version: 1\nhandlers:\n  kvm:\n    <<: {stage1: kvm}\n"))
	f.Add([]byte("version: 1\ndefault_stage1: nspawn\n---\n[1]\n"))
	f.Add([]byte("version: 1\ndefault_stage1: nspawn\nannotations: {per_namespace: {\"[\": [kvm]}, raise_only: 7}\n"))
	pods := []Pod{
		{Namespace: "default"},
		{Namespace: "kube-system", HostNetwork: true, HostPID: true, HostIPC: true, Privileged: true},
		{Namespace: "ci", Handler: "kvm", Annotations: ann(AnnotationStage1, "nspawn")},
		{Namespace: "team-a", Handler: "fly", Labels: ann("accel", "gpu"), Annotations: ann(AnnotationRktStage1, "stage1-fly")},
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		p, err := Parse("fuzz.yaml", data)
		if err != nil {
			var ps Problems
			if p != nil || !errors.As(err, &ps) || len(ps) == 0 {
				t.Fatalf("Parse returned %v, %T %v", p, err, err)
			}
			return
		}
		if err := p.Validate(stage1Caps); err != nil {
			var ps Problems
			if !errors.As(err, &ps) {
				t.Fatalf("Validate returned %T %v", err, err)
			}
		}
		for _, pod := range pods {
			if _, err := p.Decide(pod, stage1Caps); err != nil {
				var r *Refusal
				if !errors.As(err, &r) {
					t.Fatalf("Decide returned %T %v", err, err)
				}
			}
		}
		_ = p.Handlers()
	})
}

// FuzzDecide: under the embedded default, decisions never panic, every
// error is a classed *Refusal, fly goes only to kube-system pods, and an
// annotation never lowers isolation below what the pod gets without it.
func FuzzDecide(f *testing.F) {
	f.Add("", "default", AnnotationStage1, "kvm", "app", "web", false, false, false, false)
	f.Add("", "kube-system", AnnotationStage1, "fly", "", "", true, true, false, false)
	f.Add("fly", "kube-system", AnnotationRktStage1, "coreos.com/rkt/stage1-fly:1.30.0", "", "", false, true, false, false)
	f.Add("fly", "default", "", "", "", "", false, false, false, false)
	f.Add("", "kube-system", AnnotationRktStage1, "stage1-coreos", "k8s-app", "kube-proxy", true, true, true, true)
	f.Add("nspawn", "ci", AnnotationStage1, "nspawn", "", "", false, false, true, false)
	f.Add("kvm", "kube-system", AnnotationStage1, "kvm", "", "", false, true, false, false)
	f.Add("runsc", "x", AnnotationRktStage1, "stage1-", "", "", false, false, false, true)
	p := Default()
	f.Fuzz(func(t *testing.T, handler, ns, key, value, lk, lv string, priv, hostNet, hostPID, hostIPC bool) {
		pod := Pod{
			Handler: handler, Namespace: ns,
			Labels:      map[string]string{lk: lv},
			Annotations: map[string]string{},
			Privileged:  priv, HostNetwork: hostNet, HostPID: hostPID, HostIPC: hostIPC,
		}
		if key != "" {
			pod.Annotations[key] = value
		}
		d, err := p.Decide(pod, stage1Caps)
		if err != nil {
			var r *Refusal
			if !errors.As(err, &r) {
				t.Fatalf("%T %v is not a *Refusal", err, err)
			}
			if !errors.Is(err, errdefs.ErrPermissionDenied) && !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Fatalf("refusal without a class: %v", err)
			}
			return
		}
		if _, ok := stage1Caps[d.Stage1]; !ok || len(d.Reasons) == 0 {
			t.Fatalf("decision %+v", d)
		}
		if d.Stage1 == "fly" && ns != "kube-system" {
			t.Fatalf("fly for namespace %q: %+v", ns, d)
		}
		if key == AnnotationStage1 || key == AnnotationRktStage1 {
			plain := pod
			plain.Annotations = nil
			base, err := p.Decide(plain, stage1Caps)
			if err == nil && stage1Caps[d.Stage1].Isolation < stage1Caps[base.Stage1].Isolation {
				t.Fatalf("annotation %s=%q lowered %q to %q", key, value, base.Stage1, d.Stage1)
			}
			if err == nil && d.Stage1 == "fly" && base.Stage1 != "fly" {
				t.Fatalf("annotation %s=%q obtained fly", key, value)
			}
		}
		if strings.Contains(p.Explain(d), "\n\n") {
			t.Fatalf("explain: %q", p.Explain(d))
		}
	})
}
