// Package broker owns the node's pods and containers: their IDs, name
// reservations, state machines and persisted records, idempotency of
// stop/remove, and recovery after a daemon restart. It routes every call for
// a pod to the stage1 backend recorded with that pod; the choice is made
// once, when the pod is created, and never recomputed.
//
// Locking: Broker.mu guards the maps and every record field; it is never
// held across I/O to a pod's agent or the image store, nor across the
// allocation of a pod's SELinux level. Each pod and each
// container has an operation lock serialising its lifecycle calls.
package broker

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/stagelet/stagelet/agent/api"
	"github.com/stagelet/stagelet/devices"
	"github.com/stagelet/stagelet/errdefs"
	"github.com/stagelet/stagelet/image"
	"github.com/stagelet/stagelet/internal/lsm"
	"github.com/stagelet/stagelet/internal/rlimit"
	"github.com/stagelet/stagelet/livemove"
	"github.com/stagelet/stagelet/nri"
	"github.com/stagelet/stagelet/policy"
	"github.com/stagelet/stagelet/stage1"
	"github.com/stagelet/stagelet/stage1/podconn"
	"github.com/stagelet/stagelet/trust"
)

// Images is what the broker needs from the image store.
type Images interface {
	Pull(ctx context.Context, ref string, auth *image.Auth, verify image.Verify) (*image.Image, error)
	Get(ref string) (*image.Image, error)
	List() []*image.Image
	Remove(ctx context.Context, ref string) error
	Usage() (bytes, inodes uint64, err error)
	Root() string
	// MountRootfs mounts a container's root file system (image.Store's),
	// every file of it with mountLabel where SELinux is enabled.
	MountRootfs(ctx context.Context, imageID, dir string, userns *image.UserNS, mountLabel string) (string, error)
	// MountImageVolume mounts an image read-only beneath dir (a
	// container's directory, which UnmountRootfs takes away).
	MountImageVolume(ref, dir, subPath string) (string, error)
	UnmountRootfs(ctx context.Context, dir string) error
	// Annotations are an image's manifest annotations; LayerDirs its
	// unpacked layers, bottom first, read only.
	Annotations(ref string) (map[string]string, error)
	LayerDirs(ref string) ([]string, error)
}

// Options configure a Broker.
type Options struct {
	// StateDir holds durable records and container layers.
	StateDir string
	// RunDir holds volatile per-pod directories (sockets).
	RunDir string
	// CgroupParent is passed to backends for pods the kubelet gives no
	// cgroup parent: a cgroup path (cgroupfs driver) or a slice (systemd).
	CgroupParent string
	// SystemdCgroup says the node uses the systemd cgroup driver: pods'
	// cgroup parents are slices.
	SystemdCgroup bool
	// Policy decides each new pod's stage1; SetPolicy replaces it.
	Policy *policy.Policy
	// AgentBinary is the stagelet binary backends run as the pod agent.
	AgentBinary string
	// Backends are the stage1s pods run on, by name; at least one.
	Backends stage1.Registry
	Images   Images
	// Network gives pods their own network namespace; nil means only
	// pods in the host network can be created.
	Network Network
	// CDI resolves CDI device names; nil: devices.NewCDI(nil).
	CDI *devices.CDI
	Log *slog.Logger
	// Observer is told of decisions, pod starts, agent disconnects and
	// recovery, for metrics; nil: nobody.
	Observer Observer
	// Inspect: an operator tool that only reads the state, maybe beside
	// the running daemon (stagelet doctor): New makes no directory.
	Inspect bool
	// Rlimits are the resource limits every container starts with: the
	// daemon's children's (rlimit.Inherited), as containerd's containers
	// get containerd's; nil leaves each agent's children's.
	Rlimits []rlimit.Limit
	// CRIU is the criu binary that works on this node, or why none does;
	// nil: checkpoints are refused. Asked at each checkpoint or restore.
	CRIU func(context.Context) (string, error)
	// Trust is the signature policy images are checked against at pull
	// and at container creation; nil: every image runs unverified.
	Trust *trust.Source
	// LiveAddress is the IP (or IP:port) where a pod moving live is
	// offered to the other node's daemon (config checkpoint.live_address);
	// "": no pod moves live from here.
	LiveAddress string
	// NRI hosts the node's NRI plugins, which see every pod and
	// container event and adjust containers (broker/nri.go); nil: off.
	// Its Start is the caller's, with the broker, after Recover.
	NRI *nri.Host
}

// Broker is the node's pod and container manager. Create it with New, then
// call Recover once before serving.
type Broker struct {
	opts Options
	log  *slog.Logger
	rec  records
	obs  Observer

	ready atomic.Bool
	// quarantined counts the records in quarantine (Recover).
	quarantined atomic.Int32
	policy      atomic.Pointer[policy.Policy]
	caps        map[string]stage1.Capabilities

	// podLabels computes a new pod's SELinux labels, reserving their MCS
	// level (podSELinux), and releaseLabels gives a level back
	// (lsm.ReleaseSELinux). Both do I/O (selinuxfs) and are never called
	// with mu held; tests replace them.
	podLabels     func(*PodConfig) (lsm.Labels, error)
	releaseLabels func(lsm.Labels)

	// decisions counts pods per chosen stage1 and refusals, since start.
	statsMu   sync.Mutex
	decisions map[string]int

	// imageMu orders RemoveImage with the claims of containers being
	// created on their images (claimImage); taken before mu.
	imageMu sync.Mutex

	mu       sync.Mutex
	pods     map[string]*pod
	podNames map[string]*pod // name key → pod, while the pod exists
	ctrs     map[string]*container
	ctrNames map[string]*container // pod ID + name key → container

	// Event subscribers (Subscribe); subsMu is taken inside mu, never
	// the other way round.
	subsMu sync.Mutex
	subs   map[*Subscription]struct{}
	nsubs  atomic.Int32
	// subBuffer is a subscriber's buffer; 0 means SubscriberBuffer.
	subBuffer int

	// nriq orders the events NRI plugins are told (broker/nri.go).
	nriq nriQueue

	// followers counts the goroutines following pods' agents (watch).
	followers sync.WaitGroup
	// releasing counts the removed containers' file systems being
	// released off the reply path (releaseRootfs).
	releasing sync.WaitGroup
}

// Close stops following the pods' agents and waits until no follower
// writes a record any more; the pods keep running, for the next daemon to
// recover. The broker is not used afterwards.
func (b *Broker) Close() {
	b.mu.Lock()
	ps := make([]*pod, 0, len(b.pods))
	var hs []*podconn.Pod
	for _, p := range b.pods {
		ps = append(ps, p)
		if p.handle != nil {
			hs = append(hs, p.handle)
		}
	}
	b.mu.Unlock()
	for _, p := range ps {
		b.unwatch(p)
	}
	for _, h := range hs {
		h.StopLogs() // the next daemon takes them on from where they are
	}
	b.followers.Wait()
	b.releasing.Wait()
}

type pod struct {
	op  sync.Mutex // serialises Run/Stop/Remove and container creation
	rec *PodRecord
	// handle is the backend's running pod; nil when not running or gone.
	handle *podconn.Pod
	// created is closed when RunPod finished (successfully or not); err is
	// its outcome, read after created is closed.
	created chan struct{}
	err     error
	// unwatch stops following the pod's agent (watch); agent is what the
	// agent said of itself when following began. Guarded by Broker.mu.
	unwatch context.CancelFunc
	agent   *api.Info
	// runAt is when this daemon's RunPodSandbox of the pod began, until
	// its first container runs (Observer.PodStarted); zero for a
	// recovered pod, or once told. Guarded by Broker.mu.
	runAt time.Time
	// releasing counts its removed containers' file systems being
	// released (releaseRootfs): the pod's removal waits for them.
	releasing sync.WaitGroup
	// offer is the pod's live move waiting for its target, withdrawn
	// when the pod stops. Guarded by Broker.mu.
	offer *livemove.Offer
}

// id is the pod's ID, which never changes.
func (p *pod) id() string { return p.rec.ID }

type container struct {
	op      sync.Mutex
	rec     *ContainerRecord
	created chan struct{}
	err     error
}

// New returns a broker; it creates its directories but does not recover.
func New(opts Options) (*Broker, error) {
	if opts.Log == nil {
		opts.Log = slog.Default()
	}
	if opts.Policy == nil {
		return nil, fmt.Errorf("broker: no policy")
	}
	if len(opts.Backends) == 0 {
		return nil, fmt.Errorf("broker: no stage1 backends")
	}
	if opts.CDI == nil {
		opts.CDI = devices.NewCDI(nil)
	}
	if opts.Observer == nil {
		opts.Observer = nopObserver{}
	}
	b := &Broker{
		opts:      opts,
		log:       opts.Log,
		obs:       opts.Observer,
		rec:       records{dir: opts.StateDir},
		pods:      map[string]*pod{},
		podNames:  map[string]*pod{},
		ctrs:      map[string]*container{},
		ctrNames:  map[string]*container{},
		caps:      map[string]stage1.Capabilities{},
		decisions: map[string]int{},

		podLabels:     podSELinux,
		releaseLabels: lsm.ReleaseSELinux,
	}
	for n, be := range opts.Backends {
		b.caps[n] = be.Capabilities()
	}
	b.policy.Store(opts.Policy)
	if opts.Inspect {
		return b, nil
	}
	if err := b.rec.init(); err != nil {
		return nil, err
	}
	for _, d := range []string{b.podsRunDir(), b.containersDir()} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, err
		}
	}
	return b, nil
}

func backendNames(r stage1.Registry) []string {
	names := make([]string, 0, len(r))
	for n := range r {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// Ready reports whether recovery has finished; until then CRI calls are
// refused with Unavailable.
func (b *Broker) Ready() bool { return b.ready.Load() }

// Handlers lists the runtime handlers pods may name: the policy's handlers
// whose stage1 this node has.
func (b *Broker) Handlers() []string {
	p := b.policy.Load()
	var out []string
	for _, h := range p.Handlers() {
		if _, ok := b.opts.Backends[p.RuntimeHandlers[h].Stage1]; ok {
			out = append(out, h)
		}
	}
	return out
}

// HandlerCapabilities are the capabilities of the stage1 a runtime
// handler names; for "" (no handler), the policy's default stage1's. ok
// is false for a handler that names no stage1 of this daemon.
func (b *Broker) HandlerCapabilities(h string) (stage1.Capabilities, bool) {
	p := b.policy.Load()
	name := p.DefaultStage1
	if h != "" {
		name = p.RuntimeHandlers[h].Stage1
	}
	c, ok := b.caps[name]
	return c, ok
}

// BackendInfo gathers what backends say about how they run on this node
// (stage1.NodeInformer), keyed "<stage1>.<fact>".
func (b *Broker) BackendInfo(ctx context.Context) map[string]string {
	out := map[string]string{}
	for name, be := range b.opts.Backends {
		if ni, ok := be.(stage1.NodeInformer); ok {
			for k, v := range ni.NodeInfo(ctx) {
				out[name+"."+k] = v
			}
		}
	}
	return out
}

// Stage1s lists the registered backends.
func (b *Broker) Stage1s() []string { return backendNames(b.opts.Backends) }

// Policy returns the policy in force.
func (b *Broker) Policy() *policy.Policy { return b.policy.Load() }

// SetPolicy replaces the policy for pods created from now on; running pods
// keep their recorded decision.
func (b *Broker) SetPolicy(p *policy.Policy) { b.policy.Store(p) }

// Capabilities returns every registered backend's capability facts.
func (b *Broker) Capabilities() map[string]stage1.Capabilities { return b.caps }

// CDISpecDirs are the directories CDI device specs are read from.
func (b *Broker) CDISpecDirs() []string { return b.opts.CDI.SpecDirs() }

// DecisionCounts returns how many pods each stage1 got, and refusals
// (key "refused"), since the daemon started.
func (b *Broker) DecisionCounts() map[string]int {
	b.statsMu.Lock()
	defer b.statsMu.Unlock()
	out := make(map[string]int, len(b.decisions))
	for k, v := range b.decisions {
		out[k] = v
	}
	return out
}

// QuarantinedRecords counts the records in quarantine when recovery
// ended: those it could not read, this time or before.
func (b *Broker) QuarantinedRecords() int { return int(b.quarantined.Load()) }

func (b *Broker) count(key string) {
	b.statsMu.Lock()
	b.decisions[key]++
	b.statsMu.Unlock()
}

// Backend returns a registered backend's capabilities.
func (b *Broker) Backend(name string) (stage1.Backend, bool) {
	be, ok := b.opts.Backends[name]
	return be, ok
}

func (b *Broker) podsRunDir() string    { return filepath.Join(b.opts.RunDir, "pods") }
func (b *Broker) containersDir() string { return filepath.Join(b.opts.StateDir, "containers-fs") }

func newID() string {
	var buf [32]byte
	if _, err := rand.Read(buf[:]); err != nil {
		panic(err)
	}
	return hex.EncodeToString(buf[:])
}

func hashOf(v any) string {
	data, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	sum := sha256.Sum256(data)
	return hex.EncodeToString(sum[:])
}

// lookupPod finds a pod by full ID or unique prefix.
func (b *Broker) lookupPod(id string) (*pod, error) {
	if id == "" {
		return nil, errdefs.InvalidArgument("pod_sandbox_id: must not be empty")
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if p, ok := b.pods[id]; ok {
		return p, nil
	}
	var found *pod
	for pid, p := range b.pods {
		if len(id) >= 6 && len(pid) > len(id) && pid[:len(id)] == id {
			if found != nil {
				return nil, errdefs.InvalidArgument("pod sandbox id prefix %q is ambiguous", id)
			}
			found = p
		}
	}
	if found == nil {
		return nil, errdefs.NotFound("pod sandbox %q not found", id)
	}
	return found, nil
}

// lookupContainer finds a container by full ID or unique prefix.
func (b *Broker) lookupContainer(id string) (*container, error) {
	if id == "" {
		return nil, errdefs.InvalidArgument("container_id: must not be empty")
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if c, ok := b.ctrs[id]; ok {
		return c, nil
	}
	var found *container
	for cid, c := range b.ctrs {
		if len(id) >= 6 && len(cid) > len(id) && cid[:len(id)] == id {
			if found != nil {
				return nil, errdefs.InvalidArgument("container id prefix %q is ambiguous", id)
			}
			found = c
		}
	}
	if found == nil {
		return nil, errdefs.NotFound("container %q not found", id)
	}
	return found, nil
}

// waitCreated waits for an object's creation to finish.
func waitCreated(ctx context.Context, ch chan struct{}) error {
	select {
	case <-ch:
		return nil
	case <-ctx.Done():
		// The caller's own end: a deadline, or a cancel (the client went
		// away), which toStatus answers as Canceled.
		if errors.Is(ctx.Err(), context.DeadlineExceeded) {
			return fmt.Errorf("waiting for creation in progress: %w", errdefs.ErrDeadlineExceeded)
		}
		return fmt.Errorf("waiting for creation in progress: %w", ctx.Err())
	}
}

// agentCtx bounds a call to an agent that the kubelet did not bound.
func agentCtx(ctx context.Context, d time.Duration) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, d)
}
