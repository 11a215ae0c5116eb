#!/bin/sh
# dev-bundle.sh - a relocatable tree for a GPU machine that lacks the build's libraries (libuv, gRPC,
# protobuf-c, ...): the dist bundle (deploy/dist.sh) with the build's test and benchmark binaries added
# (DIST_EXTRA_BINS) and every library they need beyond the base system. Binaries carry RPATH
# $ORIGIN/../lib, so the tree runs from anywhere; NCCL and the CUDA driver come from the host.
#   B=build deploy/dev-bundle.sh DIR     (e.g. DIR = .gpu/d, an ignored path carried to the GPU machine)
# Then on the GPU machine: tests/gpu/check-all.sh DIR (every GPU test, sanitizer and benchmark in one run).
set -eu
B=${B:-build}
DIR=${1:?usage: deploy/dev-bundle.sh DIR}
VERSION=${VERSION:-0.0.0-dev}
if [ -e "$DIR" ] && [ ! -f "$DIR/.epd-dev-bundle" ]; then
  echo "deploy/dev-bundle.sh: $DIR exists and is not a tree this script made: not replacing it" >&2
  exit 1
fi
DIST_EXTRA_BINS="epd-gpu-tests epd-tests epd-faults epd-bench epd-bench-r4 epd-bench-ht epd-bench-e2e epd-bench-map" \
  B="$B" DIST_DIR=dist sh deploy/dist.sh "$VERSION" > /dev/null
rm -rf "$DIR"
mkdir -p "$DIR"
: > "$DIR/.epd-dev-bundle"
tar -C "$DIR" -xzf "dist/epd-$VERSION-linux-$(uname -m).tar.gz" --strip-components=1
echo "$DIR: $(du -sh "$DIR" | cut -f1), binaries: $(ls "$DIR/bin" | tr '\n' ' ')"
