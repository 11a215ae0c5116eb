#!/bin/bash
# 175-node-lost-three-cuda.sh - a node lost mid-exchange in a world of three (CUDA backend, three nodes of
# one rank; on one GPU all three share it: two-nodes-lib.sh). One group attached with on_rank_loss = mask
# and an expert map that places every expert on two neighbouring ranks (r and r+1 mod 3): every expert
# keeps a replica when one node is lost, and rows cross between every two nodes in every step. The
# daemons are epd-faults; while the three workers step:
#   1. node 2's daemon dies inside an exchange (its hook EPD_TEST_DIE_IN_EXCHANGE), nodes 0 and 1 waiting
#      in it: they abort the world communicator, node 0 hands the two of them the id of one without node
#      2, both make it, and their workers step on with rank 2 masked, exchanging rows between nodes 0 and
#      1 (before, the two could not exchange until node 2 came back);
#   2. node 2's daemon starts again and joins: every node makes the world communicator again with it, and
#      a new worker at node 2 steps with the other two.
# Every step of every worker is checked against the reference with the mask its completion reports.
# Fails on: a mismatch, a world communicator not made again without node 2 on node 0 or 1, the workers of
# nodes 0 and 1 not stepping without node 2 or the three not stepping after its return, a daemon of node 0
# or 1 exiting, an engine failing.
# Usage (repository root, GPU machine): bash tests/gpu/175-node-lost-three-cuda.sh [build-dir]
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
  kill -0 "$P_0" 2> /dev/null || fail "node 0 exited"
  kill -0 "$P_1" 2> /dev/null || fail "node 1 exited"
}
. "$(dirname "$0")/../mask-chaos-lib.sh"
R=$WR GROUP=lost3 MODE=ll
for n in 0 1 2; do pair $n a; done
wait_for 30 group_made || fail "group $GROUP not made"
replicated_map
stepping 50 "$T"/a0.out "$T"/a1.out "$T"/a2.out || fail "no steps with the 3 workers"

echo "== 1. node 2's daemon dies in an exchange (nodes 0 and 1 waiting in it); its worker SIGKILLed"
touch "$T/die-node2"
wait_for 30 grep -q "test hook: dying in this exchange" "$T/node2.log" || fail "node 2 ran no exchange"
wait_for 10 sh -c "! pgrep -P $P_2 > /dev/null" || fail "node 2's daemon did not die in its exchange"
rm -f "$T/die-node2"
kill -KILL "$V_2" 2> /dev/null
wait "$P_2" "$V_2" 2> /dev/null
for n in 0 1; do
  wait_for 20 grep -q "world communicator made again without the lost nodes (nodes 0, 1" "$T/node$n.log" ||
    fail "node $n did not make the world communicator without node 2: $(grep -v 'NCCL INFO' "$T/node$n.log" | grep 'cuda:' | tail -3)"
done
grep -h "was lost mid-exchange.*world communicator aborted\|aborted its world communicator mid-exchange" "$T"/node[01].log |
  head -2 | sed 's/^/   /'
stepping 100 "$T"/a0.out "$T"/a1.out || fail "the workers of nodes 0 and 1 did not step without node 2"
grep -h "world communicator made again without the lost nodes" "$T"/node[01].log | sed 's/^.*cuda: /   /'
echo "   nodes 0 and 1 stepped on with rank 2 masked, exchanging rows between them"

echo "== 2. node 2's daemon starts again and joins; a new worker there"
rm -f "$T/n2/attach.sock" "$T/n2/control.sock" # left by the killed daemon
node 2
wait_for 120 test -S "$T/n2/attach.sock" || fail "the restarted node 2 did not come up: $(grep -v 'NCCL INFO' "$T/node2.log" | tail -3)"
pair 2 b
stepping 100 "$T"/b2.out "$T"/a0.out "$T"/a1.out || fail "the three did not step after node 2 came back: $(tail -qn1 "$T"/b2.out "$T"/a0.out)"
grep -q "world communicator made again (3 ranks)" "$T/node0.log" || fail "node 0 did not make the world communicator again with node 2"
for f in "$T"/a0.out "$T"/a1.out "$T"/a2.out "$T"/b2.out; do
  grep -q " MISMATCH$\|differs\|entries dropped\|, want" "$f" &&
    fail "$(basename "$f"): $(grep -m3 " MISMATCH$\|differs\|entries dropped\|, want" "$f")"
done
daemons_alive
grep -q "engine failed" "$T"/node[01].log && fail "an engine failed: $(grep -h -m1 'engine failed' "$T"/node[01].log)"
echo "   node 0's worker checked $(checked "$T/a0.out") steps, $(cat "$T"/a[01].out | grep -c failed) ops of nodes 0" \
  "and 1 failed at the loss and the return"
echo "175-node-lost-three-cuda: the two nodes left exchanged without the lost one, and the three again after its return"
