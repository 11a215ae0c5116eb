#!/bin/bash
# 69-mask-three-nodes: nodes out of a group that masks, three nodes (host backend, 2 ranks each, every
# expert on two ranks of different nodes). The workers of node 0 run throughout (epd-worker --mask checks
# every step against the reference with the mask its completion reports); meanwhile:
#   1. node 1's workers are SIGKILLed: node 1 is out (its group is removed there);
#   2. node 2's workers are SIGKILLed, and new ones attach there while node 1 is still out: node 2's new
#      group learns from node 0's answer that node 1 is out, and nodes 0 and 2 step together.
# Fails on: a mismatch or a wrong dropped count in any worker's output, node 0's workers not stepping
# (200+ checked steps each) after a loss, node 2's new workers not checking 300 steps each, more than 10
# failed ops per worker of node 0.
set -u
. "$(dirname "$0")/mask-three-nodes-lib.sh"
GROUP=out
alive() { kill -0 "$A0" 2> /dev/null && kill -0 "$A1" 2> /dev/null || fail "a worker of node 0 exited"; }

echo "== 6 workers, every expert on two ranks of different nodes"
for r in 0 1 2 3 4 5; do run_worker $r "$T/w$r.out" --steps $CHAOS_STEPS; eval "W$r=\$!"; done
A0=$W0 A1=$W1
wait_for 20 group_made || fail "group $GROUP not made"
replicated_map
[ "$maps" -ge 1 ] || fail "the replicated map was not staged"
stepping 100 "$T/w0.out" "$T/w1.out" || fail "no steps with the 6 workers"

echo "== 1. node 1's workers SIGKILLed"
kill -KILL "$W2" "$W3"
wait "$W2" "$W3" 2> /dev/null
stepping 200 "$T/w0.out" "$T/w1.out" "$T/w4.out" || fail "nodes 0 and 2 did not step without node 1"
alive

echo "== 2. node 2's workers SIGKILLed, new ones attach there while node 1 is out"
kill -KILL "$W4" "$W5"
wait "$W4" "$W5" 2> /dev/null
stepping 200 "$T/w0.out" "$T/w1.out" || fail "node 0 did not step alone"
run_worker 4 "$T/n4.out" --steps $CHAOS_STEPS
N4=$!
run_worker 5 "$T/n5.out" --steps $CHAOS_STEPS
N5=$!
wait_for 30 sh -c "[ \$(grep -c ' ok\$' $T/n4.out) -ge 300 ] && [ \$(grep -c ' ok\$' $T/n5.out) -ge 300 ]" ||
  fail "node 2's new workers did not check 300 steps each (node 1 is out)"
grep -q "rank_masked: group $GROUP rank 2 masked.*(out of the steps on the node that answered" "$T/c.log" ||
  fail "node 2's new group did not learn that node 1 is out"
alive

{
  kill -KILL "$N4" "$N5"
  wait "$N4" "$N5"
} 2> /dev/null
kill -TERM "$A0" "$A1"
wait "$A0" "$A1" 2> /dev/null
outputs_clean 10 "$T"/w0.out "$T"/w1.out
outputs_clean 2000 "$T"/w[2-5].out "$T"/n*.out # killed: their last ops failed
echo "node 0's workers checked $(checked "$T/w0.out") and $(checked "$T/w1.out") steps," \
  "$(cat "$T"/w0.out "$T"/w1.out | grep -c failed) ops failed over the two losses and the return"
for p in "$P_a" "$P_b" "$P_c"; do kill -TERM "$p"; done
for p in "$P_a" "$P_b" "$P_c"; do wait "$p"; done
echo "69-mask-three-nodes: node 0 served on through two nodes' losses and a return"
