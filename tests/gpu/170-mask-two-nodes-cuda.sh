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
# must run. Then a whole node out, each in turn, while the other node's workers check every step:
#   1. both workers of node 1 SIGKILLed at once: the group is removed there, node 0 masks ranks 2-3 and
#      goes on;
#   2. new workers at node 1: ranks 2-3 back at a step boundary, the four step together;
#   3. both workers of node 0 SIGKILLed: node 1 goes on alone (its steps need no place in node 0's order
#      of the exchanges: no NCCL call leaves the node);
#   4. new workers at node 0: back, the four step together;
#   5. node 1 drains (epdctl drain): node 0 takes it out at its first refused dispatch and goes on.
# Fails on: a mismatch or a wrong dropped count in any worker's output, killed or not, fewer than 200
# steps checked by workers that ran to their end, no rank masked on either node or no mask learnt from
# the other node, a clean round that fails or hangs, a node's workers that do not step while the other
# node is out or after it came back, more than 10 failed ops of a worker that ran through, a daemon that
# exits or an engine that fails.
# Usage (repository root, GPU machine): bash tests/gpu/170-mask-two-nodes-cuda.sh [build-dir]
set -u
B=${1:-${EPD_BUILD:-build}}
GPN=2
TWO_NODES_DAEMON_OPTS="-o engine.slots_factor_pct=200 -o engine.step_timeout_ms=2000"
. "$(dirname "$0")/two-nodes-lib.sh"
CHAOS_S=${EPD_MASK_CHAOS_SECONDS:-20} CHAOS_STEPS=300
RANDOM=${EPD_CHAOS_SEED:-4321}
start_nodes
. "$(dirname "$0")/mask-two-nodes-lib.sh"
# at most one rank of each node down: each node keeps a live rank (its last one would not be masked)
may_kill() { [ -z "${DOWN[$(($1 ^ 1))]:-}" ] && [ -n "${WP[$(($1 ^ 1))]:-}" ]; }
daemons_alive() {
  kill -0 "$P_0" 2> /dev/null || fail "node 0 exited"
  kill -0 "$P_1" 2> /dev/null || fail "node 1 exited"
}
group_gone() { # on both nodes
  local n
  for n in 0 1; do "$EPDCTL" -s "$T/n$n/control.sock" experts "$GROUP" 2> /dev/null | grep -q '^expert' && return 1; done
  return 0
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

echo "== a whole node out, each in turn"
GROUP=out MODE=ll
clean() { # clean MAX_FAILED OUT...: no mismatch, at most MAX_FAILED failed ops
  local max=$1 f
  shift
  for f in "$@"; do
    grep -q " MISMATCH$\|differs\|entries dropped\|, want" "$f" &&
      fail "$(basename "$f"): $(grep -m3 " MISMATCH$\|differs\|entries dropped\|, want" "$f")"
    [ "$(grep -c failed "$f")" -le "$max" ] || fail "$(basename "$f"): $(grep -c failed "$f") failed ops"
  done
  return 0
}
kill_pair() { # kill_pair NODE: SIGKILL both workers of NODE at once (as a crash of the node's workers)
  local p0 p1
  eval "p0=\$V_$(($1 * 2)) p1=\$V_$(($1 * 2 + 1))"
  kill -KILL "$p0" "$p1" 2> /dev/null
  wait "$p0" "$p1" 2> /dev/null
}
pair 0 a
pair 1 b
wait_for 30 group_made || fail "group $GROUP not made"
replicated_map
stepping 50 "$T"/a0.out "$T"/a1.out "$T"/b2.out "$T"/b3.out || fail "no steps with the 4 workers"
out_and_back() { # out_and_back NODE OLD NEW: NODE's workers killed while the other node's (outputs OLD) step
  local n=$1 o=$((1 - $1)) old=$2 new=$3
  kill_pair "$n"
  stepping 100 "$T/$old$((o * 2)).out" "$T/$old$((o * 2 + 1)).out" ||
    fail "node $o's workers did not step without node $n"
  grep -q "node $n (ranks $((n * 2))..$((n * 2 + 1))) is out of its steps" "$T/node$o.log" ||
    fail "node $o did not take node $n out"
  echo "   new workers at node $n: back"
  pair "$n" "$new"
  stepping 100 "$T/$new$((n * 2)).out" "$T/$new$((n * 2 + 1)).out" "$T/$old$((o * 2)).out" \
    "$T/$old$((o * 2 + 1)).out" || fail "the four did not step after node $n came back"
}
echo "== 1-2. node 1's workers SIGKILLed: node 0 goes on without ranks 2-3; then new workers at node 1"
out_and_back 1 a c
echo "== 3-4. node 0's workers SIGKILLed: node 1 goes on alone; then new workers at node 0"
out_and_back 0 c d
echo "== 5. node 1 drains: node 0 goes on without it"
"$EPDCTL" -s "$T/n1/control.sock" drain > "$T/drain.out" 2>&1 || fail "epdctl drain: $(cat "$T/drain.out")"
stepping 100 "$T"/d0.out "$T"/d1.out || fail "node 0's workers did not step after node 1 began to drain"
grep -q "node 1 (ranks 2..3) is out of its steps.*its node is draining" "$T/node0.log" ||
  fail "node 0 did not take node 1 out when it drained"
kill_pair 0
kill_pair 1
clean 10 "$T"/d0.out "$T"/d1.out
clean 2000 "$T"/a0.out "$T"/a1.out "$T"/b2.out "$T"/b3.out "$T"/c2.out "$T"/c3.out # their last ops failed
echo "   node 0's first workers checked $(checked "$T/a0.out") steps, node 1's second $(checked "$T/c2.out")," \
  "$(cat "$T"/[a-d]*.out | grep -c failed) ops failed at the losses and the returns"
daemons_alive
grep -q "engine failed" "$T/node0.log" "$T/node1.log" && fail "an engine failed: $(grep -h -m1 'engine failed' "$T"/node*.log)"
echo "170-mask-two-nodes-cuda: every checked step matched the reference with its mask"
