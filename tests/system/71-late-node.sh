#!/bin/bash
# 71-late-node: one node's workers start 3 s after the other node's (host backend, two nodes of 2 ranks,
# engine.step_timeout_ms 1000), both ways round: the early node's first steps fail (it waits for the late
# node's parts), the late node's first steps, numbered from 0, are ones the early node already left and
# fail too, and then the four step together: every worker ends with 30 steps in a row that match the
# reference, within 400 steps. The CUDA backend's twin: tests/gpu/173-late-node-cuda.sh.
set -u
STEP_TIMEOUT_MS=1000 WORKER_TIMEOUT=60
. "$(dirname "$0")/cluster-lib.sh"
two_nodes
# late GROUP EARLY LATE: the workers of node EARLY's ranks, 3 s later those of node LATE's
late() {
  local g=$1 r nd
  for nd in "$2" "$3"; do
    for r in 0 1 2 3; do
      [ "$([ $r -lt 2 ] && echo a || echo b)" = "$nd" ] || continue
      worker "$g$r" "$nd" -g "$g" --mode ll -r $r -n 4 --steps 400 --seed 9 --experts 16 --hidden 128 --topk 4 \
        --tokens 16 --same-inputs --until-streak 30 --node-ranks 2
    done
    [ "$nd" = "$2" ] && sleep 3
  done
  expect_ok "${g}0" "${g}1" "${g}2" "${g}3"
  echo "   $g: $(cat "$T/$g"[0-3].out | grep -c failed) ops failed while a node was missing; then 30 steps in" \
    "a row matched on every rank"
}
echo "== node 1's workers first, node 0's 3 s later"
late l1 b a
echo "== node 0's workers first, node 1's 3 s later"
late l0 a b
kill -TERM "$P_a" "$P_b"; wait "$P_a"; RA=$?; wait "$P_b"; RB=$?
[ $RA -eq 0 ] && [ $RB -eq 0 ] || fail "daemons exited $RA $RB on SIGTERM"
echo "71-late-node: ok"
