#!/bin/bash
# 67-mask-two-nodes: masked ranks across two nodes (host backend). Two daemons on this host are nodes 0
# and 1 of one world of 4 ranks (2 each); one group is attached with on_rank_loss = mask and an expert map
# that places every expert on two ranks of different nodes. For EPD_MASK_CHAOS_SECONDS (default 15) a
# random worker is SIGKILLed about every 0.5 s (at most one rank of each node down at once) and a new
# worker of its rank starts 0.1-0.5 s later: LL steps for half the time, then HT steps in another group. Every worker (epd-worker --mask) checks each step
# against the reference computed with the mask its completion reports. A node masks its own ranks and
# tells the other; a step one node sent before the notice came fails everywhere (the worker goes on);
# the last live rank of a node is not masked but lost (steps fail until its new worker attaches).
# Then the workers still running are killed (one that outlives every worker of the other node could not
# step: that node has no group any more) and a clean round of 4 workers must run.
# Fails on: a mismatch or a wrong dropped count in any worker's output, killed or not, fewer than 600
# steps checked by workers that ran to their end, no rank masked on either node or no mask learnt from
# the other node, a clean round that fails or hangs, daemon fd counts above their baselines once every
# worker left.
set -u
STEP_TIMEOUT_MS=2000 WORKER_TIMEOUT=300
. "$(dirname "$0")/cluster-lib.sh"
CHAOS_S=${EPD_MASK_CHAOS_SECONDS:-15} CHAOS_STEPS=300
E=16 REP_NEXT=2 # the second replica of every expert on the other node
RANDOM=${EPD_CHAOS_SEED:-4321}
two_nodes -o engine.slots_factor_pct=200
ctl() { "$EPDCTL" -s "$T/a/control.sock" "$@"; }
run_worker() { # RANK STEPS OUT: at its node (ranks 0-1 node a, 2-3 node b)
  local nd=a
  [ "$1" -ge 2 ] && nd=b
  ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0" "$WORKER" -s "$T/$nd/control.sock" -g "$GROUP" \
    --mode "$MODE" -r "$1" -n 4 --steps "$2" --seed 9 --experts $E --hidden 64 --topk 4 --tokens 16 --same-inputs \
    --mask --until-streak 1000000 --node-ranks 2 > "$3" 2>&1 &
}
# at most one rank of each node down: each node keeps a live rank (its last one would not be masked)
may_kill() { [ -z "${DOWN[$(($1 ^ 1))]:-}" ] && [ -n "${WP[$(($1 ^ 1))]:-}" ]; }
daemons_alive() {
  kill -0 "$P_a" 2> /dev/null || fail "node 0 exited"
  kill -0 "$P_b" 2> /dev/null || fail "node 1 exited"
}
group_gone() { # on both nodes
  local n
  for n in a b; do "$EPDCTL" -s "$T/$n/control.sock" experts "$GROUP" 2> /dev/null | grep -q '^expert' && return 1; done
  return 0
}
. "$(dirname "$0")/../mask-chaos-lib.sh"

echo "== warm-up: one clean round of 4 workers, then the daemons' fds with nobody attached"
warm_up
base_a=$(fds "$P_a") base_b=$(fds "$P_b")
chaos_phases "$CHAOS_S"
clean_round
own_a=$(grep -c "rank_masked: group chaos[-ht]* rank [01] masked.*(its client" "$T/a.log")
own_b=$(grep -c "rank_masked: group chaos[-ht]* rank [23] masked.*(its client" "$T/b.log")
learnt=$(cat "$T/a.log" "$T/b.log" | grep -c "rank_masked: group chaos[-ht]* rank [0-9] masked.*(masked on its node)")
failed=$(cat "$T"/w*.out | grep -c "failed")
echo "killed $killed workers; ranks masked by their node: $own_a on node 0, $own_b on node 1, learnt from the" \
  "other node $learnt times; $nfin workers finished ($retried attaches retried, $maps" \
  "replicated maps staged); $steps checked steps, $failed failed ops"
[ $killed -ge 5 ] || fail "only $killed kills in $CHAOS_S s: the run exercised too little"
[ $((own_a + own_b)) -ge 1 ] || fail "no node masked a rank for $killed kills"
[ "$learnt" -ge 1 ] || fail "no node learnt a mask from the other node"
[ $steps -ge 600 ] || fail "only $steps checked steps (want 600+)"
# once every worker left: the group is gone on both nodes and their fds are back to the baselines
wait_for 20 sh -c "[ \$(ls /proc/$P_a/fd | wc -l) -le $((base_a + 2)) ] && [ \$(ls /proc/$P_b/fd | wc -l) -le $((base_b + 2)) ]" ||
  fail "daemon fds $base_a -> $(fds "$P_a") (node 0), $base_b -> $(fds "$P_b") (node 1) after every worker left"
for p in "$P_a" "$P_b"; do kill -TERM "$p"; done
for p in "$P_a" "$P_b"; do wait "$p"; done
echo "67-mask-two-nodes: every checked step matched the reference with its mask"
