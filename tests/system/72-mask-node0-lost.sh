#!/bin/bash
# 72-mask-node0-lost: node 0's daemon lost in a world of three (host backend, 2 ranks each, every expert on
# two ranks of different nodes, a group that masks). The six workers step; then node 0's daemon and its
# workers are SIGKILLed: nodes 1 and 2 take node 0's ranks out and step on together, every step checked
# against the reference with the mask its completion reports. The CUDA backend's twin:
# tests/gpu/176-node0-lost-three-cuda.sh.
# Fails on: a mismatch or a wrong dropped count in any worker's output, the workers of nodes 1 and 2 not
# stepping (200+ checked steps each) after node 0's loss, a daemon of node 1 or 2 exiting, more than 10
# failed ops per worker of nodes 1 and 2.
set -u
. "$(dirname "$0")/mask-three-nodes-lib.sh"
GROUP=lead
alive() {
  kill -0 "$P_b" 2> /dev/null || fail "node 1's daemon exited"
  kill -0 "$P_c" 2> /dev/null || fail "node 2's daemon exited"
  for w in "$W2" "$W3" "$W4" "$W5"; do kill -0 "$w" 2> /dev/null || fail "a worker of node 1 or 2 exited"; done
}

echo "== 6 workers, every expert on two ranks of different nodes"
for r in 0 1 2 3 4 5; do run_worker $r "$T/w$r.out" --steps $CHAOS_STEPS; eval "W$r=\$!"; done
wait_for 20 group_made || fail "group $GROUP not made"
replicated_map
[ "$maps" -ge 1 ] || fail "the replicated map was not staged"
stepping 100 "$T/w0.out" "$T/w2.out" "$T/w4.out" || fail "no steps with the 6 workers"

echo "== node 0's daemon and workers SIGKILLed"
kill -KILL "$P_a" "$W0" "$W1"
wait "$P_a" "$W0" "$W1" 2> /dev/null
stepping 200 "$T"/w[2-5].out || fail "nodes 1 and 2 did not step without node 0"
alive
"$EPDCTL" -s "$T/b/control.sock" status | grep -q "node 0 down" || fail "node 1's status does not show node 0's link down"
grep -q "node 0 (ranks 0..1) is out of its steps" "$T/b.log" || fail "node 1 did not take node 0 out"

kill -TERM "$W2" "$W3" "$W4" "$W5"
wait "$W2" "$W3" "$W4" "$W5" 2> /dev/null
outputs_clean 10 "$T"/w[2-5].out
outputs_clean 2000 "$T"/w[01].out # killed: their last ops failed
echo "nodes 1 and 2 checked $(checked "$T/w2.out") and $(checked "$T/w4.out") steps (ranks 2, 4)," \
  "$(cat "$T"/w[2-5].out | grep -c failed) ops failed at node 0's loss"
for p in "$P_b" "$P_c"; do kill -TERM "$p"; done
for p in "$P_b" "$P_c"; do wait "$p"; done
echo "72-mask-node0-lost: nodes 1 and 2 served on without node 0"
