#!/bin/bash
# The CRI conformance suite (critest, run by ../shared/conformance/critest.sh)
# against a stagelet binary, once per stage1: the node default (nspawn),
# fly (a node policy that allows the fly handler in critest's namespaces)
# and kvm (HANDLER=kvm with the guest built beside the binary). It prints
# each run's summary line and time, and fails when a spec fails that
# test/conformance/expected-failures.txt does not list for that stage1, or
# passes that it lists (unless marked may-pass: scripts/expected-failures.py).
#
#   scripts/conformance.sh [BINARY]        (default bin/stagelet)
#
# Environment: KIT (the conformance kit, default ../shared/conformance),
# REGISTRY (the kit's registry address, default 127.0.0.1:5055), GUEST (the
# kvm guest, default bin/guest), STAGE1S (default "nspawn fly kvm"),
# POD_SUBNET (for the CNI configuration installed when the node has none),
# KEEP (a directory to keep each run's critest.log, junit.xml and
# daemon.log in; without it a failed run prints what failed and nothing is
# kept).
set -u
cd "$(dirname "$0")/.."
BIN=${1:-bin/stagelet}
KIT=${KIT:-../shared/conformance}
REGISTRY=${REGISTRY:-127.0.0.1:5055}
GUEST=${GUEST:-bin/guest}
STAGE1S=${STAGE1S:-nspawn fly kvm}
LIST=test/conformance/expected-failures.txt

if [ ! -x "$KIT/critest.sh" ]; then
	echo "conformance: no conformance kit at $KIT (critest.sh): the CRI conformance suite is skipped"
	exit 0
fi
[ "$(id -u)" = 0 ] || { echo "conformance: needs root" >&2; exit 2; }
[ -x "$BIN" ] || { echo "conformance: $BIN is not built (make build)" >&2; exit 2; }
BIN=$(cd "$(dirname "$BIN")" && pwd)/$(basename "$BIN")
# Without a CNI configuration the runtime reports NetworkReady=false and
# nearly every spec fails; `cni init` leaves an existing one alone.
"$BIN" cni init --subnet "${POD_SUBNET:-10.88.0.0/16}" >/dev/null || exit 2

# critest leaves podLogTest* and test<hash> directories in $TMPDIR: each
# run gets its own, removed afterwards.
work=$(mktemp -d /tmp/conformance.XXXXXX)
cleanup() {
	# A failed spec can leave its test mounts behind (critest unmounts in
	# its own cleanup, which stops at the first error): unmount, deepest
	# first, before removing anything.
	awk -v w="$work" '$5 == w || index($5, w "/") == 1 {print $5}' /proc/self/mountinfo | sort -r |
		while read -r m; do umount -l "$m" 2>/dev/null; done
	rm -rf "$work"
}
trap cleanup EXIT

rc=0
summary=()
for s in $STAGE1S; do
	env=()
	case $s in
	nspawn) ;; # the node default
	fly)
		env=(HANDLER=fly "CONFIG_EXTRA=policy:
  version: 1
  default_stage1: nspawn
  handlers:
    fly: {stage1: fly, namespaces: [\"cri-test-namespace*\"]}")
		;;
	kvm)
		[ -f "$GUEST/vmlinux" ] || { echo "conformance: kvm: no guest at $GUEST (make guest)" >&2; rc=1; continue; }
		env=(HANDLER=kvm "GUEST=$(cd "$GUEST" && pwd)")
		;;
	*) echo "conformance: unknown stage1 $s" >&2; rc=1; continue ;;
	esac
	mkdir -p "$work/$s/tmp"
	start=$(date +%s)
	env "${env[@]}" TMPDIR="$work/$s/tmp" OUT="$work/$s/out" REGISTRY="$REGISTRY" \
		"$KIT/critest.sh" "$BIN" >"$work/$s/summary" 2>&1
	took=$(($(date +%s) - start))
	line=$(grep '^critest: ' "$work/$s/summary" || echo "critest: did not run ($(tail -1 "$work/$s/summary"))")
	echo "conformance $s: $line (${took}s)"
	summary+=("$s: $line (${took}s)")
	if [ ! -s "$work/$s/out/junit.xml" ]; then
		cat "$work/$s/summary" >&2
		rc=1
	elif ! python3 scripts/expected-failures.py "$LIST" "$s" "$work/$s/out/junit.xml"; then
		rc=1
	fi
	if [ "$rc" != 0 ] && [ -f "$work/$s/out/critest.log" ]; then
		echo "conformance $s: what failed (critest.log):"
		grep -A14 '\[FAILED\]' "$work/$s/out/critest.log" | head -n 150
	fi
	if [ -n "${KEEP:-}" ]; then
		dest=$KEEP/conformance-$s-$(date +%Y%m%d-%H%M%S)
		mkdir -p "$dest" && cp -r "$work/$s/out/." "$dest/" && echo "conformance $s: logs in $dest"
	fi
done
echo "conformance summary:"
printf '  %s\n' "${summary[@]}"
exit $rc
