#!/bin/bash
# 70-mask-node-drains: a draining node taken out of a group that masks (host backend, two nodes on this
# host, 2 ranks each, every expert on two ranks of different nodes). Four workers step (epd-worker --mask
# checks every step against the reference with the mask its completion reports, and that no entry was
# dropped where a replica was live); then node 1 drains (epdctl drain): its workers' dispatches fail with
# EPD_ERR_DRAINING, node 0 fails the dispatch node 1 refused, takes node 1 out of the group's steps and its
# workers go on alone, with no entry dropped. Then node 1's daemon exits (SIGTERM) and node 0 still steps.
# Fails on: a mismatch or a wrong dropped count in any worker's output, node 0's workers not stepping
# (200+ checked steps each) after the drain or the exit, no "out of its steps ... draining" line in node
# 0's log, no EPD_ERR_DRAINING seen by node 1's workers, more than 10 failed ops per worker of node 0.
set -u
. "$(dirname "$0")/mask-node-lib.sh"

echo "== node 1 drains: node 0 takes it out at its first refused dispatch and goes on"
"$EPDCTL" -s "$T/b/control.sock" drain > "$T/drain.out" 2>&1 || fail "epdctl drain: $(cat "$T/drain.out")"
stepping 200 || fail "node 0's workers did not step after node 1 began to drain"
alive
grep -q "node 1 (ranks 2..3) is out of its steps.*its node is draining" "$T/a.log" ||
  fail "node 0 did not take node 1 out when it drained"
wait_for 10 grep -q EPD_ERR_DRAINING "$T/b2.out" || fail "node 1's workers saw no EPD_ERR_DRAINING"

echo "== node 1's daemon exits: node 0 goes on"
kill -KILL "$B2" "$B3"
wait "$B2" "$B3" 2> /dev/null
kill -TERM "$P_b"
wait "$P_b" 2> /dev/null
stepping 200 || fail "node 0's workers did not step after node 1's daemon exited"
alive

kill -TERM "$A0" "$A1"
wait "$A0" "$A1" 2> /dev/null
outputs_clean 10 "$T"/a0.out "$T"/a1.out
outputs_clean 2000 "$T"/b2.out "$T"/b3.out # their dispatches were refused from the drain on
echo "node 0's workers checked $(checked "$T/a0.out") and $(checked "$T/a1.out") steps," \
  "$(cat "$T"/a0.out "$T"/a1.out | grep -c failed) ops failed at the drain"
kill -TERM "$P_a"
wait "$P_a"
echo "70-mask-node-drains: node 0 served on without its draining peer"
