#!/bin/sh
# Builds criu, which checkpoints and restores nspawn and fly pods, from
# the upstream tarball of Debian 13 (trixie)'s source package: upstream's
# `make criu` against Debian 12's libraries, for kernels Debian 12's criu
# 3.17 no longer knows, with the patches in scripts/criu-patches (each
# says why) applied. Installs it as /usr/local/sbin/criu, where
# stagelet looks first, and prints that path; with INSTALL=0 it only
# builds, and prints the path of the binary in CACHE.
#
# usage: scripts/build-criu.sh [CACHE]
#
# CACHE (default /var/cache/stagelet-criu, outside any checkout, so that
# CI's fresh clones find it) keeps a private apt state for trixie's
# source index (apt/; the machine's own apt configuration is neither read
# for sources nor changed), the orig tarball with the SHA-256 that the
# signed index gives it, and one directory per criu, named after the hash
# of what it is built from: the tarball, the patches, this script and the
# compiler's version. A criu whose inputs did not change is not built again, and
# once the tarball is in CACHE no network is needed.
#
# Reproducible: the build runs in one fixed directory (CACHE/src), outside
# any git repository (so no git id is compiled in), with the build date
# (which criu compiles in as its kernel-features cache's magic) set to the
# source tree's, so the same inputs give the same bytes.
set -eu

CACHE=${1:-/var/cache/stagelet-criu}
PATCHES=$(cd "$(dirname "$0")/criu-patches" && pwd)
INSTALL=${INSTALL:-1}
VERSION=4.1.1
SUITE=trixie
MIRROR=http://deb.debian.org/debian
KEYRING=/usr/share/keyrings/debian-archive-trixie-stable.gpg
DEST=/usr/local/sbin/criu
orig=criu_$VERSION.orig.tar.xz

for tool in apt-get apt-cache tar xz make gcc pkg-config protoc-c flock sha256sum cmp install patch; do
	if ! command -v "$tool" >/dev/null 2>&1; then
		echo "scripts/build-criu.sh: $tool is missing (scripts/install-deps.sh installs what the build needs)" >&2
		exit 1
	fi
done
mkdir -p "$CACHE"
CACHE=$(cd "$CACHE" && pwd)
exec 9>"$CACHE/lock"
flock 9

tarball=$CACHE/$orig
if ! [ -f "$tarball" ] || ! (cd "$CACHE" && sha256sum -c --status "$orig.sha256" 2>/dev/null); then
	rm -f "$tarball" "$tarball.sha256" "$tarball.part"
	trap 'rm -f "$tarball.part"' EXIT INT TERM
	if [ ! -f "$KEYRING" ]; then
		echo "scripts/build-criu.sh: $KEYRING is missing (a newer debian-archive-keyring has it)" >&2
		exit 1
	fi
	apt=$CACHE/apt
	mkdir -p "$apt/lists/partial" "$apt/cache/archives/partial"
	echo "deb-src [signed-by=$KEYRING] $MIRROR $SUITE main" >"$apt/sources.list"
	set -- -o Dir::Etc::SourceList="$apt/sources.list" -o Dir::Etc::SourceParts=- \
		-o Dir::State::Lists="$apt/lists" -o Dir::Cache="$apt/cache"
	echo "scripts/build-criu.sh: reading $SUITE's source index" >&2
	if ! apt-get "$@" -qq --error-on=any update >&2; then
		echo "scripts/build-criu.sh: apt-get update of $SUITE's source index failed" >&2
		exit 1
	fi
	stanza=$(apt-cache "$@" showsrc criu 2>/dev/null | awk '/^Package: / { p = ($2 == "criu") } p && /^$/ { exit } p')
	ver=$(printf '%s\n' "$stanza" | sed -n 's/^Version: //p')
	up=${ver#*:}
	up=${up%-*}
	if [ "$up" != "$VERSION" ]; then
		echo "scripts/build-criu.sh: $SUITE's criu is ${ver:-missing}, not upstream $VERSION, the version this script builds (change VERSION and check the build)" >&2
		exit 1
	fi
	dir=$(printf '%s\n' "$stanza" | sed -n 's/^Directory: //p')
	sum=$(printf '%s\n' "$stanza" | awk -v f="$orig" '/^[^ ]/ { c = ($1 == "Checksums-Sha256:") } c && $3 == f { print $1 }')
	if [ -z "$dir" ] || [ -z "$sum" ]; then
		echo "scripts/build-criu.sh: $SUITE's criu $ver lists no $orig in its Checksums-Sha256" >&2
		exit 1
	fi
	echo "scripts/build-criu.sh: downloading $orig (criu $ver)" >&2
	/usr/lib/apt/apt-helper "$@" download-file "$MIRROR/$dir/$orig" "$tarball.part" 2>&1 |
		grep -v '^W: Download is performed unsandboxed' >&2 || true
	if [ ! -f "$tarball.part" ]; then
		echo "scripts/build-criu.sh: downloading $MIRROR/$dir/$orig failed" >&2
		exit 1
	fi
	got=$(sha256sum "$tarball.part" | cut -d' ' -f1)
	if [ "$got" != "$sum" ]; then
		echo "scripts/build-criu.sh: $orig has SHA-256 $got, but $SUITE's Sources says $sum: not using it" >&2
		exit 1
	fi
	mv "$tarball.part" "$tarball"
	echo "$sum  $orig" >"$tarball.sha256"
	trap - EXIT INT TERM
fi

key=$({
	cut -d' ' -f1 "$tarball.sha256"
	cat "$PATCHES"/*.patch "$0"
	gcc --version | head -n1
} | sha256sum | cut -c1-16)
out=$CACHE/$key
if [ ! -x "$out/criu" ]; then
	src=$CACHE/src
	rm -rf "$src" "$out.new"
	trap 'rm -rf "$src" "$out.new"' EXIT INT TERM
	mkdir -p "$src"
	echo "scripts/build-criu.sh: building criu $VERSION from $orig (a minute or so)" >&2
	tar -C "$src" -xJf "$tarball"
	tree=$src/criu-$VERSION
	for p in "$PATCHES"/*.patch; do
		patch -d "$tree" -p1 -s --no-backup-if-mismatch <"$p"
	done
	SOURCE_DATE_EPOCH=$(stat -c %Y "$tree/Makefile")
	export SOURCE_DATE_EPOCH
	unset CFLAGS CPPFLAGS LDFLAGS ARCH CROSS_COMPILE
	if ! make -C "$tree" -j"$(nproc)" criu >"$CACHE/build.log" 2>&1; then
		tail -n 30 "$CACHE/build.log" >&2
		echo "scripts/build-criu.sh: the build failed (its log: $CACHE/build.log; scripts/install-deps.sh installs the -dev packages it needs)" >&2
		exit 1
	fi
	rm -f "$CACHE/build.log"
	mkdir -p "$out.new"
	cp "$tree/criu/criu" "$out.new/criu"
	mv "$out.new" "$out"
	rm -rf "$src"
	trap - EXIT INT TERM
fi

if [ "$INSTALL" = 0 ]; then
	echo "$out/criu"
	exit 0
fi
if ! cmp -s "$out/criu" "$DEST"; then
	install -D -m 0755 "$out/criu" "$DEST"
	echo "scripts/build-criu.sh: installed $DEST" >&2
fi
echo "$DEST"
