#!/bin/bash
# Builds cosign, sigstore's signing tool, which the tests of image
# signature policies (trust/) sign images with: its release VERSION,
# static (CGO off) with -trimpath, by `go install` through the Go module
# proxy. Installs it as /usr/local/bin/cosign and prints that path; with
# INSTALL=0 it only builds, and prints the path of the binary in CACHE.
#
# usage: scripts/build-cosign.sh [CACHE]
#
# CACHE (default /var/cache/stagelet-cosign, outside any checkout, so that
# CI's fresh clones find it) keeps one directory per cosign, named after
# the hash of what it is built from: VERSION, this script and `go
# version`. A cosign whose inputs did not change, and whose `cosign
# version` runs and says VERSION, is not built again. The build uses the
# machine's module and build caches (warm on CI), and its GOBIN and
# temporary files go to CACHE/build, removed on exit: nothing is left in
# /tmp. Cold: about 2.5 minutes on 2 cores with a warm module cache but a
# cold build cache, 5 s with both warm. Needs go (Go 1.26 builds v2.6.5;
# newer cosign releases need a newer Go).
set -euo pipefail

CACHE=${1:-/var/cache/stagelet-cosign}
INSTALL=${INSTALL:-1}
VERSION=v2.6.5
PACKAGE=github.com/sigstore/cosign/v2/cmd/cosign
DEST=/usr/local/bin/cosign
log() { echo "build-cosign: $*" >&2; }

# reports whether $1 runs and is cosign VERSION (grep reads all of its
# output: with -q, cosign could die of SIGPIPE and fail the pipeline).
is_version() {
	[ -x "$1" ] && "$1" version 2>/dev/null | grep "^GitVersion: *$VERSION\$" >/dev/null
}

for tool in go flock sha256sum cmp; do
	if ! command -v "$tool" >/dev/null 2>&1; then
		log "$tool is missing"
		exit 1
	fi
done
mkdir -p "$CACHE"
CACHE=$(cd "$CACHE" && pwd)
exec 9>"$CACHE/lock"
flock 9

key=$({
	echo "$VERSION"
	cat "$0"
	go version
} | sha256sum | cut -c1-16)
out=$CACHE/$key
if is_version "$out/cosign"; then
	log "using cosign $VERSION from the cache ($out)"
else
	build=$CACHE/build
	rm -rf "$out" "$out.new" "$build"
	trap 'rm -rf "$out.new" "$build"' EXIT
	trap 'exit 130' INT
	trap 'exit 143' TERM
	mkdir -p "$build/bin" "$build/tmp"
	log "building cosign $VERSION (about 2 minutes with a cold Go build cache)"
	t0=$(date +%s)
	if ! env GOBIN="$build/bin" GOTMPDIR="$build/tmp" TMPDIR="$build/tmp" \
		GOWORK=off GOFLAGS=-mod=mod CGO_ENABLED=0 \
		go install -trimpath -ldflags "-s -w" "$PACKAGE@$VERSION" >&2; then
		log "go install $PACKAGE@$VERSION failed"
		exit 1
	fi
	if ! is_version "$build/bin/cosign"; then
		log "the cosign built does not run, or its \`cosign version\` does not say $VERSION"
		exit 1
	fi
	mkdir -p "$out.new"
	mv "$build/bin/cosign" "$out.new/cosign"
	mv "$out.new" "$out"
	rm -rf "$build"
	trap - EXIT INT TERM
	log "built cosign $VERSION in $(($(date +%s) - t0))s ($out)"
fi

if [ "$INSTALL" = 0 ]; then
	echo "$out/cosign"
	exit 0
fi
if ! cmp -s "$out/cosign" "$DEST"; then
	mkdir -p "$(dirname "$DEST")"
	tmp=$(dirname "$DEST")/.cosign.new.$$
	trap 'rm -f "$tmp"' EXIT
	trap 'exit 130' INT
	trap 'exit 143' TERM
	cp "$out/cosign" "$tmp"
	chmod 0755 "$tmp"
	mv -f "$tmp" "$DEST"
	trap - EXIT INT TERM
	log "installed $DEST"
fi
echo "$DEST"
