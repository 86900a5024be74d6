package e2e

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// TestCorruptRecordKeepsHostPathFiles: a pod whose container mounts a
// hostPath volume; the daemon is killed and one of its records is torn
// (half written) or carries a version from a newer stagelet, or the
// pod's backend state does. After the restart the volume's files are all
// there, a torn record is in quarantine (counted in verbose Status), and
// nothing the record names was torn down (a pod whose backend state is
// newer is NotReady, its app still serving, and stopping it is refused):
// once the record is repaired and the daemon restarted again, the pod and
// its container are managed as before and are removed through the CRI
// with nothing left.
func TestCorruptRecordKeepsHostPathFiles(t *testing.T) {
	forEachStage1(t, corruptRecordKeepsHostPathFiles)
}

// TestCorruptRecordKeepsHostPathFilesKVM: the same for a kvm pod, whose
// volume qemu serves into the VM.
func TestCorruptRecordKeepsHostPathFilesKVM(t *testing.T) {
	corruptRecordKeepsHostPathFiles(t, newKVMEnv(t), kvmStage1)
}

func corruptRecordKeepsHostPathFiles(t *testing.T, e *env, s podStage1) {
	for _, tc := range []struct {
		name  string
		kind  string // pods, containers, backend (the pod record's backend state)
		newer bool
		podUp bool // the pod is known while its record is set aside
	}{
		{"torn pod record", "pods", false, false},
		{"torn container record", "containers", false, true},
		{"newer pod record", "pods", true, false},
		{"newer container record", "containers", true, true},
		{"newer backend state", "backend", true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			vol, files := hostPathVolume(t)
			cfg := e.netPodConfig("records", s)
			podID := e.runStage1Pod(cfg, s)
			c := e.netContainer(s, "app", httpServer("serving")...)
			c.Mounts = []*runtimeapi.Mount{{HostPath: vol, ContainerPath: "/data"}}
			ctr := e.createAndStart(podID, cfg, c)
			if out := e.execOK(ctr, "cat", "/data/sub/nested.txt"); out != "nested" {
				t.Fatalf("the volume in the container: %q", out)
			}
			url := "http://" + e.podIP(podID).String() + ":8080/"
			e.waitHTTP(url, "serving\n")
			restart := func() {
				t.Helper()
				ctx, cancel := context.WithTimeout(t.Context(), startTimeout)
				defer cancel()
				if err := e.d.Restart(ctx); err != nil {
					t.Fatalf("restart the daemon: %v", err)
				}
			}

			if err := e.d.Kill9(t.Context()); err != nil {
				t.Fatal(err)
			}
			id := podID
			if tc.kind == "containers" {
				id = ctr
			}
			dir := tc.kind
			if dir == "backend" {
				dir = "pods"
			}
			rec := filepath.Join(e.d.StateDir, dir, id+".json")
			orig, err := os.ReadFile(rec)
			if err != nil {
				t.Fatal(err)
			}
			bad := orig[:len(orig)/2]
			switch {
			case tc.kind == "backend":
				var m map[string]any
				if err := json.Unmarshal(orig, &m); err != nil {
					t.Fatal(err)
				}
				raw, err := base64.StdEncoding.DecodeString(m["backendState"].(string))
				if err != nil {
					t.Fatal(err)
				}
				var st map[string]any
				if err := json.Unmarshal(raw, &st); err != nil {
					t.Fatal(err)
				}
				st["version"] = 1000
				raw, _ = json.Marshal(st)
				m["backendState"] = base64.StdEncoding.EncodeToString(raw)
				bad, _ = json.Marshal(m)
			case tc.newer:
				var m map[string]any
				if err := json.Unmarshal(orig, &m); err != nil {
					t.Fatal(err)
				}
				m["version"] = 1000
				bad, _ = json.Marshal(m)
			}
			if err := os.WriteFile(rec, bad, 0o600); err != nil {
				t.Fatal(err)
			}
			restart()

			checkVolume(t, vol, files, "after the restart")
			resp, err := e.rt().Status(e.ctx(), &runtimeapi.StatusRequest{Verbose: true})
			if err != nil {
				t.Fatal(err)
			}
			quarantine := filepath.Join(e.d.StateDir, "quarantine", tc.kind+"-"+id+".json")
			if tc.newer {
				if _, err := os.Stat(rec); err != nil {
					t.Errorf("a newer stagelet's record was moved: %v", err)
				}
			} else {
				if got := resp.Info["quarantinedRecords"]; got != "1" {
					t.Errorf("verbose Status counts %q records in quarantine, want 1", got)
				}
				if _, err := os.Stat(quarantine); err != nil {
					t.Errorf("the torn record is not in quarantine: %v", err)
				}
			}
			ps, err := e.rt().PodSandboxStatus(e.ctx(), &runtimeapi.PodSandboxStatusRequest{PodSandboxId: podID})
			if (err == nil) != tc.podUp {
				t.Errorf("the pod's status while a record is set aside: %v", err)
			}
			if got, err := httpGet(url); err != nil || got != "serving\n" {
				t.Errorf("the pod's app while a record is set aside: %q, %v", got, err)
			}
			if tc.kind == "backend" {
				if ps.GetStatus().GetState() != runtimeapi.PodSandboxState_SANDBOX_NOTREADY {
					t.Errorf("a pod whose backend state is newer: %v", ps.GetStatus().GetState())
				}
				if st := e.containerStatus(ctr); st.State != runtimeapi.ContainerState_CONTAINER_UNKNOWN {
					t.Errorf("its container: %v, want CONTAINER_UNKNOWN", st.State)
				}
				if _, err := e.rt().StopPodSandbox(e.ctx(), &runtimeapi.StopPodSandboxRequest{PodSandboxId: podID}); err == nil {
					t.Errorf("StopPodSandbox of a pod whose state this stagelet cannot read succeeded")
				}
				if got, err := httpGet(url); err != nil || got != "serving\n" {
					t.Errorf("the pod's app after the refused stop: %q, %v", got, err)
				}
			}

			// The operator puts the record right; the next daemon
			// manages everything again.
			if err := e.d.Kill9(t.Context()); err != nil {
				t.Fatal(err)
			}
			os.Remove(quarantine)
			if err := os.WriteFile(rec, orig, 0o600); err != nil {
				t.Fatal(err)
			}
			restart()
			e.waitContainerState(ctr, running, stateTimeout)
			if out := e.execOK(ctr, "cat", "/data/keep.txt"); out != "keep" {
				t.Errorf("the volume in the container after the repair: %q", out)
			}
			if _, err := e.rt().StopPodSandbox(e.ctx(), &runtimeapi.StopPodSandboxRequest{PodSandboxId: podID}); err != nil {
				t.Fatal(err)
			}
			if _, err := e.rt().RemovePodSandbox(e.ctx(), &runtimeapi.RemovePodSandboxRequest{PodSandboxId: podID}); err != nil {
				t.Fatal(err)
			}
			checkVolume(t, vol, files, "after the pod's removal")
		})
	}
}

// hostPathVolume makes a directory of known files for a hostPath volume.
func hostPathVolume(t *testing.T) (string, map[string]string) {
	t.Helper()
	vol := t.TempDir()
	files := map[string]string{"keep.txt": "keep", "sub/nested.txt": "nested"}
	for f, body := range files {
		os.MkdirAll(filepath.Dir(filepath.Join(vol, f)), 0o755)
		if err := os.WriteFile(filepath.Join(vol, f), []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return vol, files
}

// checkVolume checks that every file of a hostPathVolume is intact.
func checkVolume(t *testing.T, vol string, files map[string]string, when string) {
	t.Helper()
	for f, body := range files {
		if b, err := os.ReadFile(filepath.Join(vol, f)); err != nil || string(b) != body {
			t.Errorf("the volume's %s %s: %q, %v", f, when, b, err)
		}
	}
}

// TestHostRootMountCleansUp: a container that mounts the host's / (a
// privileged node agent's pattern), with each propagation, is removed
// with its pod, leaving no mount, cgroup or directory behind (the harness
// checks when the test ends).
func TestHostRootMountCleansUp(t *testing.T) {
	forEachStage1(t, func(t *testing.T, e *env, s podStage1) {
		for _, prop := range []runtimeapi.MountPropagation{
			runtimeapi.MountPropagation_PROPAGATION_PRIVATE,
			runtimeapi.MountPropagation_PROPAGATION_HOST_TO_CONTAINER,
			runtimeapi.MountPropagation_PROPAGATION_BIDIRECTIONAL,
		} {
			t.Run(prop.String(), func(t *testing.T) {
				cfg := e.netPodConfig("hostroot", s)
				cfg.Linux.SecurityContext.Privileged = true
				podID := e.runStage1Pod(cfg, s)
				c := e.netContainer(s, "agent", "sleep", "3600")
				c.Linux.SecurityContext.Privileged = true
				c.Mounts = []*runtimeapi.Mount{{HostPath: "/", ContainerPath: "/host", Propagation: prop}}
				ctr := e.createAndStart(podID, cfg, c)
				if out := e.execOK(ctr, "cat", "/host/proc/1/comm"); out == "" {
					t.Errorf("the host's / is not at /host")
				}
				if _, err := e.rt().StopPodSandbox(e.ctx(), &runtimeapi.StopPodSandboxRequest{PodSandboxId: podID}); err != nil {
					t.Fatalf("StopPodSandbox: %v", err)
				}
				if _, err := e.rt().RemovePodSandbox(e.ctx(), &runtimeapi.RemovePodSandboxRequest{PodSandboxId: podID}); err != nil {
					t.Fatalf("RemovePodSandbox: %v", err)
				}
				if _, err := os.Stat("/proc/1/comm"); err != nil {
					t.Errorf("the host's files after the removal: %v", err)
				}
			})
		}
	})
}

// TestLostPodRecordReleased: a running pod whose record is lost while
// the daemon is down (deleted, as after a disk repair) is no one's: the
// restarted daemon kills what runs in its cgroup, releases the cgroup,
// its network and its directories, and never lists it. The harness then
// finds no process, mount, cgroup or network entry left.
func TestLostPodRecordReleased(t *testing.T) {
	forEachStage1(t, lostPodRecordReleased)
}

// TestLostPodRecordReleasedKVM: the same for a kvm pod: its qemu is
// killed, the VM's shared directory detached.
func TestLostPodRecordReleasedKVM(t *testing.T) {
	lostPodRecordReleased(t, newKVMEnv(t), kvmStage1)
}

func lostPodRecordReleased(t *testing.T, e *env, s podStage1) {
	cfg := e.netPodConfig("lost", s)
	podID := e.runStage1Pod(cfg, s)
	ctr := e.createAndStart(podID, cfg, e.netContainer(s, "app", httpServer("lost")...))
	url := "http://" + e.podIP(podID).String() + ":8080/"
	e.waitHTTP(url, "lost\n")
	if err := e.d.Kill9(t.Context()); err != nil {
		t.Fatal(err)
	}
	for _, rec := range []string{filepath.Join("pods", podID+".json"), filepath.Join("containers", ctr+".json")} {
		if err := os.Remove(filepath.Join(e.d.StateDir, rec)); err != nil {
			t.Fatal(err)
		}
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
		t.Errorf("pods listed after their records were lost: %v", pods.Items)
	}
	if got, err := httpGet(url); err == nil {
		t.Errorf("the lost pod's app still answers: %q", got)
	}
	if log := e.d.LogTail(400); !strings.Contains(log, "released a pod cgroup no record names") || !strings.Contains(log, podID) {
		t.Errorf("the daemon's log does not say it released the pod's cgroup:\n%s", log)
	}
	for _, dir := range []string{filepath.Join(e.d.RunDir, "pods", podID), filepath.Join(e.d.RunDir, "netns", podID)} {
		if _, err := os.Lstat(dir); !os.IsNotExist(err) {
			t.Errorf("%s after the restart: %v", dir, err)
		}
	}
}
