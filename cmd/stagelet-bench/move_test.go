package main

import (
	"archive/tar"
	"bytes"
	"strings"
	"testing"
	"time"
)

// tarOf is a tar stream of the named files.
func tarOf(t *testing.T, files ...[2]string) *bytes.Buffer {
	t.Helper()
	var b bytes.Buffer
	tw := tar.NewWriter(&b)
	for _, f := range files {
		if err := tw.WriteHeader(&tar.Header{Name: f[0], Mode: 0o600, Size: int64(len(f[1])), Typeflag: tar.TypeReg}); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write([]byte(f[1])); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return &b
}

// The pause is read from the saved VM's description in the archive, as
// stage1 kvm writes it (its migration's figures in nanoseconds).
func TestSavedVMPause(t *testing.T) {
	vm := `{"version":1,"vm":{"memoryMiB":256},"migration":{"Bytes":82000000,"Total":670000000,"Downtime":25000000}}`
	got, err := savedVMPause(tarOf(t, [2]string{"config.dump", "{}"}, [2]string{"checkpoint/vm.state", "x"}, [2]string{"checkpoint/vm.json", vm}))
	if err != nil || got != 25*time.Millisecond {
		t.Errorf("savedVMPause = %v, %v; want 25ms", got, err)
	}
	for name, b := range map[string]*bytes.Buffer{
		"no vm.json (a CRIU archive)": tarOf(t, [2]string{"config.dump", "{}"}),
		"no downtime":                 tarOf(t, [2]string{"checkpoint/vm.json", `{"migration":{}}`}),
		"not JSON":                    tarOf(t, [2]string{"checkpoint/vm.json", `vm`}),
	} {
		if _, err := savedVMPause(b); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
}

func TestMovePhaseMedian(t *testing.T) {
	ph := movePhases[1] // the pause: kvm only
	runs := []moveRun{{paused: 30 * time.Millisecond}, {paused: 10 * time.Millisecond}, {}, {paused: 20 * time.Millisecond}, {paused: 40 * time.Millisecond}}
	if v, ok := ph.medianOf(runs); !ok || v != 25 {
		t.Errorf("median of 10, 20, 30, 40 ms (and a run without): %v, %v; want 25", v, ok)
	}
	if _, ok := ph.medianOf([]moveRun{{}}); ok {
		t.Error("a median of runs without the figure")
	}
	if v, _ := movePhases[2].medianOf([]moveRun{{bytes: 3e6}, {bytes: 1e6}, {bytes: 2e6}}); movePhases[2].format(v) != "2.0 MB" {
		t.Errorf("median archive size: %s, want 2.0 MB", movePhases[2].format(v))
	}
}

// Both ways' medians stand side by side with their ratio; a figure one
// way lacks shows as -, and a skipped way says why.
func TestReportMoves(t *testing.T) {
	run := func(ckpt, pause, down time.Duration, size int64) moveRun {
		return moveRun{checkpoint: ckpt, paused: pause, bytes: size, stopSource: 100 * time.Millisecond, restore: 500 * time.Millisecond, downtime: down}
	}
	r := &moveResult{runs: map[string][]moveRun{
		"kvm":    {run(600*time.Millisecond, 25*time.Millisecond, time.Second, 82e6)},
		"nspawn": {run(300*time.Millisecond, 0, 2*time.Second, 1e6)},
	}, skipped: map[string]string{}}
	var b strings.Builder
	reportMoves(&b, 1, "pod network", r)
	out := b.String()
	for _, want := range []string{
		"CheckpointContainer", "600.0 ms", "300.0 ms", "2.00x",
		"82.0 MB", "1.0 MB", "82.00x",
		"1000.0 ms", "2000.0 ms", "0.50x",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("report lacks %q:\n%s", want, out)
		}
	}
	for _, l := range strings.Split(out, "\n") {
		if strings.Contains(l, "guest paused") {
			if f := strings.Fields(l); f[len(f)-1] != "-" || f[len(f)-2] != "-" {
				t.Errorf("pause row %q: want - for CRIU and for the ratio", l)
			}
		}
	}

	r = &moveResult{runs: map[string][]moveRun{"kvm": {run(time.Second, time.Millisecond, time.Second, 1)}}, skipped: map[string]string{"nspawn": "no criu works here"}}
	b.Reset()
	reportMoves(&b, 1, "pod network", r)
	if !strings.Contains(b.String(), "nspawn (CRIU): skipped: no criu works here") {
		t.Errorf("a skipped way is not said:\n%s", b.String())
	}
}

// A live move's figures come from the daemon's two log lines, the last
// of each.
func TestLiveFigures(t *testing.T) {
	log := `time=… level=INFO msg="kvm: VM moved live" to=127.0.0.1:1 bytes=1 paused=999ms took=2s
time=… level=INFO msg="kvm: VM moved live" stage1=kvm to=127.0.0.1:42978 bytes=81169712 paused=226ms took=591ms
time=… level=INFO msg="kvm: VM taken from a live move" stage1=kvm from=127.0.0.1:38567 bytes=81434219 load=531.64216ms downtime=763.748104ms sourcePaused=226ms
`
	paused, streamed, down, err := liveFigures(log)
	if err != nil || paused != 226*time.Millisecond || streamed != 81434219 || down != 763748104*time.Nanosecond {
		t.Errorf("liveFigures = %v, %d, %v, %v", paused, streamed, down, err)
	}
	if _, _, _, err := liveFigures("msg=\"kvm: VM moved live\" paused=1ms\n"); err == nil {
		t.Error("no error without the target's line")
	}
}
