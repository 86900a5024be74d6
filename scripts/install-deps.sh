#!/bin/sh
# Installs the Debian packages stagelet needs to run and to be built, if
# missing; what only the tests use is scripts/install-test-deps.sh's.
# Safe to run repeatedly; does nothing when everything is present.
set -eu

need=""
# Test images are built from Debian's static busybox.
command -v busybox >/dev/null 2>&1 || [ -x /bin/busybox ] || need="$need busybox-static"
# The nspawn stage1.
command -v systemd-nspawn >/dev/null 2>&1 || need="$need systemd-container"
# Pod networking: the CNI plugins, and the tools they call.
[ -x /usr/lib/cni/bridge ] || [ -x /opt/cni/bin/bridge ] || need="$need containernetworking-plugins"
command -v iptables >/dev/null 2>&1 || need="$need iptables"
command -v ip >/dev/null 2>&1 || need="$need iproute2"
command -v mount >/dev/null 2>&1 || need="$need mount"
# The kvm stage1: qemu, the tools guest/build.sh makes the initramfs and
# unpacks a Debian kernel package with, and what guest/build-kernel.sh
# builds the guest kernel with.
command -v qemu-system-x86_64 >/dev/null 2>&1 || need="$need qemu-system-x86"
for t in cpio lz4 xz:xz-utils zstd make flex bison bc flock:util-linux; do
	cmd=${t%%:*} pkg=${t#*:}
	command -v "$cmd" >/dev/null 2>&1 || need="$need $pkg"
done
[ -f /usr/include/libelf.h ] || need="$need libelf-dev"
# kvm pods' container images become read-only erofs disk images.
command -v mkfs.erofs >/dev/null 2>&1 || need="$need erofs-utils"
# make conformance: the kit's critest.sh and the expectations check.
command -v python3 >/dev/null 2>&1 || need="$need python3"
# make race: the race detector's runtime is linked with cgo.
command -v gcc >/dev/null 2>&1 || need="$need gcc libc6-dev"
# The node VM image (mkfs.ext4 -d) and the systemd launcher test bed.
command -v mkfs.ext4 >/dev/null 2>&1 || need="$need e2fsprogs"
command -v debootstrap >/dev/null 2>&1 || need="$need debootstrap"
# The default AppArmor profile's compile test (apparmor_parser -Q).
command -v apparmor_parser >/dev/null 2>&1 || [ -x /usr/sbin/apparmor_parser ] || need="$need apparmor"
# What scripts/build-criu.sh builds criu with.
command -v protoc-c >/dev/null 2>&1 || need="$need protobuf-c-compiler"
command -v pkg-config >/dev/null 2>&1 || need="$need pkgconf"
command -v patch >/dev/null 2>&1 || need="$need patch"
[ -f /usr/share/keyrings/debian-archive-trixie-stable.gpg ] || need="$need debian-archive-keyring"
for t in protobuf-c/protobuf-c.h:libprotobuf-c-dev google/protobuf/descriptor.proto:libprotobuf-dev \
	libnl3/netlink/netlink.h:libnl-3-dev libnet.h:libnet1-dev sys/capability.h:libcap-dev \
	bsd/string.h:libbsd-dev nftables/libnftables.h:libnftables-dev gnutls/gnutls.h:libgnutls28-dev \
	uuid/uuid.h:uuid-dev; do
	[ -f "/usr/include/${t%%:*}" ] || need="$need ${t#*:}"
done

if [ -n "$need" ]; then
	if [ "$(id -u)" != 0 ]; then
		echo "install-deps: need root to install:$need" >&2
		exit 1
	fi
	echo "install-deps: installing$need"
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -qq
	# shellcheck disable=SC2086
	apt-get install -y -qq --no-install-recommends $need
fi

# Checkpoints need a criu that works on this kernel: the packaged one when
# its `criu check` passes, else criu built from Debian 13's source
# (scripts/build-criu.sh, cached in /var/cache/stagelet-criu) into
# /usr/local/sbin, where stagelet looks first.
criu_works() {
	for c in /usr/local/sbin/criu "$(command -v criu 2>/dev/null || true)"; do
		[ -n "$c" ] && [ -x "$c" ] && "$c" check >/dev/null 2>&1 && return 0
	done
	return 1
}
if ! criu_works; then
	if [ "$(id -u)" != 0 ]; then
		echo "install-deps: no criu works on this kernel, and building one (scripts/build-criu.sh) needs root" >&2
		exit 1
	fi
	"$(dirname "$0")/build-criu.sh" >/dev/null
fi
