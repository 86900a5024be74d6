package main

import (
	"context"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/test/e2e/harness"
)

// fileIOFiles is how many small files the metadata phases create, stat,
// read and remove; fileIOWriteMiB the size of the file written and synced.
const (
	fileIOFiles    = 1000
	fileIOWriteMiB = 64
)

// spawnProcs is how many times the spawn measure has the container's shell
// fork and exec true, and spawnScript that loop: what any exec into the
// container costs at least, whatever the runtime's own path adds (an
// ExecSync is one such process plus the runtime's work).
const spawnProcs = 20

var spawnScript = fmt.Sprintf(`i=0; while [ $i -lt %d ]; do /bin/true || exit 1; i=$((i+1)); done`, spawnProcs)

// imageScript stats every file of the image's /bin, /sbin, /usr and
// /etc and reads a byte of each: lookups and reads in the image's own
// files, the lower layer of the container's root (a disk of the image,
// or over 9p), which the phases above, in a new directory, never touch.
// The first run finds them cold.
const imageScript = `for f in /bin/* /sbin/* /usr/*/* /etc/*; do [ -f "$f" ] || continue; read -r -n 1 l < "$f"; done; true`

// fileIOPlace is a directory of the container where the phases run.
type fileIOPlace struct {
	name string
	dir  string
}

// fileIOPlaces: the container's root file system, and as the baseline a
// tmpfs inside the pod: the container's /dev/shm, which every stage1
// mounts (a tmpfs of 64 MiB: in a kvm pod, the guest's memory). Its
// size bounds the written file to 64 MiB.
var fileIOPlaces = []fileIOPlace{
	{"rootfs", "/fileio"},
	{"tmpfs (/dev/shm)", "/dev/shm/fileio"},
}

// fileIOPhase is one timed step; its script runs in busybox sh with D set
// to the place's directory. The metadata phases use only the shell's
// builtins (no fork per file), so they time the file system rather than
// process creation, which under TCG would dwarf it.
type fileIOPhase struct {
	name, script string
}

var fileIOPhases = []fileIOPhase{
	{fmt.Sprintf("create %d files", fileIOFiles),
		fmt.Sprintf(`mkdir -p "$D" && cd "$D" && i=0 && while [ $i -lt %d ]; do echo x > f$i; i=$((i+1)); done`, fileIOFiles)},
	{fmt.Sprintf("stat %d files", fileIOFiles), `for f in "$D"/*; do [ -f "$f" ] || exit 1; done`},
	{fmt.Sprintf("read %d files", fileIOFiles), `for f in "$D"/*; do read -r l < "$f" || exit 1; done`},
	{fmt.Sprintf("remove %d files", fileIOFiles), `rm -r "$D"`},
	{fmt.Sprintf("write %d MiB + fsync", fileIOWriteMiB),
		fmt.Sprintf(`dd if=/dev/zero of="$D.big" bs=1M count=%d conv=fsync 2>/dev/null`, fileIOWriteMiB)},
}

// fileIOResult: per place, per phase, the durations of the runs; spawn:
// per run, the time of one process of spawnScript.
type fileIOResult struct {
	took  map[string]map[string][]time.Duration
	spawn []time.Duration
	// image: per run, the time of imageScript.
	image []time.Duration
}

// measureFileIO starts one pod and times, n times over, each phase in
// each place of its container. Every phase is one ExecSync whose shell
// reads the pod's clock (/proc/uptime: 10 ms steps) before and after the
// phase, so neither the call's overhead nor its noise counts. The pod is
// removed at the end.
func measureFileIO(ctx context.Context, d *harness.Daemon, ref, stage1 string, podNet bool, n int) (res *fileIOResult, err error) {
	bp, err := startPod(ctx, d, ref, stage1, podNet, "fileio")
	if err != nil {
		return nil, err
	}
	rt := d.Runtime()
	defer func() {
		if rerr := measureTeardown(ctx, rt, []string{bp.ctrID}, []string{bp.podID}, &result{}); rerr != nil && err == nil {
			err = rerr
		}
	}()
	res = &fileIOResult{took: map[string]map[string][]time.Duration{}}
	for run := range n {
		took, err := timeSh(ctx, rt, bp.ctrID, imageScript)
		if err != nil {
			return nil, fmt.Errorf("run %d, image files: %w", run, err)
		}
		res.image = append(res.image, took)
		for _, pl := range fileIOPlaces {
			if res.took[pl.name] == nil {
				res.took[pl.name] = map[string][]time.Duration{}
			}
			for _, ph := range fileIOPhases {
				took, err := timeSh(ctx, rt, bp.ctrID, "D="+pl.dir+"; "+ph.script)
				if err != nil {
					return nil, fmt.Errorf("run %d, %s, %s: %w", run, pl.name, ph.name, err)
				}
				res.took[pl.name][ph.name] = append(res.took[pl.name][ph.name], took)
			}
			if _, err := timeSh(ctx, rt, bp.ctrID, "rm -f "+pl.dir+".big"); err != nil {
				return nil, err
			}
		}
		took, err = timeSh(ctx, rt, bp.ctrID, spawnScript)
		if err != nil {
			return nil, fmt.Errorf("run %d, spawn: %w", run, err)
		}
		res.spawn = append(res.spawn, took/spawnProcs)
	}
	return res, nil
}

// timeSh runs script with sh -c in container ctr and returns how long it
// took by the container's clock; a non-zero exit is an error.
func timeSh(ctx context.Context, rt runtimeapi.RuntimeServiceClient, ctr, script string) (time.Duration, error) {
	timed := "read t0 _ </proc/uptime; ( " + script + " ) || exit $?; read t1 _ </proc/uptime; echo $t0 $t1"
	r, err := rt.ExecSync(ctx, &runtimeapi.ExecSyncRequest{ContainerId: ctr, Cmd: []string{"sh", "-c", timed}, Timeout: 300})
	if err != nil {
		return 0, err
	}
	if r.ExitCode != 0 {
		return 0, fmt.Errorf("exited %d: %s%s", r.ExitCode, r.Stdout, r.Stderr)
	}
	return uptimeSpan(string(r.Stdout))
}

// uptimeSpan reads "T0 T1", two /proc/uptime readings in seconds, as
// the time between them.
func uptimeSpan(out string) (time.Duration, error) {
	f := strings.Fields(out)
	if len(f) != 2 {
		return 0, fmt.Errorf("want two clock readings, got %q", out)
	}
	var t [2]float64
	for i := range f {
		v, err := strconv.ParseFloat(f[i], 64)
		if err != nil {
			return 0, fmt.Errorf("clock reading %q: %w", f[i], err)
		}
		t[i] = v
	}
	return time.Duration((t[1] - t[0]) * float64(time.Second)).Round(10 * time.Millisecond), nil
}

// reportFileIO prints each phase's median per place and the ratio of the
// root file system's to the tmpfs's.
func reportFileIO(w io.Writer, n int, what string, r *fileIOResult) {
	fmt.Fprintf(w, "stagelet-bench: file I/O in a container, stage1 %s, median of %d runs (timed by the pod's clock, 10 ms steps)\n\n", what, n)
	base := fileIOPlaces[len(fileIOPlaces)-1].name
	fmt.Fprintf(w, "%-24s", "phase")
	for _, pl := range fileIOPlaces {
		fmt.Fprintf(w, " %18s", pl.name)
	}
	fmt.Fprintf(w, " %18s\n", "rootfs / tmpfs")
	for _, ph := range fileIOPhases {
		fmt.Fprintf(w, "%-24s", ph.name)
		for _, pl := range fileIOPlaces {
			fmt.Fprintf(w, " %18s", ms(median(r.took[pl.name][ph.name])))
		}
		fmt.Fprintf(w, " %18s\n", ratio(median(r.took[fileIOPlaces[0].name][ph.name]), median(r.took[base][ph.name])))
	}
	fmt.Fprintln(w, strings.Repeat("-", 24+19*(len(fileIOPlaces)+1)))
	fmt.Fprintf(w, "process start in the container (its shell forks and execs true %d times), per process: %s\n", spawnProcs, ms(median(r.spawn)))
	if len(r.image) > 0 {
		warm := "-"
		if len(r.image) > 1 {
			warm = ms(median(r.image[1:]))
		}
		fmt.Fprintf(w, "the image's files in /bin, /sbin, /usr, /etc (stat, read a byte): cold (first run) %s, warm (median of the later runs) %s\n", ms(r.image[0]), warm)
	}
}

// ratio is a/b as "2.31x", or "-" when b is zero.
func ratio(a, b time.Duration) string {
	if b <= 0 {
		return "-"
	}
	return fmt.Sprintf("%.2fx", float64(a)/float64(b))
}
