#!/bin/sh
# deploy/nccl.sh [DIR]: make sure the CUDA build has an NCCL of 2.29 or later (the versioned Device API the
# kernels are built for). Where the CUDA toolkit is present and no such NCCL is found (NCCL_HOME, DIR, the
# CUDA toolkit, the system), fetch NVIDIA's PyPI package nvidia-nccl-cu13 (EPD_NCCL_VERSION, default
# 2.32.3) and unpack its headers and library into DIR (default .deps/nccl), where the Makefile looks
# first. Without the toolkit there is nothing to do (host backend only); if the fetch fails, the build
# uses the older NCCL it found (NCCL 2.28 still builds; ranks cannot share a GPU with it).
set -e
DIR=${1:-.deps/nccl}
V=${EPD_NCCL_VERSION:-2.32.3}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
[ -x "${NVCC:-$CUDA_HOME/bin/nvcc}" ] || exit 0
ver() { sed -n 's/^#define NCCL_VERSION_CODE *\([0-9]*\).*/\1/p' "$1/include/nccl.h" 2>/dev/null; }
for d in ${NCCL_HOME:-} "$DIR" "$CUDA_HOME" /usr; do
  v=$(ver "$d" || true)
  [ -f "$d/include/nccl_device.h" ] && [ "${v:-0}" -ge 22900 ] && exit 0
done
echo "fetching NCCL $V (PyPI: nvidia-nccl-cu13) into $DIR: no NCCL 2.29 or later found"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if ! python3 -m pip download -q --no-deps --only-binary=:all: "nvidia-nccl-cu13==$V" -d "$tmp" ||
   ! python3 -m zipfile -e "$tmp"/nvidia_nccl_cu13-*.whl "$tmp/x"; then
  echo "warning: could not fetch nvidia-nccl-cu13==$V; building against the NCCL found (if any)" >&2
  exit 0
fi
rm -rf "$DIR"
mkdir -p "$DIR"
cp -r "$tmp/x/nvidia/nccl/include" "$tmp/x/nvidia/nccl/lib" "$DIR/"
ln -sf libnccl.so.2 "$DIR/lib/libnccl.so"
echo "NCCL $V in $DIR"
