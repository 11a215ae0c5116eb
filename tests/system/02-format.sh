#!/bin/bash
# 02-format: every C, CUDA and header file of the tree is as clang-format (.clang-format) writes it, so
# that `make format` leaves the tree unchanged. The tree is formatted with clang-format 14 (Debian 12's):
# another major version formats some constructs differently, so the check skips there and says so.
# Generated files (tests/gpu/test_plumb_dev_ptx.h) are not checked.
set -u
cd "$(dirname "$0")/../.." || exit 1
CF=${CLANG_FORMAT:-clang-format}
command -v "$CF" > /dev/null || { echo "skip: $CF is not installed (deploy/deps.sh installs it)"; exit 77; }
ver=$("$CF" --version | sed -n 's/.*version \([0-9]*\)\..*/\1/p')
[ "$ver" = 14 ] || { echo "skip: $CF is version ${ver:-unknown}; the tree is formatted with version 14"; exit 77; }
files=$(make -s --no-print-directory format-files) || { echo "FAIL: make format-files"; exit 1; }
n=0 bad=0
for f in $files; do
  n=$((n + 1))
  if ! "$CF" "$f" | cmp -s - "$f"; then
    echo "FAIL: $f is not formatted (make format); first differences:"
    "$CF" "$f" | diff "$f" - | head -8 | sed 's/^/  /'
    bad=$((bad + 1))
  fi
done
[ "$n" -gt 50 ] || { echo "FAIL: only $n files listed: the check does not see the tree"; exit 1; }
[ $bad = 0 ] || { echo "FAIL: $bad of $n files differ from clang-format's output"; exit 1; }
echo "02-format: $n files as clang-format $ver writes them"
