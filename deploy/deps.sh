#!/bin/sh
# deploy/deps.sh [run|test]: install the Debian/Ubuntu packages epd needs, when any is missing.
#   run   what the build and `make run` need (the compiler, libraries, protobuf-c code generator);
#   test  that and what the test suite uses (the default): Python's gRPC and numpy for the system tests,
#         pytest, prometheus (promtool checks the metrics text), systemd (systemd-analyze verify),
#         valgrind, clang + libclang-rt-dev (libFuzzer, ASan and LSan for make fuzz; Debian 12:
#         libclang-rt-14-dev, Ubuntu 24.04: the runtime of its default clang), clang-format (the format
#         check, tests/system/02-format.sh) and openssl (the certificates of
#         tests/system/34-two-nodes-tls.sh).
# Then, where the CUDA toolkit is and a GPU or the test suite needs the CUDA build: NCCL 2.29+ (nccl.sh).
set -e
WHAT=${1:-test}
PKGS="build-essential pkg-config libuv1-dev libgrpc-dev libprotobuf-c-dev protobuf-c-compiler \
libsystemd-dev libinih-dev libmicrohttpd-dev grpc-proto"
[ "$WHAT" = test ] && PKGS="$PKGS python3 python3-grpcio python3-grpc-tools python3-protobuf python3-numpy \
python3-pytest python3-prometheus-client prometheus systemd valgrind clang libclang-rt-dev clang-format openssl"
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
if [ "$WHAT" = test ] || nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  "$(dirname "$0")/nccl.sh" "$(dirname "$0")/../.deps/nccl"
fi
