package e2e

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/internal/testutil"
	"github.com/stagelet/stagelet/test/e2e/harness"
)

// TestKVMHostLogs: a VM pod's container's CRI log is written on the host
// by the daemon from the agent's log session (no 9p): its lines reach
// the kubelet's path in CRI format; a rotation (rename, then
// ReopenContainerLog) puts the next lines in a new file; a daemon killed
// while the container writes finds the session again, and no line is
// lost on the way (a line the daemon wrote but had not acknowledged may
// be written twice).
func TestKVMHostLogs(t *testing.T) {
	e := newKVMEnv(t)
	podCfg := e.netPodConfig("vmlogs", kvmStage1)
	podID := e.runStage1Pod(podCfg, kvmStage1)
	cfg := e.netContainer(kvmStage1, "ticker", "sh", "-c", `echo to stderr >&2; i=0; while true; do echo "tick $i"; i=$((i+1)); sleep 0.05; done`)
	ctr := e.createAndStart(podID, podCfg, cfg)
	path := logPath(podCfg, cfg)
	e.waitLogLine(path, "stderr", "to stderr")
	e.waitLogLine(path, "stdout", "tick 5")
	if fi, err := os.Stat(path); err != nil || fi.Mode().Perm() != 0o640 {
		t.Errorf("log file: %v %v, want mode 0640", fi, err)
	}

	// The kubelet's rotation.
	rotated := path + ".20240101-000000"
	if err := os.Rename(path, rotated); err != nil {
		t.Fatal(err)
	}
	if _, err := e.rt().ReopenContainerLog(e.ctx(), &runtimeapi.ReopenContainerLogRequest{ContainerId: ctr}); err != nil {
		t.Fatalf("ReopenContainerLog: %v", err)
	}
	testutil.WaitFor(t, stateTimeout, "new lines in the reopened log", func() (bool, string) {
		return len(e.readCRILog(path)) >= 3, e.logText(path)
	})
	size := fileSize(t, rotated)
	n := len(e.readCRILog(path))
	testutil.WaitFor(t, stateTimeout, "more lines in the new log", func() (bool, string) {
		return len(e.readCRILog(path)) >= n+3, e.logText(path)
	})
	if s := fileSize(t, rotated); s != size {
		t.Errorf("the rotated log still grows after the reopen (%d -> %d bytes)", size, s)
	}

	// The daemon dies while the container writes; the agent holds what
	// comes meanwhile.
	last := lastTick(t, e.readCRILog(path))
	if err := e.d.Kill9(t.Context()); err != nil {
		t.Fatalf("kill -9 the daemon: %v", err)
	}
	if err := e.d.Launch(); err != nil {
		t.Fatalf("restart the daemon: %v", err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), startTimeout)
	defer cancel()
	if _, err := e.d.WaitReady(ctx, func(ctx context.Context) error {
		_, err := e.rt().ListPodSandbox(ctx, &runtimeapi.ListPodSandboxRequest{})
		return err
	}); err != nil {
		t.Fatalf("daemon after restart: %v", err)
	}
	testutil.WaitFor(t, stateTimeout, fmt.Sprintf("ticks past %d after the restart", last+40), func() (bool, string) {
		return lastTick(t, e.readCRILog(path)) > last+40, e.logText(path)
	})
	lines := append(e.readCRILog(rotated), e.readCRILog(path)...)
	ticks := harness.JoinPartial(lines, "stdout")
	dup := checkTicks(t, ticks)
	t.Logf("%d lines, %d of them written twice across the daemon's kill", len(ticks), dup)
}

// lastTick is the last "tick N" of lines; -1 with none.
func lastTick(t *testing.T, lines []harness.LogLine) int {
	t.Helper()
	ticks := harness.JoinPartial(lines, "stdout")
	for i := len(ticks) - 1; i >= 0; i-- {
		if n, ok := strings.CutPrefix(ticks[i], "tick "); ok {
			v, err := strconv.Atoi(n)
			if err != nil {
				t.Fatalf("bad line %q", ticks[i])
			}
			return v
		}
	}
	return -1
}

// checkTicks checks that "tick 0", "tick 1"... all come, in order, none
// missing; a run of ticks written again (a replay of what the daemon
// had not acknowledged) is counted and returned.
func checkTicks(t *testing.T, ticks []string) (dup int) {
	t.Helper()
	next := 0
	for _, l := range ticks {
		v, err := strconv.Atoi(strings.TrimPrefix(l, "tick "))
		if err != nil {
			t.Fatalf("bad line %q", l)
		}
		switch {
		case v == next:
			next++
		case v < next:
			dup++
		default:
			t.Fatalf("tick %d follows tick %d: %d lines lost", v, next-1, v-next)
		}
	}
	return dup
}
