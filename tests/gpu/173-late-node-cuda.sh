#!/bin/bash
# 173-late-node-cuda.sh - one node's workers start seconds after the other node's (CUDA backend across two
# nodes, 2 ranks each; on one GPU all four share it: two-nodes-lib.sh). The early node's first steps wait
# for the late node's parts past engine.step_timeout_ms (1000 ms here); node 0 decides which steps do not
# run, so no node may give up a step that node 0 could still order (its exchange would find no partner):
#   A. node 1's workers first: node 1 asks node 0 to give each step up (node 0 has no client of the group
#      yet: "no step on node 0"), and node 0's first steps, numbered from 0, are the ones node 1 gave up:
#      they fail at once instead of being ordered;
#   B. node 0's workers first (another group): node 0 times its steps out and tells node 1 each time;
#      node 1's first steps, numbered from 0, fail on that word (or on node 0's answer when node 1 asks).
# Then the four step together. Fails on: a worker that does not reach 30 matching steps in a row (within
# 400 steps and 120 s), a result that differs from the reference, an exchange ordered on a step another
# node had left ("ignored" in a log), a node 0 that did not answer, a daemon that exits or an engine that
# fails.
# Usage (repository root, GPU machine): bash tests/gpu/173-late-node-cuda.sh [build-dir]
set -u
B=${1:-${EPD_BUILD:-build}}
GPN=2
TWO_NODES_DAEMON_OPTS="-o engine.step_timeout_ms=1000"
. "$(dirname "$0")/two-nodes-lib.sh"
start_nodes
LATE_S=3
run_node() { # run_node NODE GROUP: both workers of NODE, outputs $T/GROUPr.out, pids in W_r
  local n=$1 g=$2 r
  for r in $((n * 2)) $((n * 2 + 1)); do
    CUDA_VISIBLE_DEVICES=$(gpu_of "$r") timeout 120 "$WORKER" -s "$T/n$n/control.sock" -g "$g" --mode ll -r "$r" \
      -n 4 --steps 400 --seed 9 --experts 16 --hidden 128 --topk 4 --tokens 16 --same-inputs \
      --until-streak 30 --node-ranks $GPN > "$T/$g$r.out" 2>&1 &
    eval "W_$r=$!"
  done
}
finish() { # finish GROUP: all four workers exit 0 with no result that differs
  local g=$1 r rc p
  for r in 0 1 2 3; do
    eval "p=\$W_$r"
    wait "$p"
    rc=$?
    [ $rc = 0 ] || fail "$g: worker of rank $r exited $rc: $(tail -3 "$T/$g$r.out")"
    grep -q "differs\|MISMATCH" "$T/$g$r.out" && fail "$g: rank $r: $(grep -m2 "differs\|MISMATCH" "$T/$g$r.out")"
  done
  echo "   $g: $(cat "$T/$g"[0-3].out | grep -c failed) ops failed while one node was missing; every worker then" \
    "ran 30 matching steps in a row"
}
echo "== A. node 1's workers first, node 0's $LATE_S s later"
run_node 1 late0
sleep $LATE_S
run_node 0 late0
finish late0
grep -q "group late0 step [0-9]*: .*asked node 0 to give the step up" "$T/node1.log" ||
  fail "node 1 never asked node 0 to give a step up"
grep -q "group late0: steps below [1-9][0-9]* were given up before it had a client here" "$T/node0.log" ||
  fail "node 0 did not take the steps node 1 gave up before node 0 had a client"
echo "== B. node 0's workers first, node 1's $LATE_S s later"
run_node 0 late1
sleep $LATE_S
run_node 1 late1
finish late1
grep -q "group late1 step 0: node 0 gave the step up" "$T/node1.log" ||
  fail "node 1's first step did not fail on node 0's word"
n=$(grep -c "group late1 step [0-9]*: .*asked node 0" "$T/node1.log")
[ "$n" -le 2 ] || fail "node 1 asked node 0 about $n steps of late1: node 0's word did not cover the steps it gave up"
for n in 0 1; do
  kill -0 "$(eval echo "\$P_$n")" 2> /dev/null || fail "node $n exited"
done
grep -h "ordered its exchange, but .*ignored\|did not answer" "$T"/node[01].log | head -3 | grep . &&
  fail "an exchange was ordered on a step a node had left, or node 0 did not answer"
grep -q "engine failed" "$T/node0.log" "$T/node1.log" && fail "an engine failed: $(grep -h -m1 'engine failed' "$T"/node*.log)"
echo "173-late-node-cuda: the late node's first steps failed at once, then every step matched"
