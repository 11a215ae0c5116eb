#!/bin/bash
# 68-mask-node-out: a node out of a group that masks (host backend, two nodes on this host, 2 ranks each,
# every expert on two ranks of different nodes). The workers of node 0 run throughout (epd-worker --mask
# checks every step against the reference with the mask its completion reports, and that no entry was
# dropped where a replica was live); meanwhile:
#   1. both workers of node 1 are SIGKILLed: the group is removed there, node 0 masks ranks 2-3 and its
#      workers go on alone;
#   2. two new workers attach at node 1: node 0 takes ranks 2-3 back at a step boundary; the new workers
#      must check 300 steps with node 0's;
#   3. node 1's daemon is SIGKILLed: its link goes down, node 0 masks ranks 2-3 again and goes on.
# Fails on: a mismatch or a wrong dropped count in any worker's output, node 0's workers not stepping
# (200+ checked steps each) after a loss, the new workers of node 1 not checking 300 steps, no
# "out of its steps" / rank_unmasked line in node 0's log, more than 10 failed ops per worker of node 0.
set -u
. "$(dirname "$0")/mask-node-lib.sh"

echo "== 1. node 1's workers SIGKILLed: node 0 goes on without ranks 2-3"
kill -KILL "$B2" "$B3"
wait "$B2" "$B3" 2> /dev/null
stepping 200 || fail "node 0's workers did not step without node 1"
alive
grep -q "node 1 (ranks 2..3) is out of its steps.*removed on its node" "$T/a.log" ||
  fail "node 0 did not take node 1 out when its group was removed there"

echo "== 2. new workers at node 1: ranks 2-3 back at a step boundary"
run_worker 2 $CHAOS_STEPS "$T/c2.out" -v --until-streak 1000000
C2=$!
run_worker 3 $CHAOS_STEPS "$T/c3.out" -v --until-streak 1000000
C3=$!
wait_for 30 sh -c "[ \$(grep -c ' ok\$' $T/c2.out) -ge 300 ] && [ \$(grep -c ' ok\$' $T/c3.out) -ge 300 ]" ||
  fail "node 1's new workers did not check 300 steps each"
grep -q "rank_unmasked: group $GROUP rank 2 back" "$T/a.log" || fail "node 0 did not take rank 2 back"
alive

echo "== 3. node 1's daemon SIGKILLed: its link goes down, node 0 goes on"
kill -KILL "$P_b"
wait "$P_b" 2> /dev/null
kill -KILL "$C2" "$C3" 2> /dev/null
wait "$C2" "$C3" 2> /dev/null
stepping 200 || fail "node 0's workers did not step after node 1's daemon died"
alive
grep -q "node 1 (ranks 2..3) is out of its steps.*link to its node is down" "$T/a.log" ||
  fail "node 0 did not take node 1 out when its link went down"

kill -TERM "$A0" "$A1"
wait "$A0" "$A1" 2> /dev/null
outputs_clean 10 "$T"/a0.out "$T"/a1.out
outputs_clean 2000 "$T"/b2.out "$T"/b3.out "$T"/c2.out "$T"/c3.out # killed: their last ops failed
echo "node 0's workers checked $(checked "$T/a0.out") and $(checked "$T/a1.out") steps," \
  "$(cat "$T"/a0.out "$T"/a1.out | grep -c failed) ops failed at the losses and the return"
kill -TERM "$P_a"
wait "$P_a"
echo "68-mask-node-out: node 0 served on through its peer's losses and took it back"
