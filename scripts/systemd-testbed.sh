#!/bin/sh
# Builds the Debian tree that the systemd launcher's tests boot with
# `systemd-nspawn -b`: a minimal bookworm with systemd and dbus. Idempotent:
# a finished tree (marked by DIR/.stagelet-testbed) is left as it is; an
# unfinished one is removed and built again.
#
# Usage: scripts/systemd-testbed.sh [DIR]
#   DIR defaults to $STAGELET_TEST_SYSTEMD_ROOT, else /var/tmp/stagelet-systemd-testbed.
#   MIRROR overrides the Debian mirror (default http://deb.debian.org/debian).
#
# Needs root and debootstrap (apt-get install debootstrap).
set -eu

dir=${1:-${STAGELET_TEST_SYSTEMD_ROOT:-/var/tmp/stagelet-systemd-testbed}}
mirror=${MIRROR:-http://deb.debian.org/debian}
suite=${SUITE:-bookworm}
mark="$dir/.stagelet-testbed"

# The mount point of the directory the tests share with a booted testbed
# (its root is read-only then, so nspawn cannot create it).
shared=/var/tmp/stagelet-systemd-shared

if [ -f "$mark" ]; then
	mkdir -p "$dir$shared"
	echo "systemd testbed: $dir is ready"
	exit 0
fi
if [ "$(id -u)" != 0 ]; then
	echo "systemd testbed: needs root" >&2
	exit 1
fi
if ! command -v debootstrap >/dev/null 2>&1; then
	echo "systemd testbed: debootstrap is not installed (apt-get install debootstrap)" >&2
	exit 1
fi

case "$dir" in
/*) ;;
*) echo "systemd testbed: $dir: want an absolute path" >&2; exit 1 ;;
esac
if [ -e "$dir" ]; then
	echo "systemd testbed: removing the unfinished tree $dir"
	rm -rf --one-file-system "$dir"
fi
mkdir -p "$(dirname "$dir")"
tmp="$dir.partial"
rm -rf --one-file-system "$tmp"

start=$(date +%s)
debootstrap --variant=minbase --include=systemd,systemd-sysv,dbus "$suite" "$tmp" "$mirror"

# A booted container needs no getty, no network setup and no journal on
# disk; fewer units make the boot quicker.
ln -sf /dev/null "$tmp/etc/systemd/system/console-getty.service"
ln -sf /dev/null "$tmp/etc/systemd/system/getty@.service"
ln -sf /dev/null "$tmp/etc/systemd/system/systemd-networkd.service"
ln -sf /dev/null "$tmp/etc/systemd/system/systemd-resolved.service"
ln -sf /dev/null "$tmp/etc/systemd/system/apt-daily.timer"
ln -sf /dev/null "$tmp/etc/systemd/system/apt-daily-upgrade.timer"
echo stagelet-testbed >"$tmp/etc/hostname"
mkdir -p "$tmp$shared"
# Empty machine-id: systemd makes a transient one at each boot.
: >"$tmp/etc/machine-id"
# Keep the image small.
rm -rf "$tmp/var/cache/apt/archives/"*.deb "$tmp/var/lib/apt/lists/"* || true

mv "$tmp" "$dir"
date -u +%Y-%m-%dT%H:%M:%SZ >"$mark"
echo "systemd testbed: built $dir in $(( $(date +%s) - start ))s"
