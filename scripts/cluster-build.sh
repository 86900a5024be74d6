#!/bin/bash
# Builds what `make test-cluster` needs that is slow to build, once per
# machine, into caches keyed by their inputs, and prints where each is as
# VAR=PATH lines on stdout (progress goes to stderr):
#
#   K8S_BIN=...     kube-apiserver, kube-controller-manager, kube-scheduler,
#                   kube-proxy, kubectl, etcd, kubelet and agnhost, built by
#                   ../shared/k8s/build.sh (its own cache, /var/cache/stagelet-k8s)
#   CLUSTER_TOOLS=...  coredns (its Go module, static) and the CNI plugins
#                   the pod network installs (bridge, host-local, loopback,
#                   portmap: containernetworking/plugins, static)
#   NODE_TREE=...   the Debian 12 tree every node boots with
#                   systemd-nspawn -b: systemd, D-Bus, systemd-nspawn for the
#                   nspawn stage1, qemu and mkfs.erofs (its image disks)
#                   for the kvm stage1, iptables and
#                   iproute2, the libraries criu links; no stagelet,
#                   kubelet, criu or configuration (the test binds and
#                   writes those per node)
#
#   scripts/cluster-build.sh
#
# Environment: CLUSTER_CACHE (default /var/cache/stagelet-cluster),
# K8S_KIT (default ../shared/k8s/build.sh), MIRROR (the Debian mirror).
# Needs root, go, debootstrap. Cold: the Kubernetes binaries 20-40
# minutes on 2 cores, coredns about 5, the tree about 3.
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${CLUSTER_CACHE:-/var/cache/stagelet-cluster}
K8S_KIT=${K8S_KIT:-$top/../shared/k8s/build.sh}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
# The libraries of the criu the test binds in (scripts/build-criu.sh).
NODE_PACKAGES=systemd,systemd-sysv,dbus,systemd-container,iptables,iproute2,kmod,procps,qemu-system-x86,erofs-utils,libprotobuf-c1,libnl-3-200,libnet1,libnftables1,libgnutls30,libbsd0,libuuid1
COREDNS_VERSION=v1.12.4
CNI_PLUGINS_VERSION=v1.9.1
log() { echo "cluster-build: $*" >&2; }

[ "$(id -u)" = 0 ] || { log "needs root"; exit 1; }
[ -x "$K8S_KIT" ] || { log "no Kubernetes build kit at $K8S_KIT"; exit 1; }
mkdir -p "$CACHE"
exec 9>"$CACHE/lock"
flock 9

# ---- Kubernetes
k8s=$("$K8S_KIT" kube-apiserver kube-controller-manager kube-scheduler kube-proxy kubectl etcd kubelet agnhost | tail -n1)
echo "K8S_BIN=$k8s"

# ---- coredns and the CNI plugins, static (CGO off: they run in images
# without a libc)
key=$(printf '%s %s %s\n' "$COREDNS_VERSION" "$CNI_PLUGINS_VERSION" "$(go env GOVERSION)" | sha256sum | cut -c1-12)
tools=$CACHE/tools-$key
if [ ! -f "$tools/.done" ]; then
	t0=$(date +%s)
	rm -rf "$tools"
	mkdir -p "$tools/cni"
	export GOWORK=off CGO_ENABLED=0 GOFLAGS=-mod=mod
	GOBIN=$tools go install -trimpath -ldflags "-s -w" "github.com/coredns/coredns@$COREDNS_VERSION" >&2
	for p in main/bridge main/loopback ipam/host-local meta/portmap; do
		GOBIN=$tools/cni go install -trimpath -ldflags "-s -w" \
			"github.com/containernetworking/plugins/plugins/$p@$CNI_PLUGINS_VERSION" >&2
	done
	touch "$tools/.done"
	log "built coredns $COREDNS_VERSION and the CNI plugins $CNI_PLUGINS_VERSION in $(($(date +%s) - t0))s"
fi
echo "CLUSTER_TOOLS=$tools"

# ---- the node tree
key=$(printf 'bookworm %s\n' "$NODE_PACKAGES" | sha256sum | cut -c1-12)
tree=$CACHE/tree-$key
if [ ! -f "$tree/.done" ]; then
	command -v debootstrap >/dev/null || { log "debootstrap is missing (scripts/install-deps.sh)"; exit 1; }
	t0=$(date +%s)
	tmp=$tree.partial
	rm -rf --one-file-system "$tmp"
	debootstrap --variant=minbase \
		--include="$NODE_PACKAGES" \
		bookworm "$tmp" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1 || {
		tail -20 "$CACHE/debootstrap.log" >&2
		exit 1
	}
	# A quick, quiet boot: no getty, no network configuration (the test
	# sets the node's address), no timers.
	for u in getty@.service serial-getty@.service console-getty.service \
		systemd-networkd.service systemd-resolved.service systemd-timesyncd.service \
		apt-daily.timer apt-daily-upgrade.timer e2scrub_all.timer fstrim.timer \
		man-db.timer dpkg-db-backup.timer logrotate.timer; do
		ln -sf /dev/null "$tmp/etc/systemd/system/$u"
	done
	: >"$tmp/etc/machine-id" # transient, made at each boot
	rm -rf "$tmp"/var/cache/apt/archives/*.deb "$tmp"/var/lib/apt/lists/* "$CACHE/debootstrap.log"
	rm -rf --one-file-system "$tree"
	mv "$tmp" "$tree"
	touch "$tree/.done"
	log "built the node tree in $(($(date +%s) - t0))s"
fi
echo "NODE_TREE=$tree"
