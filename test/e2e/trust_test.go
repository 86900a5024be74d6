package e2e

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/internal/testutil"
	"github.com/stagelet/stagelet/test/e2e/harness"
	"github.com/stagelet/stagelet/test/testregistry"
)

// cosign runs the cosign CLI (scripts/build-cosign.sh installs it) in
// dir, offline: no transparency log, a key without password.
func cosign(t *testing.T, dir string, args ...string) string {
	t.Helper()
	bin, err := exec.LookPath("cosign")
	if err != nil {
		t.Fatalf("cosign is not installed (make deps installs it): %v", err)
	}
	cmd := exec.CommandContext(t.Context(), bin, args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "COSIGN_PASSWORD=", "HOME="+dir, "COSIGN_EXPERIMENTAL=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("cosign %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// cosignKey generates a key pair in a directory of its own and returns
// that directory (cosign.key, cosign.pub).
func cosignKey(t *testing.T) string {
	dir := t.TempDir()
	cosign(t, dir, "generate-key-pair")
	return dir
}

// cosignSign signs ref (a tag reference in the test registry) by digest
// with the key in keyDir; extra are more flags of `cosign sign`.
func cosignSign(t *testing.T, keyDir, ref string, extra ...string) {
	t.Helper()
	digest := testregistry.Digest(t, ref)
	repo := ref[:strings.LastIndexByte(ref, ':')]
	args := append([]string{"sign", "--key", filepath.Join(keyDir, "cosign.key"), "--tlog-upload=false", "--yes",
		"--allow-http-registry", "--allow-insecure-registry"}, extra...)
	cosign(t, keyDir, append(args, repo+"@"+digest)...)
}

// signatureRefused checks that err is the kubelet's
// SignatureValidationFailed (an Unknown status whose message starts
// with it) and holds each of want.
func signatureRefused(t *testing.T, what string, err error, want ...string) {
	t.Helper()
	if err == nil {
		t.Fatalf("%s: accepted, want SignatureValidationFailed", what)
	}
	st, _ := status.FromError(err)
	if st.Code() != codes.Unknown || !strings.HasPrefix(st.Message(), "SignatureValidationFailed: ") {
		t.Fatalf("%s: %v, want code Unknown and a message starting with SignatureValidationFailed", what, err)
	}
	for _, w := range want {
		if !strings.Contains(st.Message(), w) {
			t.Errorf("%s: %q lacks %q", what, st.Message(), w)
		}
	}
}

func sigstorePolicy(pub, scope, def string) string {
	return fmt.Sprintf(`{
  "default": [{"type": %q}],
  "transports": {"docker": {%q: [{"type": "sigstoreSigned", "keyPath": %q, "signedIdentity": {"type": "matchRepository"}}]}}
}`, def, scope, pub)
}

// writeAtomically replaces path as an operator's tools would.
func writeAtomically(t *testing.T, path, data string) {
	t.Helper()
	if err := os.WriteFile(path+".tmp", []byte(data), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(path+".tmp", path); err != nil {
		t.Fatal(err)
	}
}

// TestImageSignatures runs images signed with the cosign CLI in a real
// registry through the policy at pull and at container creation: a node
// policy requiring signatures for one part of the registry, and a
// namespace ("locked") whose own policy requires them everywhere.
func TestImageSignatures(t *testing.T) {
	requireRoot(t)
	reg := testregistry.Start(t)
	key, other := cosignKey(t), cosignKey(t)
	pub := filepath.Join(key, "cosign.pub")
	signedScope := reg.Host + "/signed"

	policyDir := t.TempDir()
	nodePolicy := filepath.Join(policyDir, "policy.json")
	writeAtomically(t, nodePolicy, sigstorePolicy(pub, signedScope, "insecureAcceptAnything"))
	nsDir := filepath.Join(policyDir, "policy.d")
	if err := os.Mkdir(nsDir, 0o755); err != nil {
		t.Fatal(err)
	}
	locked := filepath.Join(nsDir, "locked.json")
	writeAtomically(t, locked, fmt.Sprintf(`{"default": [{"type": "sigstoreSigned", "keyPath": %q, "signedIdentity": {"type": "matchRepository"}}]}`, pub))

	busybox := testregistry.BusyboxImage(t)
	app := reg.Push(t, "signed/app", "v1", busybox)
	cosignSign(t, key, app)
	viaReferrer := reg.Push(t, "signed/referred", "v1", testregistry.WithConfig(busybox, nil, []string{"echo", "referred"}, ""))
	cosignSign(t, key, viaReferrer, "--registry-referrers-mode=oci-1-1")
	unsigned := reg.Push(t, "signed/unsigned", "v1", testregistry.WithConfig(busybox, nil, []string{"echo", "unsigned"}, ""))
	otherKey := reg.Push(t, "signed/other-key", "v1", testregistry.WithConfig(busybox, nil, []string{"echo", "other"}, ""))
	cosignSign(t, other, otherKey)
	// A signature copied to another image: cosign's tag of the stolen
	// image's digest holds the signature of app's.
	stolen := reg.Push(t, "signed/app", "stolen", testregistry.WithConfig(busybox, nil, []string{"echo", "stolen"}, ""))
	copySignature(t, reg, reg.Host+"/signed/app", testregistry.Digest(t, app), testregistry.Digest(t, stolen))
	open := reg.Push(t, "open/tool", "v1", testregistry.WithConfig(busybox, nil, []string{"echo", "open"}, ""))

	d := startDaemonOpts(t, reg, harness.Options{SignaturePolicy: nodePolicy, MetricsAddress: "127.0.0.1:0"})
	e := &env{t: t, reg: reg, d: d, image: app}
	pullFor := func(ref, namespace string) (string, error) {
		resp, err := e.is().PullImage(e.ctx(), &runtimeapi.PullImageRequest{
			Image:         &runtimeapi.ImageSpec{Image: ref},
			SandboxConfig: &runtimeapi.PodSandboxConfig{Metadata: &runtimeapi.PodSandboxMetadata{Name: "p", Namespace: namespace, Uid: "u"}},
		})
		return resp.GetImageRef(), err
	}

	t.Run("signed images pull", func(t *testing.T) {
		for _, ref := range []string{app, viaReferrer} {
			for _, ns := range []string{"e2e", "locked"} {
				if _, err := pullFor(ref, ns); err != nil {
					t.Errorf("pull %s for %s: %v", ref, ns, err)
				}
			}
		}
		if _, err := pullFor(open, "e2e"); err != nil {
			t.Errorf("pull %s, outside the signed scope: %v", open, err)
		}
	})

	t.Run("refused at pull, and nothing stored", func(t *testing.T) {
		for _, tc := range []struct {
			ref, ns string
			want    []string
		}{
			{unsigned, "e2e", []string{unsigned, "scope " + signedScope + " of " + nodePolicy, "no signature"}},
			{otherKey, "e2e", []string{"wrong key", pub}},
			{stolen, "e2e", []string{"signature for another digest", "it signs " + testregistry.Digest(t, app)}},
			{open, "locked", []string{"in namespace locked", "scope default of " + locked, "no signature"}},
		} {
			before := reg.BlobGets()
			_, err := pullFor(tc.ref, tc.ns)
			signatureRefused(t, "pull "+tc.ref+" for "+tc.ns, err, tc.want...)
			if tc.ns == "e2e" {
				if img := e.imageStatus(tc.ref); img != nil {
					t.Errorf("%s is in the store after a refused pull: %v", tc.ref, img.Id)
				}
				// Signature layers are blobs too; an image's config or
				// layer would be more than them.
				if n := reg.BlobGets() - before; n > 2 {
					t.Errorf("a refused pull of %s fetched %d blobs", tc.ref, n)
				}
			}
		}
	})

	t.Run("checked again at creation for the pod's namespace", func(t *testing.T) {
		// Pulled for e2e, where the node policy accepts it unsigned...
		if _, err := pullFor(open, "e2e"); err != nil {
			t.Fatal(err)
		}
		cfg := e.containerConfig("c", "true")
		cfg.Image = &runtimeapi.ImageSpec{Image: open, UserSpecifiedImage: open}
		podCfg := e.podConfig("locked-pod")
		podCfg.Metadata.Namespace = "locked"
		podID := e.runPod(podCfg)
		// ...then asked for by a pod in locked, whose policy wants it
		// signed.
		_, err := e.rt().CreateContainer(e.ctx(), &runtimeapi.CreateContainerRequest{PodSandboxId: podID, Config: cfg, SandboxConfig: podCfg})
		signatureRefused(t, "create "+open+" in locked", err, "in namespace locked", "no signature")
		resp, err := e.rt().ListContainers(e.ctx(), &runtimeapi.ListContainersRequest{Filter: &runtimeapi.ContainerFilter{PodSandboxId: podID}})
		if err != nil || len(resp.Containers) != 0 {
			t.Fatalf("containers of the pod after a refused create: %v, %v", resp.GetContainers(), err)
		}
		// A signed image runs there, named by the ID the kubelet passes.
		id, err := pullFor(app, "locked")
		if err != nil {
			t.Fatal(err)
		}
		cfg.Image = &runtimeapi.ImageSpec{Image: id, UserSpecifiedImage: app}
		ctr := e.createAndStart(podID, podCfg, cfg)
		e.waitContainerState(ctr, runtimeapi.ContainerState_CONTAINER_EXITED, callTimeout)

		// The namespace's policy changes: no restart, the next creation
		// sees it.
		writeAtomically(t, locked, `{"default": [{"type": "insecureAcceptAnything"}]}`)
		cfg.Metadata.Name = "c2"
		cfg.Image = &runtimeapi.ImageSpec{Image: open, UserSpecifiedImage: open}
		ctr = e.createAndStart(podID, podCfg, cfg)
		e.waitContainerState(ctr, runtimeapi.ContainerState_CONTAINER_EXITED, callTimeout)
	})

	t.Run("a tag moved after signing", func(t *testing.T) {
		verified, err := pullFor(app, "e2e")
		if err != nil {
			t.Fatal(err)
		}
		// Someone pushes another image under the signed tag.
		reg.Push(t, "signed/app", "v1", testregistry.WithConfig(busybox, nil, []string{"echo", "moved"}, ""))
		// A container asked for by the tag runs the verified digest: the
		// store still maps the tag to what was verified.
		cfg := e.containerConfig("pinned", "true")
		cfg.Image = &runtimeapi.ImageSpec{Image: app}
		podCfg := e.podConfig("pinned")
		podID := e.runPod(podCfg)
		ctr := e.createContainer(podID, podCfg, cfg)
		if st := e.containerStatus(ctr); st.ImageId != verified {
			t.Errorf("container runs image %s, the verified one is %s", st.ImageId, verified)
		}
		// Pulling the moved tag is refused: its new digest is unsigned.
		_, err = pullFor(app, "e2e")
		signatureRefused(t, "pull of the moved tag", err, "no signature")
		if img := e.imageStatus(app); img == nil || img.Id != verified {
			t.Errorf("after the refused pull %s names %v, want the verified %s", app, img, verified)
		}
	})

	t.Run("status says which requirement applies", func(t *testing.T) {
		resp, err := e.is().ImageStatus(e.ctx(), &runtimeapi.ImageStatusRequest{Image: &runtimeapi.ImageSpec{Image: viaReferrer}, Verbose: true})
		if err != nil {
			t.Fatal(err)
		}
		var verdicts []struct{ Namespace, Scope, Requires, Result string }
		if err := json.Unmarshal([]byte(resp.Info["signaturePolicy"]), &verdicts); err != nil {
			t.Fatalf("signaturePolicy %q: %v", resp.Info["signaturePolicy"], err)
		}
		if len(verdicts) != 2 || verdicts[0].Scope != signedScope || verdicts[0].Result != "accepted" || verdicts[1].Namespace != "locked" {
			t.Errorf("signaturePolicy of %s: %+v", viaReferrer, verdicts)
		}
		// cosign attached this one through the referrers API only.
		var sources []string
		if err := json.Unmarshal([]byte(resp.Info["signatures"]), &sources); err != nil || len(sources) != 1 || !strings.HasSuffix(sources[0], "(referrer)") {
			t.Errorf("signatures of %s: %q (%v), want one referrer", viaReferrer, resp.Info["signatures"], err)
		}
		if info := e.verboseStatus()["signaturePolicy"]; !strings.Contains(info, nodePolicy) || !strings.Contains(info, locked) {
			t.Errorf("verbose Status signaturePolicy: %s", info)
		}
		url, err := d.MetricsURL()
		if err != nil {
			t.Fatal(err)
		}
		m := e.scrape(url)
		for _, c := range []struct{ stage, result string }{{"pull", "accepted"}, {"pull", "rejected"}, {"pull", "unverified"}, {"create", "rejected"}, {"create", "accepted"}} {
			if m.value("stagelet_image_verifications_total", map[string]string{"stage": c.stage, "result": c.result}) == 0 {
				t.Errorf("no %s %s verification counted", c.stage, c.result)
			}
		}
	})
}

// copySignature stores the signature artifact of digest from under
// cosign's tag for digest to.
func copySignature(t *testing.T, reg *testregistry.Registry, repo, from, to string) {
	t.Helper()
	sig := testregistry.Fetch(t, repo+":"+strings.Replace(from, ":", "-", 1)+".sig")
	reg.PushSignature(t, repo, to, sig)
}

// TestEveryImageContentIsChecked: what reaches a container from an image
// other than its own passes the pod's namespace policy at creation as its
// own image does. In namespace tight, whose policy rejects all but the
// signed part of the registry, a signed container is refused an image
// volume and a checkpoint image that the node's lax policy let pull; in
// the lax namespace both work, and an image in use as a volume cannot be
// removed. A namespace file that cannot be followed refuses its
// namespace's images, and verbose Status says why.
func TestEveryImageContentIsChecked(t *testing.T) {
	needCRIU(t)
	reg := testregistry.Start(t)
	key := cosignKey(t)
	pub := filepath.Join(key, "cosign.pub")
	signedScope := reg.Host + "/signed"
	policyDir := t.TempDir()
	nodePolicy := filepath.Join(policyDir, "policy.json")
	writeAtomically(t, nodePolicy, sigstorePolicy(pub, signedScope, "insecureAcceptAnything"))
	nsDir := filepath.Join(policyDir, "policy.d")
	if err := os.Mkdir(nsDir, 0o755); err != nil {
		t.Fatal(err)
	}
	writeAtomically(t, filepath.Join(nsDir, "tight.json"), sigstorePolicy(pub, signedScope, "reject"))

	busybox := testregistry.BusyboxImage(t)
	app := reg.Push(t, "signed/app", "v1", busybox)
	cosignSign(t, key, app)
	tool := reg.Push(t, "open/tool", "v1", testregistry.WithConfig(busybox, nil, []string{"echo", "tool"}, ""))

	d := startDaemonOpts(t, reg, harness.Options{SignaturePolicy: nodePolicy, Policy: bothStage1sPolicy})
	e := &env{t: t, reg: reg, d: d, image: app}
	pullFor := func(ref, namespace string) string {
		t.Helper()
		resp, err := e.is().PullImage(e.ctx(), &runtimeapi.PullImageRequest{
			Image:         &runtimeapi.ImageSpec{Image: ref},
			SandboxConfig: &runtimeapi.PodSandboxConfig{Metadata: &runtimeapi.PodSandboxMetadata{Name: "p", Namespace: namespace, Uid: "u"}},
		})
		if err != nil {
			t.Fatalf("pull %s for %s: %v", ref, namespace, err)
		}
		return resp.GetImageRef()
	}
	appID := pullFor(app, "tight")
	toolID := pullFor(tool, "e2e")
	podIn := func(name, namespace string) (string, *runtimeapi.PodSandboxConfig) {
		cfg := e.netPodConfig(name, flyStage1)
		cfg.Metadata.Namespace = namespace
		return e.runStage1Pod(cfg, flyStage1), cfg
	}
	withVolume := func(name string) *runtimeapi.ContainerConfig {
		c := e.netContainer(flyStage1, name, "ls", "/vol/bin/busybox")
		c.Image = &runtimeapi.ImageSpec{Image: appID, UserSpecifiedImage: app}
		// As the kubelet passes an image volume: by the pulled image's ID.
		c.Mounts = []*runtimeapi.Mount{{ContainerPath: "/vol", Image: &runtimeapi.ImageSpec{Image: toolID}}}
		return c
	}

	t.Run("image volume", func(t *testing.T) {
		pod, cfg := podIn("vol-tight", "tight")
		_, err := e.rt().CreateContainer(e.ctx(), &runtimeapi.CreateContainerRequest{PodSandboxId: pod, Config: withVolume("c"), SandboxConfig: cfg})
		signatureRefused(t, "an unsigned image volume in tight", err, "volume /vol: ", tool, "in namespace tight")

		pod, cfg = podIn("vol-lax", "e2e")
		id := e.createAndStart(pod, cfg, withVolume("c"))
		e.waitContainerState(id, runtimeapi.ContainerState_CONTAINER_EXITED, callTimeout)
		if st := e.containerStatus(id); st.ExitCode != 0 {
			t.Fatalf("the image volume's files are not there: exit %d", st.ExitCode)
		}
		_, err = e.is().RemoveImage(e.ctx(), &runtimeapi.RemoveImageRequest{Image: &runtimeapi.ImageSpec{Image: toolID}})
		if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "image volume") {
			t.Errorf("RemoveImage of an image in use as a volume: %v, want FailedPrecondition", err)
		}
		if _, err := e.rt().RemoveContainer(e.ctx(), &runtimeapi.RemoveContainerRequest{ContainerId: id}); err != nil {
			t.Fatal(err)
		}
		if _, err := e.is().RemoveImage(e.ctx(), &runtimeapi.RemoveImageRequest{Image: &runtimeapi.ImageSpec{Image: toolID}}); err != nil {
			t.Errorf("RemoveImage once the volume's container is gone: %v", err)
		}
	})

	t.Run("checkpoint image", func(t *testing.T) {
		pod, cfg := podIn("ckpt-lax", "e2e")
		c := e.netContainer(flyStage1, "counter", "sh", "-c", testutil.CounterCmd)
		c.Image = &runtimeapi.ImageSpec{Image: appID, UserSpecifiedImage: app}
		c.Linux.SecurityContext.NamespaceOptions.Pid = runtimeapi.NamespaceMode_CONTAINER
		id := e.createAndStart(pod, cfg, c)
		testutil.Counting(t, e.rt(), id)
		archive := filepath.Join(t.TempDir(), "counter.tar")
		if _, err := e.rt().CheckpointContainer(e.ctx(), &runtimeapi.CheckpointContainerRequest{ContainerId: id, Location: archive, Timeout: 120}); err != nil {
			t.Fatalf("CheckpointContainer: %v", err)
		}
		// Pushed outside the signed scope, pulled under the node's
		// policy, which accepts it there.
		ref := reg.Host + "/open/checkpoint:v1"
		if out, err := exec.Command(stageletBin, "checkpoint", "image", archive, ref).CombinedOutput(); err != nil {
			t.Fatalf("stagelet checkpoint image: %v\n%s", err, out)
		}
		pullFor(ref, "e2e")
		restored := &runtimeapi.ContainerConfig{Metadata: &runtimeapi.ContainerMetadata{Name: "counter"}, Image: &runtimeapi.ImageSpec{Image: ref}, LogPath: "counter.log"}
		pod, cfg = podIn("ckpt-tight", "tight")
		_, err := e.rt().CreateContainer(e.ctx(), &runtimeapi.CreateContainerRequest{PodSandboxId: pod, Config: restored, SandboxConfig: cfg})
		signatureRefused(t, "a checkpoint image from a rejected registry in tight", err, "checkpoint image "+ref+": ", "in namespace tight")
		// The lax namespace restores it: the refusal was the policy's.
		pod, cfg = podIn("ckpt-lax2", "e2e")
		e.createContainer(pod, cfg, restored)
	})

	t.Run("a namespace file that cannot be followed", func(t *testing.T) {
		dangling := filepath.Join(nsDir, "gone.json")
		if err := os.Symlink(filepath.Join(policyDir, "missing.json"), dangling); err != nil {
			t.Fatal(err)
		}
		_, err := e.is().PullImage(e.ctx(), &runtimeapi.PullImageRequest{
			Image:         &runtimeapi.ImageSpec{Image: tool},
			SandboxConfig: &runtimeapi.PodSandboxConfig{Metadata: &runtimeapi.PodSandboxMetadata{Name: "p", Namespace: "gone", Uid: "u"}},
		})
		signatureRefused(t, "pull for a namespace whose file dangles", err, dangling, "does not exist")
		pod, cfg := podIn("gone", "gone")
		c := e.netContainer(flyStage1, "c", "true")
		c.Image = &runtimeapi.ImageSpec{Image: appID, UserSpecifiedImage: app}
		_, err = e.rt().CreateContainer(e.ctx(), &runtimeapi.CreateContainerRequest{PodSandboxId: pod, Config: c, SandboxConfig: cfg})
		signatureRefused(t, "create in a namespace whose file dangles", err, dangling)
		if info := e.verboseStatus()["signaturePolicy"]; !strings.Contains(info, dangling) || !strings.Contains(info, "does not exist") {
			t.Errorf("verbose Status does not show the dangling file: %s", info)
		}
	})
}
