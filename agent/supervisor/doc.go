// Package supervisor is the agent, the pod's supervisor and init: it
// starts apps inside their root filesystems, reaps every child, keeps exit
// codes, writes CRI logs, runs exec and serves exec, attach and
// port-forward sessions (dialling forwarded ports from the network
// namespace it runs in, the pod's). The same code runs as the fly
// supervisor on the host, as the init of an nspawn container and in a VM
// (package guestinit); it makes no assumption about which. The daemon
// reaches it through package client over the protocol in package api, on
// any transport that gives one stream per call (package transport).
package supervisor
