package node

import (
	"crypto/tls"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/checkpoint"
	"github.com/stagelet/stagelet/internal/testutil"
)

// TestKubeletCheckpoint: the kubelet's checkpoint API (KEP-2008, beta and
// on by default) against stagelet. A standalone kubelet (Kubernetes
// v1.34.12, no API server) runs a static pod's counter through stagelet's
// socket; POST /checkpoint/{namespace}/{pod}/{container} on the kubelet's
// API answers with the archive stagelet wrote beneath the kubelet's
// checkpoints directory, which holds criu's images and the counter's
// layer and which checkpointctl reads; the counter counts on.
func TestKubeletCheckpoint(t *testing.T) {
	e := nodeEnv(t)
	kubelet := os.Getenv("STAGELET_KUBELET")
	if _, err := os.Stat(kubelet); kubelet == "" || err != nil {
		t.Skipf("no kubelet in the payload (%q): scripts/test-node.sh adds it when ../shared/k8s/build.sh builds it", kubelet)
	}
	needCRIU(t)
	// The kubelet's cgroup driver, as a distribution's node runs it.
	e.installSystemdDriver(t, "kubelet-checkpoint.yaml")
	rt, img := client(t)
	ref := pullBusybox(t, img)

	dir := t.TempDir()
	manifests := filepath.Join(dir, "manifests")
	if err := os.Mkdir(manifests, 0o755); err != nil {
		t.Fatal(err)
	}
	kcfg := filepath.Join(dir, "kubelet.yaml")
	if err := os.WriteFile(kcfg, []byte(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
staticPodPath: `+manifests+`
fileCheckFrequency: 2s
containerRuntimeEndpoint: unix://`+socket+`
cgroupDriver: systemd
failSwapOn: false
address: 127.0.0.1
readOnlyPort: 0
authentication:
  anonymous: {enabled: true}
  webhook: {enabled: false}
authorization: {mode: AlwaysAllow}
resolvConf: /etc/resolv.conf
`), 0o644); err != nil {
		t.Fatal(err)
	}
	pod := `apiVersion: v1
kind: Pod
metadata: {name: counter, namespace: default}
spec:
  hostNetwork: true
  containers:
  - name: counter
    image: ` + ref + `
    imagePullPolicy: IfNotPresent
    command: ["sh", "-c", ` + strconv.Quote(testutil.CounterCmd) + `]
`
	if err := os.WriteFile(filepath.Join(manifests, "counter.yaml"), []byte(pod), 0o644); err != nil {
		t.Fatal(err)
	}
	klog, err := os.Create(filepath.Join(dir, "kubelet.log"))
	if err != nil {
		t.Fatal(err)
	}
	defer klog.Close()
	cmd := exec.Command(kubelet, "--config", kcfg, "--v=2")
	cmd.Stdout, cmd.Stderr = klog, klog
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	kubeletLog := func() string {
		b, _ := os.ReadFile(klog.Name())
		if len(b) > 8192 {
			b = b[len(b)-8192:]
		}
		return string(b)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("the kubelet's log ends:\n%s", kubeletLog())
		}
		cmd.Process.Signal(syscall.SIGTERM)
		done := make(chan struct{})
		go func() { cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			cmd.Process.Kill()
			<-done
		}
		removeAllPods(t, rt)
	})

	var ctr *runtimeapi.Container
	testutil.WaitFor(t, 3*time.Minute, "the kubelet runs the static pod's counter", func() (bool, string) {
		l, err := rt.ListContainers(ctx(t), &runtimeapi.ListContainersRequest{Filter: &runtimeapi.ContainerFilter{
			State:         &runtimeapi.ContainerStateValue{State: runtimeapi.ContainerState_CONTAINER_RUNNING},
			LabelSelector: map[string]string{"io.kubernetes.container.name": "counter"},
		}})
		if err != nil || len(l.Containers) == 0 {
			return false, fmt.Sprint(err)
		}
		ctr = l.Containers[0]
		return true, ""
	})
	podName := ctr.Labels["io.kubernetes.pod.name"]
	count := testutil.Counting(t, rt, ctr.Id)

	// The kubelet's API, with its self-signed certificate.
	hc := &http.Client{Timeout: 3 * time.Minute, Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}}
	url := "https://127.0.0.1:10250/checkpoint/default/" + podName + "/counter?timeout=120"
	start := time.Now()
	resp, err := hc.Post(url, "", nil)
	if err != nil {
		t.Fatalf("POST %s: %v\n%s", url, err, kubeletLog())
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	took := time.Since(start)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("POST %s: %s %s\n%s\n%s", url, resp.Status, body, kubeletLog(), journal(t))
	}
	var items struct {
		Items []string `json:"items"`
	}
	if err := json.Unmarshal(body, &items); err != nil || len(items.Items) != 1 {
		t.Fatalf("the kubelet answered %s (%v)", body, err)
	}
	archive := items.Items[0]
	t.Cleanup(func() { os.Remove(archive) })
	if !strings.HasPrefix(archive, "/var/lib/kubelet/checkpoints/") {
		t.Errorf("archive %s is not in the kubelet's checkpoints directory", archive)
	}
	fi, err := os.Stat(archive)
	if err != nil {
		t.Fatal(err)
	}
	got, err := checkpoint.Read(archive, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	if got.ID != ctr.Id || got.Name != "counter" || got.Namespace != "default" || got.Pod != "counter" && got.Pod != podName {
		t.Errorf("archive says %+v", got)
	}
	t.Logf("the kubelet's checkpoint of %s/counter took %v: %s, %d bytes", podName, took.Round(time.Millisecond), archive, fi.Size())
	checkpointctl(t, archive, "counter")
	n0 := count()
	testutil.WaitFor(t, time.Minute, "the counter counts on after the kubelet's checkpoint", func() (bool, string) {
		n := count()
		return n > n0, strconv.Itoa(n)
	})
}

// removeAllPods stops and removes every pod the daemon has.
func removeAllPods(t *testing.T, rt runtimeapi.RuntimeServiceClient) {
	l, err := rt.ListPodSandbox(ctx(t), &runtimeapi.ListPodSandboxRequest{})
	if err != nil {
		t.Logf("list pods: %v", err)
		return
	}
	for _, p := range l.Items {
		if _, err := rt.StopPodSandbox(ctx(t), &runtimeapi.StopPodSandboxRequest{PodSandboxId: p.Id}); err != nil {
			t.Logf("stop pod %s: %v", p.Id, err)
		}
		if _, err := rt.RemovePodSandbox(ctx(t), &runtimeapi.RemovePodSandboxRequest{PodSandboxId: p.Id}); err != nil {
			t.Logf("remove pod %s: %v", p.Id, err)
		}
	}
}
