#!/bin/bash
# 176-node0-lost-three-cuda.sh - node 0, which orders the exchanges, lost mid-exchange in a world of three
# (CUDA backend, three nodes of one rank; on one GPU all three share it: two-nodes-lib.sh). One group
# attached with on_rank_loss = mask and an expert map that places every expert on two neighbouring ranks
# (r and r+1 mod 3): every expert keeps a replica when one node is lost, and rows cross between every two
# nodes in every step. The daemons are epd-faults; while the three workers step:
#   0. node 0's worker is SIGKILLed: node 0 is out of the group's steps (no client there) but still orders
#      the exchanges, told by nodes 1 and 2 when their steps are ready; nodes 1 and 2 step on, exchanging
#      rows; a new worker at node 0 brings it back;
#   1. node 0's daemon dies inside an exchange (its hook EPD_TEST_DIE_IN_EXCHANGE), nodes 1 and 2 waiting
#      in it: they abort the world communicator, node 1 (the first node left) hands node 2 the id of one
#      without node 0, both make it, node 1 orders the exchanges from then on, and their workers step on
#      with rank 0 masked, exchanging rows between nodes 1 and 2;
#   2. node 2's worker is killed and a new one attaches: rank 2 is masked, then unmasked at a step
#      boundary, with node 1 ordering.
# Every step of every worker is checked against the reference with the mask its completion reports.
# Fails on: a mismatch, nodes 1 and 2 not stepping while node 0 is out of the group or the three not
# after its new worker came, a world communicator not made again without node 0 on node 1 or 2, the
# workers of nodes 1 and 2 not stepping without node 0 or after node 2's new worker came, a daemon of node 1 or 2
# exiting, an engine failing. The host backend's twin: tests/system/72-mask-node0-lost.sh.
# Usage (repository root, GPU machine): bash tests/gpu/176-node0-lost-three-cuda.sh [build-dir]
set -u
B=${1:-${EPD_BUILD:-build}}
GPN=1
NODES=3
TWO_NODES_DAEMON_OPTS="-o engine.slots_factor_pct=200 -o engine.step_timeout_ms=2000"
TWO_NODES_FAULTS=1
. "$(dirname "$0")/two-nodes-lib.sh"
start_nodes
. "$(dirname "$0")/mask-two-nodes-lib.sh"
E=12 REP_NEXT=1 # expert e on ranks e/4 and e/4 + 1 (mod 3)
may_kill() { return 1; }
daemons_alive() {
  kill -0 "$P_1" 2> /dev/null || fail "node 1 exited"
  kill -0 "$P_2" 2> /dev/null || fail "node 2 exited"
}
. "$(dirname "$0")/../mask-chaos-lib.sh"
R=$WR GROUP=lead3 MODE=ll
for n in 0 1 2; do pair $n a; done
wait_for 30 group_made || fail "group $GROUP not made"
replicated_map
stepping 50 "$T"/a0.out "$T"/a1.out "$T"/a2.out || fail "no steps with the 3 workers"

echo "== 0. node 0's worker SIGKILLed (node 0 out of the group, still ordering); a new one attaches"
kill -KILL "$V_0"
wait "$V_0" 2> /dev/null
wait_for 20 grep -q "group $GROUP: node 0 (ranks 0..0) is out of its steps" "$T/node1.log" || fail "node 1 did not take node 0 out"
stepping 200 "$T"/a1.out "$T"/a2.out || fail "nodes 1 and 2 did not step while node 0 was out of the group"
grep -q "ordered its exchange, but the group is not served" "$T"/node[12].log &&
  fail "an order of nodes 1 and 2's exchange reached a node out of it: $(grep -h -m1 'the group is not served' "$T"/node[12].log)"
pair 0 b
stepping 100 "$T"/b0.out "$T"/a1.out "$T"/a2.out || fail "the three did not step after node 0's new worker came"
echo "   nodes 1 and 2 stepped on (node 0 ordering their exchanges), then the three again"

echo "== 1. node 0's daemon dies in an exchange (nodes 1 and 2 waiting in it); its worker SIGKILLed"
touch "$T/die-node0"
wait_for 30 grep -q "test hook: dying in this exchange" "$T/node0.log" || fail "node 0 ran no exchange"
wait_for 10 sh -c "! pgrep -P $P_0 > /dev/null" || fail "node 0's daemon did not die in its exchange"
kill -KILL "$V_0" 2> /dev/null
wait "$P_0" "$V_0" 2> /dev/null
for n in 1 2; do
  wait_for 20 grep -q "world communicator made again without the lost nodes (nodes 1, 2" "$T/node$n.log" ||
    fail "node $n did not make the world communicator without node 0: $(grep -v 'NCCL INFO' "$T/node$n.log" | grep 'cuda:' | tail -3)"
  grep -q "node 1 orders the exchanges from now" "$T/node$n.log" || fail "node $n did not take node 1 as the lead"
done
grep -h "which ordered the exchanges, was lost\|was lost mid-exchange.*world communicator aborted\|aborted its world communicator mid-exchange" \
  "$T"/node[12].log | head -2 | sed 's/^.*cuda: /   /'
stepping 100 "$T"/a1.out "$T"/a2.out || fail "the workers of nodes 1 and 2 did not step without node 0"
grep -h "world communicator made again without the lost nodes" "$T"/node[12].log | sed 's/^.*cuda: /   /'
echo "   nodes 1 and 2 stepped on with rank 0 masked, exchanging rows between them, node 1 ordering"

echo "== 2. node 2's worker SIGKILLed, a new one attaches"
kill -KILL "$V_2"
wait "$V_2" 2> /dev/null
stepping 50 "$T"/a1.out || fail "node 1's worker did not step alone"
pair 2 c
stepping 100 "$T"/c2.out "$T"/a1.out || fail "nodes 1 and 2 did not step after the new worker came: $(tail -qn1 "$T"/c2.out "$T"/a1.out)"
for f in "$T"/a0.out "$T"/b0.out "$T"/a1.out "$T"/a2.out "$T"/c2.out; do
  grep -q " MISMATCH$\|differs\|entries dropped\|, want" "$f" &&
    fail "$(basename "$f"): $(grep -m3 " MISMATCH$\|differs\|entries dropped\|, want" "$f")"
done
daemons_alive
grep -q "engine failed" "$T"/node[12].log && fail "an engine failed: $(grep -h -m1 'engine failed' "$T"/node[12].log)"
echo "   node 1's worker checked $(checked "$T/a1.out") steps, $(cat "$T"/a1.out "$T"/a2.out | grep -c failed) ops of nodes 1" \
  "and 2 failed at the losses"
echo "176-node0-lost-three-cuda: the two nodes left exchanged without node 0, the first of them ordering"
