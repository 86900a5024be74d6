package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"

	"gopkg.in/yaml.v3"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/stagelet/stagelet/config"
	"github.com/stagelet/stagelet/policy"
)

const policyUsage = `usage:
  stagelet policy check FILE...            validate policy files; exit 1 on problems
  stagelet policy explain [--config NODECONFIG | --policy FILE] [--handler H] POD...
                                           the stage1 each pod would get, and why;
                                           POD is a Kubernetes Pod manifest (YAML or
                                           JSON) or a CRI PodSandboxConfig (JSON), or -
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
		errs, warns := splitProblems(err)
		for _, w := range warns {
			fmt.Fprintf(out, "warning: %s\n", w)
		}
		for _, e := range errs {
			fmt.Fprintln(out, e)
		}
		switch {
		case len(errs) > 0:
			fmt.Fprintf(out, "%s: %d problem(s)\n", f, len(errs))
			rc = 1
		default:
			fmt.Fprintf(out, "%s: ok\n", f)
		}
	}
	return rc
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
	fs := flag.NewFlagSet("stagelet policy explain", flag.ContinueOnError)
	file := fs.String("policy", "", "policy file (default: the embedded default)")
	cfgFile := fs.String("config", "", "node config whose policy to use (its policy: or policy_file:)")
	handler := fs.String("handler", "", "RuntimeClass handler, for a CRI PodSandboxConfig")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if fs.NArg() == 0 {
		fmt.Fprint(os.Stderr, policyUsage)
		return 2
	}
	p := policy.Default()
	p.Source = "embedded default"
	if *file != "" && *cfgFile != "" {
		fmt.Fprintln(os.Stderr, "stagelet policy explain: give --policy or --config, not both")
		return 2
	}
	if *cfgFile != "" {
		cfg, err := config.Load(*cfgFile)
		if err == nil {
			p, err = cfg.LoadPolicy()
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
	}
	if *file != "" {
		data, err := os.ReadFile(*file)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		if p, err = policy.Parse(*file, data); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		p.Source = *file
	}
	caps := capabilitiesOf(builtinBackends(quietLog, config.Default(), nil, true, ""))
	rc := 0
	for i, name := range fs.Args() {
		var data []byte
		var err error
		if name == "-" {
			data, err = io.ReadAll(os.Stdin)
		} else {
			data, err = os.ReadFile(name)
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		pod, title, err := parsePodForPolicy(data, *handler)
		if err != nil {
			fmt.Fprintf(os.Stderr, "%s: %v\n", name, err)
			return 1
		}
		if i > 0 {
			fmt.Fprintln(out)
		}
		fmt.Fprintf(out, "pod:     %s\n", title)
		d, err := p.Decide(pod, caps)
		var ref *policy.Refusal
		switch {
		case err == nil:
			fmt.Fprint(out, p.Explain(d))
		case errors.As(err, &ref):
			fmt.Fprint(out, ref.Explain())
			rc = 1
		default:
			fmt.Fprintf(out, "refused: %v\n", err)
			rc = 1
		}
	}
	return rc
}

// k8sPod is the part of a Kubernetes Pod manifest the policy reads.
type k8sPod struct {
	Kind     string `yaml:"kind" json:"kind"`
	Metadata struct {
		Name        string            `yaml:"name"`
		Namespace   string            `yaml:"namespace"`
		Labels      map[string]string `yaml:"labels"`
		Annotations map[string]string `yaml:"annotations"`
	} `yaml:"metadata"`
	Spec struct {
		RuntimeClassName string `yaml:"runtimeClassName"`
		HostNetwork      bool   `yaml:"hostNetwork"`
		HostPID          bool   `yaml:"hostPID"`
		HostIPC          bool   `yaml:"hostIPC"`
		Containers       []struct {
			SecurityContext struct {
				Privileged bool `yaml:"privileged"`
			} `yaml:"securityContext"`
		} `yaml:"containers"`
		InitContainers []struct {
			SecurityContext struct {
				Privileged bool `yaml:"privileged"`
			} `yaml:"securityContext"`
		} `yaml:"initContainers"`
	} `yaml:"spec"`
}

// parsePodForPolicy reads a Kubernetes Pod manifest or a CRI
// PodSandboxConfig. A Pod's runtimeClassName stands for its handler (a
// RuntimeClass object maps the name to a handler; stagelet's defaults use
// the same word for both).
func parsePodForPolicy(data []byte, handler string) (policy.Pod, string, error) {
	var k k8sPod
	if err := yaml.Unmarshal(data, &k); err == nil && k.Kind == "Pod" {
		ns := k.Metadata.Namespace
		if ns == "" {
			ns = "default"
		}
		pod := policy.Pod{
			Handler:     k.Spec.RuntimeClassName,
			Namespace:   ns,
			Labels:      k.Metadata.Labels,
			Annotations: k.Metadata.Annotations,
			HostNetwork: k.Spec.HostNetwork,
			HostPID:     k.Spec.HostPID,
			HostIPC:     k.Spec.HostIPC,
		}
		if handler != "" {
			pod.Handler = handler
		}
		for _, c := range k.Spec.Containers {
			pod.Privileged = pod.Privileged || c.SecurityContext.Privileged
		}
		for _, c := range k.Spec.InitContainers {
			pod.Privileged = pod.Privileged || c.SecurityContext.Privileged
		}
		return pod, ns + "/" + k.Metadata.Name, nil
	} else if err == nil && k.Kind != "" {
		return policy.Pod{}, "", fmt.Errorf("kind %q: want a Pod manifest or a CRI PodSandboxConfig", k.Kind)
	}
	var c runtimeapi.PodSandboxConfig
	dec := json.NewDecoder(strings.NewReader(string(data)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&c); err != nil {
		return policy.Pod{}, "", fmt.Errorf("neither a Pod manifest nor a CRI PodSandboxConfig: %v", err)
	}
	if c.GetMetadata().GetName() == "" {
		return policy.Pod{}, "", fmt.Errorf("CRI PodSandboxConfig without metadata.name")
	}
	sc := c.GetLinux().GetSecurityContext()
	ns := sc.GetNamespaceOptions()
	pod := policy.Pod{
		Handler:     handler,
		Namespace:   c.GetMetadata().GetNamespace(),
		Labels:      c.GetLabels(),
		Annotations: c.GetAnnotations(),
		Privileged:  sc.GetPrivileged(),
		HostNetwork: ns.GetNetwork() == runtimeapi.NamespaceMode_NODE,
		HostPID:     ns.GetPid() == runtimeapi.NamespaceMode_NODE,
		HostIPC:     ns.GetIpc() == runtimeapi.NamespaceMode_NODE,
	}
	return pod, pod.Namespace + "/" + c.GetMetadata().GetName(), nil
}
