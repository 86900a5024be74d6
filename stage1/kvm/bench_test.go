package kvm

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/cgroups"
	"github.com/stagelet/stagelet/stage1"
	"github.com/stagelet/stagelet/stage1/podconn"
)

// Benchmarks of the kvm stage1 (root, qemu; run with -benchtime 10x):
//
//	BenchmarkRunPodToRunning  StartPod → a container running (median), the
//	                          VM restored from a template (built before
//	                          the timing) or booting its kernel
//	BenchmarkBareBoot         the same kernel, initramfs and accelerator
//	                          booted to the agent's ready line (the floor),
//	                          per machine type and kernel format
//	BenchmarkExecSync         one ExecSync round trip
//	BenchmarkAgentCall        one ContainerStatus round trip: the agent
//	                          channel's share of an ExecSync
//	BenchmarkFootprint        qemu's RSS and PSS of one pod, restored or booted

func benchBackend(b *testing.B) *Backend {
	if skipReason != "" {
		b.Skip(skipReason)
	}
	if setupErr != nil {
		b.Fatal(setupErr)
	}
	return New(slog.New(slog.DiscardHandler), Config{AssetsDir: assetsDir})
}

// templateBenchBackend is benchBackend restoring VMs from templates.
func templateBenchBackend(b *testing.B) *Backend {
	be := benchBackend(b)
	be.cfg.TemplateDir = b.TempDir()
	return be
}

func medianMS(ds []time.Duration) float64 {
	s := slices.Clone(ds)
	slices.Sort(s)
	if len(s) == 0 {
		return 0
	}
	return float64(s[len(s)/2].Microseconds()) / 1000
}

// benchPod is a pod started for a benchmark.
type benchPod struct {
	spec  *stage1.PodSpec
	pod   *podconn.Pod
	mu    sync.Mutex
	state []byte
}

func startBenchPod(b *testing.B, be *Backend, i int) *benchPod {
	b.Helper()
	id := fmt.Sprintf("bench%d-%d", os.Getpid(), i)
	run, err := os.MkdirTemp("", "sl")
	if err != nil {
		b.Fatal(err)
	}
	bp := &benchPod{spec: &stage1.PodSpec{ID: id, Name: "bench", Namespace: "default", UID: id, RunDir: run, CgroupParent: benchCgroup(b)}}
	b.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		bp.mu.Lock()
		st := bp.state
		bp.mu.Unlock()
		if err := be.DestroyPod(ctx, bp.spec, st); err != nil {
			b.Errorf("DestroyPod: %v", err)
		}
		os.RemoveAll(run)
	})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pod, err := be.StartPod(ctx, bp.spec, func(st []byte) error {
		bp.mu.Lock()
		defer bp.mu.Unlock()
		bp.state = append([]byte(nil), st...)
		return nil
	})
	if err != nil {
		b.Fatalf("StartPod: %v", err)
	}
	bp.mu.Lock()
	bp.pod = podconn.Open(pod, nil)
	bp.state = pod.State()
	bp.mu.Unlock()
	return bp
}

var benchSeq int

// benchCgroup is a fresh cgroup parent beneath the test's own cgroup,
// removed when the benchmark ends.
func benchCgroup(b *testing.B) string {
	benchSeq++
	name := fmt.Sprintf("stagelet-bench-%d-%d", os.Getpid(), benchSeq)
	cg, err := cgroups.Resolve(name)
	if err != nil {
		b.Skipf("no usable cgroups: %v", err)
	}
	b.Cleanup(func() {
		cg.Kill()
		cg.Delete()
	})
	return name
}

// benchRootfsDir makes a busybox root filesystem, as
// stage1test.BusyboxRootfs does for tests.
func benchRootfsDir(b *testing.B) string {
	const bb = "/bin/busybox"
	if _, err := os.Stat(bb); err != nil {
		b.Skipf("needs %s", bb)
	}
	root := filepath.Join(b.TempDir(), "rootfs")
	for _, d := range []string{"bin", "etc", "tmp", "proc", "sys", "dev"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			b.Fatal(err)
		}
	}
	data, err := os.ReadFile(bb)
	if err != nil {
		b.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "bin", "busybox"), data, 0o755); err != nil {
		b.Fatal(err)
	}
	out, err := exec.Command(bb, "--list").Output()
	if err != nil {
		b.Fatal(err)
	}
	for _, name := range strings.Fields(string(out)) {
		if name != "busybox" {
			os.Symlink("busybox", filepath.Join(root, "bin", name))
		}
	}
	return root
}

func startContainer(b *testing.B, pod *podconn.Pod, rootfs, id string, args ...string) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	spec := &stage1.ContainerSpec{AppSpec: api.AppSpec{ID: id, Name: id, Rootfs: rootfs, Args: args, Env: []string{"PATH=/bin"},
		LogPath: filepath.Join(b.TempDir(), id+".log")}}
	if _, err := pod.CreateContainer(ctx, spec); err != nil {
		b.Fatal(err)
	}
	if _, err := pod.StartContainer(ctx, id); err != nil {
		b.Fatal(err)
	}
	for {
		st, err := pod.ContainerStatus(ctx, id)
		if err != nil {
			b.Fatal(err)
		}
		if st.State == api.StateRunning {
			return
		}
		time.Sleep(2 * time.Millisecond) // polling the app's state
	}
}

func BenchmarkRunPodToRunning(b *testing.B) {
	b.Run("template", func(b *testing.B) {
		be := templateBenchBackend(b)
		t, err := be.resolveTools()
		if err != nil {
			b.Fatal(err)
		}
		vm, err := be.vmConfig(nil, stage1.PodResources{})
		if err != nil {
			b.Fatal(err)
		}
		vm.Accelerator = be.accelerator(context.Background(), t)
		if vm.Accelerator != "kvm" {
			vm.TBSizeMiB = be.cfg.TBSizeMiB
		}
		tpl, err := be.template(context.Background(), t, vm)
		if err != nil {
			b.Fatal(err)
		}
		be.releaseTemplate(tpl)
		runPodToRunning(b, be)
	})
	b.Run("boot", func(b *testing.B) { runPodToRunning(b, benchBackend(b)) })
}

func runPodToRunning(b *testing.B, be *Backend) {
	rootfs := benchRootfsDir(b)
	if _, err := be.Accelerator(context.Background()); err != nil {
		b.Fatal(err)
	}
	var ds []time.Duration
	for i := 0; b.Loop(); i++ {
		start := time.Now()
		bp := startBenchPod(b, be, i)
		startContainer(b, bp.pod, rootfs, "c", "/bin/sleep", "1000")
		ds = append(ds, time.Since(start))
		b.StopTimer()
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		bp.pod.Stop(ctx, time.Second)
		be.DestroyPod(ctx, bp.spec, bp.pod.State())
		cancel()
		b.StartTimer()
	}
	b.ReportMetric(medianMS(ds), "ms-median")
}

func BenchmarkBareBoot(b *testing.B) {
	be := benchBackend(b)
	t, err := be.resolveTools()
	if err != nil {
		b.Fatal(err)
	}
	accel, _ := be.Accelerator(context.Background())
	for _, machine := range []string{"microvm", "q35"} {
		for _, kernel := range []string{"vmlinux", "vmlinuz"} {
			b.Run(machine+"-"+kernel, func(b *testing.B) {
				tt := *t
				tt.kernel = filepath.Join(be.cfg.AssetsDir, kernel)
				var ds []time.Duration
				for b.Loop() {
					start := time.Now()
					if err := bootProbe(context.Background(), &tt, accel, machine, time.Minute); err != nil {
						b.Fatal(err)
					}
					ds = append(ds, time.Since(start))
				}
				b.ReportMetric(medianMS(ds), "ms-median")
			})
		}
	}
}

func BenchmarkExecSync(b *testing.B) {
	be := benchBackend(b)
	bp := startBenchPod(b, be, 0)
	startContainer(b, bp.pod, benchRootfsDir(b), "c", "/bin/sleep", "1000")
	ctx := context.Background()
	// Back to back, and spaced as a probe's execs are (the VM idle in
	// between).
	for _, gap := range []time.Duration{0, 300 * time.Millisecond} {
		b.Run("gap="+gap.String(), func(b *testing.B) {
			var ds []time.Duration
			for b.Loop() {
				if gap > 0 {
					b.StopTimer()
					time.Sleep(gap) // the idle time between a probe's execs
					b.StartTimer()
				}
				start := time.Now()
				res, err := bp.pod.ExecSync(ctx, "c", []string{"true"}, 30*time.Second)
				if err != nil || res.ExitCode != 0 {
					b.Fatalf("ExecSync: %+v, %v", res, err)
				}
				ds = append(ds, time.Since(start))
			}
			b.ReportMetric(medianMS(ds), "ms-median")
		})
	}
}

func BenchmarkAgentCall(b *testing.B) {
	be := benchBackend(b)
	bp := startBenchPod(b, be, 0)
	startContainer(b, bp.pod, benchRootfsDir(b), "c", "/bin/sleep", "1000")
	ctx := context.Background()
	var ds []time.Duration
	for b.Loop() {
		start := time.Now()
		if _, err := bp.pod.ContainerStatus(ctx, "c"); err != nil {
			b.Fatalf("ContainerStatus: %v", err)
		}
		ds = append(ds, time.Since(start))
	}
	b.ReportMetric(medianMS(ds), "ms-median")
}

func BenchmarkFootprint(b *testing.B) {
	b.Run("template", func(b *testing.B) { footprint(b, templateBenchBackend(b)) })
	b.Run("boot", func(b *testing.B) { footprint(b, benchBackend(b)) })
}

// footprint reports the host memory of one pod's qemu running a container
// alone: RSS, PSS, and of the RSS what is anonymous (qemu's own, TCG's
// translation cache, and a booted guest's memory or the pages a restored
// guest wrote) and what is file-backed (a restored guest's pages of the
// template it only read, shared with other VMs of that template).
func footprint(b *testing.B, be *Backend) {
	bp := startBenchPod(b, be, 0)
	startContainer(b, bp.pod, benchRootfsDir(b), "c", "/bin/sleep", "1000")
	st, _ := parseState(bp.pod.State())
	for b.Loop() {
		// One measurement; the loop only satisfies the framework.
	}
	b.ReportMetric(float64(statusKiB(st.qemu().PID, "VmRSS"))/1024, "qemu-RSS-MiB")
	b.ReportMetric(float64(rollupKiB(st.qemu().PID, "Pss"))/1024, "qemu-PSS-MiB")
	b.ReportMetric(float64(statusKiB(st.qemu().PID, "RssAnon"))/1024, "qemu-anon-MiB")
	b.ReportMetric(float64(statusKiB(st.qemu().PID, "RssFile")+statusKiB(st.qemu().PID, "RssShmem"))/1024, "qemu-file-MiB")
}

// statusKiB is a kB field of /proc/PID/status.
func statusKiB(pid int, field string) int { return procKiB(pid, "status", field) }

// rollupKiB is a kB field of /proc/PID/smaps_rollup.
func rollupKiB(pid int, field string) int { return procKiB(pid, "smaps_rollup", field) }

// procKiB is a "field: N kB" line of /proc/PID/file.
func procKiB(pid int, file, field string) int {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/" + file)
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, field+":"); ok {
			n, _ := strconv.Atoi(strings.TrimSuffix(strings.TrimSpace(v), " kB"))
			return n
		}
	}
	return 0
}
