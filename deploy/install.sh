#!/bin/sh
# make install: binaries, libepd + headers + pkg-config file, config example, systemd units, man pages.
# Usage: install.sh DESTDIR PREFIX   (B selects the build directory, default build)
set -eu
DESTDIR=${1:-}
PREFIX=${2-/usr/local}
B=${B:-build}
root="$DESTDIR$PREFIX"
install -d "$root/bin" "$root/lib/pkgconfig" "$root/include/epd" "$root/share/man/man1" \
  "$root/share/man/man5" "$root/share/man/man8" "$root/share/doc/epd" "$DESTDIR/etc/epd" \
  "$root/lib/systemd/system" "$root/lib/tmpfiles.d" "$root/lib/sysusers.d"
install -m 0755 "$B/bin/epd" "$B/bin/epdctl" "$root/bin/"
install -m 0755 "$B/lib/libepd.so" "$root/lib/libepd.so.1"
ln -sf libepd.so.1 "$root/lib/libepd.so"
install -m 0644 include/epd/epd.h include/epd/epd_abi.h "$root/include/epd/"
[ -f include/epd/epd_device.h ] && install -m 0644 include/epd/epd_device.h "$root/include/epd/"
# The pkg-config file is made here rather than copied from $B: that copy carries the PREFIX `make all` ran
# with, not this one. An empty PREFIX (make dist) gives a relocatable file, relative to where it lies.
version=$(sed -n 's/^Version: *//p' "$B/epd.pc")
pcprefix=${PREFIX:-'${pcfiledir}/../..'}
sed -e "s|@PREFIX@|$pcprefix|g" -e "s|@VERSION@|${version:-0.0.0}|g" client/epd.pc.in > "$root/lib/pkgconfig/epd.pc"
chmod 0644 "$root/lib/pkgconfig/epd.pc"
[ -f "$DESTDIR/etc/epd/epd.conf" ] || install -m 0644 config/epd.conf "$DESTDIR/etc/epd/epd.conf"
for u in deploy/*.service; do
  sed "s|/usr/bin/epd|$PREFIX/bin/epd|g" "$u" > "$root/lib/systemd/system/$(basename "$u")"
done
[ -f deploy/epd.tmpfiles ] && install -m 0644 deploy/epd.tmpfiles "$root/lib/tmpfiles.d/epd.conf"
[ -f deploy/epd.sysusers ] && install -m 0644 deploy/epd.sysusers "$root/lib/sysusers.d/epd.conf"
for m in docs/man/*.[158]; do
  [ -f "$m" ] || continue
  sec=${m##*.}
  gzip -9nc "$m" > "$root/share/man/man$sec/$(basename "$m").gz"
done
install -m 0644 README.md "$root/share/doc/epd/"
echo "installed into $root"
