#!/bin/bash
# 170-mask-two-nodes-cuda.sh - masked ranks across two nodes on the CUDA backend (the GPU twin of
# tests/system/67-mask-two-nodes.sh): two daemons with engine.backend=cuda are nodes 0 and 1 of one world
# of 4 ranks (2 each; on one GPU all four share it: two-nodes-lib.sh). One group is attached with
# on_rank_loss = mask and an expert map that places every expert on two ranks of different nodes. For
# EPD_MASK_CHAOS_SECONDS (default 20) a random worker is SIGKILLed about every 0.5 s (at most one rank of
# each node down at once) and a new worker of its rank starts 0.1-0.5 s later: LL steps for half the
# time, then HT steps in another group. Every worker (epd-worker --mask) checks each step against the
# reference computed with the mask its completion reports (the world plan routes without the masked
# ranks; their node sends no tokens for them). A node masks its own ranks and tells the other; a step one
# node sent before the notice came fails on both (the worker goes on), as does a combine whose dispatch
# ran with a rank masked since. Then the workers still running are killed and a clean round of 4 workers
# must run.
# Fails on: a mismatch or a wrong dropped count in any worker's output, killed or not, fewer than 200
# steps checked by workers that ran to their end, no rank masked on either node or no mask learnt from
# the other node, a clean round that fails or hangs, a daemon that exits.
# Usage (repository root, GPU machine): bash tests/gpu/170-mask-two-nodes-cuda.sh [build-dir]
set -u
B=${1:-${EPD_BUILD:-build}}
GPN=2
TWO_NODES_DAEMON_OPTS="-o engine.slots_factor_pct=200 -o engine.step_timeout_ms=2000"
. "$(dirname "$0")/two-nodes-lib.sh"
CHAOS_S=${EPD_MASK_CHAOS_SECONDS:-20} CHAOS_STEPS=300
E=16 REP_NEXT=2 # the second replica of every expert on the other node
RANDOM=${EPD_CHAOS_SEED:-4321}
start_nodes
ctl() { "$EPDCTL" -s "$T/n0/control.sock" "$@"; }
run_worker() { # RANK STEPS OUT: at its node (ranks 0-1 node 0, 2-3 node 1)
  CUDA_VISIBLE_DEVICES=$(gpu_of "$1") "$WORKER" -s "$T/n$(($1 / GPN))/control.sock" -g "$GROUP" --mode "$MODE" \
    -r "$1" -n 4 --steps "$2" --seed 9 --experts $E --hidden 128 --topk 4 --tokens 16 --same-inputs --mask \
    --until-streak 1000000 --node-ranks $GPN > "$3" 2>&1 &
}
# at most one rank of each node down: each node keeps a live rank (its last one would not be masked)
may_kill() { [ -z "${DOWN[$(($1 ^ 1))]:-}" ] && [ -n "${WP[$(($1 ^ 1))]:-}" ]; }
daemons_alive() {
  kill -0 "$P_0" 2> /dev/null || fail "node 0 exited"
  kill -0 "$P_1" 2> /dev/null || fail "node 1 exited"
}
. "$(dirname "$0")/../mask-chaos-lib.sh"

echo "== warm-up: one clean round of 4 workers"
warm_up
chaos_phases "$CHAOS_S"
clean_round
own0=$(grep -c "rank_masked: group chaos[-ht]* rank [01] masked.*(its client" "$T/node0.log")
own1=$(grep -c "rank_masked: group chaos[-ht]* rank [23] masked.*(its client" "$T/node1.log")
learnt=$(cat "$T/node0.log" "$T/node1.log" | grep -c "rank_masked: group chaos[-ht]* rank [0-9] masked.*(masked on its node)")
failed=$(cat "$T"/w*.out | grep -c "failed")
echo "killed $killed workers; ranks masked by their node: $own0 on node 0, $own1 on node 1, learnt from the" \
  "other node $learnt times; $nfin workers finished ($retried attaches retried, $maps" \
  "replicated maps staged); $steps checked steps, $failed failed ops"
[ $killed -ge 5 ] || fail "only $killed kills in $CHAOS_S s: the run exercised too little"
[ $((own0 + own1)) -ge 1 ] || fail "no node masked a rank for $killed kills"
[ "$learnt" -ge 1 ] || fail "no node learnt a mask from the other node"
[ $steps -ge 200 ] || fail "only $steps checked steps (want 200+)"
daemons_alive
grep -q "engine failed" "$T/node0.log" "$T/node1.log" && fail "an engine failed: $(grep -h -m1 'engine failed' "$T"/node*.log)"
echo "170-mask-two-nodes-cuda: every checked step matched the reference with its mask"
