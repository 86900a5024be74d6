#!/bin/sh
# Builds the node VM image that `make test-node` boots: a Debian 12 system
# as a Kubernetes node runs one — systemd as PID 1 on a pure cgroup v2
# hierarchy, AppArmor, with systemd-nspawn, the CNI plugins and iptables — as a raw
# ext4 disk image plus the Debian kernel and initramfs that boot it under
# qemu.
#
# Usage: scripts/node-image.sh [DIR]
#   DIR defaults to $STAGELET_NODE_IMAGE_DIR, else
#   /var/cache/stagelet-node/<key>, where <key> is a checksum of this
#   script (and, for the SELinux variant, of contrib/selinux): an image
#   is built once per version of its inputs and reused.
#   NODE_VARIANT=selinux builds the variant `make test-node-selinux` boots:
#   Debian's reference policy (selinux-policy-default) with stagelet's
#   module (contrib/selinux) installed, the tree labelled once, SELinux
#   enforcing from /etc/selinux/config; its kernel is booted with
#   security=selinux, and AppArmor is then off.
#   MIRROR overrides the Debian mirror (default http://deb.debian.org/debian).
# Prints the directory on its last line.
#
# The image holds no test and no stagelet binary: at boot the unit
# stagelet-node-run.service mounts the disk labelled "payload" (made by
# scripts/test-node.sh) read-only at /payload, runs /payload/run with its
# output on the serial console and powers the VM off, whatever the result;
# a disk without that label boots to a plain node.
#
# Needs root, debootstrap and e2fsprogs (mkfs.ext4 -d).
set -eu

self=$(readlink -f "$0")
top=$(dirname "$self")/..
variant=${NODE_VARIANT:-}
case $variant in
'') key=$(sha256sum "$self" | cut -c1-16) ;;
selinux) key=selinux-$(cat "$self" "$top"/contrib/selinux/* | sha256sum | cut -c1-16) ;;
*) echo "node-image: unknown NODE_VARIANT $variant (selinux or none)" >&2; exit 1 ;;
esac
cache=/var/cache/stagelet-node
dir=${1:-${STAGELET_NODE_IMAGE_DIR:-$cache/$key}}
mirror=${MIRROR:-http://deb.debian.org/debian}

if [ -f "$dir/.done" ]; then
	echo "$dir"
	exit 0
fi
if [ "$(id -u)" != 0 ]; then
	echo "node-image: needs root" >&2
	exit 1
fi
for tool in debootstrap mkfs.ext4; do
	command -v "$tool" >/dev/null 2>&1 || {
		echo "node-image: $tool is missing (scripts/install-deps.sh installs it)" >&2
		exit 1
	}
done

start=$(date +%s)
tmp="$dir.partial"
rm -rf --one-file-system "$tmp"
mkdir -p "$tmp"
tree="$tmp/tree"
trap 'rm -rf --one-file-system "$tmp"' EXIT

# What a node needs: systemd and D-Bus, the nspawn stage1, pod networking,
# and what the conformance kit's driver calls (python3, xz, busybox).
# criu: checkpoint/restore is tried on this kernel, not the host's.
# apparmor: Debian's kernel runs AppArmor, and the daemon loads its
# default container profile with apparmor_parser; critest loads its test
# profiles with sudo apparmor_parser.
# qemu-system-x86: the kvm stage1's pods, whose qemu is confined here
# (its SELinux domain, its AppArmor profile); their VMs run under TCG.
# containerd, runc and openjdk-17-jre-headless: the reference runtime the
# side-by-side test compares a container's view with, and the JVM that
# test runs (TestSeenAsUnderRunc, test/node).
# selinux: Debian's reference policy, its tools, auditd (the AVCs go to
# /var/log/audit) and what builds a policy module (selinux-policy-dev).
extra=
[ "$variant" != selinux ] || extra=,selinux-policy-default,selinux-utils,policycoreutils,auditd,selinux-policy-dev,make,m4,checkpolicy,semodule-utils
debootstrap --variant=minbase \
	--include=systemd,systemd-sysv,dbus,systemd-container,containernetworking-plugins,iptables,iproute2,kmod,linux-image-cloud-amd64,python3,xz-utils,busybox-static,procps,criu,apparmor,apparmor-utils,qemu-system-x86,sudo,containerd,runc,openjdk-17-jre-headless$extra \
	bookworm "$tree" "$mirror" >"$tmp/debootstrap.log" 2>&1 || {
	tail -20 "$tmp/debootstrap.log" >&2
	exit 1
}

echo stagelet-node >"$tree/etc/hostname"
printf '127.0.0.1 localhost\n127.0.1.1 stagelet-node\n' >"$tree/etc/hosts"
printf '/dev/vda / ext4 rw,relatime 0 1\n' >"$tree/etc/fstab"
: >"$tree/etc/machine-id" # transient, made at each boot
# A quick, quiet boot: no getty, no network configuration, no timers;
# no containerd (the side-by-side test starts a private one).
for u in getty@.service serial-getty@.service console-getty.service \
	systemd-networkd.service systemd-resolved.service systemd-timesyncd.service \
	apt-daily.timer apt-daily-upgrade.timer e2scrub_all.timer fstrim.timer \
	man-db.timer dpkg-db-backup.timer logrotate.timer \
	containerd.service; do
	ln -sf /dev/null "$tree/etc/systemd/system/$u"
done
mkdir -p "$tree/payload"
cat >"$tree/etc/systemd/system/stagelet-node-run.service" <<'UNIT'
[Unit]
Description=Run the payload disk's /payload/run, then power off
ConditionPathExists=/dev/disk/by-label/payload
After=multi-user.target
Requires=dev-disk-by\x2dlabel-payload.device
After=dev-disk-by\x2dlabel-payload.device

[Service]
Type=oneshot
ExecStartPre=/bin/mount -o ro /dev/disk/by-label/payload /payload
ExecStart=/payload/run
StandardOutput=journal+console
StandardError=journal+console
TimeoutStartSec=infinity
SuccessAction=poweroff-force
FailureAction=poweroff-force

[Install]
WantedBy=multi-user.target
UNIT
ln -sf /etc/systemd/system/stagelet-node-run.service \
	"$tree/etc/systemd/system/multi-user.target.wants/stagelet-node-run.service"

if [ "$variant" = selinux ]; then
	# stagelet's module, and the contexts go-selinux reads to label
	# containers (Debian's policy has no lxc_contexts), built and loaded
	# in the tree; then every file labelled as the policy says. The
	# tree is labelled last: setfiles labels what exists.
	mkdir -p "$tree/usr/share/stagelet/selinux"
	cp "$top"/contrib/selinux/stagelet.te "$top"/contrib/selinux/stagelet.fc "$top"/contrib/selinux/stagelet.if "$tree/usr/share/stagelet/selinux/"
	cp "$top"/contrib/selinux/lxc_contexts "$tree/etc/selinux/default/contexts/lxc_contexts"
	printf 'SELINUX=enforcing\nSELINUXTYPE=default\n' >"$tree/etc/selinux/config"
	mount -t proc proc "$tree/proc"
	trap 'umount "$tree/proc" 2>/dev/null; rm -rf --one-file-system "$tmp"' EXIT
	chroot "$tree" sh -ec 'cd /usr/share/stagelet/selinux && make -s -f /usr/share/selinux/devel/Makefile stagelet.pp && semodule -i stagelet.pp && rm -rf tmp' >"$tmp/selinux.log" 2>&1 || {
		cat "$tmp/selinux.log" >&2
		exit 1
	}
	chroot "$tree" setfiles -F /etc/selinux/default/contexts/files/file_contexts / >>"$tmp/selinux.log" 2>&1 || {
		tail -20 "$tmp/selinux.log" >&2
		exit 1
	}
	umount "$tree/proc"
	trap 'rm -rf --one-file-system "$tmp"' EXIT
fi

kernel=$(ls "$tree"/boot/vmlinuz-* | head -n1)
initrd=$(ls "$tree"/boot/initrd.img-* | head -n1)
[ -f "$kernel" ] && [ -f "$initrd" ] || {
	echo "node-image: no kernel or initramfs in the tree" >&2
	exit 1
}
cp "$kernel" "$tmp/vmlinuz"
cp "$initrd" "$tmp/initrd.img"
rm -rf "$tree"/var/cache/apt/archives/*.deb "$tree"/var/lib/apt/lists/*

# A sparse 4 GiB disk: pods' images, layers and logs go on it.
mkfs.ext4 -q -F -L node -d "$tree" "$tmp/root.img" 4G
rm -rf --one-file-system "$tree"
rm -f "$tmp/debootstrap.log"
date -u +%Y-%m-%dT%H:%M:%SZ >"$tmp/.done"
rm -rf --one-file-system "$dir"
mkdir -p "$(dirname "$dir")"
mv "$tmp" "$dir"
trap - EXIT
# Images of this variant built from older inputs are of no more use.
if [ "$(dirname "$dir")" = "$cache" ]; then
	for old in "$cache"/*; do
		name=$(basename "$old")
		[ "$old" != "$dir" ] && [ -f "$old/.done" ] || continue
		case $variant:$name in
		selinux:selinux-*) rm -rf --one-file-system "$old" ;;
		:selinux-*) ;;
		:*) rm -rf --one-file-system "$old" ;;
		esac
	done
fi
echo "node-image: built in $(($(date +%s) - start))s" >&2
echo "$dir"
