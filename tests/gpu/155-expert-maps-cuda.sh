#!/bin/bash
# 155-expert-maps-cuda.sh - the daemon with engine.backend=cuda, 2 ranks (redundant slots), and two
# epd-worker processes stepping while rank 0 stages a new random expert map every 3 steps through
# SetExpertMap: every step is checked against the reference with the map version its completion carries,
# read from libepd's mapped map table (BF16, then FP8 with skewed routing); then with expert-weights
# regions (64 KiB per slot) and maps that move replicas with weight copies (GPU to GPU over NVLink at the
# switch: every slot must hold its expert's weights word for word, and the toy expert of each slot runs
# on the weights it holds); then the same with every dispatch and combine replayed from CUDA graphs
# captured once (the graphs keep replaying across the switches). On one GPU both ranks share it
# (daemon-lib.sh): the weight copies between the ranks are then copies within that GPU (no NVLink), the
# checks the same.
# Usage (repository root, on the GPU machine): bash tests/gpu/155-expert-maps-cuda.sh [build-dir]
set -u
B=${1:-${EPD_BUILD:-build}}
. "$(dirname "$0")/daemon-lib.sh"

start_daemon -o engine.step_timeout_ms=4000 -o engine.slots_factor_pct=200

run2() { # GROUP STEPS ARGS...
  local g=$1 steps=$2; shift 2
  for r in 0 1; do
    timeout 120 "$WORKER" -s "$SOCK" -g "$g" -r $r -n 2 --steps "$steps" --map-every 3 "$@" > "$T/w$g$r.out" 2>&1 &
    eval "P$r=$!"
  done
  for r in 0 1; do
    eval "wait \$P$r" || fail "worker $g/$r exited $?"
    grep -q "steps ok" "$T/w$g$r.out" || fail "worker $g/$r printed no summary"
  done
  grep -h "steps ok\|map switches seen" "$T"/w"$g"?.out
  local seen; seen=$(sed -n 's/.*: \([0-9]*\) map switches seen.*/\1/p' "$T/w${g}1.out")
  [ "${seen:-0}" -ge $(( steps / 3 - 2 )) ] || fail "rank 1 saw ${seen:-0} map switches in $steps steps"
}
echo "== LL BF16, 120 steps, a new map every 3 steps (hidden 256, 32 experts, top-4)"
run2 bf 120 --seed 21 --hidden 256 --experts 32 --topk 4 --tokens 64
echo "== LL FP8 + skew, 60 steps, a new map every 3 steps (hidden 512)"
run2 f8 60 --seed 22 --hidden 512 --experts 32 --topk 4 --tokens 64 --fp8 --skew
echo "== LL + weight migration (64 KiB per slot), 90 steps, a new map with copies every 3 steps"
run2 mw 90 --seed 23 --hidden 256 --experts 32 --topk 4 --tokens 64 --weights 65536
copies=$(sed -n 's/.*, \([0-9]*\) weight copies asked.*/\1/p' "$T/wmw0.out")
[ "${copies:-0}" -ge 30 ] || fail "rank 0 asked for only ${copies:-0} weight copies"
grep -Eq "switched expert map .* \([1-9][0-9]* weight bytes copied\)" "$LOG" || fail "no switch copied weights"
echo "== LL FP8 from CUDA graphs captured once, with weight migration, 90 steps, a new map every 3 steps"
run2 gw 90 --seed 24 --hidden 512 --experts 32 --topk 4 --tokens 64 --fp8 --weights 65536 --graph
grep -q "graph replays" "$T/wgw0.out" || fail "the graph run did not say so"
grep -c "event map_switch" "$LOG"
stop_daemon
echo "ok"
