#!/bin/bash
# 174-node-lost-cuda.sh - a daemon lost while its node steps (CUDA backend across two nodes, 2 ranks each;
# on one GPU all four share it: two-nodes-lib.sh). One group attached with on_rank_loss = mask and an
# expert map that places every expert on two neighbouring ranks (r and r+1 mod 4): the experts of ranks 1
# and 3 have a replica on each node, those of ranks 0 and 2 on one node only, so every step exchanges
# rows between the nodes and, without node 1, drops the entries of rank 2's experts. While the four workers
# step, node 1's daemon is lost, ROUNDS times (default 2) SIGKILLed from outside with its workers, then
# once more killed in an exchange it has been ordered to run (the daemons are epd-faults: its hook
# EPD_TEST_DIE_IN_EXCHANGE), node 0's half of that exchange waiting for it. Each time:
#   1. node 0 takes node 1 out at its lost link and its workers go on with ranks 2-3 masked, every step
#      checked against the reference with its mask; an exchange that was running with node 1 fails (the
#      world communicator aborted, logged: always in the last round) and no engine fails;
#   2. node 1's daemon starts again and joins the running world (node 0 hands out a new world
#      communicator id, both make it again); new workers at node 1: the four step together again.
# Fails on: a mismatch in any worker's output, node 0's workers not stepping while node 1 is gone or the
# four not stepping after its return, no aborted exchange in the last round, node 0 exiting or its
# engine failing.
# Usage (repository root, GPU machine): bash tests/gpu/174-node-lost-cuda.sh [build-dir]
set -u
B=${1:-${EPD_BUILD:-build}}
GPN=2
TWO_NODES_DAEMON_OPTS="-o engine.slots_factor_pct=200 -o engine.step_timeout_ms=2000"
TWO_NODES_FAULTS=1
. "$(dirname "$0")/two-nodes-lib.sh"
ROUNDS=${EPD_NODE_LOST_ROUNDS:-2}
start_nodes
. "$(dirname "$0")/mask-two-nodes-lib.sh"
REP_NEXT=1 # rows cross the nodes in every step (with a replica on each node none would)
may_kill() { return 1; }
daemons_alive() { kill -0 "$P_0" 2> /dev/null || fail "node 0 exited"; }
. "$(dirname "$0")/../mask-chaos-lib.sh"
GROUP=lost MODE=ll
pair 0 a
pair 1 b0-
wait_for 30 group_made || fail "group $GROUP not made"
replicated_map
stepping 50 "$T"/a0.out "$T"/a1.out "$T"/b0-2.out "$T"/b0-3.out || fail "no steps with the 4 workers"
aborted() { grep -c "was lost mid-exchange.*world communicator aborted" "$T/node0.log"; }
lose_node1() { # lose_node1 ROUND HOW: node 1 lost (HOW: kill from outside, or exchange: dies in one), back
  local i=$1 how=$2 before
  before=$(aborted)
  if [ "$how" = kill ]; then
    echo "== round $i: node 1's daemon and workers SIGKILLed while the four step"
    pkill -KILL -P "$P_1"
    kill -KILL "$P_1" "$V_2" "$V_3" 2> /dev/null
    wait "$P_1" "$V_2" "$V_3" 2> /dev/null
  else
    echo "== round $i: node 1's daemon dies in an exchange (node 0 waiting in it); its workers SIGKILLed"
    touch "$T/die-node1"
    wait_for 30 grep -q "test hook: dying in this exchange" "$T/node1.log" || fail "node 1 ran no exchange"
    wait_for 10 sh -c "! pgrep -P $P_1 > /dev/null" || fail "node 1's daemon did not die in its exchange"
    rm -f "$T/die-node1"
    kill -KILL "$V_2" "$V_3" 2> /dev/null
    wait "$P_1" "$V_2" "$V_3" 2> /dev/null
  fi
  cp "$T/node1.log" "$T/node1.round$i.log"
  wait_for 10 grep -q "data link to node 1 lost" "$T/node0.log" || fail "node 0 did not notice the lost link"
  stepping 100 "$T"/a0.out "$T"/a1.out || fail "node 0's workers did not step without node 1"
  grep -q "node 1 (ranks 2..3) is out of its steps" "$T/node0.log" || fail "node 0 did not take node 1 out"
  grep -q "engine failed" "$T/node0.log" && fail "node 0's engine failed: $(grep -m1 'engine failed' "$T/node0.log")"
  [ "$how" = kill ] || [ "$(aborted)" -gt "$before" ] ||
    fail "node 1 died in an exchange, but node 0 aborted none: $(grep -v 'NCCL INFO' "$T/node0.log" | tail -3)"
  echo "   node 0's workers stepped on with ranks 2-3 masked (exchanges aborted by the loss so far: $(aborted))"
  echo "   node 1's daemon starts again and joins the running world; new workers there"
  rm -f "$T/n1/attach.sock" "$T/n1/control.sock" # left by the killed daemon
  node 1
  wait_for 120 test -S "$T/n1/attach.sock" || fail "the restarted node 1 did not come up: $(grep -v 'NCCL INFO' "$T/node1.log" | tail -3)"
  grep -q "joined the running world again (this daemon restarted)" "$T/node1.log" ||
    fail "node 1's log: $(grep -v 'NCCL INFO' "$T/node1.log" | grep cluster | tail -2)"
  pair 1 "b$i-"
  stepping 100 "$T/b$i-2.out" "$T/b$i-3.out" "$T"/a0.out "$T"/a1.out ||
    fail "the four did not step after node 1 came back: $(tail -qn1 "$T/b$i-2.out" "$T"/a0.out)"
  grep -q "world communicator made again" "$T/node0.log" || fail "node 0 did not make the world communicator again"
}
for i in $(seq 1 "$ROUNDS"); do lose_node1 "$i" kill; done
lose_node1 $((ROUNDS + 1)) exchange
for f in "$T"/a0.out "$T"/a1.out "$T"/b*.out; do
  grep -q " MISMATCH$\|differs\|entries dropped\|, want" "$f" &&
    fail "$(basename "$f"): $(grep -m3 " MISMATCH$\|differs\|entries dropped\|, want" "$f")"
done
daemons_alive
grep -q "engine failed" "$T/node0.log" "$T/node1.log" && fail "an engine failed: $(grep -h -m1 'engine failed' "$T"/node*.log)"
echo "   node 0's first workers checked $(checked "$T/a0.out") steps, $(cat "$T"/a[01].out | grep -c failed) ops failed" \
  "at the losses and returns; exchanges running at a loss (world communicator aborted): $(aborted)" \
  "$(grep -o "world communicator aborted ([^)]*)" "$T/node0.log" | sed 's/.*(/(/' | tr '\n' ' ')"
echo "174-node-lost-cuda: node 0 served on through $((ROUNDS + 1)) losses of node 1, and the four stepped again each time"
