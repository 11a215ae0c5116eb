#!/bin/bash
# 167-three-nodes-cuda.sh - THREE nodes simulated on one host: three daemons with engine.backend=cuda, one
# GPU each, told they are different hosts (NCCL_HOSTID node0 / node1 / node2; NCCL's P2P and SHM off), so
# every inter-node stage runs over NCCL's socket transport and node 0 orders the exchanges of two other
# nodes (GO frames to both). A GPU per node with 3; with fewer the nodes share them (two-nodes-lib.sh:
# node n on GPU n mod count; with one, all three on it, as CUDA_VISIBLE_DEVICES=0,0,0 also gives): the
# daemons and workers of a shared GPU are time-sliced; steps take milliseconds, results stay exact.
# One epd-worker per node checks every step against the reference of the 3-rank world:
#   LL BF16 skewed and FP8 with special values (H 7168, 256 experts, top-8, 128 tokens); HT FP8 skewed and
#   BF16 (256 tokens); three groups at once (their exchanges in node 0's order, a new map every 3 steps of
#   one, switched on all three nodes at the same steps); expert weights moving with the maps between any
#   two nodes (nodes 1 and 2 included, neither of them the coordinator); a map set at node 2 with epdctl,
#   staged by node 0, active on every node; a worker killed at a random moment, 6 rounds over every node
#   (the other two stop at once naming its rank, no engine fails); node 2's worker dies and restarts (the
#   group made again there takes the others' step); node 1 never submits (EPD_ERR_TIMEOUT naming rank 1
#   on nodes 0 and 2); node 2 stops (EPD_ERR_PEER naming rank 2 on nodes 0 and 1, promptly; both serve on),
#   then its daemon starts again and joins the running world: node 0 hands it a new NCCL world
#   communicator id and every node makes its world communicator again with it; node 2's new worker joins
#   a group nodes 0 and 1 kept stepping (20 steps in a row on all three, equal to the reference), and
#   fresh LL FP8 / HT groups of all three nodes run (the host backend's twin: tests/system/36-node-restart.sh);
#   then nodes 1 and 2 are killed together and started again: node 0 hands the second the id of the world
#   communicator being made for the first, and an LL FP8 group of the three runs.
# Usage (repository root, GPU machine): bash tests/gpu/167-three-nodes-cuda.sh [build-dir]; logs go to
# $TWO_NODES_OUT if set. Set-up, daemons and workers: two-nodes-lib.sh.
set -u
B=${1:-${EPD_BUILD:-build}}
GPN=1
NODES=3
TWO_NODES_DAEMON_OPTS="-o engine.slots_factor_pct=200"
. "$(dirname "$0")/two-nodes-lib.sh"

start_nodes
"$EPDCTL" -s "$T/n2/control.sock" status > "$T/status2.out" || fail "epdctl status at node 2"
grep -q "node 2 of 3, 3 world ranks, inter-node transport nccl-p2p" "$T/status2.out" || fail "node 2's status: $(cat "$T/status2.out")"
grep -q "^links: *node 0 up; node 1 up$" "$T/status2.out" || fail "node 2's links: $(grep links "$T/status2.out")"

COMMON="--experts 256 --hidden 7168 --topk 8"
ALL="0 1 2"
outs() { local g=$1 r; for r in $ALL; do echo "$g$r"; done; }
# same_switches GROUP MIN: every node logged at least MIN switches of GROUP, the same (version, step) on all
same_switches() {
  local g=$1 min=$2 n
  for n in $ALL; do grep -o "group $g switched expert map [0-9]* -> [0-9]* at step [0-9]*" "$T/node$n.log" > "$T/sw$g$n.txt"; done
  [ "$(wc -l < "$T/sw${g}0.txt")" -ge "$min" ] || fail "$g: node 0 logged $(wc -l < "$T/sw${g}0.txt") switches, want $min"
  for n in 1 2; do cmp -s "$T/sw${g}0.txt" "$T/sw$g$n.txt" || fail "$g: nodes 0 and $n switched at different steps: $(diff "$T/sw${g}0.txt" "$T/sw$g$n.txt" | head -3)"; done
}
# one_step_fails GROUP CODE PEER CASE RANK...: one step of GROUP by only these ranks (each at its node) must
# fail on every one of them with CODE naming rank PEER
one_step_fails() {
  local g=$1 code=$2 peer=$3 what=$4 r rc; shift 4
  for r in "$@"; do
    CUDA_VISIBLE_DEVICES=$(gpu_of $r) timeout 30 "$WORKER" -s "$T/n$r/control.sock" -g "$g" -r $r -n 3 --steps 1 --hidden 256 > "$T/$g$r.out" 2>&1 &
    eval "W_$g$r=$!"
  done
  for r in "$@"; do
    eval "wait \$W_$g$r"; rc=$?
    [ $rc -eq 2 ] || fail "$what: rank $r's worker exited $rc: $(tail -2 "$T/$g$r.out")"
    grep -q "$code.*peer rank $peer" "$T/$g$r.out" || fail "$what: rank $r: $(tail -2 "$T/$g$r.out")"
  done
}
no_engine_failed() {
  grep -q "did not finish within\|engine failed" "$T"/node[012].log && fail "$1: an engine failed: $(grep -h -m1 'did not finish within\|engine failed' "$T"/node[012].log)"
  return 0
}

if [ "${THREE_NODES_QUICK:-0}" != 1 ]; then # THREE_NODES_QUICK=1: start-up, a lost node and the restarts only
echo "== LL BF16 skewed and LL FP8 with special values (128 tokens, H 7168, top-8), 12 steps each"
start_workers llb --steps 12 --seed 5 --skew $COMMON --tokens 128
expect_ok $(outs llb)
start_workers llf --steps 12 --seed 7 --fp8 --specials $COMMON --tokens 128
expect_ok $(outs llf)
echo "== HT FP8 skewed with special values and HT BF16 (256 tokens), 6 steps each"
start_workers htf --steps 6 --seed 4 --mode ht --fp8 --skew --specials $COMMON --tokens 256
expect_ok $(outs htf)
start_workers htb --steps 6 --seed 8 --mode ht $COMMON --tokens 256
expect_ok $(outs htb)

echo "== three groups at once (LL FP8, HT BF16, LL small with a new map every 3 steps): exchanges in node 0's order"
start_workers ga --steps 20 --seed 21 --fp8 --skew $COMMON --tokens 64
start_workers gb --steps 10 --seed 22 --mode ht $COMMON --tokens 128
start_workers gc --steps 90 --seed 23 --hidden 256 --map-every 3
expect_ok $(outs ga) $(outs gb) $(outs gc)
same_switches gc 25
grep -q "ordered its exchange, but\|to order the step's exchange" "$T"/node[012].log && fail "$(grep -h -m1 'ordered its exchange, but\|to order the step' "$T"/node[012].log)"
echo "   ok: $(wc -l < "$T/swgc0.txt") switches of gc at the same steps on all three nodes"

echo "== expert weights move with the maps between every pair of nodes: 45 LL steps, a map every 3 with weight copies"
start_workers wm --steps 45 --seed 14 --hidden 256 --weights 4096 --map-every 3
expect_ok $(outs wm)
weights_moved wm 5
grep -q "group wm: weights of copy .* received from node 2" "$T/node1.log" ||
  grep -q "group wm: weights of copy .* received from node 1" "$T/node2.log" ||
  fail "wm: no copy went between nodes 1 and 2: $(grep -h 'group wm: weights of copy' "$T"/node[12].log | head -3)"
echo "   copies received per node: $(for n in $ALL; do printf 'node %s %s; ' $n "$(grep -c 'group wm: weights of copy .* received from node' "$T/node$n.log")"; done)"

echo "== SetExpertMap at node 2 while steps run: staged by node 0, active on all three nodes"
start_workers ex --steps 4000 --seed 13 --hidden 256
ex_steps() { "$EPDCTL" -s "$T/n0/control.sock" status 2>/dev/null | awk '$1 == "ex" { print $7 }'; }
ex_running() { [ "$(ex_steps)" -ge 10 ]; }
wait_for 60 ex_running || fail "group ex did not run 10 steps on node 0"
{ echo "group ex"; for e in $(seq 0 15); do i=$(( (e + 5) % 24 )); echo "expert $e: $((i / 8)):$((i % 8))"; done; } > "$T/map2.txt"
"$EPDCTL" -s "$T/n2/control.sock" set-map "$T/map2.txt" > "$T/sm2.out" 2>&1 || fail "set-map at node 2: $(cat "$T/sm2.out")"
V=$(sed -n 's/.*version \([0-9][0-9]*\).*/\1/p' "$T/sm2.out" | head -1)
[ -n "$V" ] || fail "set-map printed no version: $(cat "$T/sm2.out")"
experts_all() {
  local n
  for n in $ALL; do "$EPDCTL" -s "$T/n$n/control.sock" experts ex > "$T/e$n.txt" || return 1; done
  cmp -s "$T/e0.txt" "$T/e1.txt" && cmp -s "$T/e0.txt" "$T/e2.txt" && grep -q "version $V\b" "$T/e0.txt"
}
wait_for 30 experts_all || fail "group ex: the nodes do not all run version $V: $(head -1 "$T/e0.txt") / $(head -1 "$T/e1.txt") / $(head -1 "$T/e2.txt")"
grep -q "^expert 0: 0:5$" "$T/e1.txt" || fail "group ex: not node 2's map: $(head -3 "$T/e1.txt")"
grep -q "group ex: expert map version $V staged from node 0" "$T/node2.log" || fail "node 2 did not log version $V staged from node 0"
[ -n "$(ex_steps)" ] || fail "group ex finished before the checks did (raise its --steps)"
expect_ok $(outs ex)
echo "   version $V set at node 2, active on all three nodes"

echo "== a worker killed at a random moment, 6 rounds over the three nodes: the other two stop at once naming it, no engine fails"
for i in 1 2 3 4 5 6; do
  v=$(( i % 3 ))
  start_workers "k$i" --steps 100000 --seed $((30 + i)) --hidden 512 --tokens 32 -v
  wait_for 60 grep -q "^rank $v step 3:" "$T/k${i}$v.out" || fail "k$i: rank $v's worker did not reach step 3: $(tail -2 "$T/k${i}$v.out")"
  sleep "0.0$((RANDOM % 10))$((RANDOM % 10))"
  pkill -KILL -P "$(eval echo \$W_k${i}$v)"
  s=$(date +%s%N)
  for o in $ALL; do
    [ "$o" = "$v" ] && continue
    eval "wait \$W_k${i}$o"; RC=$?
    ms=$(( ($(date +%s%N) - s) / 1000000 ))
    [ $RC -eq 2 ] || fail "k$i: rank $o's worker exited $RC: $(tail -2 "$T/k${i}$o.out")"
    grep -q "failed.*peer rank $v" "$T/k${i}$o.out" || fail "k$i: rank $o's worker stopped without naming rank $v: $(tail -2 "$T/k${i}$o.out")"
    [ $ms -lt 4000 ] || fail "k$i: rank $o's worker stopped only after $ms ms: $(tail -1 "$T/k${i}$o.out")"
  done
  no_engine_failed "k$i"
  echo "   k$i: rank $v killed: $(grep -h 'failed' "$T/k${i}$(( (v + 1) % 3 )).out" | head -1 | cut -c1-100) ($ms ms)"
done 2>/dev/null # bash's "Killed" notices
for n in $ALL; do "$EPDCTL" -s "$T/n$n/control.sock" health > /dev/null 2>&1 || fail "node $n not serving after the kills"; done
start_workers kz --steps 10 --seed 39 --hidden 512 --tokens 32
expect_ok $(outs kz)

echo "== node 2's worker dies and restarts: the group made again there takes the others' step, theirs go on"
RJ="--seed 40 --hidden 512 --tokens 32 --fp8 --same-inputs"
for r in 0 1; do
  CUDA_VISIBLE_DEVICES=$(gpu_of $r) timeout 150 "$WORKER" -s "$T/n$r/control.sock" -g rj -r $r -n 3 --steps 5000 $RJ --until-streak 20 > "$T/rj$r.out" 2>&1 &
  eval "W_rj$r=$!"
done
CUDA_VISIBLE_DEVICES=$(gpu_of 2) timeout 150 "$WORKER" -s "$T/n2/control.sock" -g rj -r 2 -n 3 --steps 5000 $RJ -v > "$T/rj2.out" 2>&1 &
W_rj2=$!
wait_for 60 grep -q "^rank 2 step 10:" "$T/rj2.out" || fail "rejoin: rank 2 did not reach step 10: $(tail -2 "$T/rj2.out")"
pkill -KILL -P "$W_rj2"
wait_for 10 grep -q "rank 0 step [0-9]*: .* failed (skipped).*EPD_ERR_PEER" "$T/rj0.out" || fail "rejoin: node 0's worker did not fail meanwhile: $(tail -2 "$T/rj0.out")"
CUDA_VISIBLE_DEVICES=$(gpu_of 2) timeout 150 "$WORKER" -s "$T/n2/control.sock" -g rj -r 2 -n 3 --steps 20 $RJ > "$T/rjb2.out" 2>&1 &
W_rjb2=$!
expect_ok rjb2 rj0 rj1
grep -q "group rj: made again here while the other nodes step it: it runs from their step [1-9]" "$T/node2.log" ||
  fail "rejoin: node 2's log: $(grep 'group rj' "$T/node2.log" | tail -3)"
no_engine_failed rejoin
echo "   $(grep -o 'group rj: made again here.*' "$T/node2.log" | head -1); skipped meanwhile: node 0 $(grep -c 'failed (skipped)' "$T/rj0.out"), node 1 $(grep -c 'failed (skipped)' "$T/rj1.out")"

echo "== node 1 never submits: EPD_ERR_TIMEOUT naming rank 1 on nodes 0 and 2"
one_step_fails to EPD_ERR_TIMEOUT 1 "timeout case" 0 2
no_engine_failed "timeout case"
echo "   ok: $(grep -h EPD_ERR_TIMEOUT "$T/to2.out" | head -1 | cut -c1-140)"

fi
echo "== node 2 stops: EPD_ERR_PEER naming rank 2 on nodes 0 and 1 within 3 s; both keep serving"
kill -TERM "$P_2"; wait "$P_2"; R2=$?
for n in 0 1; do wait_for 5 grep -q "data link to node 2 lost" "$T/node$n.log" || fail "node $n did not notice the lost link"; done
s=$(date +%s%N)
one_step_fails pe EPD_ERR_PEER 2 "lost node" 0 1
ms=$(( ($(date +%s%N) - s) / 1000000 ))
[ $ms -lt 3000 ] || fail "lost node: the steps failed only after $ms ms"
"$EPDCTL" -s "$T/n1/control.sock" status > "$T/status1b.out" || fail "node 1 stopped serving after losing node 2"
grep -q "^links: *node 0 up; node 2 down" "$T/status1b.out" || fail "node 1's links: $(grep links "$T/status1b.out")"
no_engine_failed "lost node"
echo "   ok in $ms ms: $(grep -h EPD_ERR_PEER "$T/pe1.out" | head -1 | cut -c1-140)"
echo "== node 2's daemon starts again: it joins the running world, every node makes the NCCL world communicator again"
# a group of nodes 0 and 1 skips the ops that fail meanwhile; node 2's new worker joins it
RW="--seed 41 --hidden 512 --tokens 32 --fp8 --same-inputs"
for r in 0 1; do
  CUDA_VISIBLE_DEVICES=$(gpu_of $r) timeout 150 "$WORKER" -s "$T/n$r/control.sock" -g rw -r $r -n 3 --steps 5000 $RW --until-streak 20 > "$T/rw$r.out" 2>&1 &
  eval "W_rw$r=$!"
done
wait_for 10 grep -q "rank 0 step [0-9]*: .* failed (skipped).*EPD_ERR_PEER" "$T/rw0.out" || fail "restart: node 0's worker did not fail while node 2 was down: $(tail -2 "$T/rw0.out")"
mv "$T/node2.log" "$T/node2-first.log"
rm -f "$T/n2/attach.sock" "$T/n2/control.sock"
s=$(date +%s%N)
node 2
wait_for 120 test -S "$T/n2/attach.sock" || fail "the restarted node 2 did not come up: $(grep -v 'NCCL INFO' "$T/node2.log" | tail -3)"
ms=$(( ($(date +%s%N) - s) / 1000000 ))
grep -q "joined the running world again (this daemon restarted)" "$T/node2.log" || fail "node 2's log: $(grep -v 'NCCL INFO' "$T/node2.log" | grep cluster | tail -2)"
grep -q "every node makes the NCCL world communicator again with it" "$T/node0.log" || fail "node 0 did not hand out a new world communicator"
for n in 0 1; do wait_for 60 grep -q "world communicator made again" "$T/node$n.log" || fail "node $n did not make the world communicator again: $(grep -v 'NCCL INFO' "$T/node$n.log" | tail -3)"; done
CUDA_VISIBLE_DEVICES=$(gpu_of 2) timeout 150 "$WORKER" -s "$T/n2/control.sock" -g rw -r 2 -n 3 --steps 5000 $RW --until-streak 20 --streak-any > "$T/rw2.out" 2>&1 &
W_rw2=$!
expect_ok rw2 rw0 rw1
grep -q "group rw: made again here while the other nodes step it: it runs from their step" "$T/node2.log" || fail "node 2's group rw: $(grep 'group rw' "$T/node2.log" | tail -2)"
echo "   node 2 up in $ms ms; $(grep -h -o 'world communicator made again.*' "$T/node1.log" | head -1); $(grep -o 'group rw: made again here.*' "$T/node2.log" | head -1)"
start_workers fr --steps 6 --seed 9 --fp8 --skew $COMMON --tokens 64
expect_ok $(outs fr)
start_workers fh --steps 4 --seed 10 --mode ht $COMMON --tokens 128
expect_ok $(outs fh)
no_engine_failed "restart"

echo "== nodes 1 and 2 killed together and started again: the second gets the same world communicator id"
# P_n is the pid of the timeout(1) that runs node n's daemon (two-nodes-lib.sh's node): a SIGKILL to it
# would leave the daemon running, so kill its child, the daemon, as the worker kills above do. Node 0's log
# already says node 2's first link was lost: only lines written after the kill count.
L0=$(wc -l < "$T/node0.log")
lost_since_kill() { tail -n +"$((L0 + 1))" "$T/node0.log" | grep -q "data link to node $1 lost"; }
pkill -KILL -P "$P_1,$P_2"; wait "$P_1" "$P_2" 2>/dev/null
for n in 1 2; do wait_for 5 lost_since_kill $n || fail "node 0 did not notice node $n's lost link"; done
for n in 1 2; do mv "$T/node$n.log" "$T/node$n-before-double.log"; rm -f "$T/n$n/attach.sock" "$T/n$n/control.sock"; done
s=$(date +%s%N)
node 1
sleep 1
node 2
for n in 1 2; do wait_for 120 test -S "$T/n$n/attach.sock" || fail "node $n did not come up: $(grep -v 'NCCL INFO' "$T/node$n.log" | tail -3)"; done
ms=$(( ($(date +%s%N) - s) / 1000000 ))
grep -q "node 2 restarted while the world communicator is being made again: it gets the same id" "$T/node0.log" ||
  fail "node 0 did not give node 2 the same id: $(grep -h 'cluster: node' "$T/node0.log" | tail -3)"
start_workers dw --steps 6 --seed 12 --fp8 $COMMON --tokens 64
expect_ok $(outs dw)
no_engine_failed "double restart"
echo "   both up in $ms ms, one world communicator made again for both"
kill -TERM "$P_0" "$P_1" "$P_2"
wait "$P_0"; R0=$?
wait "$P_1"; R1=$?
wait "$P_2" || fail "the restarted node 2 exited $? on SIGTERM"
[ $R0 -eq 0 ] && [ $R1 -eq 0 ] && [ $R2 -eq 0 ] || fail "daemons exited $R0 $R1 $R2 on SIGTERM"
grep -q "via NET/Socket" "$T/node1.log" || fail "NCCL did not use its socket transport on node 1"
grep -q "via P2P\|via SHM" "$T"/node[012].log && fail "NCCL used P2P or SHM between nodes"
save_logs
echo "167-three-nodes-cuda: all checks passed"
