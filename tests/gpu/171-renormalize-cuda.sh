#!/bin/bash
# 171-renormalize-cuda.sh - renormalisation of masked ranks on the CUDA backend: one daemon of 2 ranks
# (on one GPU they share it), groups attached with on_rank_loss = mask and renormalize = 1, the default
# expert map (every expert on one rank: no replicas). Both workers step; then rank 1's worker is SIGKILLed
# and rank 0 steps alone: its entries for rank 1's experts are dropped and the weights each token keeps
# are scaled to the sum of all its valid entries' weights. epd-worker --mask --renormalize checks every
# step against the reference computed with the mask its completion reports and renormalisation (the LL
# combine's output, the HT receivers' weights), and the dropped count. LL, then HT.
# Fails on: a mismatch or a wrong dropped count, rank 0 not checking 100 steps alone, no entry dropped,
# more than 10 failed ops of rank 0, a daemon that exits.
# Usage (repository root, on the GPU machine): bash tests/gpu/171-renormalize-cuda.sh [build-dir]
set -u
B=${1:-${EPD_BUILD:-build}}
DL_NGPU=2
. "$(dirname "$0")/daemon-lib.sh"
start_daemon -o engine.step_timeout_ms=2000
checked() { cat "$1" 2> /dev/null | grep -c " ok$"; }
for MODE in ll ht; do
  echo "== $MODE: two ranks, then rank 0 alone"
  for r in 0 1; do
    worker "$MODE$r" -g "rn-$MODE" --mode "$MODE" -r $r -n 2 --steps 1000000 --seed 5 --experts 16 --hidden 256 \
      --topk 8 --tokens 32 --same-inputs --mask --renormalize -v --until-streak 1000000
  done
  eval "w0=\$W_${MODE}0 w1=\$W_${MODE}1"
  wait_for 60 sh -c "[ \$(grep -c ' ok\$' $T/${MODE}0.out) -ge 30 ] && [ \$(grep -c ' ok\$' $T/${MODE}1.out) -ge 30 ]" ||
    fail "$MODE: the two workers did not step: $(tail -2 "$T/${MODE}0.out")"
  kill -KILL $(pgrep -P "$w1") "$w1" 2> /dev/null # the worker under timeout(1), and timeout
  wait "$w1" 2> /dev/null
  n0=$(checked "$T/${MODE}0.out")
  wait_for 60 sh -c "[ \$(grep -c ' ok\$' $T/${MODE}0.out) -ge $((n0 + 100)) ]" ||
    fail "$MODE: rank 0 did not step alone: $(tail -2 "$T/${MODE}0.out")"
  kill -0 "$PID" 2> /dev/null || fail "the daemon exited"
  st=$("$CTL" -s "$SOCK" status 2>&1)
  echo "$st" | grep -q "on rank loss: mask (renormalize); masked now: 1;" || fail "$MODE: status: $st"
  drop=$(echo "$st" | sed -n 's/.*entries dropped: \([0-9]*\).*/\1/p' | head -1)
  [ "${drop:-0}" -gt 0 ] || fail "$MODE: no entry dropped: $st"
  kill -TERM $(pgrep -P "$w0") 2> /dev/null
  wait "$w0" 2> /dev/null
  f=$T/${MODE}0.out
  grep -q " MISMATCH$\|differs\|entries dropped\|, want" "$f" &&
    fail "$MODE: $(grep -m3 " MISMATCH$\|differs\|entries dropped\|, want" "$f")"
  [ "$(grep -c failed "$f")" -le 10 ] || fail "$MODE: $(grep -c failed "$f") failed ops of rank 0"
  grep -q "rank_masked: group rn-$MODE rank 1 masked" "$LOG" || fail "$MODE: rank 1 was not masked"
  echo "   rank 0 checked $(checked "$f") steps, $(grep -c failed "$f") ops failed at the loss, $drop entries dropped"
done
stop_daemon
echo "171-renormalize-cuda: every checked step matched the reference with its mask and renormalisation"
