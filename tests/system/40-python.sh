#!/bin/sh
# The Python package (python/) against a real daemon on the host backend: pytest of python/tests.
# Skips (77) when the daemon or libepd is not built, or when pytest/numpy are missing.
set -u
cd "$(dirname "$0")/../.." || exit 1
B="${EPD_BUILD:-build}"
case "$B" in /*) ;; *) B="$PWD/$B" ;; esac
PY="${PYTHON:-/usr/bin/python3}"
LIB="${EPD_LIBRARY:-$B/lib/libepd.so}"
if [ ! -x "$B/bin/epd" ] || [ ! -f "$LIB" ]; then
  echo "skip: $B/bin/epd or $LIB not built"
  exit 77
fi
if ! "$PY" -c "import numpy, pytest" 2>/dev/null; then
  echo "skip: $PY lacks numpy or pytest"
  exit 77
fi
export EPD_BUILD="$B" EPD_LIBRARY="$LIB"
export EPD_PROTO_CACHE="${EPD_PROTO_CACHE:-${EPD_TEST_TMPDIR:-/tmp}/proto-cache}"
exec "$PY" -m pytest -q -p no:cacheprovider python/tests
