#!/bin/bash
# The kubelet's node conformance suite (test/e2e_node of Kubernetes
# v1.34.12, focused on [NodeConformance]) against a stagelet binary, once
# per stage1, offline, with the kit in ../shared/nodee2e: the kit builds the
# kubelet, e2e_node.test, ginkgo and the test images (cached in
# /var/cache), serves the images on 127.0.0.1:5059 and runs the suite in
# its services mode (etcd, the API server and the kubelet started by the
# suite itself, the kubelet pointed at stagelet's socket).
#
#   scripts/node-e2e.sh [BINARY]        (default bin/stagelet)
#
# For each stage1 it starts `stagelet serve` on its own temporary
# directories with a node config that makes that stage1 the default and
# the RuntimeClass handler the suite uses (test-handler): a policy that
# puts every pod on it, or with POLICY=default the embedded default
# policy with that stage1 as its default_stage1 (pods the stage1 cannot
# run, hostNetwork ones on kvm, go where that policy sends them; the
# run's expectations are those of STAGE1/default in the list), a bridge network
# of its own (bridge stne2e0, 10.246.0.0/24, addresses kept in the run's
# directory), and the kit's registry marked insecure. Every pod is removed
# before the daemon stops, then everything the run made. The run fails
# when a spec fails that test/node-e2e/expected-failures.txt does not list
# for that stage1, or passes that it lists (unless marked may-pass:
# scripts/expected-failures.py).
#
# Environment: KIT (default ../shared/nodee2e; without it the suite is
# skipped, saying so), STAGE1S (default "nspawn fly kvm"), GUEST (the kvm
# guest, default bin/guest), NODES (parallel ginkgo processes, default 6,
# and 4 for kvm: with 6 at once, VMs under TCG on 2 cores miss the
# specs' own time bounds now and then, an exec probe's 1 s or a
# container's first lines before its SIGTERM trap; one spec of 236 in
# each of two runs of the embedded policy on kvm, none with 4),
# SERIAL=1 (the [Serial] specs of [NodeConformance] instead, one at a
# time), POLICY (default: see above), FOCUS and SKIP (passed to the
# kit's run.sh), KEEP (a directory to keep each run's logs in; without it
# a failed run prints what failed).
set -u
cd "$(dirname "$0")/.."
BIN=${1:-bin/stagelet}
KIT=${KIT:-../shared/nodee2e}
STAGE1S=${STAGE1S:-nspawn fly kvm}
GUEST=${GUEST:-bin/guest}
LIST=test/node-e2e/expected-failures.txt
BRIDGE=stne2e0
SUBNET=10.246.0.0/24

if [ ! -x "$KIT/run.sh" ]; then
	echo "node-e2e: no node e2e kit at $KIT (run.sh): the node conformance suite is skipped"
	exit 0
fi
[ "$(id -u)" = 0 ] || { echo "node-e2e: needs root" >&2; exit 2; }
[ -x "$BIN" ] || { echo "node-e2e: $BIN is not built (make build)" >&2; exit 2; }
BIN=$(readlink -f "$BIN")
KIT=$(readlink -f "$KIT")

if [ "${SERIAL:-0}" = 1 ]; then
	# The kit's run.sh focuses on [NodeConformance] and skips [Serial]
	# by default: here only the serial ones, one process.
	export FOCUS=${FOCUS:-'\[NodeConformance\].*\[Serial\]|\[Serial\].*\[NodeConformance\]'}
	export SKIP=${SKIP:-'\[Flaky\]'}
	export NODES=1
else
	nodes=${NODES:-}
fi

echo "node-e2e: building the kit (cached after the first time: the Kubernetes binaries take 15-40 minutes cold)"
H=$("$KIT/build.sh" | tail -n1) || { echo "node-e2e: the kit's build.sh failed" >&2; exit 2; }
export NODEE2E_CACHE=$H
CRICTL=$H/bin/crictl

T=
DPID=
# The suite's hostPath and device plugin specs write beneath /tmp by fixed
# names (the kubelet and the pods make them, not stagelet), and the suite
# leaves its Go test temporary directory there: what a run made there under
# those names, and was not there before, is removed after it.
tmp_before=
suite_ran=
clean_tmp() {
	local f
	[ -n "$suite_ran" ] || return 0
	suite_ran=
	for f in /tmp/sub-path /tmp/test-file /tmp/device-plugin-failures-* /tmp/TestE2eNode*; do
		[ -e "$f" ] || continue
		printf '%s\n' "$tmp_before" | grep -qxF "$f" && continue
		mountpoint -q "$f" && continue
		rm -rf --one-file-system "$f"
	done
}
KPID=
# stop_suite ends an interrupted suite: the kit's run.sh (its own session,
# so the group holds ginkgo, the suite and the kubelet it started) gets
# TERM and a minute to clean up after itself, then what is left of the
# group, and any process still naming the suite's directory, gets KILL.
stop_suite() {
	[ -n "$KPID" ] || return 0
	if kill -0 "$KPID" 2>/dev/null; then
		echo "node-e2e: stopping the suite (pid $KPID)" >&2
		kill -TERM -- "-$KPID" 2>/dev/null
		for _ in $(seq 600); do
			kill -0 "$KPID" 2>/dev/null || break
			sleep 0.1
		done
		kill -KILL -- "-$KPID" 2>/dev/null
	fi
	local p
	for p in $(pgrep -f -- "$T/out/suite"); do
		kill -KILL "$p" 2>/dev/null
	done
	KPID=
}
stop_run() {
	[ -n "$T" ] || return 0
	stop_suite
	if [ -n "$DPID" ] && kill -0 "$DPID" 2>/dev/null; then
		# Pods outlive the daemon by design: remove them first.
		local c="$CRICTL --config /dev/null --runtime-endpoint unix://$T/run/stagelet.sock --timeout 120s"
		local pods
		pods=$($c pods -q 2>/dev/null)
		if [ -n "$pods" ]; then
			# shellcheck disable=SC2086
			$c stopp $pods >/dev/null 2>&1
			# shellcheck disable=SC2086
			$c rmp -f $pods >/dev/null 2>&1
		fi
		kill "$DPID" 2>/dev/null
		wait "$DPID" 2>/dev/null
	fi
	DPID=
	clean_tmp
	# Unmount what is left beneath the run's directory (deepest first),
	# then remove it: never through a mount.
	awk -v t="$T" 'index($5, t "/") == 1 {print $5}' /proc/self/mountinfo | sort -r |
		while read -r m; do umount "$m" 2>/dev/null || umount -l "$m"; done
	ip link del "$BRIDGE" 2>/dev/null
	if awk -v t="$T" 'index($5, t "/") == 1 {found=1} END {exit !found}' /proc/self/mountinfo; then
		echo "node-e2e: mounts remain beneath $T: left in place" >&2
	else
		rm -rf --one-file-system "$T"
	fi
	T=
}
trap stop_run EXIT
trap 'exit 130' INT TERM

rc=0
summary=()
for s in $STAGE1S; do
	case $s in
	nspawn | fly) ;;
	kvm)
		[ -f "$GUEST/vmlinux" ] || { echo "node-e2e: kvm: no guest at $GUEST (make guest)" >&2; rc=1; continue; }
		;;
	*) echo "node-e2e: unknown stage1 $s" >&2; rc=1; continue ;;
	esac
	run=$s
	case ${POLICY:-} in
	"") ;;
	default) run=$s/default ;;
	*) echo "node-e2e: POLICY=$POLICY: want default or nothing" >&2; exit 2 ;;
	esac
	if [ "${SERIAL:-0}" != 1 ]; then
		case $s in
		kvm) export NODES=${nodes:-4} ;;
		*) export NODES=${nodes:-6} ;;
		esac
	fi
	T=$(mktemp -d /var/tmp/stagelet-ne2e.XXXXXX)
	mkdir -p "$T/cni" "$T/out"
	cat >"$T/cni/10-node-e2e.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "stagelet-node-e2e",
  "plugins": [
    {"type": "bridge", "bridge": "$BRIDGE", "isGateway": true, "ipMasq": true, "hairpinMode": true,
     "ipam": {"type": "host-local", "dataDir": "$T/ipam", "ranges": [[{"subnet": "$SUBNET"}]],
              "routes": [{"dst": "0.0.0.0/0"}]}},
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
EOF
	{
		echo "registries:"
		echo "  127.0.0.1:5059: {insecure: true}"
		echo "cni: {conf_dir: \"$T/cni\"}"
		[ "$s" = kvm ] && echo "kvm: {assets_dir: \"$(readlink -f "$GUEST")\"}"
		if [ "$run" != "$s" ]; then
			# The embedded default policy, the stage1 under test its
			# default and the suite's handler.
			"$BIN" policy default | sed -e "s/^default_stage1: nspawn\$/default_stage1: $s/" \
				-e "s/^handlers:\$/handlers:\n  test-handler: {stage1: $s}/" >"$T/policy.yaml"
			if ! grep -qx "default_stage1: $s" "$T/policy.yaml" || ! grep -qx "  test-handler: {stage1: $s}" "$T/policy.yaml"; then
				echo "node-e2e $run: the embedded default policy has no default_stage1 or handlers to set" >&2
				exit 2
			fi
			echo "policy_file: \"$T/policy.yaml\""
		else
			# The stage1 under test for every pod: the default, and the
			# handler the suite's RuntimeClass specs name. nspawn runs as
			# the embedded default policy ships it (a hostPID or hostIPC
			# pod falls back to fly); fly and kvm take every pod and
			# refuse what they cannot give, so those specs fail by design.
			cat <<EOF
policy:
  version: 1
  default_stage1: $s
  handlers:
    test-handler: {stage1: $s}
    nspawn: {stage1: nspawn}
    kvm: {stage1: kvm}
    fly: {stage1: fly}
  conflicts:
EOF
			for need in host_network host_pid host_ipc user_namespace; do
				case $s:$need in
				nspawn:host_pid | nspawn:host_ipc) echo "    $need: {fallback: fly}" ;;
				*) echo "    $need: {refuse: \"$s cannot give a pod $need\"}" ;;
				esac
			done
		fi
	} >"$T/config.yaml"
	"$BIN" serve --socket "$T/run/stagelet.sock" --state-dir "$T/state" --run-dir "$T/run" \
		--config "$T/config.yaml" >"$T/out/daemon.log" 2>&1 &
	DPID=$!
	for _ in $(seq 300); do
		[ -S "$T/run/stagelet.sock" ] && "$CRICTL" --config /dev/null --runtime-endpoint "unix://$T/run/stagelet.sock" version >/dev/null 2>&1 && break
		kill -0 "$DPID" 2>/dev/null || break
		sleep 0.1
	done
	if ! [ -S "$T/run/stagelet.sock" ]; then
		echo "node-e2e $s: stagelet serve did not start: $(tail -3 "$T/out/daemon.log")" >&2
		rc=1
		stop_run
		continue
	fi
	start=$(date +%s)
	tmp_before=$(find /tmp -mindepth 1 -maxdepth 1)
	suite_ran=1
	setsid "$KIT/run.sh" "$T/run/stagelet.sock" "$T/out/suite" >"$T/out/run.log" 2>&1 &
	KPID=$!
	wait "$KPID"
	KPID=
	took=$(($(date +%s) - start))
	line=$(tail -n1 "$T/out/run.log")
	echo "node-e2e $run: $line (${took}s)"
	summary+=("$run: $line (${took}s)")
	if [ ! -s "$T/out/suite/report.json" ]; then
		tail -20 "$T/out/run.log" >&2
		rc=1
	elif ! python3 scripts/expected-failures.py "$LIST" "$run" "$T/out/suite/report.json" "node-e2e $run"; then
		rc=1
		grep -A3 '^- ' "$T/out/suite/summary.txt" | head -n 120
	fi
	if [ -n "${KEEP:-}" ]; then
		dest=$KEEP/node-e2e-${run//\//-}-$(date +%Y%m%d-%H%M%S)
		mkdir -p "$dest" && cp -r "$T/out/." "$dest/" && echo "node-e2e $run: logs in $dest"
	fi
	stop_run
done
echo "node-e2e summary:"
printf '  %s\n' "${summary[@]}"
exit $rc
