// Package host is the host-side bookkeeping the stage1 backends share:
// launching detached processes (plainly, or as systemd transient units
// over D-Bus), tracking a process by PID and start time, shared
// directories that reach a pod's mount namespace or VM, waiting for an
// agent, stopping and releasing a pod's host resources (the ledger),
// collecting a lost pod's units, and checkpointing and restoring apps
// with criu.
//
// It is apart from package stage1 so that the contract stays a leaf of
// types (no D-Bus, no agent): policy, config and the broker read the
// contract without linking what backends need to run pods. What the
// broker and config share with the backends is not here but in the
// packages that own it: cgroup and slice names, pod cgroups, the cgroup
// v1 memory placement and the collection of orphaned pod cgroups in
// cgroups; removing a tree beneath mounts in internal/mountsafe; bind
// mounts, idmapped ones and their user namespaces in internal/bindmount
// (broker/deps_test.go keeps it so).
package host
