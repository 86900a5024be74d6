// Package policy decides which stage1 (isolation backend) each pod gets,
// and why, from the operator's policy and the capabilities the node's
// stage1s declare. Deciding is a pure function: no I/O, no state, no
// backend known by name — only by the caps.Capabilities it declares.
//
// # The policy file
//
// The policy is the `policy:` section of the node config, or a file of its
// own. It is YAML, decoded strictly: unknown keys, duplicate keys, wrong
// types, unknown stage1 names, unreachable or contradictory rules are
// errors naming file, line and column. So are options a rule or handler
// gives its stage1 that the stage1 does not declare (caps.Option, beside
// its capabilities), or whose value the option's check refuses: kvm takes
// memory and vcpus, fly and nspawn take none. The embedded default
// (DefaultYAML) is a complete, commented example. A worked example:
//
//	version: 1
//	default_stage1: nspawn          # pods nothing else decides
//
//	handlers:                       # RuntimeClass handler → stage1
//	  nspawn: {stage1: nspawn}
//	  kvm:    {stage1: kvm}
//	  fly:
//	    stage1: fly
//	    namespaces: [kube-system]   # names or globs; not_namespaces too
//
//	rules:                          # ordered
//	  - name: system-daemons-on-host
//	    match: {namespaces: [kube-system], host_network: true}
//	    stage1: fly
//	  - name: no-privileged-in-ci
//	    match: {namespaces: [ci], privileged: true}
//	    refuse: "privileged pods do not run in ci"
//	  - name: ci-in-vms
//	    match: {namespaces: [ci]}
//	    stage1: kvm
//	    options: {memory: 2048M, vcpus: "2"}
//	    locked: true
//
//	annotations:                    # what stagelet.io/stage1 may request
//	  allow: [kvm]
//	  per_namespace: {"team-*": [nspawn, kvm]}
//	  raise_only: true              # the default
//
//	conflicts:                      # the stage1 lacks what the pod needs
//	  host_network: {refuse: "hostNetwork pods cannot run in a VM"}
//	  host_pid: {fallback: nspawn}
//
// A rule's match conditions must all hold; an empty match matches every
// pod, and a rule after such a rule is unreachable (an error). Matchers:
// namespaces and not_namespaces (exact names or globs: *, ?, [a-z]),
// labels and annotations (each key with exactly that value), privileged,
// host_network, host_pid, host_ipc (booleans). Pod authors set labels and
// annotations, so a rule that lowers isolation should also match on
// namespace.
//
// # Precedence
//
//  1. A matching rule with `refuse:` refuses the pod (PermissionDenied),
//     wherever it stands in the list and whatever the handler.
//  2. A non-empty RuntimeClass handler chooses the stage1. An unknown
//     handler is refused (InvalidArgument); a handler outside its
//     namespaces limit is refused (PermissionDenied naming the mapping); a
//     handler choosing another stage1 than a matching locked rule is
//     refused (PermissionDenied naming the rule); one choosing the same
//     stage1 leaves the decision, options included, to that rule.
//  3. Otherwise the first matching rule with `stage1:` chooses.
//  4. Otherwise default_stage1.
//
// Then the pod annotation stagelet.io/stage1 (or rktnetes'
// rkt.alpha.kubernetes.io/stage1-name-override, whose values such as
// "coreos.com/rkt/stage1-kvm:1.30.0", "stage1-coreos" and "stage1-fly" mean
// kvm, nspawn and fly) may change the choice. An annotation asking for the
// stage1 already chosen changes nothing and is accepted. Any other request
// is refused with PermissionDenied when the stage1 is not in the
// allow-list for the pod's namespace (per_namespace, else allow), when a
// locked rule matches the pod, or, with raise_only (the default), when the
// requested stage1's isolation level is below the chosen one's. An
// annotation therefore never obtains fly unless fly is listed, and never
// lowers isolation under raise_only. An unparseable value is refused with
// InvalidArgument.
//
// Last, the chosen stage1's capabilities are checked against the pod:
// hostNetwork needs HostNetwork, hostPID needs HostPID, hostIPC needs
// HostIPC. If the policy (a rule or the default) chose the stage1, the
// `conflicts:` entry for the missing capability routes the pod to its
// fallback (re-checked) or refuses it (InvalidArgument; refusing is the
// default). If the pod itself asked for the stage1, by handler or
// annotation, it is refused: the request is impossible. The embedded
// default gives hostPID and hostIPC pods fly (the kubelet's admission has
// already decided that they may share the host's namespaces, and fly is
// the most isolated stage1 that does) and refuses hostNetwork pods only on
// a stage1 without the host's network.
//
// Every refusal is a *Refusal whose message names the rule, handler
// mapping, allow-list or conflict setting that refused; Decision.Reasons
// records every step of an accepted decision, including what was
// overridden.
package policy
