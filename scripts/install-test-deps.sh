#!/bin/sh
# Installs what only stagelet's tests use, if missing (make test-deps):
# - containerd and runc, the reference runtime the side-by-side test
#   (test/e2e's TestSeenAsUnderRunc) compares a container's view with;
# - OpenJDK 17's runtime, whose files make the JVM test image
#   (testregistry.PushJRE);
# - cosign (sigstore), which the image signature tests sign with: the
#   release scripts/build-cosign.sh pins (its VERSION), built with go
#   install (cached in /var/cache/stagelet-cosign) into /usr/local/bin;
# - containerd/nri's own NRI plugins, which the NRI tests run unmodified:
#   the kit's ../shared/nri/build.sh builds those they use (cached in
#   /var/cache/stagelet-nri); the tests ask it for their directory.
# Safe to run repeatedly; does nothing when everything is present.
set -eu

need=""
command -v containerd >/dev/null 2>&1 || need="$need containerd"
command -v runc >/dev/null 2>&1 || need="$need runc"
[ -x /usr/lib/jvm/java-17-openjdk-amd64/bin/java ] || need="$need openjdk-17-jre-headless"

if [ -n "$need" ]; then
	if [ "$(id -u)" != 0 ]; then
		echo "install-test-deps: need root to install:$need" >&2
		exit 1
	fi
	echo "install-test-deps: installing$need"
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -qq
	# shellcheck disable=SC2086
	apt-get install -y -qq --no-install-recommends $need
fi

cosign_version=$(sed -n 's/^VERSION=//p' "$(dirname "$0")/build-cosign.sh")
if ! /usr/local/bin/cosign version 2>/dev/null | grep -q "^GitVersion: *$cosign_version\$"; then
	if [ "$(id -u)" != 0 ]; then
		echo "install-test-deps: no cosign $cosign_version in /usr/local/bin, and building one (scripts/build-cosign.sh) needs root" >&2
		exit 1
	fi
	"$(dirname "$0")/build-cosign.sh" >/dev/null
fi

nri_kit="$(dirname "$0")/../../shared/nri/build.sh"
if [ -x "$nri_kit" ]; then
	"$nri_kit" ulimit-adjuster device-injector hook-injector logger template >/dev/null
else
	echo "install-test-deps: no NRI plugin kit at $nri_kit: the NRI tests will fail" >&2
fi
