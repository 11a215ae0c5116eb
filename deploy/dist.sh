#!/bin/sh
# make dist: a relocatable tarball dist/epd-VERSION-linux-x86_64.tar.gz with bin/, lib/ (libepd and
# every shared library the binaries need that is not part of the base system), include/, etc/,
# systemd units and man pages. Binaries carry RPATH $ORIGIN/../lib, so the tree runs from anywhere
# (Debian 12, Ubuntu 24.04). NCCL and the CUDA driver are not bundled: they come from the host
# (set LD_LIBRARY_PATH to the directory of a libnccl.so.2 that the build takes, README "NCCL versions", if
# it is not on the loader path). DIST_EXTRA_BINS: more binaries of the build to put in bin/ with their
# libraries (deploy/dev-bundle.sh). DIST_DIR: where the tarball goes (default dist/ in the checkout).
set -eu
VERSION=${1:-0.0.0}
B=${B:-build}
name=epd-$VERSION-linux-$(uname -m)
D=${DIST_DIR:-dist}
case "$D" in /*) ;; *) D=$PWD/$D ;; esac
stage=$D/$name
rm -rf "$stage" && mkdir -p "$stage"
DESTDIR="" B="$B" sh deploy/install.sh "$stage" "" >/dev/null
cp "$B/bin/epd-worker" "$stage/bin/" 2>/dev/null || true
for b in ${DIST_EXTRA_BINS:-}; do
  [ -x "$B/bin/$b" ] && cp "$B/bin/$b" "$stage/bin/"
done
# Libraries that every supported system has (glibc, libstdc++, libgcc, the CUDA driver, NCCL) stay out.
skip='^(linux-vdso|libc\.so|libm\.so|libdl\.so|librt\.so|libpthread\.so|ld-linux|libgcc_s|libstdc\+\+|libcuda\.so|libnccl\.so)'
for bin in "$stage"/bin/* "$stage"/lib/libepd.so.1; do
  ldd "$bin" 2>/dev/null | awk '/=> \// {print $1, $3}' | while read -r soname path; do
    echo "$soname" | grep -Eq "$skip" && continue
    [ -f "$stage/lib/$soname" ] || cp -L "$path" "$stage/lib/$soname"
  done
done
tar -C "$D" -czf "$D/$name.tar.gz" "$name"
echo "${DIST_DIR:-dist}/$name.tar.gz ($(du -h "$D/$name.tar.gz" | cut -f1))"
