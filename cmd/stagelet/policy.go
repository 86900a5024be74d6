package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"slices"
	"strings"

	"gopkg.in/yaml.v3"
	"k8s.io/apimachinery/pkg/api/resource"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/config"
	"github.com/stagelet/stagelet/policy"
	"github.com/stagelet/stagelet/stage1"
	"github.com/stagelet/stagelet/trust"
)

const policyUsage = `usage:
  stagelet policy check FILE...            validate policy files; exit 1 on problems
  stagelet policy explain [--config NODECONFIG | --policy FILE] [--handler H] [--overhead SIZE] POD...
                                           the stage1 each pod would get, and why, and
                                           how the stage1 would run it (a VM's size, where
                                           its qemu runs) or why it cannot;
                                           POD is a Kubernetes Pod manifest (YAML or
                                           JSON) or a CRI PodSandboxConfig (JSON), or -
  stagelet policy explain [--config NODECONFIG] --image REF [--namespace NS]
                                           the signature requirement that applies to an
                                           image in a namespace (images.signature_policy
                                           and its namespace files); with PODs, the one of
                                           each of their containers' images too
  stagelet policy default                  print the embedded default policy
`

func policyMain(args []string) int {
	if len(args) == 0 {
		fmt.Fprint(os.Stderr, policyUsage)
		return 2
	}
	switch args[0] {
	case "check":
		return policyCheck(args[1:], os.Stdout)
	case "explain":
		return policyExplain(args[1:], os.Stdout)
	case "default":
		os.Stdout.Write(policy.DefaultYAML())
		return 0
	default:
		fmt.Fprintf(os.Stderr, "stagelet policy: unknown command %q\n%s", args[0], policyUsage)
		return 2
	}
}

var quietLog = slog.New(slog.NewTextHandler(io.Discard, nil))

// policyCheck validates each file against the stage1s this binary carries.
// Problems naming a stage1 this build lacks are warnings: the file may be
// meant for a node that has it.
func policyCheck(files []string, out io.Writer) int {
	if len(files) == 0 {
		fmt.Fprint(os.Stderr, policyUsage)
		return 2
	}
	caps := capabilitiesOf(builtinBackends(quietLog, config.Default(), nil, true, ""))
	rc := 0
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			fmt.Fprintf(out, "%s: %v\n", f, err)
			rc = 1
			continue
		}
		p, err := policy.Parse(f, data)
		if err == nil {
			p.Source = f
			err = p.Validate(caps)
		}
		if n := reportProblems(out, err); n > 0 {
			fmt.Fprintf(out, "%s: %d problem(s)\n", f, n)
			rc = 1
		} else {
			fmt.Fprintf(out, "%s: ok\n", f)
		}
	}
	return rc
}

// reportProblems prints the problems err holds (Validate's or Parse's),
// one a line: warnings for those naming a stage1 this build lacks (the
// daemon loads such a policy, and refuses the pods routed there), then
// the errors (the daemon refuses the policy). It returns how many errors.
func reportProblems(out io.Writer, err error) int {
	errs, warns := splitProblems(err)
	for _, w := range warns {
		fmt.Fprintf(out, "warning: %s\n", w)
	}
	for _, e := range errs {
		fmt.Fprintln(out, e)
	}
	return len(errs)
}

// policyLoads checks p against this build's stage1s as policy check and
// the daemon do, and reports whether it loads; it prints its problems,
// and when it does not load, that explain decides nothing under it.
func policyLoads(out io.Writer, p *policy.Policy, caps map[string]stage1.Capabilities) bool {
	n := reportProblems(out, p.Validate(caps))
	if n > 0 {
		fmt.Fprintf(out, "refused: the policy (%s) has %d problem(s): the daemon does not load it, so it decides no pod\n", p.Source, n)
	}
	return n == 0
}

// splitProblems separates unknown-stage1 problems (warnings) from the rest.
func splitProblems(err error) (errs, warns []string) {
	if err == nil {
		return nil, nil
	}
	var ps policy.Problems
	if !errors.As(err, &ps) {
		return []string{err.Error()}, nil
	}
	for _, p := range ps {
		if errors.Is(p, policy.ErrUnknownStage1) {
			warns = append(warns, p.Error())
		} else {
			errs = append(errs, p.Error())
		}
	}
	return errs, warns
}

func policyExplain(args []string, out io.Writer) int {
	f, ok := parseExplainFlags(args)
	if !ok {
		return 2
	}
	cfg, p, err := explainPolicy(f.cfgFile, f.file)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	signatures, err := trust.NewSource(cfg.Images.SignaturePolicy, cfg.Images.PolicyDir(), quietLog)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	rc := 0
	if f.imageRef != "" {
		if !explainImage(out, signatures, f.namespace, f.imageRef) {
			rc = 1
		}
		if len(f.pods) > 0 {
			fmt.Fprintln(out)
		}
	}
	e := &podExplainer{out: out, policy: p, signatures: signatures}
	e.backends = builtinBackends(quietLog, cfg, nil, true, "")
	e.caps = capabilitiesOf(e.backends)
	if len(f.pods) > 0 && !policyLoads(out, p, e.caps) {
		return 1
	}
	for i, name := range f.pods {
		pp, err := readPodForPolicy(name, f.handler, f.overhead)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		if i > 0 {
			fmt.Fprintln(out)
		}
		if !e.explain(pp) {
			rc = 1
		}
	}
	return rc
}

// explainFlags is the command line of policy explain.
type explainFlags struct {
	file, cfgFile, handler string
	imageRef, namespace    string
	overhead               int64    // --overhead, in bytes
	pods                   []string // the POD arguments
}

// parseExplainFlags parses the arguments of policy explain; false: they
// are wrong, which it reported (exit status 2).
func parseExplainFlags(args []string) (*explainFlags, bool) {
	fs := flag.NewFlagSet("stagelet policy explain", flag.ContinueOnError)
	file := fs.String("policy", "", "policy file (default: the embedded default)")
	cfgFile := fs.String("config", "", "node config whose policy and stage1 settings to use (its policy: or policy_file:)")
	handler := fs.String("handler", "", "RuntimeClass handler, for a CRI PodSandboxConfig")
	overhead := fs.String("overhead", "", "the RuntimeClass overhead's memory (overhead.podFixed.memory, 192Mi) of a Pod manifest without spec.overhead")
	imageRef := fs.String("image", "", "an image reference: say which signature requirement applies to it")
	namespace := fs.String("namespace", "default", "the Kubernetes namespace of --image")
	if err := fs.Parse(args); err != nil {
		return nil, false
	}
	if fs.NArg() == 0 && *imageRef == "" {
		fmt.Fprint(os.Stderr, policyUsage)
		return nil, false
	}
	var over int64
	if *overhead != "" {
		q, err := resource.ParseQuantity(*overhead)
		if err != nil || q.Value() < 0 {
			fmt.Fprintf(os.Stderr, "stagelet policy explain: --overhead %q: want a size such as 192Mi\n", *overhead)
			return nil, false
		}
		over = q.Value()
	}
	if *file != "" && *cfgFile != "" {
		fmt.Fprintln(os.Stderr, "stagelet policy explain: give --policy or --config, not both")
		return nil, false
	}
	return &explainFlags{
		file: *file, cfgFile: *cfgFile, handler: *handler,
		imageRef: *imageRef, namespace: *namespace,
		overhead: over, pods: fs.Args(),
	}, true
}

// readPodForPolicy reads and parses the pod in file name (- : standard
// input) as parsePodForPolicy does; an error in its content names the
// file.
func readPodForPolicy(name, handler string, overhead int64) (explainedPod, error) {
	var data []byte
	var err error
	if name == "-" {
		data, err = io.ReadAll(os.Stdin)
	} else {
		data, err = os.ReadFile(name)
	}
	if err != nil {
		return explainedPod{}, err
	}
	pp, err := parsePodForPolicy(data, handler, overhead)
	if err != nil {
		return explainedPod{}, fmt.Errorf("%s: %v", name, err)
	}
	return pp, nil
}

// podExplainer explains pods under one policy, with the stage1s and the
// signature policy of one node config.
type podExplainer struct {
	out        io.Writer
	policy     *policy.Policy
	backends   stage1.Registry
	caps       map[string]stage1.Capabilities
	signatures *trust.Source
}

// explain prints the stage1 the policy gives pp and why, how that stage1
// would run it (explainPlan) and the signature requirement of each of its
// containers' images, or why the policy refuses it. It reports whether
// all of that is fine.
func (e *podExplainer) explain(pp explainedPod) bool {
	fmt.Fprintf(e.out, "pod:     %s\n", pp.title)
	d, err := e.policy.Decide(pp.pod, e.caps)
	var ref *policy.Refusal
	switch {
	case err == nil:
		fmt.Fprint(e.out, e.policy.Explain(d))
		ok := explainPlan(e.out, e.backends[d.Stage1], d, pp)
		for _, img := range pp.images {
			if !explainImage(e.out, e.signatures, pp.pod.Namespace, img) {
				ok = false
			}
		}
		return ok
	case errors.As(err, &ref):
		fmt.Fprint(e.out, ref.Explain())
		return false
	default:
		fmt.Fprintf(e.out, "refused: %v\n", err)
		return false
	}
}

// explainPolicy is the node config and the isolation policy explain uses:
// those of cfgFile, or the defaults; a policy file wins.
func explainPolicy(cfgFile, file string) (*config.Config, *policy.Policy, error) {
	p := policy.Default()
	p.Source = "embedded default"
	cfg := config.Default()
	if cfgFile != "" {
		var err error
		if cfg, err = config.Load(cfgFile); err != nil {
			return nil, nil, err
		}
		if p, err = cfg.LoadPolicy(); err != nil {
			return nil, nil, err
		}
	}
	if file != "" {
		data, err := os.ReadFile(file)
		if err != nil {
			return nil, nil, err
		}
		if p, err = policy.Parse(file, data); err != nil {
			return nil, nil, err
		}
		p.Source = file
	}
	return cfg, p, nil
}

// explainImage says which signature requirement applies to ref in
// namespace, and where it is written; false when the policy refuses the
// image whatever its signatures (or the reference is bad).
func explainImage(out io.Writer, src *trust.Source, namespace, ref string) bool {
	r, err := trust.ParseReference(ref)
	if err == nil && r.NameOnly() {
		r.Tag = "latest"
	}
	if err != nil {
		fmt.Fprintf(out, "image:   %s: %v\n", ref, err)
		return false
	}
	fmt.Fprintf(out, "image:   %s in namespace %s\n", r, namespace)
	d, err := src.Decide(context.Background(), namespace, r)
	if err != nil {
		fmt.Fprintf(out, "  refused: %v\n", err)
		return false
	}
	file := d.File
	if file == "" {
		file = "none configured (images.signature_policy): every image runs unverified"
	}
	fmt.Fprintf(out, "  policy:   %s\n  scope:    %s\n  requires: %s\n", file, d.Scope, d.Requirements.Describe())
	for _, q := range d.Requirements {
		if q.Type == trust.TypeReject {
			return false
		}
	}
	return true
}

// explainPlan says how the chosen stage1 would run the pod, for one that
// plans its pods (stage1.PodPlanner): what the daemon asks it before it
// takes anything. It reports whether the stage1 takes the pod.
func explainPlan(out io.Writer, be stage1.Backend, d policy.Decision, pp explainedPod) bool {
	pl, ok := be.(stage1.PodPlanner)
	if !ok {
		return true
	}
	id := strings.Repeat("0", 64)
	spec := &stage1.PodSpec{
		ID: id, Name: pp.title, Namespace: pp.pod.Namespace, RunDir: "/run/stagelet/pods/" + id,
		HostNetwork: pp.pod.HostNetwork, HostPID: pp.pod.HostPID, HostIPC: pp.pod.HostIPC,
		Options: d.Options, Resources: pp.res, CgroupMemoryLimit: &pp.cgroupLimit,
	}
	plan, err := pl.PlanPod(spec)
	if err != nil {
		fmt.Fprintf(out, "refused: stage1 %s (chosen by %s) cannot run the pod: %v\n", d.Stage1, d.ChosenBy, err)
		return false
	}
	fmt.Fprintf(out, "plan:    %s\n", plan)
	return true
}

// explainedPod is what explain reads of a pod: what the policy decides
// on, and its limits as the kubelet would give them.
type explainedPod struct {
	pod   policy.Pod
	title string
	res   stage1.PodResources
	// cgroupLimit is the memory limit the kubelet would set on the pod's
	// cgroup (0: none).
	cgroupLimit uint64
	// images are a Pod manifest's containers' images.
	images []string
}

// k8sResources are a container's (or a pod's) resources in a manifest.
type k8sResources struct {
	Limits   map[string]string `yaml:"limits"`
	Requests map[string]string `yaml:"requests"`
}

// k8sContainer is the part of a container of a Pod manifest explain
// reads.
type k8sContainer struct {
	Image string `yaml:"image"`
	// RestartPolicy Always makes an init container a sidecar.
	RestartPolicy   string       `yaml:"restartPolicy"`
	Resources       k8sResources `yaml:"resources"`
	SecurityContext struct {
		Privileged bool `yaml:"privileged"`
	} `yaml:"securityContext"`
}

// k8sPod is the part of a Kubernetes Pod manifest explain reads.
type k8sPod struct {
	Kind     string `yaml:"kind" json:"kind"`
	Metadata struct {
		Name        string            `yaml:"name"`
		Namespace   string            `yaml:"namespace"`
		Labels      map[string]string `yaml:"labels"`
		Annotations map[string]string `yaml:"annotations"`
	} `yaml:"metadata"`
	Spec struct {
		RuntimeClassName string         `yaml:"runtimeClassName"`
		HostNetwork      bool           `yaml:"hostNetwork"`
		HostPID          bool           `yaml:"hostPID"`
		HostIPC          bool           `yaml:"hostIPC"`
		Containers       []k8sContainer `yaml:"containers"`
		InitContainers   []k8sContainer `yaml:"initContainers"`
		// Resources are pod-level resources; Overhead the RuntimeClass's,
		// which admission sets.
		Resources *k8sResources     `yaml:"resources"`
		Overhead  map[string]string `yaml:"overhead"`
	} `yaml:"spec"`
}

// parsePodForPolicy reads a Kubernetes Pod manifest or a CRI
// PodSandboxConfig. A Pod's runtimeClassName stands for its handler (a
// RuntimeClass object maps the name to a handler; stagelet's defaults use
// the same word for both); overhead is the RuntimeClass overhead's
// memory of a manifest that has no spec.overhead.
func parsePodForPolicy(data []byte, handler string, overhead int64) (explainedPod, error) {
	var k k8sPod
	if err := yaml.Unmarshal(data, &k); err == nil && k.Kind == "Pod" {
		ns := k.Metadata.Namespace
		if ns == "" {
			ns = "default"
		}
		pp := explainedPod{title: ns + "/" + k.Metadata.Name, pod: policy.Pod{
			Handler:     k.Spec.RuntimeClassName,
			Namespace:   ns,
			Labels:      k.Metadata.Labels,
			Annotations: k.Metadata.Annotations,
			HostNetwork: k.Spec.HostNetwork,
			HostPID:     k.Spec.HostPID,
			HostIPC:     k.Spec.HostIPC,
		}}
		if handler != "" {
			pp.pod.Handler = handler
		}
		for _, c := range append(slices.Clone(k.Spec.InitContainers), k.Spec.Containers...) {
			pp.pod.Privileged = pp.pod.Privileged || c.SecurityContext.Privileged
			if c.Image != "" && !slices.Contains(pp.images, c.Image) {
				pp.images = append(pp.images, c.Image)
			}
		}
		var err error
		if pp.res, pp.cgroupLimit, err = k.limits(overhead); err != nil {
			return explainedPod{}, err
		}
		return pp, nil
	} else if err == nil && k.Kind != "" {
		return explainedPod{}, fmt.Errorf("kind %q: want a Pod manifest or a CRI PodSandboxConfig", k.Kind)
	}
	var c runtimeapi.PodSandboxConfig
	dec := json.NewDecoder(strings.NewReader(string(data)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&c); err != nil {
		return explainedPod{}, fmt.Errorf("neither a Pod manifest nor a CRI PodSandboxConfig: %v", err)
	}
	if c.GetMetadata().GetName() == "" {
		return explainedPod{}, fmt.Errorf("CRI PodSandboxConfig without metadata.name")
	}
	sc := c.GetLinux().GetSecurityContext()
	ns := sc.GetNamespaceOptions()
	pp := explainedPod{pod: policy.Pod{
		Handler:     handler,
		Namespace:   c.GetMetadata().GetNamespace(),
		Labels:      c.GetLabels(),
		Annotations: c.GetAnnotations(),
		Privileged:  sc.GetPrivileged(),
		HostNetwork: ns.GetNetwork() == runtimeapi.NamespaceMode_NODE,
		HostPID:     ns.GetPid() == runtimeapi.NamespaceMode_NODE,
		HostIPC:     ns.GetIpc() == runtimeapi.NamespaceMode_NODE,
	}}
	pp.title = pp.pod.Namespace + "/" + c.GetMetadata().GetName()
	// A CRI config's limits are the kubelet's; its cgroup, as the
	// kubelet's, holds them and the overhead.
	r, o := c.GetLinux().GetResources(), c.GetLinux().GetOverhead()
	pp.res = stage1.PodResources{MemoryLimit: r.GetMemoryLimitInBytes(), CPUQuota: r.GetCpuQuota(), CPUPeriod: r.GetCpuPeriod(),
		CPUShares: r.GetCpuShares(), OverheadMemory: o.GetMemoryLimitInBytes()}
	if pp.res.MemoryLimit > 0 {
		pp.cgroupLimit = uint64(pp.res.MemoryLimit + max(0, pp.res.OverheadMemory))
	}
	return pp, nil
}

// cpuPeriod is the CFS period the kubelet gives limited pods (µs).
const cpuPeriod = 100000

// limits are the pod's totals as the kubelet sends them to its runtime,
// and the memory limit it puts on the pod's cgroup (0: none): the
// containers' limits summed (what a container without one adds is
// nothing), at least any init container's with the sidecars started
// before it; or the pod-level limits. The cgroup is limited (to that
// total and the overhead) only when every container has a memory limit,
// or the pod one of its own.
func (k *k8sPod) limits(overhead int64) (stage1.PodResources, uint64, error) {
	var res stage1.PodResources
	memory, memoryDeclared, err := k.total("limits", "memory")
	if err != nil {
		return res, 0, err
	}
	cpu, _, err := k.total("limits", "cpu")
	if err != nil {
		return res, 0, err
	}
	requests, _, err := k.total("requests", "cpu")
	if err != nil {
		return res, 0, err
	}
	if k.Spec.Overhead != nil {
		if overhead, err = quantity("spec.overhead.memory", k.Spec.Overhead["memory"], false); err != nil {
			return res, 0, err
		}
	}
	res.MemoryLimit, res.OverheadMemory = memory, overhead
	if cpu > 0 {
		res.CPUQuota, res.CPUPeriod = cpu*cpuPeriod/1000, cpuPeriod
	}
	if requests > 0 {
		res.CPUShares = max(2, requests*1024/1000)
	}
	var limit uint64
	if memoryDeclared && memory > 0 {
		limit = uint64(memory + overhead)
	}
	return res, limit, nil
}

// total sums resource name (memory in bytes, cpu in millicores) of kind
// (limits, requests) as the kubelet does, and reports whether every
// container declares it (or the pod does, at pod level).
func (k *k8sPod) total(kind, name string) (int64, bool, error) {
	milli := name == "cpu"
	if r := k.Spec.Resources; r != nil {
		if v, ok := r.field(kind)[name]; ok {
			n, err := quantity("spec.resources."+kind+"."+name, v, milli)
			return n, true, err
		}
	}
	var sum, sidecars, initMax int64
	declared := len(k.Spec.Containers) > 0
	for i, c := range k.Spec.Containers {
		v, ok := c.Resources.field(kind)[name]
		declared = declared && ok
		n, err := quantity(fmt.Sprintf("spec.containers[%d].resources.%s.%s", i, kind, name), v, milli)
		if err != nil {
			return 0, false, err
		}
		sum += n
	}
	for i, c := range k.Spec.InitContainers {
		n, err := quantity(fmt.Sprintf("spec.initContainers[%d].resources.%s.%s", i, kind, name), c.Resources.field(kind)[name], milli)
		if err != nil {
			return 0, false, err
		}
		if c.RestartPolicy == "Always" {
			sidecars += n
			continue
		}
		initMax = max(initMax, n+sidecars)
	}
	return max(sum+sidecars, initMax), declared, nil
}

func (r k8sResources) field(kind string) map[string]string {
	if kind == "limits" {
		return r.Limits
	}
	return r.Requests
}

// quantity reads a Kubernetes quantity of field: its value, in
// thousandths when milli; "" is 0.
func quantity(field, v string, milli bool) (int64, error) {
	if v == "" {
		return 0, nil
	}
	q, err := resource.ParseQuantity(v)
	if err != nil || q.Sign() < 0 {
		return 0, fmt.Errorf("%s: %q is not a size", field, v)
	}
	if milli {
		return q.MilliValue(), nil
	}
	return q.Value(), nil
}
