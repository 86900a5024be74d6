package cluster

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/remote"
)

// signedNamespace is the namespace whose signature policy, a file of its
// own in the nodes' signaturePolicyDir, needs every image of the
// cluster's registry signed with the test's key.
const signedNamespace = "signed-only"

// signedKey is where the nodes find the test's public key.
const signedKey = "/etc/stagelet/keys/" + signedNamespace + ".pub"

// imagePod is a pod of one container that prints its image's /image and
// sleeps, stopped at once (its sleep ignores SIGTERM) when its namespace
// goes.
const imagePod = `
apiVersion: v1
kind: Pod
metadata: {name: {{.Name}}, namespace: {{.NS}}}
spec:
  terminationGracePeriodSeconds: 1
  containers:
  - name: main
    image: {{.Image}}
    command: [sh, -c, "cat /image && exec sleep 3600"]
`

// testSignaturePolicy: in a namespace whose policy needs the images of
// the cluster's registry signed (cosign, with a key the test makes), a
// pod of an unsigned image gets the kubelet's SignatureValidationFailed
// and no container, while a pod of an image the test signed runs. The
// nodes' own policy accepts anything: the other namespaces are as
// without one.
func (c *cluster) testSignaturePolicy(t *testing.T) {
	cosign, err := exec.LookPath("cosign")
	if err != nil {
		t.Fatalf("cosign signs the test's image and is not on PATH (make deps installs it: scripts/build-cosign.sh): %v", err)
	}
	keys := c.path("cosign")
	if err := os.MkdirAll(keys, 0o700); err != nil {
		t.Fatal(err)
	}
	c.cosign(t, cosign, keys, "generate-key-pair")
	pub, err := os.ReadFile(filepath.Join(keys, "cosign.pub"))
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range c.nodes {
		c.writeNamespaceSignaturePolicy(t, n, signedNamespace, pub)
	}
	c.cosign(t, cosign, keys, "sign", "--key", "cosign.key", "--tlog-upload=false", "--yes",
		"--allow-http-registry", "--allow-insecure-registry", byDigest(t, img.signed))

	c.kubectl(t, "create", "namespace", signedNamespace)
	t.Cleanup(func() {
		if _, err := c.kubectlErr("delete", "namespace", signedNamespace, "--wait", "--timeout=3m"); err != nil {
			t.Error(err)
		}
	})
	c.wait(t, time.Minute, "the service account of "+signedNamespace, func() (bool, error) {
		_, err := c.kubectlErr("-n", signedNamespace, "get", "serviceaccount", "default")
		return err == nil, err
	})
	c.apply(t, imagePod, "NS", signedNamespace, "Name", "unsigned", "Image", img.unsigned)
	c.apply(t, imagePod, "NS", signedNamespace, "Name", "signed", "Image", img.signed)

	c.wait(t, 3*time.Minute, "an event of the unsigned pod saying SignatureValidationFailed", func() (bool, error) {
		ev, err := c.podEvents(signedNamespace, "unsigned")
		for _, e := range ev {
			if strings.Contains(e, "SignatureValidationFailed") {
				t.Logf("unsigned: %s", e)
				return true, nil
			}
		}
		return false, fmt.Errorf("events %q (%v)", ev, err)
	})
	c.wait(t, time.Minute, "the unsigned pod's container waiting on SignatureValidationFailed", func() (bool, error) {
		return c.refusedUnsigned()
	})
	c.wait(t, 3*time.Minute, "the signed pod running", func() (bool, error) {
		p, err := c.podIn(signedNamespace, "signed")
		if err != nil {
			return false, err
		}
		st := p.container("main")
		return p.Status.Phase == "Running" && st != nil && st.State.Running != nil, fmt.Errorf("phase %s, %+v", p.Status.Phase, st)
	})
	if out := strings.TrimSpace(c.kubectl(t, "-n", signedNamespace, "logs", "signed")); out != "signed" {
		t.Errorf("the signed pod printed %q, want signed", out)
	}
	// Still refused once the signed pod runs, and never started: its
	// sandbox is there, without a container.
	if ok, err := c.refusedUnsigned(); !ok {
		t.Errorf("the unsigned pod: %v", err)
	}
	if pods, containers := c.containersCreated(t, "unsigned_"+signedNamespace+"_"); pods == 0 || containers != 0 {
		t.Errorf("the unsigned pod: %d sandboxes started, %d containers created; want some, and none", pods, containers)
	}
	c.testImageVolumeRefused(t)
}

// pinnedImagePod is imagePod on node Node.
const pinnedImagePod = `
apiVersion: v1
kind: Pod
metadata: {name: {{.Name}}, namespace: {{.NS}}}
spec:
  nodeName: {{.Node}}
  terminationGracePeriodSeconds: 1
  containers:
  - name: main
    image: {{.Image}}
    command: [sh, -c, "cat /image && exec sleep 3600"]
`

// volumePod is a pod of the signed image on node Node with the image
// Volume as an image volume at /vol, which the kubelet does not pull
// again when the node has it.
const volumePod = `
apiVersion: v1
kind: Pod
metadata: {name: {{.Name}}, namespace: {{.NS}}}
spec:
  nodeName: {{.Node}}
  terminationGracePeriodSeconds: 1
  containers:
  - name: main
    image: {{.Image}}
    command: [sh, -c, "cat /vol/image && exec sleep 3600"]
    volumeMounts: [{name: vol, mountPath: /vol}]
  volumes:
  - name: vol
    image: {reference: {{.Volume}}, pullPolicy: IfNotPresent}
`

// testImageVolumeRefused: the unsigned image, pulled on a node for a pod
// of the default namespace (whose policy, the node's, accepts it), is
// refused as an image volume of a signed pod in signedNamespace: not at
// pull (the kubelet finds it on the node) but at CreateContainer, which
// checks every image whose files reach the container.
func (c *cluster) testImageVolumeRefused(t *testing.T) {
	p, err := c.podIn(signedNamespace, "signed")
	if err != nil {
		t.Fatal(err)
	}
	node := p.Spec.NodeName
	c.apply(t, pinnedImagePod, "NS", "default", "Name", "unsigned-lax", "Node", node, "Image", img.unsigned)
	t.Cleanup(func() { c.kubectlErr("delete", "pod", "unsigned-lax", "--wait=false") })
	c.wait(t, 3*time.Minute, "the unsigned image running in the default namespace on "+node, func() (bool, error) {
		p, err := c.pod("unsigned-lax")
		if err != nil {
			return false, err
		}
		st := p.container("main")
		return st != nil && st.State.Running != nil, fmt.Errorf("phase %s, %+v", p.Status.Phase, st)
	})
	c.apply(t, volumePod, "NS", signedNamespace, "Name", "volume", "Node", node, "Image", img.signed, "Volume", img.unsigned)
	c.wait(t, 3*time.Minute, "the pod with the unsigned image volume waiting on SignatureValidationFailed", func() (bool, error) {
		p, err := c.podIn(signedNamespace, "volume")
		if err != nil {
			return false, err
		}
		st := p.container("main")
		if st == nil || st.State.Waiting == nil {
			return false, fmt.Errorf("phase %s, %+v", p.Status.Phase, st)
		}
		w := st.State.Waiting
		if !strings.Contains(w.Message, "SignatureValidationFailed: volume /vol: ") {
			return false, fmt.Errorf("waiting: %s: %s", w.Reason, w.Message)
		}
		t.Logf("volume: %s: %s", w.Reason, w.Message)
		return p.Status.Phase == "Pending" && st.ContainerID == "", fmt.Errorf("phase %s, %+v", p.Status.Phase, st)
	})
	if _, containers := c.containersCreated(t, "volume_"+signedNamespace+"_"); containers != 0 {
		t.Errorf("the pod with the unsigned image volume: %d containers created, want none", containers)
	}
}

// cosign runs cosign in dir, with the empty password that
// generate-key-pair gave the key, and nothing written outside dir.
func (c *cluster) cosign(t *testing.T, cosign, dir string, args ...string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, cosign, args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "COSIGN_PASSWORD=", "HOME="+dir, "TMPDIR="+dir)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("cosign %s: %v\n%s", strings.Join(args, " "), err, out)
	}
}

// byDigest is ref, a tag of the cluster's registry, by the digest it
// names now: what cosign signs.
func byDigest(t *testing.T, ref string) string {
	t.Helper()
	tag, err := name.NewTag(ref, name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	desc, err := remote.Head(tag)
	if err != nil {
		t.Fatalf("%s: %v", ref, err)
	}
	return tag.Repository.Name() + "@" + desc.Digest.String()
}

// writeNamespaceSignaturePolicy gives namespace, on node n, a signature
// policy of its own: the images of the cluster's registry signed with
// pub (a PEM public key, which cosign's payload names by repository
// alone), and nothing else. The node rereads it at its next pull.
func (c *cluster) writeNamespaceSignaturePolicy(t *testing.T, n *node, namespace string, pub []byte) {
	t.Helper()
	policy, err := json.MarshalIndent(map[string]any{
		"default": []any{map[string]any{"type": "reject"}},
		"transports": map[string]any{"docker": map[string]any{
			c.registry: []any{map[string]any{
				"type":           "sigstoreSigned",
				"keyPath":        signedKey,
				"signedIdentity": map[string]any{"type": "matchRepository"},
			}},
		}},
	}, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	// The key first: the policy names it.
	writeFileAtomic(t, filepath.Join(n.root, signedKey), pub)
	writeFileAtomic(t, filepath.Join(n.root, signaturePolicyDir, namespace+".json"), policy)
}

// writeFileAtomic writes path whole, by a rename: a node never reads
// half of it.
func writeFileAtomic(t *testing.T, path string, data []byte) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	tmp := filepath.Join(filepath.Dir(path), "."+filepath.Base(path)+".tmp")
	if err := os.WriteFile(tmp, data, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

// podEvents are the reasons and messages of the events of pod name in
// namespace ns, one "reason: message" each.
func (c *cluster) podEvents(ns, name string) ([]string, error) {
	out, err := c.kubectlErr("-n", ns, "get", "events", "--field-selector", "involvedObject.kind=Pod,involvedObject.name="+name, "-o", "json")
	if err != nil {
		return nil, err
	}
	var l struct {
		Items []struct {
			Reason  string `json:"reason"`
			Message string `json:"message"`
		} `json:"items"`
	}
	if err := json.Unmarshal([]byte(out), &l); err != nil {
		return nil, err
	}
	var ev []string
	for _, e := range l.Items {
		ev = append(ev, e.Reason+": "+e.Message)
	}
	return ev, nil
}

// refusedUnsigned tells whether the unsigned pod of signedNamespace is
// pending, its container never created and waiting on the signature
// refusal (SignatureValidationFailed, then the back-off that names it).
func (c *cluster) refusedUnsigned() (bool, error) {
	p, err := c.podIn(signedNamespace, "unsigned")
	if err != nil {
		return false, err
	}
	st := p.container("main")
	if st == nil || p.Status.Phase != "Pending" || st.ContainerID != "" || st.State.Running != nil || st.State.Waiting == nil {
		return false, fmt.Errorf("phase %s, container %+v", p.Status.Phase, st)
	}
	w := st.State.Waiting
	if w.Reason != "SignatureValidationFailed" && !(w.Reason == "ImagePullBackOff" && strings.Contains(w.Message, "SignatureValidationFailed")) {
		return false, fmt.Errorf("waiting: %s: %s", w.Reason, w.Message)
	}
	return true, nil
}

// containersCreated counts, in the stagelet logs of every node, the pods
// whose sandbox name starts with prefix and the containers created in
// them.
func (c *cluster) containersCreated(t *testing.T, prefix string) (pods, containers int) {
	t.Helper()
	for _, n := range c.nodes {
		b, err := os.ReadFile(filepath.Join(n.root, "var/log/stagelet.log"))
		if err != nil {
			t.Fatal(err)
		}
		lines := strings.Split(string(b), "\n")
		for _, line := range lines {
			if !strings.Contains(line, `msg="pod started"`) || !strings.Contains(line, " name="+prefix) {
				continue
			}
			pods++
			_, rest, _ := strings.Cut(line, " pod=")
			id, _, _ := strings.Cut(rest, " ")
			for _, l := range lines {
				if strings.Contains(l, `msg="container created"`) && strings.Contains(l, " pod="+id+" ") {
					containers++
				}
			}
		}
	}
	return pods, containers
}
