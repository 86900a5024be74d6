package e2e

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/metadata"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/internal/testutil"
	"github.com/stagelet/stagelet/test/e2e/harness"
	"github.com/stagelet/stagelet/test/otlpsink"
)

// traced is ctx carrying a W3C traceparent of a new sampled trace, as the
// kubelet sends with its CRI calls when KubeletTracing is on; it returns
// the trace's and the caller's span's IDs.
func traced(ctx context.Context) (context.Context, string, string) {
	var tid [16]byte
	var sid [8]byte
	rand.Read(tid[:])
	rand.Read(sid[:])
	t, s := hex.EncodeToString(tid[:]), hex.EncodeToString(sid[:])
	return metadata.AppendToOutgoingContext(ctx, "traceparent", "00-"+t+"-"+s+"-01"), t, s
}

// spanTree is one trace's spans by ID, and a lookup by name.
type spanTree struct {
	spans []otlpsink.Span
}

func (tr spanTree) named(name string) []otlpsink.Span {
	var out []otlpsink.Span
	for _, s := range tr.spans {
		if s.Name == name {
			out = append(out, s)
		}
	}
	return out
}

func (tr spanTree) byID(id string) (otlpsink.Span, bool) {
	for _, s := range tr.spans {
		if s.SpanID == id {
			return s, true
		}
	}
	return otlpsink.Span{}, false
}

// under reports whether span s descends from the span with ID ancestor.
func (tr spanTree) under(s otlpsink.Span, ancestor string) bool {
	for i := 0; i < 64 && s.ParentID != ""; i++ {
		if s.ParentID == ancestor {
			return true
		}
		p, ok := tr.byID(s.ParentID)
		if !ok {
			return false
		}
		s = p
	}
	return false
}

func (tr spanTree) String() string {
	var b strings.Builder
	for _, s := range tr.spans {
		fmt.Fprintf(&b, "  %s %s parent %s %v\n", s.SpanID, s.Name, s.ParentID, s.Attrs)
	}
	return b.String()
}

// TestTracing: with tracing on, the daemon continues the trace a CRI
// call's traceparent names: RunPodSandbox's span is the caller's span's
// child, and beneath it are the policy's decision (naming the stage1),
// the pod's start and, beneath that, its network namespace, CNI ADD, the
// stage1's start with its launch and the wait for the agent (for kvm the
// template and qemu's launch). CreateContainer's span holds the rootfs
// mount and the agent call, and beneath that the agent's own spans,
// recorded in the pod (in the VM for kvm) and exported by the daemon;
// StartContainer's the same. A call that came without a sampled
// parent is not traced at sampling rate 0. On fly, nspawn and (with guest
// assets) kvm.
func TestTracing(t *testing.T) {
	stage1s := []podStage1{flyStage1, nspawnStage1}
	policy := bothStage1sPolicy
	if os.Getenv("STAGELET_GUEST_ASSETS") != "" {
		stage1s = append(stage1s, kvmStage1)
		policy = allStage1sPolicy
	}
	for _, s := range stage1s {
		t.Run(s.handler, func(t *testing.T) {
			sink := otlpsink.Start(t)
			e := newEnvOpts(t, harness.Options{Policy: policy, TracingEndpoint: sink.Addr}, true)
			// Untraced first: at rate 0 it must not show up.
			if _, err := e.rt().RemoveContainer(e.ctx(), &runtimeapi.RemoveContainerRequest{ContainerId: "no-such-container"}); err != nil {
				t.Fatal(err)
			}
			// The status path is never traced, even under a sampled
			// caller.
			lctx, _, _ := traced(e.ctx())
			if _, err := e.rt().ListPodSandbox(lctx, &runtimeapi.ListPodSandboxRequest{}); err != nil {
				t.Fatal(err)
			}
			cfg := e.netPodConfig("traced-"+s.handler, s)
			ctx, traceID, caller := traced(e.ctx())
			resp, err := e.rt().RunPodSandbox(ctx, &runtimeapi.RunPodSandboxRequest{Config: cfg, RuntimeHandler: s.handler})
			if err != nil {
				t.Fatalf("RunPodSandbox: %v", err)
			}
			e.cleanupPod(resp.PodSandboxId)
			cctx, ctrTrace, _ := traced(e.ctx())
			cr, err := e.rt().CreateContainer(cctx, &runtimeapi.CreateContainerRequest{
				PodSandboxId: resp.PodSandboxId, SandboxConfig: cfg, Config: e.netContainer(s, "c", "true"),
			})
			if err != nil {
				t.Fatalf("CreateContainer: %v", err)
			}
			if _, err := e.rt().StartContainer(cctx, &runtimeapi.StartContainerRequest{ContainerId: cr.ContainerId}); err != nil {
				t.Fatalf("StartContainer: %v", err)
			}

			var tree spanTree
			testutil.WaitFor(t, 60*time.Second, "RunPodSandbox's spans to reach the receiver", func() (bool, string) {
				tree = spanTree{sink.Trace(traceID)}
				return len(tree.named("pod.start")) == 1 && len(tree.named("runtime.v1.RuntimeService/RunPodSandbox")) == 1, tree.String()
			})
			t.Logf("RunPodSandbox's trace:\n%s", tree)
			root := tree.named("runtime.v1.RuntimeService/RunPodSandbox")[0]
			if root.ParentID != caller {
				t.Errorf("RunPodSandbox's span has parent %s, want the caller's span %s", root.ParentID, caller)
			}
			if root.Attrs["stagelet.request_id"] == "" || root.Service != "stagelet" {
				t.Errorf("RunPodSandbox's span: service %q, attributes %v: want stagelet and a request ID", root.Service, root.Attrs)
			}
			want := []struct{ name, under string }{
				{"policy.decide", "runtime.v1.RuntimeService/RunPodSandbox"},
				{"pod.start", "runtime.v1.RuntimeService/RunPodSandbox"},
				{"pod.netns", "pod.start"},
				{"cni.add", "pod.start"},
				{"stage1.start_pod", "pod.start"},
				{"host.launch", "stage1.start_pod"},
				{"agent.ready", "stage1.start_pod"},
				{"pod.files", "pod.start"},
			}
			if s.handler == "kvm" {
				want = append(want, struct{ name, under string }{"kvm.template", "stage1.start_pod"},
					struct{ name, under string }{"kvm.launch_qemu", "stage1.start_pod"})
			}
			for _, w := range want {
				got := tree.named(w.name)
				parent := tree.named(w.under)
				if len(got) == 0 || len(parent) != 1 || !tree.under(got[0], parent[0].SpanID) {
					t.Errorf("no span %s beneath %s in the trace:\n%s", w.name, w.under, tree)
				}
			}
			if d := tree.named("policy.decide"); len(d) == 1 && d[0].Attrs["stagelet.stage1"] != s.handler {
				t.Errorf("policy.decide names stage1 %q, want %s", d[0].Attrs["stagelet.stage1"], s.handler)
			}

			var ctrTree spanTree
			testutil.WaitFor(t, 60*time.Second, "CreateContainer's and StartContainer's spans", func() (bool, string) {
				ctrTree = spanTree{sink.Trace(ctrTrace)}
				return len(ctrTree.named("agent.create")) == 1 && len(ctrTree.named("app.launch")) == 1, ctrTree.String()
			})
			t.Logf("CreateContainer's and StartContainer's trace:\n%s", ctrTree)
			drawTrace(t, s.handler+"-RunPodSandbox.svg", tree.spans)
			drawTrace(t, s.handler+"-CreateContainer-StartContainer.svg", ctrTree.spans)
			// The agent's own spans (in the pod, in the VM for kvm), sent
			// back with its answers and exported by the daemon, beneath
			// the daemon's span of each agent call.
			for _, w := range []struct{ name, under string }{
				{"handle.create", "agent.create"}, {"app.cgroup", "handle.create"},
				{"handle.start", "agent.start"}, {"app.launch", "handle.start"},
			} {
				got, parent := ctrTree.named(w.name), ctrTree.named(w.under)
				if len(got) != 1 || len(parent) != 1 || got[0].ParentID != parent[0].SpanID || got[0].Service != "stagelet-agent" {
					t.Errorf("no agent span %s (service stagelet-agent) beneath %s:\n%s", w.name, w.under, ctrTree)
				}
			}
			if c := ctrTree.named("runtime.v1.RuntimeService/CreateContainer"); len(c) != 1 ||
				!ctrTree.under(ctrTree.named("agent.create")[0], c[0].SpanID) ||
				len(ctrTree.named("container.rootfs")) != 1 || !ctrTree.under(ctrTree.named("container.rootfs")[0], c[0].SpanID) {
				t.Errorf("CreateContainer's trace lacks agent.create and container.rootfs beneath its span:\n%s", ctrTree)
			}
			if !strings.Contains(e.d.LogTail(400), "trace_id="+ctrTrace) {
				t.Errorf("no log line of the traced CreateContainer carries trace_id=%s", ctrTrace)
			}
			// The agent's spans lie within the daemon's span of the call,
			// on the daemon's clock (a VM's clock may be off).
			for _, tr := range []spanTree{tree, ctrTree} {
				for _, sp := range tr.spans {
					if sp.Service != "stagelet-agent" {
						continue
					}
					p, ok := tr.byID(sp.ParentID)
					if ok && p.Service == "stagelet" && (sp.Start.Before(p.Start) || sp.End.After(p.End)) {
						t.Errorf("%s (%v to %v) is not within %s (%v to %v)", sp.Name, sp.Start, sp.End, p.Name, p.Start, p.End)
					}
				}
			}
			// The batch that brought these spans would have brought the
			// untraced RemoveContainer's and the ListPodSandbox's, sent
			// earlier.
			for _, sp := range sink.All() {
				switch sp.Name {
				case "runtime.v1.RuntimeService/RemoveContainer":
					t.Errorf("a call without a sampled parent was traced at rate 0: %+v", sp)
				case "runtime.v1.RuntimeService/ListPodSandbox":
					t.Errorf("a call of the status path was traced: %+v", sp)
				}
			}
		})
	}
}

// drawTrace writes spans as a waterfall picture (otlpsink.WriteSVG) named
// name into the directory $STAGELET_TRACE_SVG, when it is set: the
// pictures of the README come from there.
func drawTrace(t *testing.T, name string, spans []otlpsink.Span) {
	dir := os.Getenv("STAGELET_TRACE_SVG")
	if dir == "" {
		return
	}
	var b bytes.Buffer
	if err := otlpsink.WriteSVG(&b, spans); err != nil {
		t.Error(err)
		return
	}
	if err := os.WriteFile(filepath.Join(dir, name), b.Bytes(), 0o644); err != nil {
		t.Error(err)
	}
}
