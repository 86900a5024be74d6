#!/bin/sh
# Builds the kvm stage1's guest assets into OUTDIR:
#
#   vmlinux       the guest kernel, uncompressed ELF with a PVH entry point
#                 (qemu boots it directly, skipping the decompressor)
#   vmlinuz       the same kernel as a bzImage
#   initrd.cpio   uncompressed newc initramfs: /init is BINARY (the static
#                 stagelet binary, run as `stagelet agent guest`) and, for
#                 a Debian kernel package, /lib/modules holds the modules the
#                 guest loads, in order (/lib/modules/stagelet.load)
#   manifest      where the kernel comes from, its version and checksums
#
# usage: guest/build.sh BINARY OUTDIR
#
# The kernel is built from Debian's kernel source (linux-source-6.1) by
# guest/build-kernel.sh with the options in guest/kernel.config, all
# built in: it boots to the agent in about 55% of the time Debian's
# generic kernel takes under TCG, and a template VM keeps about 70 MiB of
# memory instead of 126. It is cached outside OUTDIR (KERNEL_CACHE,
# default /var/cache/stagelet-guest-kernel) and built again only when its
# inputs change.
#
# KERNEL_PACKAGE=linux-image-<version>-amd64 uses a Debian kernel package
# instead (fetched with `apt-get download`, cached in OUTDIR/.cache): its
# generic flavour has the modules the guest needs (the cloud flavour has
# no 9p).
#
# Reproducible: the same binary and kernel give the same bytes (files
# sorted, owned by 0:0, mtimes fixed). Idempotent: outputs are rewritten
# only when their inputs changed.
set -eu

if [ $# -ne 2 ]; then
	echo "usage: $0 BINARY OUTDIR" >&2
	exit 2
fi
BINARY=$1
OUTDIR=$2

for tool in apt-get apt-cache dpkg-deb cpio lz4 xz zstd gzip sha256sum; do
	if ! command -v "$tool" >/dev/null 2>&1; then
		echo "guest/build.sh: $tool is missing (Debian: apt-get install cpio lz4 xz-utils zstd)" >&2
		exit 1
	fi
done
[ -x "$BINARY" ] || { echo "guest/build.sh: $BINARY is not an executable" >&2; exit 1; }
if file_out=$(command -v file >/dev/null 2>&1 && file -b "$BINARY"); then
	case "$file_out" in
	*"dynamically linked"*) echo "guest/build.sh: $BINARY is dynamically linked; build it with CGO_ENABLED=0" >&2; exit 1 ;;
	esac
fi

# The modules the guest needs from a Debian kernel package (the kernel
# built here has them built in), by name; their dependencies are added.
# virtio_mmio: microvm's devices; virtio_pci: q35's; 9p, 9pnet_virtio: the
# pod's shared directory. bridge: containers
# that make bridges (CNI plugins, privileged pods running brctl) find it
# loaded, as the guest has no modprobe for the kernel to call.
MODULES="virtio_mmio virtio_pci virtio_console virtio_net 9p 9pnet_virtio virtio-rng bridge"

mkdir -p "$OUTDIR/.cache"
OUTDIR=$(cd "$OUTDIR" && pwd)
CACHE=$OUTDIR/.cache

work=$(mktemp -d "$OUTDIR/.build.XXXXXX")
trap 'rm -rf "$work"' EXIT INT TERM
order=""

# replace installs file as OUTDIR/name unless that holds the same bytes.
replace() {
	if ! cmp -s "$1" "$OUTDIR/$2" 2>/dev/null; then
		cp "$1" "$OUTDIR/$2.new"
		mv "$OUTDIR/$2.new" "$OUTDIR/$2"
	fi
}

pkg=${KERNEL_PACKAGE:-}
if [ -z "$pkg" ]; then
	kout=$("$(dirname "$0")/build-kernel.sh" "${KERNEL_CACHE:-/var/cache/stagelet-guest-kernel}")
	replace "$kout/vmlinux" vmlinux
	replace "$kout/vmlinuz" vmlinuz
	rm -f "$CACHE/kernel.sha256" # OUTDIR no longer holds a package's kernel
	kver=$(cat "$kout/release")
	origin="built from linux-source-6.1 with guest/kernel.config"
	source="config-sha256 $(sha256sum "$kout/config" | cut -d' ' -f1)"
	epoch=${SOURCE_DATE_EPOCH:-0}
else
	deb=$(ls "$CACHE/${pkg}_"*.deb 2>/dev/null | head -n1 || true)
	if [ -z "$deb" ]; then
		echo "guest/build.sh: downloading $pkg"
		(cd "$CACHE" && apt-get download -q "$pkg" 2>&1 | grep -v '^W: Download is performed unsandboxed' >&2 || true)
		deb=$(ls "$CACHE/${pkg}_"*.deb 2>/dev/null | head -n1 || true)
		[ -n "$deb" ] || { echo "guest/build.sh: apt-get download $pkg failed" >&2; exit 1; }
	fi
	debsum=$(sha256sum "$deb" | cut -d' ' -f1)
	# The kernel, unless this package's is already there.
	if [ ! -f "$OUTDIR/vmlinux" ] || [ ! -f "$OUTDIR/vmlinuz" ] || [ ! -d "$CACHE/modules" ] ||
		[ "$(cat "$CACHE/kernel.sha256" 2>/dev/null)" != "$debsum" ]; then
		dpkg-deb -x "$deb" "$work/pkg"
		vmlinuz=$(ls "$work"/pkg/boot/vmlinuz-* | head -n1)
		# vmlinux: the payload of the bzImage, found by its compression's magic.
		found=""
		for fmt in lz4 xz zstd gzip; do
			case $fmt in
			lz4) magic='\002!L\030' ;;
			xz) magic='\3757zXZ\000' ;;
			zstd) magic='(\265/\375' ;;
			gzip) magic='\037\213\010' ;;
			esac
			off=$(LC_ALL=C grep -abo "$(printf "$magic")" "$vmlinuz" 2>/dev/null | head -n1 | cut -d: -f1 || true)
			[ -n "$off" ] || continue
			if tail -c +"$((off + 1))" "$vmlinuz" | "$fmt" -dc >"$work/vmlinux" 2>/dev/null ||
				[ -s "$work/vmlinux" ]; then
				if [ "$(head -c 4 "$work/vmlinux" | od -An -c | tr -d ' ')" = '177ELF' ]; then
					found=$fmt
					break
				fi
			fi
		done
		[ -n "$found" ] || { echo "guest/build.sh: cannot find the kernel inside $vmlinuz" >&2; exit 1; }
		rm -rf "$CACHE/modules"
		mkdir -p "$CACHE/modules"
		cp -a "$work"/pkg/lib/modules/* "$CACHE/modules/"
		cp "$vmlinuz" "$OUTDIR/vmlinuz.new"
		mv "$OUTDIR/vmlinuz.new" "$OUTDIR/vmlinuz"
		mv "$work/vmlinux" "$OUTDIR/vmlinux"
		echo "$debsum" >"$CACHE/kernel.sha256"
		rm -rf "$work/pkg"
	fi
	kver=$(ls "$CACHE/modules")
	kdir=$CACHE/modules/$kver/kernel

	# The modules, dependencies first (read from each module's depends=).
	find "$kdir" -name '*.ko' | LC_ALL=C sort >"$work/ko.list"
	modpath() {
		# Module names use '-' and '_' interchangeably.
		pat=$(echo "$1" | sed 's/[-_]/[-_]/g')
		grep -E "/$pat\.ko\$" "$work/ko.list" | head -n1
	}
	order=""
	visit() {
		case " $order " in *" $1 "*) return ;; esac
		f=$(modpath "$1")
		[ -n "$f" ] || { echo "guest/build.sh: module $1 not in $pkg" >&2; exit 1; }
		deps=$(LC_ALL=C grep -a -o 'depends=[a-z0-9_,-]*' "$f" | head -n1 | cut -d= -f2 | tr ',' ' ')
		for d in $deps; do visit "$d"; done
		order="$order $1"
	}
	for m in $MODULES; do visit "$m"; done
	origin="package $pkg"
	source="package-sha256 $debsum"
	epoch=${SOURCE_DATE_EPOCH:-$(stat -c %Y "$kdir")}
fi

root=$work/root
for d in dev proc sys run tmp sysroot mnt/stagelet; do mkdir -p "$root/$d"; done
if [ -n "$order" ]; then
	mkdir -p "$root/lib/modules"
	: >"$root/lib/modules/stagelet.load"
	for m in $order; do
		f=$(modpath "$m")
		cp "$f" "$root/lib/modules/"
		basename "$f" >>"$root/lib/modules/stagelet.load"
	done
fi
cp "$BINARY" "$root/init"
chmod 0755 "$root/init"
find "$root" -exec touch -h -d "@$epoch" {} +
(cd "$root" && find . -mindepth 1 | LC_ALL=C sort |
	cpio --quiet -o -H newc -R 0:0 --reproducible) >"$work/initrd.cpio"
if ! cmp -s "$work/initrd.cpio" "$OUTDIR/initrd.cpio" 2>/dev/null; then
	mv "$work/initrd.cpio" "$OUTDIR/initrd.cpio"
fi

cat >"$work/manifest" <<EOF
kernel-origin $origin
$source
kernel $kver
modules$order
vmlinux-sha256 $(sha256sum "$OUTDIR/vmlinux" | cut -d' ' -f1)
initrd-sha256 $(sha256sum "$OUTDIR/initrd.cpio" | cut -d' ' -f1)
EOF
cmp -s "$work/manifest" "$OUTDIR/manifest" 2>/dev/null || mv "$work/manifest" "$OUTDIR/manifest"
echo "guest/build.sh: $OUTDIR: kernel $kver ($origin)${order:+, modules$order}"
