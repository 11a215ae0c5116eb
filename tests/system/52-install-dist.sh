#!/bin/bash
# 52-install-dist: packaging without a GPU.
#  make install DESTDIR=tmp PREFIX=/usr: the files land where they should, the installed binaries are the
#  built ones and run, pkg-config finds libepd, a C program compiles and links against the installed
#  library and gets EPD_ERR_CLOSED from a missing socket; the man pages render.
#  make dist: the tarball unpacks elsewhere, its bin/epd (host backend) runs with LD_LIBRARY_PATH unset,
#  a worker from the bundle attaches and steps, and ldd resolves the bundled libraries from its lib/.
set -u
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
B=${EPD_BUILD:-build}
case $B in /*) ;; *) [ -d "$PWD/$B" ] && B=$PWD/$B || B=$ROOT/$B ;; esac
B=$(cd "$B" 2>/dev/null && pwd) || { echo "skip: no build directory"; exit 77; }
for b in epd epdctl epd-worker; do [ -x "$B/bin/$b" ] || { echo "skip: $B/bin/$b is not built"; exit 77; }; done
command -v pkg-config > /dev/null && command -v cc > /dev/null || { echo "skip: no pkg-config or cc"; exit 77; }
# The Makefile's B, relative to the repository when it lies inside it (its dependency files use that form).
MB=${B#$ROOT/}
T=$(mktemp -d)
PID=
cleanup() {
  [ -n "$PID" ] && kill -KILL "$PID" 2>/dev/null
  rm -rf "$T"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*"
  for f in "$T"/*.log; do [ -f "$f" ] && sed "s#^#  $(basename "$f")| #" "$f" | tail -15; done
  exit 1
}
wait_for() { local n=$(( $1 * 20 )); shift; while ! "$@" 2>/dev/null; do n=$((n-1)); [ $n -le 0 ] && return 1; sleep 0.05; done; }
unset LD_LIBRARY_PATH

echo "== make install DESTDIR=\$T/dest PREFIX=/usr"
D=$T/dest
timeout 300 make -C "$ROOT" --no-print-directory B="$MB" install DESTDIR="$D" PREFIX=/usr > "$T/install.log" 2>&1 ||
  fail "make install failed"
for f in usr/bin/epd usr/bin/epdctl usr/lib/libepd.so.1 usr/include/epd/epd.h usr/include/epd/epd_abi.h \
  usr/lib/pkgconfig/epd.pc etc/epd/epd.conf usr/lib/systemd/system/epd.service usr/lib/tmpfiles.d/epd.conf \
  usr/lib/sysusers.d/epd.conf usr/share/man/man1/epdctl.1.gz usr/share/man/man5/epd.conf.5.gz \
  usr/share/man/man8/epd.8.gz; do
  [ -s "$D/$f" ] || fail "not installed: $f"
done
[ -L "$D/usr/lib/libepd.so" ] && [ "$(readlink "$D/usr/lib/libepd.so")" = libepd.so.1 ] || fail "libepd.so is not a link to libepd.so.1"
[ -x "$D/usr/bin/epd" ] && [ -x "$D/usr/bin/epdctl" ] || fail "installed binaries are not executable"
cmp -s "$D/usr/bin/epd" "$B/bin/epd" || fail "installed epd is not $B/bin/epd (B not passed to install.sh?)"
grep -q '^ExecStart=/usr/bin/epd' "$D/usr/lib/systemd/system/epd.service" || fail "epd.service ExecStart is not /usr/bin/epd"
grep -q '^prefix=/usr$' "$D/usr/lib/pkgconfig/epd.pc" || fail "epd.pc prefix is not /usr: $(head -1 "$D/usr/lib/pkgconfig/epd.pc")"
"$D/usr/bin/epd" --version | grep -q "^epd [0-9]" || fail "installed epd --version"
"$D/usr/bin/epdctl" --version | grep -q "^epdctl [0-9]" || fail "installed epdctl --version"
"$D/usr/bin/epd" --check-config -c "$D/etc/epd/epd.conf" > "$T/check.log" 2>&1 || fail "installed epd.conf does not validate"
grep -q "^engine.backend = " "$T/check.log" || fail "--check-config printed no engine.backend"

echo "== pkg-config and a program linked against the installed libepd"
export PKG_CONFIG_PATH=$D/usr/lib/pkgconfig PKG_CONFIG_SYSROOT_DIR=$D
flags=$(pkg-config --cflags --libs epd) || fail "pkg-config --cflags --libs epd"
echo "pkg-config: $flags"
case " $flags " in *" -I$D/usr/include/epd "*) ;; *) fail "cflags lack -I$D/usr/include/epd" ;; esac
case " $flags " in *" -L$D/usr/lib "*) ;; *) fail "libs lack -L$D/usr/lib" ;; esac
[ "$(pkg-config --modversion epd)" = "$(sed -n 's/^Version: *//p' "$B/epd.pc")" ] || fail "pkg-config version"
cat > "$T/prog.c" <<'CEOF'
#include <stdio.h>
#include <string.h>
#include "epd.h"
int main(int argc, char **argv) {
  epd_connect_opts_t o = EPD_CONNECT_OPTS_INITIALIZER;
  o.socket_path = argv[1];
  o.timeout_ms = 2000;
  epd_conn_t *c = NULL;
  epd_result_t r = epd_connect(&o, &c);
  printf("epd_connect: %d %s\n", (int)r, epd_strerror(r));
  if (r == EPD_OK) epd_disconnect(c);
  return r == EPD_ERR_CLOSED ? 0 : 1;
}
CEOF
# shellcheck disable=SC2086
cc -o "$T/prog" "$T/prog.c" $flags -Wl,-rpath,"$D/usr/lib" > "$T/cc.log" 2>&1 || fail "compiling against the installed libepd"
ldd "$T/prog" | grep -q "libepd.so.1 => $D/usr/lib/libepd.so.1" || fail "prog does not load the installed libepd: $(ldd "$T/prog" | grep epd)"
timeout 30 "$T/prog" "$T/no-such-dir/control.sock" > "$T/prog.log" 2>&1 || fail "prog did not get EPD_ERR_CLOSED"
cat "$T/prog.log"
unset PKG_CONFIG_PATH PKG_CONFIG_SYSROOT_DIR

echo "== man pages render"
if command -v man > /dev/null || command -v groff > /dev/null; then
  for m in man1/epdctl.1 man5/epd.conf.5 man8/epd.8; do
    f=$D/usr/share/man/$m.gz
    if command -v man > /dev/null; then
      MANWIDTH=100 man -l "$f" > "$T/man.out" 2> "$T/man.log" </dev/null
    else
      gzip -dc "$f" | groff -man -Tutf8 > "$T/man.out" 2> "$T/man.log"
    fi
    [ $? -eq 0 ] || fail "$m does not render"
    [ "$(wc -l < "$T/man.out")" -ge 20 ] || fail "$m renders to fewer than 20 lines"
    grep -q "NAME" "$T/man.out" || fail "$m has no NAME section"
    grep -qiE "warning|cannot" "$T/man.log" && fail "$m: renderer warnings: $(head -3 "$T/man.log")"
  done
  echo "man pages: ok"
else
  echo "man pages: neither man nor groff, not checked"
fi

echo "== make dist, unpacked and run from elsewhere"
# DIST_DIR: the tarball goes to the test's directory, not into the checkout
DIST_DIR="$T/dist" timeout 300 make -C "$ROOT" --no-print-directory B="$MB" dist > "$T/dist.log" 2>&1 || fail "make dist failed"
tarball=$(sed -n 's|^\('"$T"'/dist/[^ ]*\.tar\.gz\) .*|\1|p' "$T/dist.log" | tail -1)
[ -n "$tarball" ] && [ -f "$tarball" ] || fail "make dist named no tarball: $(tail -3 "$T/dist.log")"
mkdir -p "$T/u" && tar -C "$T/u" -xzf "$tarball" || fail "cannot unpack $tarball"
U=$(echo "$T"/u/epd-*)
[ -d "$U" ] || fail "the tarball has no epd-* top directory"
for f in bin/epd bin/epdctl bin/epd-worker lib/libepd.so.1 include/epd/epd.h lib/pkgconfig/epd.pc; do
  [ -e "$U/$f" ] || fail "dist lacks $f"
done
readelf -d "$U/bin/epd" | grep -E 'RPATH|RUNPATH' | grep -qF '$ORIGIN/../lib' || fail "bin/epd has no RPATH \$ORIGIN/../lib"
# NCCL is opened when the CUDA backend starts, never needed to load: the host backend runs without it
for bin in epd epdctl epd-worker; do
  readelf -d "$U/bin/$bin" | grep NEEDED | grep -q libnccl && fail "bin/$bin needs libnccl at load time"
done
nbundled=0
for bin in "$U/bin/epd" "$U/bin/epdctl" "$U/bin/epd-worker"; do
  ldd "$bin" > "$T/ldd.log" 2>&1 || fail "ldd $bin"
  grep -q "not found" "$T/ldd.log" && fail "$(basename "$bin"): unresolved: $(grep 'not found' "$T/ldd.log")"
  for lib in "$U"/lib/*.so*; do
    so=$(basename "$lib")
    path=$(awk -v so="$so" '$1 == so && $2 == "=>" {print $3}' "$T/ldd.log")
    [ -n "$path" ] || continue
    # ldd prints the path as the loader built it ($ORIGIN expanded: bin/../lib/...).
    [ "$(realpath "$path")" = "$(realpath "$lib")" ] || fail "$(basename "$bin"): $so resolves outside the bundle: $path"
    nbundled=$((nbundled+1))
  done
done
for so in libgrpc libuv libprotobuf-c libmicrohttpd; do
  path=$(ldd "$U/bin/epd" | awk -v so="$so" 'index($1, so ".so") == 1 && $2 == "=>" {print $3}')
  case $(realpath "${path:-/nonexistent}" 2>/dev/null) in "$(realpath "$U")/lib/"*) ;;
    *) fail "bin/epd does not load $so from the bundle: ${path:-not loaded}" ;; esac
done
echo "ldd: $nbundled bundled resolutions, all from $U/lib"

S=$T/run
mkdir -p "$S"
(cd "$T" && exec env -u LD_LIBRARY_PATH "$U/bin/epd" -f -s "$S/control.sock" -o engine.backend=host \
  -o engine.num_ranks=2 -o daemon.attach_socket="$S/attach.sock" -o daemon.drain_timeout_ms=2000) 2> "$T/epd.log" &
PID=$!
wait_for 15 test -S "$S/attach.sock" || fail "the bundled epd did not start"
export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0"
timeout 60 env -u LD_LIBRARY_PATH "$U/bin/epd-worker" -s "$S/control.sock" -g d -r 0 -n 2 --steps 5 --seed 1 > "$T/w0.log" 2>&1 & w0=$!
timeout 60 env -u LD_LIBRARY_PATH "$U/bin/epd-worker" -s "$S/control.sock" -g d -r 1 -n 2 --steps 5 --seed 1 > "$T/w1.log" 2>&1 & w1=$!
wait $w0 || fail "bundled worker rank 0 failed"
wait $w1 || fail "bundled worker rank 1 failed"
grep -q "steps ok" "$T/w0.log" || fail "bundled worker printed no summary"
ops=$(env -u LD_LIBRARY_PATH "$U/bin/epdctl" -s "$S/control.sock" status --json | /usr/bin/python3 -c \
  'import json,sys; print(sum(r["ops"] for r in json.load(sys.stdin)["ranks"]))') || fail "bundled epdctl status"
[ "$ops" -ge 20 ] || fail "the bundled daemon counted $ops ops, want >= 20 (2 ranks x 5 steps x 2 ops)"
kill -TERM "$PID"
wait_for 15 bash -c "! kill -0 $PID" || fail "the bundled epd did not exit after SIGTERM"
wait "$PID"; rc=$?; PID=
[ $rc -eq 0 ] || fail "the bundled epd exited $rc"
echo "ok"
