// Package agent is the pod's supervisor and init: it starts apps inside their
// root filesystems, reaps every child, keeps exit codes, writes CRI logs and
// runs exec. The same code runs as the fly supervisor on the host, as the
// init of an nspawn container and as PID 1 of a VM; it makes no assumption
// about which. The daemon reaches it through Client over the protocol in
// package api.
package agent
