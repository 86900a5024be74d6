#!/bin/sh
# Builds the kvm guest's kernel from Debian's kernel source: `make
# tinyconfig`, then every option in guest/kernel.config built in (no
# modules). Prints the directory holding the result:
#
#   vmlinux   uncompressed ELF with a PVH entry point (qemu boots it directly)
#   vmlinuz   the same kernel as a bzImage
#   release   its `uname -r`
#   config    its full configuration
#
# usage: guest/build-kernel.sh [CACHE]
#
# CACHE (default /var/cache/stagelet-guest-kernel, outside any checkout,
# so that CI's fresh clones find it) keeps the source package and one
# directory per kernel, named after the hash of what it is built from:
# the source package, guest/kernel.config, this script and the compiler's
# version. A kernel whose inputs did not change is not built again.
#
# Reproducible: the build runs in one fixed directory (CACHE/src), with
# the build date set to the source tree's and user and host fixed, so the
# same inputs give the same bytes.
set -eu

here=$(cd "$(dirname "$0")" && pwd)
CACHE=${1:-/var/cache/stagelet-guest-kernel}
SOURCE=linux-source-6.1

for tool in apt-get apt-cache dpkg-deb tar xz make gcc flex bison bc flock sha256sum; do
	if ! command -v "$tool" >/dev/null 2>&1; then
		echo "guest/build-kernel.sh: $tool is missing (scripts/install-deps.sh installs what the build needs)" >&2
		exit 1
	fi
done
mkdir -p "$CACHE"
CACHE=$(cd "$CACHE" && pwd)
exec 9>"$CACHE/lock"
flock 9

ver=$(apt-cache policy "$SOURCE" 2>/dev/null | sed -n 's/^ *Candidate: \(.*\)$/\1/p')
if [ -z "$ver" ] || [ "$ver" = "(none)" ]; then
	deb=$(ls "$CACHE/${SOURCE}_"*.deb 2>/dev/null | tail -n1 || true)
	[ -n "$deb" ] || { echo "guest/build-kernel.sh: cannot resolve $SOURCE (run apt-get update)" >&2; exit 1; }
else
	deb=$CACHE/${SOURCE}_${ver}_all.deb
	if [ ! -f "$deb" ]; then
		echo "guest/build-kernel.sh: downloading $SOURCE $ver" >&2
		(cd "$CACHE" && apt-get download -q "$SOURCE=$ver" 2>&1 | grep -v '^W: Download is performed unsandboxed' >&2 || true)
		[ -f "$deb" ] || { echo "guest/build-kernel.sh: apt-get download $SOURCE=$ver failed" >&2; exit 1; }
	fi
fi

key=$({
	sha256sum "$deb" | cut -d' ' -f1
	cat "$here/kernel.config" "$0"
	gcc --version | head -n1
} | sha256sum | cut -c1-16)
out=$CACHE/$key
if [ -f "$out/vmlinux" ] && [ -f "$out/vmlinuz" ] && [ -f "$out/release" ]; then
	echo "$out"
	exit 0
fi

src=$CACHE/src
rm -rf "$src" "$out.new"
trap 'rm -rf "$src" "$out.new"' EXIT INT TERM
mkdir -p "$src"
echo "guest/build-kernel.sh: building the guest kernel from $(basename "$deb") (a few minutes)" >&2
dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$src" "./usr/src/$SOURCE.tar.xz"
tar -C "$src" -xJf "$src/usr/src/$SOURCE.tar.xz"
tree=$src/$SOURCE

opts=$(sed -e 's/#.*//' "$here/kernel.config" | tr -s ' \t\n' '   ')
export KBUILD_BUILD_TIMESTAMP="$(date -u -d "@$(stat -c %Y "$tree/Makefile")")"
export KBUILD_BUILD_USER=stagelet KBUILD_BUILD_HOST=stagelet KBUILD_BUILD_VERSION=1
make -C "$tree" -s tinyconfig >/dev/null
set --
for o in $opts; do set -- "$@" -e "$o"; done
"$tree/scripts/config" --file "$tree/.config" "$@" --set-str LOCALVERSION "-stagelet" -d LOCALVERSION_AUTO
make -C "$tree" -s olddefconfig >/dev/null
missing=""
for o in $opts; do
	grep -q "^CONFIG_$o=y\$" "$tree/.config" || missing="$missing $o"
done
if [ -n "$missing" ]; then
	echo "guest/build-kernel.sh: options of guest/kernel.config not set after olddefconfig (a dependency missing?):$missing" >&2
	exit 1
fi
make -C "$tree" -s -j"$(nproc)" bzImage >&2

mkdir -p "$out.new"
cp "$tree/vmlinux" "$out.new/vmlinux"
cp "$tree/arch/x86/boot/bzImage" "$out.new/vmlinuz"
cp "$tree/include/config/kernel.release" "$out.new/release"
cp "$tree/.config" "$out.new/config"
mv "$out.new" "$out"
echo "$out"
