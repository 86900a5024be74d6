#!/bin/bash
# containerd beside stagelet in `make bench`: the same stagelet-bench calls
# (pod start and each of its calls, ExecSync, streaming exec, teardown)
# against a private containerd with runc (Debian 12: containerd 1.6.20),
# its pods in their own network through the same CNI plugins (bridge,
# host-local, portmap from containernetworking-plugins), busybox served by
# the conformance kit's registry on 127.0.0.1.
#
#   scripts/bench-containerd.sh [stagelet-bench flags...]   (e.g. -n 10)
#   scripts/bench-containerd.sh --beside -bin BIN -stage1 fly -scale 50,100
#
# With --beside, stagelet runs too, and stagelet-bench times the
# status-path calls of both in the same rounds, alternately (-beside):
# ratios that the machine's drift between two runs does not skew.
#
# Without containerd and runc installed it says so and exits 0 (install
# them with apt-get install containerd runc; the Debian package's own
# service is not used). Everything it makes lives beneath one directory in
# /var/tmp (root, state, sockets, CNI config and addresses) and is removed,
# with the bridge, the registry and containerd (by PID), when it ends.
#
# Environment: KIT (the conformance kit, default ../shared/conformance),
# REGISTRY (default 127.0.0.1:5086), BRIDGE (stbench0), SUBNET (10.247.0).
set -euo pipefail
cd "$(dirname "$0")/.."
KIT=${KIT:-../shared/conformance}
REGISTRY=${REGISTRY:-127.0.0.1:5086}
BRIDGE=${BRIDGE:-stbench0}
SUBNET=${SUBNET:-10.247.0}
CNI_BIN=/usr/lib/cni

if ! command -v containerd >/dev/null || ! command -v runc >/dev/null; then
	echo "bench-containerd: containerd and runc are not installed (apt-get install containerd runc): no side-by-side figures"
	exit 0
fi
[ -f "$KIT/bin/cri-test-registry.xz" ] || { echo "bench-containerd: no conformance kit at $KIT: no side-by-side figures"; exit 0; }
[ "$(id -u)" = 0 ] || { echo "bench-containerd: needs root" >&2; exit 2; }
for p in bridge host-local portmap loopback; do
	[ -x "$CNI_BIN/$p" ] || { echo "bench-containerd: no CNI plugin $CNI_BIN/$p (apt-get install containernetworking-plugins)" >&2; exit 2; }
done

D=$(mktemp -d /var/tmp/stagelet-bench-containerd.XXXXXX)
CPID= RPID=
cleanup() {
	set +e
	if [ -n "$CPID" ]; then
		kill "$CPID" 2>/dev/null
		for _ in $(seq 100); do kill -0 "$CPID" 2>/dev/null || break; sleep 0.1; done
		kill -9 "$CPID" 2>/dev/null
	fi
	# Shims of pods a failed run left (their address names this directory).
	for pid in $(pgrep -f "containerd-shim-runc-v2 .*$D/" || true); do kill -9 "$pid" 2>/dev/null; done
	[ -n "$RPID" ] && { kill "$RPID" 2>/dev/null; wait "$RPID" 2>/dev/null; }
	grep -o " $D/[^ ]*" /proc/self/mounts | sort -r | while read -r m; do umount "$m" 2>/dev/null || umount -l "$m"; done
	if ip link show "$BRIDGE" >/dev/null 2>&1; then ip link del "$BRIDGE"; fi
	iptables -D FORWARD -s "$SUBNET.0/24" ! -d "$SUBNET.0/24" -j DROP 2>/dev/null
	rm -rf --one-file-system "$D"
}
trap cleanup EXIT

mkdir -p "$D"/{root,state,runc,certs.d,net.d,ipam,logs,bin}
xz -dc "$KIT/bin/cri-test-registry.xz" >"$D/bin/cri-test-registry"
chmod +x "$D/bin/cri-test-registry"
"$D/bin/cri-test-registry" -addr "$REGISTRY" -helpers "$KIT/helpers" -busybox-critest "$KIT/busybox-dyn" >"$D/logs/registry.log" 2>&1 &
RPID=$!
for _ in $(seq 100); do grep -q READY "$D/logs/registry.log" && break; kill -0 $RPID 2>/dev/null || break; sleep 0.1; done
grep -q READY "$D/logs/registry.log" || { echo "bench-containerd: the registry did not start: $(tail -2 "$D/logs/registry.log")" >&2; exit 2; }

for h in registry.k8s.io "$REGISTRY"; do
	mkdir -p "$D/certs.d/$h"
	printf 'server = "http://%s"\n\n[host."http://%s"]\n  capabilities = ["pull", "resolve"]\n' "$REGISTRY" "$REGISTRY" >"$D/certs.d/$h/hosts.toml"
done
cat >"$D/net.d/10-bench.conflist" <<JSON
{
  "cniVersion": "0.4.0",
  "name": "stagelet-bench-containerd",
  "plugins": [
    {"type": "bridge", "bridge": "$BRIDGE", "isGateway": true, "ipMasq": false, "hairpinMode": true,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": "$SUBNET.0/24", "gateway": "$SUBNET.1"}]], "dataDir": "$D/ipam"}},
    {"type": "portmap", "capabilities": {"portMappings": true}, "snat": true}
  ]
}
JSON
cat >"$D/config.toml" <<TOML
version = 2
root = "$D/root"
state = "$D/state"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.tracing.processor.v1.otlp"]
[grpc]
  address = "$D/containerd.sock"
[ttrpc]
  address = "$D/containerd.sock.ttrpc"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$REGISTRY/pause:3.9"
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "$D/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "$CNI_BIN"
    conf_dir = "$D/net.d"
    max_conf_num = 1
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = "$D/certs.d"
TOML
# The pods' subnet reaches only itself and the host.
iptables -I FORWARD -s "$SUBNET.0/24" ! -d "$SUBNET.0/24" -j DROP
setsid containerd --config "$D/config.toml" >"$D/logs/containerd.log" 2>&1 </dev/null &
CPID=$!
for _ in $(seq 200); do [ -S "$D/containerd.sock" ] && break; kill -0 $CPID 2>/dev/null || break; sleep 0.1; done
[ -S "$D/containerd.sock" ] || { echo "bench-containerd: containerd did not start: $(tail -5 "$D/logs/containerd.log")" >&2; exit 2; }

image="$REGISTRY/e2e-test-images/busybox:1.29-2"
if [ "${1:-}" = --beside ]; then
	shift
	go run ./cmd/stagelet-bench -beside "$D/containerd.sock" -beside-image "$image" "$@"
else
	go run ./cmd/stagelet-bench -endpoint "$D/containerd.sock" -image "$image" -podnet "$@"
fi
