package e2e

import (
	"bytes"
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"strings"
	"syscall"
	"testing"

	"google.golang.org/grpc/codes"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/internal/testutil"
	"github.com/stagelet/stagelet/test/e2e/harness"
)

// workedPolicy is the README's worked example for the stage1s this node
// has: namespace ci → nspawn (locked, privileged pods refused; without
// the example's VM options, which nspawn does not take), kube-system
// hostNetwork → fly, everything else → nspawn, annotations may only
// raise, to nspawn; the fly handler is for kube-system only.
const workedPolicy = `version: 1
default_stage1: nspawn
handlers:
  nspawn: {stage1: nspawn}
  fly:
    stage1: fly
    namespaces: [kube-system]
rules:
  - name: system-daemons-on-host
    match: {namespaces: [kube-system], host_network: true}
    stage1: fly
  - name: no-privileged-in-ci
    match: {namespaces: [ci], privileged: true}
    refuse: "privileged pods do not run in ci"
  - name: ci-isolated
    match: {namespaces: [ci]}
    stage1: nspawn
    locked: true
annotations:
  allow: [nspawn]
  raise_only: true
`

const (
	annStage1 = "stagelet.io/stage1"
	annRkt    = "rkt.alpha.kubernetes.io/stage1-name-override"
)

// nsOpts is a NamespaceOption from three modes.
func nsOpts(network, pid, ipc runtimeapi.NamespaceMode) *runtimeapi.NamespaceOption {
	return &runtimeapi.NamespaceOption{Network: network, Pid: pid, Ipc: ipc}
}

var (
	allHost = nsOpts(runtimeapi.NamespaceMode_NODE, runtimeapi.NamespaceMode_NODE, runtimeapi.NamespaceMode_NODE)
	allPod  = nsOpts(runtimeapi.NamespaceMode_POD, runtimeapi.NamespaceMode_POD, runtimeapi.NamespaceMode_POD)
)

// policyPod is a pod config in namespace ns with the namespace modes ns
// and annotations ann.
func (e *env) policyPod(name, namespace string, opts *runtimeapi.NamespaceOption, ann map[string]string) *runtimeapi.PodSandboxConfig {
	cfg := e.podConfig(name)
	cfg.Metadata.Namespace = namespace
	cfg.Linux.SecurityContext.NamespaceOptions = opts
	maps.Copy(cfg.Annotations, ann)
	return cfg
}

// verbosePod is PodSandboxStatus with verbose info.
func (e *env) verbosePod(id string) *runtimeapi.PodSandboxStatusResponse {
	e.t.Helper()
	resp, err := e.rt().PodSandboxStatus(e.ctx(), &runtimeapi.PodSandboxStatusRequest{PodSandboxId: id, Verbose: true})
	if err != nil {
		e.t.Fatalf("PodSandboxStatus %s (verbose): %v", id, err)
	}
	return resp
}

// verboseStatus is the runtime's verbose Status info.
func (e *env) verboseStatus() map[string]string {
	e.t.Helper()
	resp, err := e.rt().Status(e.ctx(), &runtimeapi.StatusRequest{Verbose: true})
	if err != nil {
		e.t.Fatalf("Status (verbose): %v", err)
	}
	return resp.Info
}

// decisionCounts is the "decisions" of the verbose Status info.
func (e *env) decisionCounts() map[string]int {
	e.t.Helper()
	info := e.verboseStatus()
	var m map[string]int
	if err := json.Unmarshal([]byte(info["decisions"]), &m); err != nil {
		e.t.Fatalf("Status info decisions %q: %v", info["decisions"], err)
	}
	return m
}

// Pods of different namespaces, handlers and annotations get different
// stage1s, say why, and really run differently: fly shares the host's PID
// namespace, nspawn does not.
func TestPolicyChoosesStage1PerPod(t *testing.T) {
	e := newEnvOpts(t, harness.Options{Policy: workedPolicy}, true)
	cases := []struct {
		name, namespace, handler string
		ns                       *runtimeapi.NamespaceOption
		ann                      map[string]string
		stage1, rule             string
		reason                   string // a piece of the reasons
	}{
		{name: "system", namespace: "kube-system", ns: allHost,
			stage1: "fly", rule: "system-daemons-on-host", reason: `rule "system-daemons-on-host"`},
		{name: "plain", namespace: "default", ns: allPod,
			stage1: "nspawn", reason: "default_stage1"},
		{name: "ci", namespace: "ci", ns: allPod,
			stage1: "nspawn", rule: "ci-isolated", reason: `rule "ci-isolated"`},
		{name: "by-handler", namespace: "kube-system", handler: "fly",
			ns:     nsOpts(runtimeapi.NamespaceMode_POD, runtimeapi.NamespaceMode_NODE, runtimeapi.NamespaceMode_NODE),
			stage1: "fly", reason: `runtime handler "fly"`},
		{name: "rkt-raised", namespace: "kube-system",
			ns:     nsOpts(runtimeapi.NamespaceMode_NODE, runtimeapi.NamespaceMode_POD, runtimeapi.NamespaceMode_POD),
			ann:    map[string]string{annRkt: "coreos.com/rkt/stage1-coreos:1.30.0"},
			stage1: "nspawn", rule: "system-daemons-on-host", reason: annRkt},
		{name: "annotated", namespace: "default", ns: allPod,
			ann:    map[string]string{annStage1: "nspawn"},
			stage1: "nspawn", reason: annStage1},
	}
	hostPID, hostNet := hostNSLink(t, "pid"), hostNSLink(t, "net")
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg := e.policyPod("policy-"+tc.name, tc.namespace, tc.ns, tc.ann)
			id := e.runPodHandler(cfg, tc.handler)
			resp := e.verbosePod(id)
			if got := resp.Status.RuntimeHandler; got != tc.stage1 {
				t.Errorf("runtime_handler %q, want %q", got, tc.stage1)
			}
			info := resp.Info
			if info["stage1"] != tc.stage1 || info["rule"] != tc.rule {
				t.Errorf("verbose info stage1 %q rule %q, want %q %q (info %v)", info["stage1"], info["rule"], tc.stage1, tc.rule, info)
			}
			if !strings.Contains(info["reasons"], tc.reason) {
				t.Errorf("verbose info reasons %q do not mention %q", info["reasons"], tc.reason)
			}
			ctr := e.containerConfig("app", "sleep", "3600")
			ctr.Linux.SecurityContext.NamespaceOptions = tc.ns
			cid := e.createAndStart(id, cfg, ctr)
			e.waitContainerState(cid, running, stateTimeout)
			pid := strings.TrimSpace(e.execOK(cid, "readlink", "/proc/self/ns/pid"))
			net := strings.TrimSpace(e.execOK(cid, "readlink", "/proc/self/ns/net"))
			if sharesPID := pid == hostPID; sharesPID != (tc.stage1 == "fly") {
				t.Errorf("on %s the container's PID namespace is %s, the host's %s", tc.stage1, pid, hostPID)
			}
			if sharesNet := net == hostNet; sharesNet != (tc.ns.Network == runtimeapi.NamespaceMode_NODE) {
				t.Errorf("with network mode %s the container's network namespace is %s, the host's %s", tc.ns.Network, net, hostNet)
			}
		})
	}
	list, err := e.rt().ListPodSandbox(e.ctx(), &runtimeapi.ListPodSandboxRequest{})
	if err != nil {
		t.Fatalf("ListPodSandbox: %v", err)
	}
	for _, p := range list.Items {
		if want := e.podStatus(p.Id).RuntimeHandler; p.RuntimeHandler != want {
			t.Errorf("ListPodSandbox says pod %s runs on %q, its status says %q", p.Metadata.Name, p.RuntimeHandler, want)
		}
	}
}

// Requests the policy does not allow are refused with the code and a
// message naming what refused, and create nothing.
func TestPolicyRefusals(t *testing.T) {
	e := newEnvOpts(t, harness.Options{Policy: workedPolicy}, false)
	cases := []struct {
		name, namespace, handler string
		ns                       *runtimeapi.NamespaceOption
		ann                      map[string]string
		privileged               bool
		code                     codes.Code
		names                    []string // what the message must name
	}{
		{name: "fly-annotation", namespace: "default", ns: allHost,
			ann: map[string]string{annStage1: "fly"}, code: codes.PermissionDenied, names: []string{"annotations.allow", annStage1, "fly"}},
		{name: "rkt-fly-annotation", namespace: "default", ns: allHost,
			ann: map[string]string{annRkt: "coreos.com/rkt/stage1-fly:1.30.0"}, code: codes.PermissionDenied, names: []string{"annotations.allow", annRkt}},
		{name: "unknown-handler", namespace: "default", handler: "warp", ns: allPod,
			code: codes.InvalidArgument, names: []string{`"warp"`}},
		{name: "fly-handler-outside-kube-system", namespace: "default", handler: "fly", ns: allHost,
			code: codes.PermissionDenied, names: []string{"handlers.fly", "kube-system"}},
		{name: "privileged-in-ci", namespace: "ci", ns: allPod, privileged: true,
			code: codes.PermissionDenied, names: []string{"no-privileged-in-ci", "privileged pods do not run in ci"}},
		{name: "unparseable-annotation", namespace: "default", ns: allPod,
			ann: map[string]string{annRkt: "example.com/not-a-stage1"}, code: codes.InvalidArgument, names: []string{annRkt}},
		{name: "host-pid-on-nspawn", namespace: "default", ns: nsOpts(runtimeapi.NamespaceMode_POD, runtimeapi.NamespaceMode_NODE, runtimeapi.NamespaceMode_POD),
			code: codes.InvalidArgument, names: []string{"conflicts.host_pid"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg := e.policyPod("refused-"+tc.name, tc.namespace, tc.ns, tc.ann)
			cfg.Linux.SecurityContext.Privileged = tc.privileged
			resp, err := e.rt().RunPodSandbox(e.ctx(), &runtimeapi.RunPodSandboxRequest{Config: cfg, RuntimeHandler: tc.handler})
			if err == nil {
				e.cleanupPod(resp.PodSandboxId)
			}
			requireCode(t, err, tc.code, "RunPodSandbox")
			for _, n := range tc.names {
				if !strings.Contains(err.Error(), n) {
					t.Errorf("the refusal does not name %q: %v", n, err)
				}
			}
		})
	}
	list, err := e.rt().ListPodSandbox(e.ctx(), &runtimeapi.ListPodSandboxRequest{})
	if err != nil {
		t.Fatalf("ListPodSandbox: %v", err)
	}
	if len(list.Items) != 0 {
		t.Errorf("refused requests left pods: %v", list.Items)
	}
	if got, want := e.decisionCounts(), map[string]int{"refused": len(cases)}; !maps.Equal(got, want) {
		t.Errorf("Status decisions %v, want %v", got, want)
	}
}

// The decisions in the verbose Status info count what the test asked for:
// pods per stage1 and refusals; a retried RunPodSandbox is not a new
// decision.
func TestPolicyDecisionCounts(t *testing.T) {
	e := newEnvOpts(t, harness.Options{Policy: workedPolicy}, false)
	if got := e.decisionCounts(); len(got) != 0 {
		t.Errorf("decisions of a fresh daemon: %v, want none", got)
	}
	info := e.verboseStatus()
	if info["policy"] != e.d.ConfigPath || info["defaultStage1"] != "nspawn" {
		t.Errorf("Status info policy %q defaultStage1 %q, want %q nspawn", info["policy"], info["defaultStage1"], e.d.ConfigPath)
	}
	run := func(name, namespace, handler string, ns *runtimeapi.NamespaceOption, ann map[string]string) error {
		cfg := e.policyPod(name, namespace, ns, ann)
		resp, err := e.rt().RunPodSandbox(e.ctx(), &runtimeapi.RunPodSandboxRequest{Config: cfg, RuntimeHandler: handler})
		if err == nil {
			e.cleanupPod(resp.PodSandboxId)
			// The kubelet's retry of the same request.
			again, err := e.rt().RunPodSandbox(e.ctx(), &runtimeapi.RunPodSandboxRequest{Config: cfg, RuntimeHandler: handler})
			if err != nil || again.PodSandboxId != resp.PodSandboxId {
				t.Errorf("retry of RunPodSandbox %s: %v, id %q want %q", name, err, again.GetPodSandboxId(), resp.PodSandboxId)
			}
		}
		return err
	}
	for i, c := range []struct {
		namespace, handler string
		ns                 *runtimeapi.NamespaceOption
		ann                map[string]string
		ok                 bool
	}{
		{"default", "", allPod, nil, true},                                   // nspawn
		{"ci", "", allPod, nil, true},                                        // nspawn
		{"kube-system", "", allHost, nil, true},                              // fly
		{"default", "warp", allPod, nil, false},                              // refused
		{"default", "", allHost, map[string]string{annStage1: "fly"}, false}, // refused
	} {
		err := run(fmt.Sprintf("count-%d", i), c.namespace, c.handler, c.ns, c.ann)
		if (err == nil) != c.ok {
			t.Fatalf("pod %d in %s: %v, want success %v", i, c.namespace, err, c.ok)
		}
	}
	want := map[string]int{"nspawn": 2, "fly": 1, "refused": 2}
	if got := e.decisionCounts(); !maps.Equal(got, want) {
		t.Errorf("Status decisions %v, want %v", got, want)
	}
}

// countLog counts the daemon log's lines holding s.
func (e *env) countLog(s string) int {
	b, err := os.ReadFile(e.d.LogPath)
	if err != nil {
		e.t.Fatalf("daemon log: %v", err)
	}
	return bytes.Count(b, []byte(s))
}

// reload writes pol as the daemon's policy, sends SIGHUP and waits until
// the daemon logs a line holding logged more times than before.
func (e *env) reload(pol, logged string) {
	e.t.Helper()
	before := e.countLog(logged)
	if err := e.d.WritePolicy(pol); err != nil {
		e.t.Fatalf("write the policy: %v", err)
	}
	if err := syscall.Kill(e.d.PID(), syscall.SIGHUP); err != nil {
		e.t.Fatalf("SIGHUP the daemon: %v", err)
	}
	testutil.WaitFor(e.t, stateTimeout, fmt.Sprintf("the daemon to log %q", logged), func() (bool, string) {
		if !e.d.Running() {
			e.t.Fatalf("the daemon exited on SIGHUP: %s", e.d.ExitStatus())
		}
		return e.countLog(logged) > before, e.d.LogTail(5)
	})
}

// A broken policy is rejected on reload and the previous one stays in
// force; a valid one replaces it for new pods, while running pods keep
// their recorded stage1.
func TestPolicyReload(t *testing.T) {
	e := newEnvOpts(t, harness.Options{Policy: bothStage1sPolicy}, true)
	const rejected, reloaded = `msg="policy reload rejected`, `msg="policy reloaded"`

	first := e.policyPod("before-reload", "default", allHost, nil)
	firstID := e.runPod(first)
	if got := e.podStatus(firstID).RuntimeHandler; got != "fly" {
		t.Fatalf("pod under the first policy runs on %q, want fly (its default)", got)
	}
	firstCtr := e.createAndStart(firstID, first, e.containerConfig("app", "sleep", "3600"))
	e.waitContainerState(firstCtr, running, stateTimeout)

	// A broken policy: an unknown stage1 and an unknown key.
	e.reload("version: 1\ndefault_stage1: warp\ncolour: blue\nhandlers:\n  nspawn: {stage1: nspawn}\n", rejected)
	var line string
	for _, l := range strings.Split(e.d.LogTail(50), "\n") {
		if strings.Contains(l, rejected) {
			line = l
		}
	}
	if !strings.Contains(line, "warp") && !strings.Contains(line, "colour") {
		t.Errorf("the rejection does not name the problem (warp, colour): %s", line)
	}
	if info := e.verboseStatus(); info["defaultStage1"] != "fly" {
		t.Errorf("after the rejected reload Status says defaultStage1 %q, want the old fly", info["defaultStage1"])
	}
	kept := e.policyPod("after-rejected", "default", allHost, nil)
	keptID := e.runPod(kept)
	if got := e.podStatus(keptID).RuntimeHandler; got != "fly" {
		t.Errorf("after the rejected reload a new pod runs on %q, want fly (the old policy's default)", got)
	}
	viaHandler := e.policyPod("after-rejected-fly-handler", "default", allHost, nil)
	e.runPodHandler(viaHandler, "fly") // the old policy's handler still works

	// A valid, changed policy: default nspawn, and no fly handler.
	e.reload("version: 1\ndefault_stage1: nspawn\nhandlers:\n  nspawn: {stage1: nspawn}\n", reloaded)
	if info := e.verboseStatus(); info["defaultStage1"] != "nspawn" {
		t.Errorf("after the reload Status says defaultStage1 %q, want nspawn", info["defaultStage1"])
	}
	next := e.policyPod("after-reload", "default", nsOpts(runtimeapi.NamespaceMode_NODE, runtimeapi.NamespaceMode_POD, runtimeapi.NamespaceMode_POD), nil)
	nextID := e.runPod(next)
	if got := e.podStatus(nextID).RuntimeHandler; got != "nspawn" {
		t.Errorf("after the reload a new pod runs on %q, want nspawn (the new default)", got)
	}
	gone := e.policyPod("after-reload-fly-handler", "default", allHost, nil)
	_, err := e.rt().RunPodSandbox(e.ctx(), &runtimeapi.RunPodSandboxRequest{Config: gone, RuntimeHandler: "fly"})
	requireCode(t, err, codes.InvalidArgument, "RunPodSandbox with the handler the new policy dropped")

	// The earlier pods keep their recorded decision and still work.
	for _, id := range []string{firstID, keptID} {
		resp := e.verbosePod(id)
		if resp.Status.RuntimeHandler != "fly" || resp.Info["stage1"] != "fly" {
			t.Errorf("pod %s after the reload: runtime_handler %q, info stage1 %q, want fly", id, resp.Status.RuntimeHandler, resp.Info["stage1"])
		}
	}
	if pid := strings.TrimSpace(e.execOK(firstCtr, "readlink", "/proc/self/ns/pid")); pid != hostNSLink(t, "pid") {
		t.Errorf("the fly pod's container left the host's PID namespace after the reload: %s", pid)
	}
	nextCtr := e.createAndStart(nextID, next, func() *runtimeapi.ContainerConfig {
		c := e.containerConfig("app", "sleep", "3600")
		c.Linux.SecurityContext.NamespaceOptions = next.Linux.SecurityContext.NamespaceOptions
		return c
	}())
	e.waitContainerState(nextCtr, running, stateTimeout)
	if pid := strings.TrimSpace(e.execOK(nextCtr, "readlink", "/proc/self/ns/pid")); pid == hostNSLink(t, "pid") {
		t.Errorf("the nspawn pod's container is in the host's PID namespace")
	}
}
