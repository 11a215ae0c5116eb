#!/bin/sh
# Install the Debian/Ubuntu packages epd builds and tests with, when any is missing.
# clang + libclang-rt-dev (Debian 12: libclang-rt-14-dev; Ubuntu 24.04: the runtime of its default clang)
# give libFuzzer, ASan and LSan for make fuzz (tests/system/61-fuzz.sh); openssl makes the certificates of
# tests/system/34-two-nodes-tls.sh.
set -e
PKGS="build-essential pkg-config libuv1-dev libgrpc-dev libprotobuf-c-dev protobuf-c-compiler \
libsystemd-dev libinih-dev libmicrohttpd-dev grpc-proto python3 python3-grpcio python3-grpc-tools python3-protobuf \
python3-numpy python3-pytest python3-prometheus-client prometheus systemd valgrind clang libclang-rt-dev openssl"
missing=""
for p in $PKGS; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
echo "installing:$missing"
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi
# The CUDA build needs NCCL 2.29 or later: fetched from PyPI into .deps/nccl when the one found is older.
"$(dirname "$0")/nccl.sh" "$(dirname "$0")/../.deps/nccl"
