#!/bin/bash
# 172-renormalize-two-nodes-cuda.sh - renormalisation of masked ranks across two nodes on the CUDA
# backend: two daemons with engine.backend=cuda are nodes 0 and 1 of one world of 4 ranks (2 each; on one
# GPU all four share it: two-nodes-lib.sh), groups attached with on_rank_loss = mask and renormalize = 1,
# the default expert map (every expert on one rank). The four workers step; then rank 3's worker is
# SIGKILLed: node 1 masks it and tells node 0, and the world plan drops every rank's entries for rank 3's
# experts and scales the weights each token keeps to the sum of all its valid entries' weights. epd-worker
# --mask --renormalize checks every step against the reference computed with the mask its completion
# reports and renormalisation. LL, then HT.
# Fails on: a mismatch or a wrong dropped count, the three ranks left not checking 100 steps each, no
# entry dropped on node 0, more than 10 failed ops of a rank left, a daemon that exits or an engine that
# fails.
# Usage (repository root, GPU machine): bash tests/gpu/172-renormalize-two-nodes-cuda.sh [build-dir]
set -u
B=${1:-${EPD_BUILD:-build}}
GPN=2
TWO_NODES_DAEMON_OPTS="-o engine.step_timeout_ms=2000"
. "$(dirname "$0")/two-nodes-lib.sh"
start_nodes
checked() { cat "$1" 2> /dev/null | grep -c " ok$"; }
for MODE in ll ht; do
  echo "== $MODE: four ranks, then without rank 3"
  g=rn$MODE
  start_workers $g --mode $MODE --steps 1000000 --seed 5 --experts 16 --hidden 256 --topk 8 --tokens 32 \
    --same-inputs --mask --renormalize -v --until-streak 1000000
  c="true"
  for r in 0 1 2 3; do c="$c && [ \$(cat $T/$g$r.out 2> /dev/null | grep -c ' ok\$') -ge 30 ]"; done
  wait_for 90 sh -c "$c" || fail "$MODE: the four workers did not step: $(tail -2 "$T/${g}0.out")"
  eval "w3=\$W_${g}3"
  kill -KILL $(pgrep -P "$w3") "$w3" 2> /dev/null # the worker under timeout(1), and timeout
  wait "$w3" 2> /dev/null
  c="true"
  for r in 0 1 2; do c="$c && [ \$(cat $T/$g$r.out | grep -c ' ok\$') -ge $(($(checked "$T/$g$r.out") + 100)) ]"; done
  wait_for 90 sh -c "$c" || fail "$MODE: ranks 0-2 did not step without rank 3: $(tail -2 "$T/${g}0.out")"
  st=$("$EPDCTL" -s "$T/n0/control.sock" status 2>&1)
  echo "$st" | grep -q "on rank loss: mask (renormalize); masked now: 3;" || fail "$MODE: node 0 status: $st"
  drop=$(echo "$st" | sed -n 's/.*entries dropped: \([0-9]*\).*/\1/p' | head -1)
  [ "${drop:-0}" -gt 0 ] || fail "$MODE: no entry dropped on node 0: $st"
  for r in 0 1 2; do
    eval "kill -TERM \$W_$g$r"
    eval "wait \$W_$g$r" 2> /dev/null
    f=$T/$g$r.out
    grep -q " MISMATCH$\|differs\|entries dropped\|, want" "$f" &&
      fail "$MODE rank $r: $(grep -m3 " MISMATCH$\|differs\|entries dropped\|, want" "$f")"
    [ "$(grep -c failed "$f")" -le 10 ] || fail "$MODE rank $r: $(grep -c failed "$f") failed ops"
  done
  echo "   ranks 0-2 checked $(checked "$T/${g}0.out"), $(checked "$T/${g}1.out"), $(checked "$T/${g}2.out") steps;" \
    "$drop entries dropped on node 0"
done
kill -0 "${PIDS[0]}" 2> /dev/null && kill -0 "${PIDS[1]}" 2> /dev/null || fail "a daemon exited"
grep -q "engine failed" "$T/node0.log" "$T/node1.log" && fail "an engine failed: $(grep -h -m1 'engine failed' "$T"/node*.log)"
echo "172-renormalize-two-nodes-cuda: every checked step matched the reference with its mask and renormalisation"
