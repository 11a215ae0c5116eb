#!/bin/bash
# 36-node-restart: a node whose daemon dies rejoins the RUNNING world when it restarts (host backend;
# three nodes of two ranks). Node 1's daemon is killed (SIGKILL) while a group of every node steps with
# an expert map set through node 0; the other nodes' workers skip the ops that fail meanwhile
# (EPD_ERR_PEER: the link is down). A new daemon for node 1 (same configuration, a new data port) gets the
# world from node 0's Rendezvous server, which stays up for that, and links to nodes 0 and 2 (node 2 is a
# higher node: it accepts the link too); node 0 sends it the group's map. New workers at node 1 attach:
# the group made there takes the others' step and map, and all six ranks run 20 steps in a row equal to
# the reference. Refused meanwhile: a second daemon claiming node 1 while its link is up, and a restarted
# node whose configuration differs (the key is named). Then nodes 1 and 2 are killed together and started
# again one after the other: node 1 finds node 2 down (its link stays down, not fatal), node 2 then links
# to every node, and an HT group of all three runs.
set -u
STEP_TIMEOUT_MS=3000 WORKER_TIMEOUT=60
. "$(dirname "$0")/cluster-lib.sh"
NODE_OF=(a a b b c c)

PORT=$(free_ports 1)
node a 0 3 "$PORT"
node b 1 3 "$PORT"
node c 2 3 "$PORT"
for n in a b c; do wait_for 15 test -S "$T/$n/attach.sock" || fail "node $n did not come up"; done

echo "== a group of every node steps; a map set through node 0 is active everywhere"
RS="--seed 21 --hidden 64 --same-inputs"
for r in 0 1 4 5; do worker "rs$r" "${NODE_OF[$r]}" -g rs -r $r -n 6 --steps 4000 $RS --until-streak 20; done
for r in 2 3; do worker "rs$r" b -g rs -r $r -n 6 --steps 4000 $RS -v; done
wait_for 20 grep -q "^rank 2 step 10:" "$T/rs2.out" || fail "rank 2 did not reach step 10: $(tail -2 "$T/rs2.out")"
{ echo "group rs"; for e in $(seq 0 15); do i=$(( (e + 5) % 18 )); echo "expert $e: $((i / 3)):$((i % 3))"; done; } > "$T/map.txt"
"$EPDCTL" -s "$T/a/control.sock" set-map "$T/map.txt" > "$T/sm.out" 2>&1 || fail "set-map: $(cat "$T/sm.out")"
V=$(sed -n 's/.*version \([0-9][0-9]*\).*/\1/p' "$T/sm.out" | head -1)
switched() { grep -q "group rs switched expert map [0-9]* -> $V at step" "$T/$1.log"; }
for n in a b c; do wait_for 10 switched $n || fail "node $n did not switch group rs to version $V"; done
echo "   version $V active on all three nodes"

echo "== node 1's daemon killed: the others' steps fail at once, they keep serving"
kill -KILL "$P_b"; wait "$P_b" 2>/dev/null
for n in a c; do wait_for 5 grep -q "data link to node 1 lost" "$T/$n.log" || fail "node $n did not notice the lost link"; done
wait_for 5 grep -q "rank 0 step [0-9]*: .* failed (skipped).*EPD_ERR_PEER" "$T/rs0.out" || fail "node 0's worker did not fail meanwhile: $(tail -2 "$T/rs0.out")"

echo "== refused meanwhile: a restarted node 1 whose configuration differs"
node bad 1 3 "$PORT" -o engine.max_tokens=128
refused 12000 bad
expect_log bad "configuration disagrees with the running world's: engine.max_tokens (node 0: 256, node 1: 128)"

echo "== node 1's daemon starts again: it joins the running world, its new workers step with the others"
S=$(date +%s%N)
node b2 1 3 "$PORT"
wait_for 15 test -S "$T/b2/attach.sock" || fail "the restarted node 1 did not come up"
MS=$(( ($(date +%s%N) - S) / 1000000 ))
expect_log b2 "joined the running world again (this daemon restarted)"
expect_log a "cluster: node 1 joins the running world again"
for n in a c; do wait_for 5 grep -q "data link to node 1 up again" "$T/$n.log" || fail "node $n did not take node 1's new link"; done
# (before the group is made there, or right after: either way before node 0's reply to its creation notice)
wait_for 5 grep -q "group rs: expert map version $V \(from node 0 kept\|staged from node 0\)" "$T/b2.log" || fail "node 0 did not send node 1 the map: $(grep 'group rs' "$T/b2.log" | tail -2)"
"$EPDCTL" -s "$T/b2/control.sock" status > "$T/status.out" || fail "status at the restarted node"
grep -q "^links:    node 0 up; node 2 up$" "$T/status.out" || fail "the restarted node's links: $(grep links "$T/status.out")"
"$EPDCTL" -s "$T/c/control.sock" status > "$T/status-c.out" || fail "status at node 2"
grep -q "^links:    node 0 up; node 1 up$" "$T/status-c.out" || fail "node 2's links: $(grep links "$T/status-c.out")"
echo "   up and linked in $MS ms: $(grep -o 'cluster: node 1 of 3, .*' "$T/b2.log" | cut -c1-160)"
# the new workers' first ops may fail while the nodes agree on the step again (the others kept failing
# theirs, each at its own pace): they too stop after 20 steps in a row
for r in 2 3; do worker "rsb$r" b2 -g rs -r $r -n 6 --steps 3000 $RS --until-streak 20 --streak-any; done
expect_ok rsb2 rsb3 rs0 rs1 rs4 rs5
grep -q "group rs: made again here while the other nodes step it: it runs from their step [1-9][0-9]*, expert map version $V" "$T/b2.log" ||
  fail "the group made at the restarted node: $(grep 'group rs' "$T/b2.log" | tail -3)"
echo "   $(grep -o 'group rs: made again here.*' "$T/b2.log" | head -1); skipped meanwhile: node 0 $(grep -c 'failed (skipped)' "$T/rs0.out"), node 2 $(grep -c 'failed (skipped)' "$T/rs4.out")"

echo "== refused: a second daemon claiming node 1 while its link is up"
node dup 1 3 "$PORT"
refused 12000 dup
expect_log dup "node 1 is part of the running world and its data link is up"

echo "== a fresh group of all three nodes runs"
for r in 0 1 2 3 4 5; do
  nd=${NODE_OF[$r]}; [ "$nd" = b ] && nd=b2
  worker "fr$r" "$nd" -g fr -r $r -n 6 --steps 10 --seed 5 --fp8 --skew
done
expect_ok fr0 fr1 fr2 fr3 fr4 fr5

echo "== nodes 1 and 2 killed together and started again: the first to join skips the other (down), which links to it later"
kill -KILL "$P_b2" "$P_c"; wait "$P_b2" "$P_c" 2>/dev/null
wait_for 5 grep -q "data link to node 2 lost" "$T/a.log" || fail "node 0 did not notice node 2's lost link"
node b3 1 3 "$PORT"
wait_for 20 test -S "$T/b3/attach.sock" || fail "node 1 (second restart) did not come up: $(tail -3 "$T/b3.log")"
expect_log b3 "data link to node 2: not reachable at"
node c2 2 3 "$PORT"
wait_for 20 test -S "$T/c2/attach.sock" || fail "node 2 (restarted) did not come up: $(tail -3 "$T/c2.log")"
wait_for 5 grep -q "data link to node 2 up again" "$T/b3.log" || fail "node 1 did not take node 2's link"
"$EPDCTL" -s "$T/b3/control.sock" status > "$T/status-b3.out" || fail "status at node 1"
grep -q "^links:    node 0 up; node 2 up$" "$T/status-b3.out" || fail "node 1's links: $(grep links "$T/status-b3.out")"
NODE2=(a a b3 b3 c2 c2)
for r in 0 1 2 3 4 5; do worker "tw$r" "${NODE2[$r]}" -g tw -r $r -n 6 --steps 10 --seed 6 --mode ht --skew; done
expect_ok tw0 tw1 tw2 tw3 tw4 tw5
kill -TERM "$P_a" "$P_b3" "$P_c2"
for p in "$P_a" "$P_b3" "$P_c2"; do wait "$p" || fail "a daemon exited $? on SIGTERM"; done
echo "36-node-restart: all checks passed"
