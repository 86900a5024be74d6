package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/internal/testutil"
)

// TestSetAsideRecordReleased: a running pod whose record is torn while
// the daemon is down is set aside by the next start, and keeps what it
// holds. stagelet doctor names the record and what its pod holds (its
// processes, netns and address); stagelet gc --set-aside refuses while
// the daemon runs, and once it is stopped releases all of it: the pod's
// app stops answering, nothing of its network, cgroups or directories is
// left (the harness checks when the test ends), the hostPath volume's
// files are intact, and the record is kept in quarantine/released, no
// longer set aside.
func TestSetAsideRecordReleased(t *testing.T) {
	forEachStage1(t, func(t *testing.T, e *env, s podStage1) {
		vol, files := hostPathVolume(t)
		cfg := e.netPodConfig("aside", s)
		podID := e.runStage1Pod(cfg, s)
		c := e.netContainer(s, "app", httpServer("aside")...)
		c.Mounts = []*runtimeapi.Mount{{HostPath: vol, ContainerPath: "/data"}}
		ctr := e.createAndStart(podID, cfg, c)
		ip := e.podIP(podID).String()
		url := "http://" + ip + ":8080/"
		e.waitHTTP(url, "aside\n")

		if err := e.d.Kill9(t.Context()); err != nil {
			t.Fatal(err)
		}
		rec := filepath.Join(e.d.StateDir, "pods", podID+".json")
		orig, err := os.ReadFile(rec)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(rec, orig[:len(orig)/2], 0o600); err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(t.Context(), startTimeout)
		defer cancel()
		if err := e.d.Restart(ctx); err != nil {
			t.Fatalf("restart the daemon: %v", err)
		}
		if got, err := httpGet(url); err != nil || got != "aside\n" {
			t.Fatalf("the set-aside pod's app: %q, %v", got, err)
		}

		// doctor lists the record and what its pod holds.
		out, _, _ := e.stageletTool(t, "doctor", "-o", "json")
		var rep struct {
			Checks []struct{ Name, Status, Detail string }
		}
		if err := json.Unmarshal(out, &rep); err != nil {
			t.Fatalf("doctor -o json: %v\n%s", err, out)
		}
		var aside string
		for _, ch := range rep.Checks {
			if ch.Name == "set-aside" {
				aside = ch.Status + ": " + ch.Detail
			}
		}
		for _, want := range []string{"warn: 1 set-aside records", "pod " + podID, "pids=", "netns=", ip, "containers=[" + ctr + "]"} {
			if !strings.Contains(aside, want) {
				t.Errorf("doctor's set-aside check lacks %q:\n%s", want, aside)
			}
		}

		// crictl info says the same, once the daemon's preflight ran.
		testutil.WaitFor(t, 2*time.Minute, "the preflight in verbose Status", func() (bool, string) {
			got := e.verboseStatus()["preflight.set-aside"]
			return strings.Contains(got, "pod "+podID) && strings.Contains(got, ip), got
		})

		// Not while the daemon runs.
		if _, stderr, err := e.stageletTool(t, "gc", "--set-aside"); err == nil || !strings.Contains(string(stderr), "the daemon runs") {
			t.Errorf("gc while the daemon runs: %v\n%s", err, stderr)
		}
		if got, err := httpGet(url); err != nil || got != "aside\n" {
			t.Fatalf("the pod's app after the refused gc: %q, %v", got, err)
		}

		if err := e.d.Stop(t.Context(), 30*time.Second); err != nil {
			t.Fatal(err)
		}
		out, stderr, err := e.stageletTool(t, "gc", "--set-aside")
		if err != nil || !strings.Contains(string(out), "released "+podID) {
			t.Fatalf("gc --set-aside: %v\n%s%s", err, out, stderr)
		}
		if got, err := httpGet(url); err == nil {
			t.Errorf("the released pod's app still answers: %q", got)
		}
		if held := e.networkHeld(); len(held) > 0 {
			t.Errorf("network held after the release: %v", held)
		}
		for _, dir := range []string{filepath.Join(e.d.RunDir, "pods", podID), filepath.Join(e.d.StateDir, "containers-fs", ctr)} {
			if _, err := os.Lstat(dir); !os.IsNotExist(err) {
				t.Errorf("%s after the release: %v", dir, err)
			}
		}
		checkVolume(t, vol, files, "after the release")
		for _, kept := range []string{"pods-" + podID + ".json", "containers-" + ctr + ".json"} {
			if _, err := os.Stat(filepath.Join(e.d.StateDir, "quarantine", "released", kept)); err != nil {
				t.Errorf("the released record %s is not kept: %v", kept, err)
			}
		}
		// Nothing left to release; the next daemon sets nothing aside.
		if out, stderr, err := e.stageletTool(t, "gc", "--set-aside"); err != nil || !strings.Contains(string(out), "no set-aside records") {
			t.Errorf("a second gc: %v\n%s%s", err, out, stderr)
		}
		if err := e.d.Restart(ctx); err != nil {
			t.Fatalf("restart the daemon: %v", err)
		}
		if got := e.verboseStatus()["quarantinedRecords"]; got != "0" {
			t.Errorf("records in quarantine after the release: %q", got)
		}
		pods, err := e.rt().ListPodSandbox(e.ctx(), &runtimeapi.ListPodSandboxRequest{})
		if err != nil {
			t.Fatal(err)
		}
		if len(pods.Items) != 0 {
			t.Errorf("pods listed after the release: %v", pods.Items)
		}
	})
}

// stageletTool runs an operator command of the binary against the test
// daemon's configuration and state: its stdout, stderr and error.
func (e *env) stageletTool(t *testing.T, args ...string) ([]byte, []byte, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	args = append(args, "--config", e.d.ConfigPath, "--state-dir", e.d.StateDir, "--run-dir", e.d.RunDir)
	cmd := exec.CommandContext(ctx, stageletBin, args...)
	var out, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &stderr
	err := cmd.Run()
	t.Logf("stagelet %s: %v\n%s%s", strings.Join(args, " "), err, out.String(), stderr.String())
	return out.Bytes(), stderr.Bytes(), err
}

// TestGCAll: with the daemon stopped, stagelet gc --all stops and removes
// every pod, as the kubelet would (a runtime being removed): the apps
// stop answering, nothing is left (the harness checks when the test
// ends), and the next daemon lists no pod.
func TestGCAll(t *testing.T) {
	forEachStage1(t, func(t *testing.T, e *env, s podStage1) {
		var urls []string
		for _, name := range []string{"one", "two"} {
			cfg := e.netPodConfig(name, s)
			podID := e.runStage1Pod(cfg, s)
			e.createAndStart(podID, cfg, e.netContainer(s, "app", httpServer(name)...))
			url := "http://" + e.podIP(podID).String() + ":8080/"
			e.waitHTTP(url, name+"\n")
			urls = append(urls, url)
		}
		if err := e.d.Stop(t.Context(), 30*time.Second); err != nil {
			t.Fatal(err)
		}
		out, stderr, err := e.stageletTool(t, "gc", "--all")
		if err != nil || !strings.Contains(string(out), "released 2 pods") {
			t.Fatalf("gc --all: %v\n%s%s", err, out, stderr)
		}
		for _, url := range urls {
			if got, err := httpGet(url); err == nil {
				t.Errorf("%s still answers: %q", url, got)
			}
		}
		if held := e.networkHeld(); len(held) > 0 {
			t.Errorf("network held after gc --all: %v", held)
		}
		ctx, cancel := context.WithTimeout(t.Context(), startTimeout)
		defer cancel()
		if err := e.d.Restart(ctx); err != nil {
			t.Fatalf("restart the daemon: %v", err)
		}
		pods, err := e.rt().ListPodSandbox(e.ctx(), &runtimeapi.ListPodSandboxRequest{})
		if err != nil {
			t.Fatal(err)
		}
		if len(pods.Items) != 0 {
			t.Errorf("pods listed after gc --all: %v", pods.Items)
		}
	})
}
