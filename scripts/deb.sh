#!/bin/sh
# make deb: the Debian package of stagelet, built with dpkg-deb alone (no
# tool outside Debian 12's essential set, dpkg-deb and what the kvm guest
# build needs).
#
#   scripts/deb.sh BINARY DEB_VERSION OUTDIR
#
# Writes OUTDIR/stagelet_<DEB_VERSION>_amd64.deb holding:
#   /usr/bin/stagelet                    BINARY (static)
#   /lib/systemd/system/stagelet.service contrib/systemd/stagelet.service,
#                                        running /usr/bin/stagelet with
#                                        /etc/stagelet/config.yaml
#   /etc/stagelet/config.yaml            `stagelet config default` (a conffile)
#   /usr/lib/stagelet/guest/             the kvm guest (guest/build.sh with
#                                        BINARY, built here; the kernel comes
#                                        from its cache)
#   /usr/share/stagelet/selinux/         the SELinux module's source and
#                                        container contexts (contrib/selinux),
#                                        which an SELinux node builds and
#                                        loads (README, "Security modules")
#   /usr/share/doc/stagelet/             README.md, copyright, changelog
# and the maintainer scripts of contrib/debian. DEB_MAINTAINER names the
# maintainer (default: a placeholder lintian calls bogus).
# SOURCE_DATE_EPOCH (default: the last commit's time) fixes every
# timestamp. Everything it makes besides the package goes in one
# temporary directory, removed at the end.
set -eu

if [ $# -ne 3 ]; then
	echo "usage: $0 BINARY DEB_VERSION OUTDIR" >&2
	exit 2
fi
BINARY=$(readlink -f "$1")
VERSION=$2
OUTDIR=$3
top=$(cd "$(dirname "$0")/.." && pwd)
deb=$top/contrib/debian

# Debian's version syntax, without an epoch; a hyphen would start a
# Debian revision, which a native package has none of.
if ! printf '%s\n' "$VERSION" | grep -Eqx '[0-9][A-Za-z0-9.+~]*'; then
	echo "deb.sh: $VERSION is not a Debian version (digits first, then letters, digits, . + ~)" >&2
	exit 2
fi
[ -x "$BINARY" ] || { echo "deb.sh: $BINARY is not an executable" >&2; exit 2; }
command -v dpkg-deb >/dev/null || { echo "deb.sh: needs dpkg-deb" >&2; exit 1; }
maintainer=${DEB_MAINTAINER:-stagelet developers <stagelet@localhost>}
export SOURCE_DATE_EPOCH="${SOURCE_DATE_EPOCH:-$(git -C "$top" log -1 --format=%ct 2>/dev/null || date +%s)}"

W=$(mktemp -d /var/tmp/stagelet-deb.XXXXXX)
trap 'rm -rf --one-file-system "$W"' EXIT
umask 022
R=$W/root

install -D -m 0755 "$BINARY" "$R/usr/bin/stagelet"

# The unit of contrib, running the packaged binary with the packaged
# configuration; the line is checked so that a change of the unit's
# ExecStart fails here rather than ships a unit that runs nothing.
from='ExecStart=/usr/local/bin/stagelet serve'
to='ExecStart=/usr/bin/stagelet serve --config /etc/stagelet/config.yaml'
grep -qx "$from" "$top/contrib/systemd/stagelet.service" || {
	echo "deb.sh: contrib/systemd/stagelet.service has no line '$from' to rewrite" >&2
	exit 1
}
mkdir -p "$R/lib/systemd/system"
sed "s|^$from\$|$to|" "$top/contrib/systemd/stagelet.service" >"$R/lib/systemd/system/stagelet.service"

mkdir -p "$R/etc/stagelet"
"$R/usr/bin/stagelet" config default >"$R/etc/stagelet/config.yaml"
"$R/usr/bin/stagelet" config check "$R/etc/stagelet/config.yaml" >/dev/null

# The guest embeds the binary: built for this one, never copied from
# another build.
"$top/guest/build.sh" "$R/usr/bin/stagelet" "$W/guest" >&2
mkdir -p "$R/usr/lib/stagelet/guest"
for f in vmlinux vmlinuz initrd.cpio manifest; do
	[ -f "$W/guest/$f" ] && install -m 0644 "$W/guest/$f" "$R/usr/lib/stagelet/guest/$f"
done

# The module is built on the node, against the policy it runs
# (selinux-policy-dev there), not here.
mkdir -p "$R/usr/share/stagelet/selinux"
for f in stagelet.te stagelet.fc stagelet.if lxc_contexts; do
	install -m 0644 "$top/contrib/selinux/$f" "$R/usr/share/stagelet/selinux/$f"
done

doc=$R/usr/share/doc/stagelet
mkdir -p "$doc"
install -m 0644 "$top/README.md" "$doc/README.md"
install -m 0644 "$deb/copyright" "$doc/copyright"
install -D -m 0644 "$deb/lintian-overrides" "$R/usr/share/lintian/overrides/stagelet"
{
	printf 'stagelet (%s) unstable; urgency=medium\n\n' "$VERSION"
	printf '  * Built from %s.\n\n' "$(git -C "$top" describe --always --dirty 2>/dev/null || echo 'a tree outside git')"
	printf ' -- %s  %s\n' "$maintainer" "$(date -u -R -d "@$SOURCE_DATE_EPOCH")"
} | gzip -9n >"$doc/changelog.gz"

mkdir -p "$R/DEBIAN"
size=$(du -sk --exclude=DEBIAN "$R" | cut -f1)
sed -e "s/@VERSION@/$VERSION/" -e "s/@SIZE@/$size/" -e "s/@MAINTAINER@/$maintainer/" "$deb/control.in" >"$R/DEBIAN/control"
install -m 0644 "$deb/conffiles" "$R/DEBIAN/conffiles"
for s in postinst prerm postrm; do
	install -m 0755 "$deb/$s" "$R/DEBIAN/$s"
done
(cd "$R" && find . -path ./DEBIAN -prune -o -type f -printf '%P\n' | LC_ALL=C sort | xargs md5sum) >"$R/DEBIAN/md5sums"
chmod 0644 "$R/DEBIAN/md5sums"
find "$R" -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +

mkdir -p "$OUTDIR"
out=$OUTDIR/stagelet_${VERSION}_amd64.deb
dpkg-deb --root-owner-group -Zxz --build "$R" "$out" >/dev/null
echo "$out"
