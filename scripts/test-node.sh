#!/bin/bash
# make test-node: stagelet on a node as Kubernetes nodes run it — systemd as
# PID 1, a pure cgroup v2 hierarchy — in a VM booted under qemu.
#
#   scripts/test-node.sh STAGELET_BINARY
#
# It builds (or reuses) the node image (scripts/node-image.sh) and a payload
# disk with the binary, the node tests (test/node, compiled static),
# contrib/systemd/stagelet.service, two versions of the Debian package
# (make deb), checkpointctl and the kubelet (../shared/k8s/build.sh, for
# the checkpoint tests) and, when ../shared/conformance exists, the CRI
# conformance kit. In the VM the node tests install and drive the
# service under both cgroup drivers, then critest runs against the nspawn
# stage1 with the systemd driver. critest also runs on this host first, and
# the two runs must fail the same specs. Everything it makes goes in one
# temporary directory, removed at the end, whatever happens.
#
# NODE_VARIANT=selinux (make test-node-selinux) boots the image's SELinux
# variant instead (scripts/node-image.sh), enforcing, where the node tests
# are TestSELinux and TestVMMConfined and critest then runs as it does
# elsewhere; any SELinux denial during its run fails it.
#
# GUEST names the kvm stage1's guest (make guest: bin/guest), which goes
# in the payload for TestVMMConfined (a VM pod, its qemu confined); that
# test skips without it.
#
# Environment: NODE_TIMEOUT (seconds the VM may run, default 2400),
# NODE_TESTS (a -test.run pattern for the node tests; critest runs only
# when it is unset),
# NODE_MEMORY (MiB, default 3072), NODE_ACCEL (qemu accelerator, default
# tcg: KVM does not work on every machine this runs on), REGISTRY (critest's registry on this
# host, default 127.0.0.1:5055).
set -euo pipefail

BIN=${1:?usage: scripts/test-node.sh STAGELET_BINARY}
BIN=$(readlink -f "$BIN")
top=$(cd "$(dirname "$0")/.." && pwd)
kit=$(readlink -f "$top/../shared/conformance" 2>/dev/null || true)
timeout_s=${NODE_TIMEOUT:-2400}
tests=${NODE_TESTS:-}
[ -z "$tests" ] || kit=
variant=${NODE_VARIANT:-}
pattern=${tests:-.}
# The node has no KVM: under TCG qemu's "max" CPU offers AMD's SVM, so the
# node's kernel would load kvm_amd and have a /dev/kvm; every daemon with
# the kvm guest installed (the Debian package's service) then probes KVM,
# booting a guest on TCG's emulation of SVM, and that once held one of the
# node's CPUs in qemu's KVM_RUN until the VM's timeout (a soft lockup, in
# CI). A node is tested as one without nested virtualization. (Turning
# the CPU's svm off instead breaks the initramfs's programs.)
cmdline="root=/dev/vda rw console=ttyS0 systemd.unified_cgroup_hierarchy=1 quiet module_blacklist=kvm_amd,kvm_intel,kvm"
case $variant in
'') ;;
selinux)
	pattern=${tests:-TestSELinux|TestVMMConfined}
	# SELinux instead of AppArmor, enforcing from the first process on.
	cmdline="$cmdline security=selinux enforcing=1"
	;;
*) echo "test-node: unknown NODE_VARIANT $variant (selinux or none)" >&2; exit 1 ;;
esac
mem=${NODE_MEMORY:-3072}

[ "$(id -u)" = 0 ] || { echo "test-node: needs root" >&2; exit 1; }
command -v qemu-system-x86_64 >/dev/null || { echo "test-node: needs qemu-system-x86_64" >&2; exit 1; }

W=$(mktemp -d /var/tmp/stagelet-node.XXXXXX)
QPID=
cleanup() {
	if [ -n "$QPID" ] && kill -0 "$QPID" 2>/dev/null; then
		kill "$QPID" 2>/dev/null || true
		wait "$QPID" 2>/dev/null || true
	fi
	rm -rf --one-file-system "$W"
}
trap cleanup EXIT
t0=$(date +%s)

img=$(NODE_VARIANT=$variant "$top/scripts/node-image.sh" | tail -n1)
echo "test-node: node image $img ($(($(date +%s) - t0))s)"

P=$W/payload
mkdir -p "$P"
cp "$BIN" "$P/stagelet"
cp "$top/contrib/systemd/stagelet.service" "$P/stagelet.service"
(cd "$top" && CGO_ENABLED=0 go test -c -o "$P/node.test" ./test/node)
# checkpointctl, which CRI-O's and containerd's users read checkpoint
# archives with: TestCheckpointContainer reads stagelet's with it. Built
# static from the module proxy (cached by go), only for that test.
if printf 'TestCheckpointContainer\nTestKubeletCheckpoint\n' | grep -Eq -- "$pattern"; then
	CGO_ENABLED=0 GOBIN="$P" go install github.com/checkpoint-restore/checkpointctl@v1.4.0 ||
		echo "test-node: checkpointctl could not be built: TestCheckpointContainer will say so"
fi
# The kubelet (Kubernetes v1.34.12, built once by ../shared/k8s/build.sh
# and cached in /var/cache): TestKubeletCheckpoint runs it standalone.
if printf 'TestKubeletCheckpoint\n' | grep -Eq -- "$pattern"; then
	if [ -x "$top/../shared/k8s/build.sh" ] && kbin=$("$top/../shared/k8s/build.sh" kubelet | tail -n1) && [ -x "$kbin/kubelet" ]; then
		cp "$kbin/kubelet" "$P/kubelet"
	else
		echo "test-node: the kubelet could not be built: TestKubeletCheckpoint will say so"
	fi
fi
# Two Debian packages of this tree (make deb), the second a higher
# version, for the package's install, upgrade and purge
# (TestDebianPackage): each with a binary of its own version, so that the
# upgrade shows in the daemon's version. About a minute: not built when
# NODE_TESTS leaves that test out.
if printf 'TestDebianPackage\n' | grep -Eq -- "$pattern"; then
	for n in 1 2; do
		make -s -C "$top" deb BIN="$W/deb$n/stagelet" VERSION="0.1.0+node.$n" \
			DEB_VERSION="0.1.0~node$n" DEB_DIR="$P" >/dev/null
	done
fi
if [ -n "${GUEST:-}" ] && printf 'TestVMMConfined\n' | grep -Eq -- "$pattern"; then
	mkdir -p "$P/guest"
	cp "$GUEST/vmlinux" "$GUEST/initrd.cpio" "$GUEST/manifest" "$P/guest/"
fi
# The node e2e kit's containerd-up.sh and containerd-down.sh: the
# reference runtime TestSeenAsUnderRunc compares with.
if [ -f "$top/../shared/nodee2e/containerd-up.sh" ]; then
	mkdir -p "$P/nodee2e"
	cp "$top/../shared/nodee2e/containerd-up.sh" "$top/../shared/nodee2e/containerd-down.sh" "$P/nodee2e/"
fi
if [ -n "$kit" ] && [ -x "$kit/critest.sh" ]; then
	cp -r "$kit" "$P/conformance"
elif [ -n "$tests" ]; then
	echo "test-node: NODE_TESTS is set: critest is not run"
else
	echo "test-node: ../shared/conformance is missing: critest is not run"
fi
printf '%s\n' "$pattern" >"$P/tests"
printf '%s\n' "$variant" >"$P/variant"
cat >"$P/run" <<'RUN'
#!/bin/sh
# Runs inside the node VM (stagelet-node-run.service), then the VM powers off.
P=/payload
echo "node: kernel $(uname -r), $(systemctl --version | head -n1), /sys/fs/cgroup is $(stat -fc %T /sys/fs/cgroup)"
rc=0
selinux=
if [ "$(cat $P/variant)" = selinux ]; then
	selinux=1
	echo "node: SELinux $(getenforce), policy $(sed -n 's/^SELINUXTYPE=//p' /etc/selinux/config)"
fi
cp $P/stagelet /usr/local/bin/stagelet && /usr/local/bin/stagelet cni init --subnet 10.88.0.0/16 || rc=1
cd /tmp
if [ $rc = 0 ]; then
	STAGELET_NODE_TEST=1 STAGELET_NODE_SELINUX=$selinux STAGELET_BIN=$P/stagelet STAGELET_UNIT=$P/stagelet.service STAGELET_CHECKPOINTCTL=$P/checkpointctl STAGELET_KUBELET=$P/kubelet \
		STAGELET_GUEST=$([ -d $P/guest ] && echo $P/guest) STAGELET_NODEE2E_KIT=$([ -d $P/nodee2e ] && echo $P/nodee2e) \
		STAGELET_DEB_A=$P/stagelet_0.1.0~node1_amd64.deb STAGELET_DEB_B=$P/stagelet_0.1.0~node2_amd64.deb \
		$P/node.test -test.v -test.timeout 20m -test.run "$(cat $P/tests)" || rc=1
fi
R=/var/tmp/node-result
mkdir -p $R
if [ $rc = 0 ] && [ -x $P/conformance/critest.sh ]; then
	mkdir -p /var/tmp/critest
	seen=$(cat /var/log/audit/audit.log 2>/dev/null | wc -l)
	TMPDIR=/var/tmp/critest OUT=$R CONFIG_EXTRA="cgroup_driver: systemd" \
		$P/conformance/critest.sh /usr/local/bin/stagelet | tee $R/critest.out
	if [ -n "$selinux" ]; then
		# Every SELinux denial while critest ran: there must be none.
		tail -n +$((seen + 1)) /var/log/audit/audit.log | grep 'avc:  denied' >$R/critest-avc || true
		echo "critest-avc: $(wc -l <$R/critest-avc) SELinux denials while critest ran"
	fi
fi
if [ -n "$selinux" ]; then
	cp /var/log/audit/audit.log $R/audit.log 2>/dev/null
	[ $rc = 0 ] || { echo "node: the last SELinux denials:"; grep 'avc:  denied' /var/log/audit/audit.log | tail -n 40; }
fi
echo "STAGELET-NODE-RESULT rc=$rc"
# The result goes to the host on a disk of its own, as a tar stream: the
# console goes through the journal, which may not have written its last
# lines when the VM powers off.
echo "rc=$rc" >$R/result
tar -C $R -cf /dev/disk/by-id/virtio-result . && sync
# Off at once: the root disk is a throw-away snapshot, and a clean
# shutdown could wait on what a failed test left running.
echo o >/proc/sysrq-trigger
RUN
chmod +x "$P/run"
if [ "$variant" = selinux ]; then
	# The payload's files carry a label (mkfs.ext4 -d keeps extended
	# attributes): commands, bin_t, which the run script starts as any
	# service's does. Set here as plain attributes; this host need not
	# run SELinux.
	python3 -c 'import os, sys
for d, ds, fs in os.walk(sys.argv[1]):
    for n in [d] + [os.path.join(d, f) for f in fs]:
        if not os.path.islink(n):
            os.setxattr(n, "security.selinux", b"system_u:object_r:bin_t:s0\0")' "$P"
fi
size=$(( $(du -sm "$P" | cut -f1) + 64 ))
mkfs.ext4 -q -F -L payload -d "$P" "$W/payload.img" "${size}M" >/dev/null
truncate -s 256M "$W/result.img"

# critest on this host first: the VM's run must fail the same specs.
host_fails=$W/host-fails
if [ -d "$P/conformance" ]; then
	mkdir -p "$W/ct"
	echo "test-node: critest on this host"
	TMPDIR=$W/ct REGISTRY=${REGISTRY:-127.0.0.1:5055} "$kit/critest.sh" "$BIN" | tee "$W/host-critest" || true
	grep '^\[FAIL\]' "$W/host-critest" | sort -u >"$host_fails" || true
	# In the SELinux variant some specs fail by design, and some
	# denials are what a spec asks for: scripts/node-selinux-expected
	# names each, with why.
	if [ "$variant" = selinux ]; then
		sed -n 's/^FAIL //p' "$top/scripts/node-selinux-expected" | sed 's/^/[FAIL] /' | sort -u - "$host_fails" >"$W/fails"
		mv "$W/fails" "$host_fails"
	fi
fi

# The result disk sits in a PCI slot after the others, so that the root
# disk stays /dev/vda. AppArmor is on in the VM, as Debian ships it: there
# critest runs its AppArmor specs, which it skips on a host without it,
# so the two runs still fail the same specs.
accel=${NODE_ACCEL:-tcg}
echo "test-node: booting the node VM (accel $accel)"
tb=$(date +%s)
TMPDIR=$W timeout "$timeout_s" qemu-system-x86_64 \
	-M q35 -accel "$accel" -cpu max -smp 2 -m "$mem" \
	-nographic -no-reboot -monitor none -nic none \
	-kernel "$img/vmlinuz" -initrd "$img/initrd.img" \
	-append "$cmdline" \
	-drive "file=$img/root.img,if=virtio,format=raw,snapshot=on" \
	-drive "file=$W/payload.img,if=virtio,format=raw,readonly=on" \
	-drive "file=$W/result.img,if=none,id=result,format=raw" \
	-device virtio-blk-pci,drive=result,serial=result,addr=0x10 \
	-serial "file:$W/console.log" >"$W/qemu.log" 2>&1 &
QPID=$!
# The console as it comes, without the journal's prefixes.
touch "$W/console.log"
tail -n +1 -f --pid=$QPID "$W/console.log" | sed -u 's/^\[ *[0-9.]*\] [a-z.-]*\[[0-9]*\]: //'
wait $QPID && qrc=0 || qrc=$?
QPID=
[ $qrc = 0 ] || { echo "test-node: qemu ended with status $qrc (124: the VM ran longer than ${timeout_s}s)"; cat "$W/qemu.log"; }
clean=$W/console.txt
sed 's/^\[ *[0-9.]*\] [a-z.-]*\[[0-9]*\]: //' "$W/console.log" | tr -d '\r' >"$clean"
boot=$(grep -ao '\[ *[0-9.]*\] [a-z.-]*\[[0-9]*\]: node: kernel' "$W/console.log" | head -n1 | sed 's/^\[ *\([0-9.]*\)\].*/\1/')
echo "test-node: the payload started ${boot}s after the kernel; the VM ran $(($(date +%s) - tb))s"

rc=1
V=$W/vm
mkdir -p "$V"
if ! tar -C "$V" -xf "$W/result.img" 2>/dev/null || [ ! -f "$V/result" ]; then
	echo "test-node: the VM left no result"
elif [ "$(cat "$V/result")" = rc=0 ]; then
	rc=0
fi
if [ $rc = 0 ] && [ -f "$host_fails" ]; then
	grep '^\[FAIL\]' "$V/critest.out" 2>/dev/null | sort -u >"$W/vm-fails" || true
	: >"$W/avc-unexpected"
	if [ -f "$V/critest-avc" ]; then
		sed -n 's/^AVC //p' "$top/scripts/node-selinux-expected" >"$W/avc-expected"
		grep -Evf "$W/avc-expected" "$V/critest-avc" >"$W/avc-unexpected" || true
	fi
	if ! grep -q '^critest: ' "$V/critest.out" 2>/dev/null; then
		echo "test-node: critest printed no summary in the VM"
		rc=1
	elif [ -s "$W/avc-unexpected" ]; then
		echo "test-node: SELinux denied $(wc -l <"$W/avc-unexpected") accesses while critest ran that scripts/node-selinux-expected does not name; one of each:"
		sed -E 's/^.*avc: +denied +//; s/ (pid|ino)=[0-9]+//g; s/path="[^"]*"/path=…/; s/name="[0-9]+"/name=PID/' "$W/avc-unexpected" | sort | uniq -c | sort -rn | sed -n 1,40p
		grep '^\[FAIL\]' "$V/critest.out" 2>/dev/null | sort -u
		rc=1
	elif ! diff -u --label host "$host_fails" --label vm "$W/vm-fails"; then
		echo "test-node: critest failed different specs in the VM than on this host; what failed in the VM:"
		grep -A12 '\[FAILED\]' "$V/critest.log" | sed -n 1,200p
		echo "the daemon's last lines in the VM:"
		tail -n 40 "$V/daemon.log"
		rc=1
	else
		echo "test-node: critest in the VM: $(grep -m1 '^critest: ' "$V/critest.out" | cut -d' ' -f2-); on this host: $(grep -m1 '^critest: ' "$W/host-critest" | cut -d' ' -f2-); the same specs fail$([ "$variant" != selinux ] || echo ", besides scripts/node-selinux-expected's; SELinux denials while critest ran: $(wc -l <"$V/critest-avc"), each one it names")"
	fi
fi
echo "test-node: $([ $rc = 0 ] && echo passed || echo FAILED) in $(($(date +%s) - t0))s"
exit $rc
