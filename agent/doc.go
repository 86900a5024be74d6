// Package agent holds no code: its packages are the two sides of the
// agent, the process stagelet runs in every pod, and what they share.
//
// In the pod:
//   - supervisor: the agent itself. It starts apps inside their root
//     filesystems, reaps every child, keeps exit codes, writes CRI logs,
//     runs exec and serves exec, attach and port-forward sessions. The same
//     code runs as the fly supervisor on the host, as the init of an nspawn
//     container and in a VM; it makes no assumption about which.
//   - guestinit: PID 1 of a kvm pod's VM, which prepares the guest and
//     runs the supervisor on the VM's virtio-serial port.
//
// On the host:
//   - client: the daemon's side, the only one that calls an agent (the
//     broker for every container call, the backends for readiness).
//
// Shared by both sides:
//   - api: the protocol's requests, responses, events and frame types.
//   - wire: how the protocol travels on a stream (frames, error codes).
//   - transport: the streams themselves (unix sockets; yamux over
//     virtio-serial).
//   - guest: the VM's configuration as the host passes it on the kernel
//     command line.
//
// Host-side packages never import supervisor or guestinit.
package agent
