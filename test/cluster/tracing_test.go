package cluster

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stagelet/stagelet/test/otlpsink"
)

// testTrace: the nodes' kubelets trace every pod sync (tracing in their
// KubeletConfiguration, sampling all) and their stagelets trace only
// what a sampled caller asks for; both send to the test's receiver. One
// trace then holds a kubelet's syncPod span, stagelet's RunPodSandbox
// span beneath the kubelet's own span of that call, and the pod agent's
// spans (service stagelet-agent) beneath the same syncPod.
func (c *cluster) testTrace(t *testing.T) {
	var found string
	err := c.waitFor(2*time.Minute, "one trace from a kubelet's syncPod into a pod's agent", func() (bool, error) {
		found = traceIntoPod(c.traces.All())
		return found != "", nil
	})
	if err != nil {
		seen := map[string]int{}
		for _, s := range c.traces.All() {
			seen[s.Service+" "+s.Name]++
		}
		t.Fatalf("%v; the receiver got (service, span: count): %v", err, seen)
	}
	t.Logf("a pod's start, as the receiver got it:\n%s", found)
}

// traceIntoPod finds a trace holding a kubelet's syncPod with stagelet's
// RunPodSandbox and an agent's span beneath it, and describes it; "" when
// there is none.
func traceIntoPod(all []otlpsink.Span) string {
	byTrace := map[string][]otlpsink.Span{}
	for _, s := range all {
		byTrace[s.TraceID] = append(byTrace[s.TraceID], s)
	}
	for _, spans := range byTrace {
		byID := map[string]otlpsink.Span{}
		for _, s := range spans {
			byID[s.SpanID] = s
		}
		// ancestors lists s's chain up to its root, s first.
		ancestors := func(s otlpsink.Span) []otlpsink.Span {
			chain := []otlpsink.Span{s}
			for i := 0; i < 64; i++ {
				p, ok := byID[chain[len(chain)-1].ParentID]
				if !ok {
					break
				}
				chain = append(chain, p)
			}
			return chain
		}
		syncPod := func(chain []otlpsink.Span) string {
			for _, a := range chain {
				if a.Service == "kubelet" && a.Name == "syncPod" {
					return a.SpanID
				}
			}
			return ""
		}
		var run, agent []otlpsink.Span
		for _, s := range spans {
			switch {
			case s.Service == "stagelet" && s.Name == "runtime.v1.RuntimeService/RunPodSandbox":
				if chain := ancestors(s); len(chain) > 1 && chain[1].Service == "kubelet" && syncPod(chain) != "" {
					run = chain
				}
			case s.Service == "stagelet-agent":
				if chain := ancestors(s); syncPod(chain) != "" {
					agent = chain
				}
			}
		}
		if run == nil || agent == nil || syncPod(run) != syncPod(agent) {
			continue
		}
		var b strings.Builder
		for _, chain := range [][]otlpsink.Span{run, agent} {
			for i := len(chain) - 1; i >= 0; i-- {
				fmt.Fprintf(&b, "%s%s (%s)\n", strings.Repeat("  ", len(chain)-1-i), chain[i].Name, chain[i].Service)
			}
		}
		return b.String()
	}
	return ""
}
