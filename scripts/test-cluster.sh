#!/bin/bash
# make test-cluster: stagelet as one node of many. A Kubernetes v1.34
# cluster on this machine: etcd, kube-apiserver, kube-controller-manager and
# kube-scheduler on the host, two nodes booted from a Debian 12 tree with
# systemd-nspawn -b, each running stagelet and a kubelet as services, with
# kube-proxy, the pod network and CoreDNS as pods (test/cluster).
#
#   scripts/test-cluster.sh STAGELET_BINARY [GUEST_DIR]
#
# What is slow to build (the Kubernetes binaries, coredns, the node tree)
# is built once by scripts/cluster-build.sh and cached in /var/cache.
# Environment: CLUSTER_TESTS (a -test.run pattern, default TestCluster),
# CLUSTER_TIMEOUT (go test -timeout, default 40m).
set -euo pipefail
BIN=$(readlink -f "${1:?usage: scripts/test-cluster.sh STAGELET_BINARY [GUEST_DIR]}")
GUEST=${2:-}
top=$(cd "$(dirname "$0")/.." && pwd)
[ "$(id -u)" = 0 ] || { echo "test-cluster: needs root" >&2; exit 1; }
if [ ! -x "$top/../shared/k8s/build.sh" ] && [ -z "${K8S_KIT:-}" ]; then
	echo "test-cluster: no Kubernetes build kit (../shared/k8s/build.sh): the cluster test is skipped"
	exit 0
fi
t0=$(date +%s)
built=$("$top/scripts/cluster-build.sh")
eval "$built"
echo "test-cluster: built or found in the cache in $(($(date +%s) - t0))s"
[ -n "$GUEST" ] && [ -f "$GUEST/vmlinux" ] && GUEST=$(readlink -f "$GUEST") || GUEST=
cd "$top"
STAGELET_CLUSTER_K8S_BIN=$K8S_BIN STAGELET_CLUSTER_TOOLS=$CLUSTER_TOOLS STAGELET_CLUSTER_TREE=$NODE_TREE \
	STAGELET_BIN=$BIN STAGELET_GUEST_ASSETS=$GUEST \
	go test -count=1 -v -timeout "${CLUSTER_TIMEOUT:-40m}" -run "${CLUSTER_TESTS:-TestCluster}" ./test/cluster/
