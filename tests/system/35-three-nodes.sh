#!/bin/bash
# 35-three-nodes: scale-out over THREE nodes with the host backend standing in for GPUs (the CUDA backend's
# twin is tests/gpu/167-three-nodes-cuda.sh). Three daemons on this host are nodes 0, 1 and 2 of one EP
# world (2 ranks each: 6 world ranks), node 0 the coordinator; every node pair has its TCP link.
# - status shows node 2 of 3 with both its links up; epd-worker processes attach every world rank at its
#   node's daemon and check every step against the reference of the 6-rank world: LL and HT, BF16 and
#   FP8, skewed routing, two groups at once;
# - expert maps staged every 3 steps move expert weights between the ranks of every node pair (nodes 1 and
#   2 included, neither of them node 0) and switch on all three nodes at the same steps; a map set at node
#   2 with epdctl is staged by node 0 and active everywhere;
# - a killed worker of each node in turn: the other nodes' workers stop at once naming its rank; node 2's
#   workers die and restart: the group made again there takes the others' step and map; one worker of
#   node 1 dies while its node's other worker stays: the other nodes fail at once naming its rank, and a
#   new worker of that rank steps with every other again;
# - node 1 never submits: EPD_ERR_TIMEOUT naming rank 2 on nodes 0 and 2; node 2 killed: EPD_ERR_PEER
#   naming rank 4 on nodes 0 and 1, promptly, and both keep serving, their status showing the lost link.
set -u
STEP_TIMEOUT_MS=3000 WORKER_TIMEOUT=60
. "$(dirname "$0")/cluster-lib.sh"
NODE_OF=(a a b b c c)
# world GROUP STEPS ARGS...: the 6 world ranks of GROUP, ranks 2n and 2n+1 at node n (a, b, c).
world() {
  local g=$1 s=$2 r; shift 2
  for r in 0 1 2 3 4 5; do worker "${g}$r" "${NODE_OF[$r]}" -g "$g" -r $r -n 6 --steps "$s" --seed 11 "$@"; done
}
all() { local r; for r in 0 1 2 3 4 5; do echo "$1$r"; done; }
# one_step_fails GROUP CODE PEER CASE RANK...: one step of GROUP by only these ranks (each at its node) must
# fail on every one of them with CODE naming rank PEER
one_step_fails() {
  local g=$1 code=$2 peer=$3 what=$4 r rc; shift 4
  for r in "$@"; do worker "$g$r" "${NODE_OF[$r]}" -g "$g" -r $r -n 6 --steps 1; done
  for r in "$@"; do
    eval "wait \$W_$g$r"; rc=$?
    [ $rc -eq 2 ] || fail "$what: rank $r exited $rc: $(tail -2 "$T/$g$r.out")"
    grep -q "$code.*peer rank $peer" "$T/$g$r.out" || fail "$what: rank $r: $(tail -2 "$T/$g$r.out")"
  done
}
switches() { grep -o "group $1 switched expert map [0-9]* -> [0-9]* at step [0-9]*" "$T/$2.log"; }

PORT=$(free_ports 1)
node a 0 3 "$PORT"
node b 1 3 "$PORT"
node c 2 3 "$PORT"
for n in a b c; do wait_for 15 test -S "$T/$n/attach.sock" || fail "node $n did not come up"; done

echo "== status: node 2 of 3, 6 world ranks, both links up"
"$EPDCTL" -s "$T/c/control.sock" status > "$T/status.out" || fail "epdctl status"
grep -q "cluster:  node 2 of 3, 6 world ranks, inter-node transport host-tcp" "$T/status.out" || fail "status: $(cat "$T/status.out")"
grep -q "^links:    node 0 up; node 1 up$" "$T/status.out" || fail "status links: $(grep links "$T/status.out")"

echo "== LL BF16 and HT FP8 skewed, then LL FP8 with special values and HT BF16, two groups at once each"
world ll 8 --skew
world ht 8 --skew --mode ht --fp8
expect_ok $(all ll) $(all ht)
world lf 6 --fp8 --specials --tokens 12
world hb 6 --mode ht --tokens 12
expect_ok $(all lf) $(all hb)

echo "== weights move with the maps between the ranks of every node pair: 60 LL steps, a map every 3"
world wt 60 --hidden 64 --weights 4096 --map-every 3 --node-ranks 2
expect_ok $(all wt)
for n in a b c; do
  switches wt $n > "$T/wt-$n.txt"
  grep -Eq "group wt switched expert map .* \([1-9][0-9]* weight bytes copied\)" "$T/$n.log" || fail "node $n: no switch of group wt copied weights"
  grep -q "weight copy .* skipped" "$T/$n.log" && fail "node $n skipped a copy: $(grep -m1 skipped "$T/$n.log")"
done
[ "$(wc -l < "$T/wt-a.txt")" -ge 15 ] || fail "group wt: node 0 logged $(wc -l < "$T/wt-a.txt") switches"
cmp -s "$T/wt-a.txt" "$T/wt-b.txt" && cmp -s "$T/wt-a.txt" "$T/wt-c.txt" || fail "group wt: the nodes switched at different steps"
grep -q "group wt: weights of copy .* received from node 2" "$T/b.log" || grep -q "group wt: weights of copy .* received from node 1" "$T/c.log" ||
  fail "group wt: no weights went between nodes 1 and 2"
echo "   $(wc -l < "$T/wt-a.txt") switches, the same on all three nodes; copies received: node 0 $(grep -c 'group wt: weights of copy .* received' "$T/a.log"), node 1 $(grep -c 'group wt: weights of copy .* received' "$T/b.log"), node 2 $(grep -c 'group wt: weights of copy .* received' "$T/c.log")"

echo "== a map set at node 2 while steps run: staged by node 0, active on all three nodes"
world ex 3000 --hidden 64
ex_steps() { "$EPDCTL" -s "$T/a/control.sock" status 2>/dev/null | awk '$1 == "ex" { print $7 }'; }
ex_running() { [ "$(ex_steps)" -ge 10 ]; }
wait_for 20 ex_running || fail "group ex did not run 10 steps"
{ echo "group ex"; for e in $(seq 0 15); do i=$(( (e + 7) % 18 )); echo "expert $e: $((i / 3)):$((i % 3))"; done; } > "$T/map.txt"
"$EPDCTL" -s "$T/c/control.sock" set-map "$T/map.txt" > "$T/sm.out" 2>&1 || fail "set-map at node 2: $(cat "$T/sm.out")"
V=$(sed -n 's/.*version \([0-9][0-9]*\).*/\1/p' "$T/sm.out" | head -1)
[ -n "$V" ] || fail "set-map printed no version: $(cat "$T/sm.out")"
experts_all() {
  local n
  for n in a b c; do "$EPDCTL" -s "$T/$n/control.sock" experts ex > "$T/e-$n.txt" || return 1; done
  cmp -s "$T/e-a.txt" "$T/e-b.txt" && cmp -s "$T/e-a.txt" "$T/e-c.txt" && grep -q "version $V\b" "$T/e-a.txt"
}
wait_for 15 experts_all || fail "group ex: the nodes do not all run version $V: $(head -1 "$T/e-a.txt") / $(head -1 "$T/e-b.txt") / $(head -1 "$T/e-c.txt")"
grep -q "^expert 0: 2:1$" "$T/e-b.txt" || fail "group ex: not node 2's map: $(head -3 "$T/e-b.txt")"
grep -q "group ex: expert map version $V staged from node 0" "$T/c.log" || fail "node 2 did not log version $V staged from node 0"
[ -n "$(ex_steps)" ] || fail "group ex finished before the checks did (raise its steps)"
expect_ok $(all ex)
echo "   version $V set at node 2, active on all three nodes"

echo "== a worker of each node killed mid-run: the other nodes' workers stop at once naming its rank"
for v in 1 2 5; do # a rank of node 0, 1, 2
  g=k$v
  world "$g" 100000 --hidden 64 -v
  wait_for 20 grep -q "^rank $v step 3:" "$T/$g$v.out" || fail "$g: rank $v did not reach step 3: $(tail -2 "$T/$g$v.out")"
  pkill -KILL -P "$(eval echo \$W_$g$v)"
  S=$(date +%s%N)
  for o in 0 1 2 3 4 5; do
    [ "${NODE_OF[$o]}" = "${NODE_OF[$v]}" ] && { kill "$(eval echo \$W_$g$o)" 2>/dev/null; continue; } # its node's other worker
    eval "wait \$W_$g$o"; rc=$?
    [ $rc -eq 2 ] || fail "$g: rank $o exited $rc: $(tail -2 "$T/$g$o.out")"
    grep -q "failed.*peer rank $v" "$T/$g$o.out" || fail "$g: rank $o stopped without naming rank $v: $(tail -2 "$T/$g$o.out")"
  done
  MS=$(( ($(date +%s%N) - S) / 1000000 ))
  [ $MS -lt 2500 ] || fail "$g: the other nodes' workers stopped only after $MS ms (step_timeout_ms 3000)"
  echo "   rank $v (node ${NODE_OF[$v]}) killed: $(grep -h failed "$T/${g}0.out" "$T/${g}4.out" | head -1 | cut -c1-110) ($MS ms)"
done 2>/dev/null # bash's "Killed" notices
for n in a b c; do "$EPDCTL" -s "$T/$n/control.sock" health > /dev/null 2>&1 || fail "node $n not serving after the kills"; done

echo "== node 2's workers die and restart: the group made again there takes the others' step and map"
for r in 0 1 2 3; do worker "rj$r" "${NODE_OF[$r]}" -g rj -r $r -n 6 --steps 3000 --seed 12 --same-inputs --until-streak 20; done
for r in 4 5; do worker "rj$r" c -g rj -r $r -n 6 --steps 3000 --seed 12 --same-inputs -v; done
wait_for 20 grep -q "^rank 4 step 10:" "$T/rj4.out" || fail "rejoin: rank 4 did not reach step 10: $(tail -2 "$T/rj4.out")"
pkill -KILL -P "$W_rj4"; pkill -KILL -P "$W_rj5"
wait_for 10 grep -q "group rj: removed on node 2" "$T/a.log" || fail "rejoin: node 0 did not hear of the removal"
wait_for 10 grep -q "group rj: removed on node 2" "$T/b.log" || fail "rejoin: node 1 did not hear of the removal"
for r in 4 5; do worker "rjb$r" c -g rj -r $r -n 6 --steps 20 --seed 12 --same-inputs; done
expect_ok rjb4 rjb5 rj0 rj1 rj2 rj3
grep -q "group rj: made again here while the other nodes step it: it runs from their step [1-9]" "$T/c.log" ||
  fail "rejoin: node 2's log: $(grep 'group rj' "$T/c.log" | tail -3)"
echo "   $(grep -o 'group rj: made again here.*' "$T/c.log" | head -1)"

echo "== one worker of node 1 dies, a new one takes its rank: the other nodes fail at once naming it, then all step together"
# the others skip the ops that fail meanwhile (--until-streak) and stop after 20 steps in a row with the
# new worker: node 1 told them the rank lost its client (their steps fail at once, not after the step
# timeout), then that it has one again (they reply with their step, node 1 takes it if ahead; a node
# behind fails its steps at once until it reaches the others', seeing their parts of later steps)
for r in 0 1 2 4 5; do worker "rp$r" "${NODE_OF[$r]}" -g rp -r $r -n 6 --steps 3000 --seed 13 --same-inputs --until-streak 20; done
worker rp3 b -g rp -r 3 -n 6 --steps 3000 --seed 13 --same-inputs -v
wait_for 20 grep -q "^rank 3 step 10:" "$T/rp3.out" || fail "replace: rank 3 did not reach step 10: $(tail -2 "$T/rp3.out")"
pkill -KILL -P "$W_rp3"
for r in 0 5; do
  wait_for 5 grep -q "rank $r step [0-9]*: .* failed (skipped).*EPD_ERR_PEER.*peer rank 3" "$T/rp$r.out" ||
    fail "replace: rank $r did not fail at once naming rank 3: $(tail -2 "$T/rp$r.out")"
done
grep -q "group rp: the client of rank 3 died on node 1 at its step [0-9]*" "$T/a.log" || fail "replace: node 0's log: $(grep 'group rp' "$T/a.log" | tail -2)"
grep -q "EPD_ERR_TIMEOUT" "$T"/rp[0-5].out && fail "replace: a step timed out: $(grep -h EPD_ERR_TIMEOUT "$T"/rp[0-5].out | head -1)"
sleep 0.5 # the others skip steps meanwhile
worker rpb3 b -g rp -r 3 -n 6 --steps 20 --seed 13 --same-inputs
expect_ok rp0 rp1 rp2 rp4 rp5 rpb3
for n in a c; do grep -q "group rp: rank 3 has a client again on node 1" "$T/$n.log" || fail "replace: node $n did not hear of the new client"; done
echo "   skipped meanwhile: $(for r in 0 1 2 4 5; do printf 'rank %s %s; ' $r "$(grep -c 'failed (skipped)' "$T/rp$r.out")"; done)$(grep -o 'group rp: a rank attached again here.*' "$T/b.log" | head -1)"

echo "== node 1 never submits: EPD_ERR_TIMEOUT naming rank 2 on nodes 0 and 2"
S=$(date +%s%N)
one_step_fails to EPD_ERR_TIMEOUT 2 "timeout case" 0 1 4 5
MS=$(( ($(date +%s%N) - S) / 1000000 ))
[ $MS -lt 8000 ] || fail "timeout took $MS ms (step_timeout_ms 3000)"
for n in a c; do grep -q "node 1 (ranks 2..3) did not send" "$T/$n.log" || fail "node $n's log does not say node 1 was silent"; done

echo "== node 2 killed: EPD_ERR_PEER naming rank 4 on nodes 0 and 1, promptly; both keep serving"
kill -KILL "$P_c"; wait "$P_c" 2>/dev/null
for n in a b; do wait_for 5 grep -q "data link to node 2 lost" "$T/$n.log" || fail "node $n did not notice the lost link"; done
S=$(date +%s%N)
one_step_fails pe EPD_ERR_PEER 4 "lost node" 0 1 2 3
MS=$(( ($(date +%s%N) - S) / 1000000 ))
[ $MS -lt 2500 ] || fail "lost node: the steps failed only after $MS ms"
"$EPDCTL" -s "$T/b/control.sock" status > "$T/lost.out" || fail "node 1 stopped serving after losing node 2"
grep -q "^links:    node 0 up; node 2 down: " "$T/lost.out" || fail "node 1's status after losing node 2: $(grep links "$T/lost.out")"
echo "   node 1's status: $(grep '^links:' "$T/lost.out" | cut -c1-120)"
kill -TERM "$P_a" "$P_b"
wait "$P_a"; RA=$?
wait "$P_b"; RB=$?
[ $RA -eq 0 ] && [ $RB -eq 0 ] || fail "nodes 0 and 1 exited $RA $RB on SIGTERM"
echo "35-three-nodes: all checks passed"
