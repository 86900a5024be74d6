#!/bin/sh
# Installs the Debian packages stagelet and its tests need, if missing.
# Safe to run repeatedly; does nothing when everything is present.
set -eu

need=""
command -v busybox >/dev/null 2>&1 || [ -x /bin/busybox ] || need="$need busybox-static"
# Used by pods and tests: mount tools, iproute2 for network namespaces.
command -v mount >/dev/null 2>&1 || need="$need mount"

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
