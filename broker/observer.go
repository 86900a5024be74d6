package broker

import (
	"errors"
	"time"

	"github.com/stagelet/stagelet/agent/client"
	"github.com/stagelet/stagelet/policy"
	"github.com/stagelet/stagelet/stage1"
	"github.com/stagelet/stagelet/stage1/podconn"
)

// Observer is told what the broker decides and sees, for metrics
// (Options.Observer). Its methods are called from any goroutine, some
// with the broker's lock held: they must return at once and must not call
// back into the broker.
type Observer interface {
	// PolicyDecided: a new pod got stage1; rule is the policy rule that
	// chose it, "" when a handler or the default did.
	PolicyDecided(stage1, rule string)
	// PolicyRefused: a new pod was refused; reason names what refused
	// (policy.Refusal.By: `rule "x"`, "handlers.fly", ...).
	PolicyRefused(reason string)
	// PodStarted: a pod this daemon created has its first container
	// running, took after its RunPodSandbox began.
	PodStarted(stage1 string, took time.Duration)
	// AgentDisconnected: the event stream of a pod's agent ended while
	// the broker followed it (the agent died, or the stream broke and is
	// subscribed again).
	AgentDisconnected(stage1 string)
	// Recovered: Recover finished.
	Recovered(RecoveryResult)
	// ImageVerified: an image was checked against the signature policy
	// at stage (VerifyAtPull, VerifyAtCreate) with result (VerifyAccepted,
	// ...).
	ImageVerified(stage, result string)
	// AgentRefused: the broker did not take n things a pod's agent of
	// stage1 answered as it said them: spans (field client.FieldSpans,
	// reason a tracing.Drop*), or a field of its answers (a
	// client.Field*, reason a client.Reason*) that refused the answer
	// or was replaced. Every label is the daemon's, never the agent's.
	AgentRefused(stage1, field, reason string, n int)
}

// nopObserver is the Observer of a broker given none.
type nopObserver struct{}

func (nopObserver) PolicyDecided(string, string)             {}
func (nopObserver) PolicyRefused(string)                     {}
func (nopObserver) PodStarted(string, time.Duration)         {}
func (nopObserver) AgentDisconnected(string)                 {}
func (nopObserver) Recovered(RecoveryResult)                 {}
func (nopObserver) ImageVerified(string, string)             {}
func (nopObserver) AgentRefused(string, string, string, int) {}

// openPod opens a pod of rec's stage1 as the broker holds it: what its
// agent answers is checked by the protocol client (agent/client), which
// tells the Observer (and the debug log) what it refused.
func (b *Broker) openPod(h stage1.Pod, rec *PodRecord) *podconn.Pod {
	log := b.log.With("pod", rec.ID)
	stage1 := rec.Stage1 // never changes
	return podconn.Open(h, log, client.OnRefusal(func(field, reason string, n int) {
		b.obs.AgentRefused(stage1, field, reason, n)
		log.Debug("refused what the pod's agent answered", "field", field, "reason", reason, "n", n)
	}))
}

// Refusal reasons that are not the policy's own (policy.Refusal.By).
const (
	RefusedStage1Unavailable = "stage1 unavailable" // the policy chose a stage1 this node lacks
	RefusedOther             = "other"              // an error that is no policy.Refusal
)

// refusalReason is the reason label of a policy refusal.
func refusalReason(err error) string {
	var r *policy.Refusal
	if errors.As(err, &r) && r.By != "" {
		return r.By
	}
	return RefusedOther
}

// Census counts the pods and the containers the broker holds, by stage1
// and state (a container counts under its pod's stage1).
type Census struct {
	Pods       map[StageState]int
	Containers map[StageState]int
}

// StageState is a stage1 and a pod or container state.
type StageState struct{ Stage1, State string }

// Census counts the pods and containers by stage1 and state, from the
// broker's memory alone: no pod is asked. A pod is "ready" as
// PodSandboxStatus says it: recorded ready and its agent connected (one
// that recovery could not reattach, or whose agent is gone, is
// "notready").
func (b *Broker) Census() Census {
	c := Census{Pods: map[StageState]int{}, Containers: map[StageState]int{}}
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, p := range b.pods {
		state := p.rec.State
		if state == PodReady && p.handle == nil {
			state = PodNotReady
		}
		c.Pods[StageState{p.rec.Stage1, state}]++
	}
	for _, ctr := range b.ctrs {
		stage1 := ""
		if p := b.pods[ctr.rec.PodID]; p != nil {
			stage1 = p.rec.Stage1
		}
		c.Containers[StageState{stage1, ctr.rec.State}]++
	}
	return c
}

// PodStates and ContainerStates are every state the Census may count.
var (
	PodStates       = []string{PodCreating, PodReady, PodNotReady}
	ContainerStates = []string{ContainerCreating, ContainerCreated, ContainerRunning, ContainerExited, ContainerUnknown}
)
