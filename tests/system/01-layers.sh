#!/bin/bash
# 01-layers: the daemon's layers (docs/ARCHITECTURE.md "Layers") include only downwards. core includes
# no other layer; host, net and cuda include the core, and host and cuda the net layer's headers; no layer
# but control includes control, and main.c reaches the engine through its public header (core/engine.h)
# only. A violation names the file and the include.
set -u
cd "$(dirname "$0")/../.." || exit 1
allowed() { # layer -> the layers its files may include besides its own
  case $1 in
    core) echo "" ;;
    net) echo "core" ;;
    host) echo "core net" ;;
    cuda) echo "core net" ;;
    control) echo "core net host cuda" ;;
  esac
}
bad=0 n=0
for f in daemon/*/*.[ch]; do
  layer=$(basename "$(dirname "$f")")
  ok=" $layer $(allowed "$layer") "
  [ "$ok" = " $layer  " ] && [ "$layer" != core ] && { echo "FAIL: $f is in no known layer ($layer)"; bad=1; continue; }
  while IFS= read -r inc; do
    n=$((n + 1))
    dep=${inc%%/*}
    case "$ok" in *" $dep "*) ;; *) echo "FAIL: $f ($layer) includes $inc"; bad=1 ;; esac
  done < <(grep -oE '^#include "(core|host|cuda|net|control)/[^"]*"' "$f" | cut -d'"' -f2)
done
# main.c: public headers of the engine only
if grep -q '^#include "core/engine_internal.h"\|^#include "cuda/\|^#include "host/\|^#include "net/' \
    daemon/control/main.c; then
  echo "FAIL: daemon/control/main.c includes an engine-internal header:"
  grep -n '^#include "core/engine_internal.h"\|^#include "cuda/\|^#include "host/\|^#include "net/' daemon/control/main.c
  bad=1
fi
# a daemon header or source outside the layer folders
for f in daemon/*.[ch]; do [ -e "$f" ] && { echo "FAIL: $f is outside the layer folders"; bad=1; }; done
[ "$n" -gt 20 ] || { echo "FAIL: only $n layer includes found: the check does not see the tree"; exit 1; }
[ $bad = 0 ] && echo "01-layers: $n includes across daemon/{core,host,cuda,net,control} follow the layers"
exit $bad
