// Package host is the host-side bookkeeping the stage1 backends share:
// launching detached processes (plainly, or as systemd transient units
// over D-Bus), tracking a process by PID and start time, pod cgroups and
// slices, shared directories that reach a pod's mount namespace or VM,
// removing only what is not a mount, waiting for an agent, stopping and
// releasing a pod's host resources, and collecting orphaned cgroups.
//
// It is apart from package stage1 so that the contract stays a leaf of
// types (no D-Bus, no agent): policy, config and the broker read the
// contract without linking what backends need to run pods.
package host
