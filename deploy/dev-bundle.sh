#!/bin/sh
# dev-bundle.sh - a relocatable tree for a GPU machine that lacks the build's libraries (libuv, gRPC,
# protobuf-c, ...): the dist bundle (deploy/dist.sh) plus the test and benchmark binaries of the build and
# every library they need beyond the base system. Binaries carry RPATH $ORIGIN/../lib, so the tree runs
# from anywhere; NCCL and the CUDA driver come from the host.
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
B="$B" sh deploy/dist.sh "$VERSION" > /dev/null
rm -rf "$DIR"
mkdir -p "$DIR"
: > "$DIR/.epd-dev-bundle"
tar -C "$DIR" -xzf "dist/epd-$VERSION-linux-$(uname -m).tar.gz" --strip-components=1
for b in epd-gpu-tests epd-tests epd-bench epd-bench-r4 epd-bench-ht epd-bench-e2e epd-bench-map; do
  [ -x "$B/bin/$b" ] && cp "$B/bin/$b" "$DIR/bin/"
done
skip='^(linux-vdso|libc\.so|libm\.so|libdl\.so|librt\.so|libpthread\.so|ld-linux|libgcc_s|libstdc\+\+|libcuda\.so|libnccl\.so)'
for bin in "$DIR"/bin/*; do
  ldd "$bin" 2>/dev/null | awk '/=> \// {print $1, $3}' | while read -r soname path; do
    echo "$soname" | grep -Eq "$skip" && continue
    [ -f "$DIR/lib/$soname" ] || cp -L "$path" "$DIR/lib/$soname"
  done
done
echo "$DIR: $(du -sh "$DIR" | cut -f1), binaries: $(ls "$DIR/bin" | tr '\n' ' ')"
