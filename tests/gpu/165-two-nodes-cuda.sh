#!/bin/bash
# 165-two-nodes-cuda.sh - two nodes simulated on one host with GPUs: two daemons with engine.backend=cuda,
# each owning one GPU (CUDA_VISIBLE_DEVICES 0 / 1), told they are different hosts (NCCL_HOSTID node0 /
# node1) with NCCL's P2P and SHM transports off, so the inter-node stage (grouped ncclSend/ncclRecv on
# the world communicator) really runs over NCCL's network transport (sockets on lo). cluster.nodes=2,
# rendezvous over 127.0.0.1. One epd-worker per node checks every step against the reference:
#   LL BF16 and FP8 (H 7168, 256 experts, top-8, 128 tokens, skewed and uniform), HT BF16 and FP8
#   (256 tokens; BF16 also 4096 tokens with 16 experts); status shows transport nccl-p2p, the NCCL log shows
#   NET/Socket; expert maps staged through either node's daemon (rank 0 every 3 LL / 4 HT steps; epdctl
#   set-map at node 1) become active on both nodes at the same step, expert weights move with the maps
#   between the nodes (--weights: copies whose bytes the source's daemon sends), a copy into a group
#   without weights refused on both; node 1
#   silent -> EPD_ERR_TIMEOUT naming rank 1 while a second group runs; four groups at once (their
#   exchanges in node 0's order); node 1 drains while a group
#   of both nodes holds between a dispatch and its combine -> the combines run, then both workers stop on
#   EPD_ERR_DRAINING at their next dispatch, node 0's at once (the per-group notice);
#   then node 0's dispatch in a group node 1 does not have fails with EPD_ERR_DRAINING naming rank 1 at once;
#   node 1 gone -> EPD_ERR_PEER naming rank 1 within 3 s.
# Then (TWO_NODES_BASELINE=1, default) the same LL steps on ONE daemon driving both GPUs over NVLink (not
# where the ranks share a GPU: two-nodes-lib.sh; with one GPU both nodes run on it, checks the same).
# TWO_NODES_QUICK=1: the LL cases only; TWO_NODES_NCCL_ENV: extra NCCL variables for the daemons.
# Usage (repository root, GPU machine): bash tests/gpu/165-two-nodes-cuda.sh [build-dir]; logs go to
# $TWO_NODES_OUT if set. Set-up, daemons and workers: two-nodes-lib.sh.
set -u
B=${1:-${EPD_BUILD:-build}}
GPN=1
# twice the slots an expert needs: the free slots the weight migrations (--weights --map-every) move experts into
TWO_NODES_DAEMON_OPTS="-o engine.slots_factor_pct=200"
. "$(dirname "$0")/two-nodes-lib.sh"

start_nodes
grep -h "inter-node transport nccl-p2p" "$T/node0.log" | sed 's/^.*scale-out/   scale-out/' | head -1

COMMON="--experts 256 --hidden 7168 --topk 8"

# One step of group $4 on node 0 alone must fail with $1 naming rank 1 within $2 ms ($3: the case).
node0_fails() {
  local code=$1 limit=$2 what=$3 g=$4 s rc ms
  s=$(date +%s%N)
  CUDA_VISIBLE_DEVICES=$(gpu_of 0) timeout 30 "$WORKER" -s "$T/n0/control.sock" -g "$g" -r 0 -n 2 --steps 1 --hidden 256 > "$T/$g.out" 2>&1
  rc=$?
  ms=$(( ($(date +%s%N) - s) / 1000000 ))
  [ $rc -eq 2 ] || fail "$what: worker exited $rc"
  grep -q "$code.*peer rank 1" "$T/$g.out" || fail "$what: no $code naming rank 1: $(tail -2 "$T/$g.out")"
  [ $ms -lt "$limit" ] || fail "$what: the step failed only after $ms ms"
  echo "   ok in $ms ms: $(grep -h "$code" "$T/$g.out" | head -1 | cut -c1-150)"
}
echo "== LL BF16, skewed routing, 128 tokens, 20 steps"
start_workers llb --steps 20 --seed 5 --skew $COMMON --tokens 128 --bench 200
expect_ok llb0 llb1
echo "== LL FP8 (special values in some groups), uniform routing, 128 tokens, 20 steps"
start_workers llf --steps 20 --seed 7 --fp8 --specials $COMMON --tokens 128 --bench 200
expect_ok llf0 llf1
echo "== four groups at once on both nodes (LL FP8 H 7168, HT BF16 256 tokens, LL small with a new map every 3 steps, HT FP8 small)"
# their NCCL exchanges share the world communicator: every node runs them in node 0's order (GO frames);
# in another order two groups' sends and receives of different sizes would meet (errors or a hang)
start_workers ga --steps 30 --seed 21 --fp8 --skew $COMMON --tokens 128
start_workers gb --steps 12 --seed 22 --mode ht $COMMON --tokens 256
start_workers gc --steps 150 --seed 23 --hidden 256 --map-every 3
start_workers gd --steps 150 --seed 24 --mode ht --fp8 --hidden 512 --tokens 96
expect_ok ga0 ga1 gb0 gb1 gc0 gc1 gd0 gd1
for n in 0 1; do
  grep -q "ordered its exchange, but\|to order the step's exchange" "$T/node$n.log" && fail "node $n: $(grep -m1 'ordered its exchange, but\|to order the step' "$T/node$n.log")"
  grep -o "group gc switched expert map [0-9]* -> [0-9]* at step [0-9]*" "$T/node$n.log" > "$T/gsw$n.txt"
done
[ "$(wc -l < "$T/gsw0.txt")" -ge 40 ] || fail "gc: node 0 logged $(wc -l < "$T/gsw0.txt") switches"
cmp -s "$T/gsw0.txt" "$T/gsw1.txt" || fail "gc: the nodes switched at different steps"
# the groups went away when their workers left: each logged how many of its steps waited for another's exchange
wait_for 10 grep -q "group ga: [0-9]* steps ready while another" "$T/node1.log" || fail "no contention line for ga on node 1"
behind=$(cat "$T/node0.log" "$T/node1.log" | sed -n 's/.*group g[abcd]: \([0-9]*\) steps ready while another.*/\1/p' | awk '{ s += $1 } END { print s + 0 }')
[ "$behind" -gt 0 ] || fail "the four groups never overlapped (0 steps ready behind another group's exchange)"
echo "   ok: $(wc -l < "$T/gsw0.txt") switches of gc at the same steps on both nodes; $behind steps (both nodes) were ready while another group's exchange ran"
if [ "${TWO_NODES_QUICK:-0}" != 1 ]; then
echo "== HT FP8 skewed and HT BF16 (256 tokens, 8 steps), HT BF16 4096 tokens (16 experts, top-4, 2 steps)"
start_workers htf --steps 8 --seed 4 --mode ht --fp8 --skew --specials $COMMON --tokens 256 --bench 50
expect_ok htf0 htf1
start_workers htb --steps 8 --seed 8 --mode ht $COMMON --tokens 256 --bench 50
expect_ok htb0 htb1
start_workers htl --steps 2 --seed 6 --mode ht --experts 16 --hidden 7168 --topk 4 --tokens 4096 --bench 5
expect_ok htl0 htl1
echo "== LL small (hidden 256, 16 experts, top-4, 64 tokens), 40 steps"
start_workers lls --steps 40 --seed 3 --hidden 256
expect_ok lls0 lls1

echo "== expert maps across nodes: rank 0 stages a new map through node 0's daemon every 3 LL / 4 HT steps"
start_workers lm --steps 90 --seed 11 --skew --hidden 256 --map-every 3
expect_ok lm0 lm1
start_workers hm --steps 40 --seed 12 --mode ht --fp8 --skew --specials --hidden 256 --map-every 4
expect_ok hm0 hm1
for g in lm hm; do
  want=8; [ $g = lm ] && want=25
  seen=$(sed -n 's/.*: \([0-9]*\) map switches seen.*/\1/p' "$T/${g}1.out" | tail -1)
  [ "${seen:-0}" -ge $want ] || fail "$g: the worker at node 1 saw ${seen:-0} map switches"
  for n in 0 1; do grep -o "group $g switched expert map [0-9]* -> [0-9]* at step [0-9]*" "$T/node$n.log" > "$T/sw$n.txt"; done
  [ "$(wc -l < "$T/sw0.txt")" -ge $want ] || fail "$g: node 0 logged $(wc -l < "$T/sw0.txt") switches"
  cmp -s "$T/sw0.txt" "$T/sw1.txt" || fail "$g: the nodes switched at different steps: $(diff "$T/sw0.txt" "$T/sw1.txt" | head -4)"
  echo "   $g: $(wc -l < "$T/sw0.txt") switches, the same (version, step) on both nodes; node 1's worker saw $seen"
done
echo "== expert weights move with the maps across nodes: 60 LL steps, a map every 3 with weight copies"
# every copy between the two ranks crosses nodes (one GPU per node): the source's daemon reads the slot
# from its GPU and sends it, the destination's writes it into its GPU at the switch; every worker checks
# at every step that each slot holds its expert's weights, and its toy experts compute with them
start_workers wm --steps 60 --seed 14 --hidden 256 --weights 4096 --map-every 3
expect_ok wm0 wm1
weights_moved wm 5
echo "== SetExpertMap sent to node 1's daemon while steps run: staged by node 0, active on both nodes"
start_workers ex --steps 8000 --seed 13 --hidden 256
experts_same() { # GROUP VERSION: both nodes run the same map of GROUP, at VERSION
  "$EPDCTL" -s "$T/n0/control.sock" experts "$1" > "$T/e0.txt" && "$EPDCTL" -s "$T/n1/control.sock" experts "$1" > "$T/e1.txt" &&
    cmp -s "$T/e0.txt" "$T/e1.txt" && grep -q "version $2\b" "$T/e0.txt"
}
ex_steps() { "$EPDCTL" -s "$T/n0/control.sock" status 2>/dev/null | awk '$1 == "ex" { print $7 }'; }
ex_running() { [ "$(ex_steps)" -ge 20 ]; }
version_of() { sed -n 's/.*version \([0-9][0-9]*\).*/\1/p' "$1" | head -1; }
wait_for 30 ex_running || fail "group ex did not run 20 steps on node 0"
S0=$(ex_steps)
for sh in 1 2 3; do # 16 experts over the first 8 slots of each rank: expert e on slot (e + sh) % 16
  { echo "group ex"; for e in $(seq 0 15); do i=$(( (e + sh) % 16 )); echo "expert $e: $((i / 8)):$((i % 8))"; done; } > "$T/map$sh.txt"
  "$EPDCTL" -s "$T/n1/control.sock" set-map "$T/map$sh.txt" > "$T/sm$sh.out" 2>&1 || fail "set-map at node 1: $(cat "$T/sm$sh.out")"
done
VB=$(version_of "$T/sm3.out")
[ -n "$VB" ] || fail "set-map printed no version: $(cat "$T/sm3.out")"
wait_for 20 experts_same ex "$VB" || fail "group ex: the nodes do not both run version $VB: $(head -2 "$T/e0.txt" | tr '\n' ' ') / $(head -2 "$T/e1.txt" | tr '\n' ' ')"
grep -q "^expert 0: 0:3$" "$T/e0.txt" || fail "group ex: not node 1's last map: $(head -3 "$T/e0.txt")"
grep -q "group ex: expert map version $VB staged from node 0" "$T/node1.log" || fail "node 1 did not log version $VB staged from node 0"
{ cat "$T/map1.txt"; echo "copy 0:0 -> 1:4"; } > "$T/xcopy.txt" # weight copies: refused, group ex has no weights
for n in 0 1; do
  "$EPDCTL" -s "$T/n$n/control.sock" set-map "$T/xcopy.txt" > "$T/xc$n.out" 2>&1 && fail "a weight copy was accepted at node $n"
  grep -q "no expert-weights region" "$T/xc$n.out" || fail "weight copy at node $n: $(cat "$T/xc$n.out")"
done
# the refused maps took no version: the next map (set at node 0 this time) gets VB + 1 and becomes active
{ echo "group ex"; for e in $(seq 0 15); do i=$(( (e + 2) % 16 )); echo "expert $e: $((i / 8)):$((i % 8))"; done; } > "$T/map4.txt"
"$EPDCTL" -s "$T/n0/control.sock" set-map "$T/map4.txt" > "$T/sm4.out" 2>&1 || fail "set-map at node 0: $(cat "$T/sm4.out")"
V4=$(version_of "$T/sm4.out")
[ "$V4" = $((VB + 1)) ] || fail "the map after the refused ones got version '$V4', want $((VB + 1))"
wait_for 20 experts_same ex "$V4" || fail "group ex: the nodes do not both run version $V4"
grep -q "^expert 0: 0:2$" "$T/e1.txt" || fail "group ex: not node 0's map: $(head -3 "$T/e1.txt")"
S1=$(ex_steps)
[ -n "$S1" ] || fail "group ex finished before the checks did (raise its --steps)"
expect_ok ex0 ex1
echo "   versions $(version_of "$T/sm1.out") .. $VB staged at node 1, then $V4 at node 0 (a weight copy into a group without weights refused on both), active on both nodes; steps $S0 .. $S1 meanwhile"
for n in 0 1; do
  grep -q "dispatches with expert map version" "$T/node$n.log" && fail "the map mismatch check fired on node $n"
done

echo "== node 1 never submits: EPD_ERR_TIMEOUT naming rank 1; meanwhile a second group of both nodes runs"
CUDA_VISIBLE_DEVICES=$(gpu_of 0) timeout 30 "$WORKER" -s "$T/n0/control.sock" -g to -r 0 -n 2 --steps 1 --hidden 256 > "$T/to.out" 2>&1 &
W_TO=$!
sleep 1
start_workers two --steps 20 --seed 15 --hidden 256
expect_ok two0 two1
wait "$W_TO"; RC=$?
[ $RC -eq 2 ] || fail "timeout case: worker exited $RC"
grep -q "EPD_ERR_TIMEOUT.*peer rank 1" "$T/to.out" || fail "timeout does not name rank 1: $(cat "$T/to.out")"
grep -q "node 1 (ranks 1..1) did not send" "$T/node0.log" || fail "the log does not say node 1 was silent"
echo "   ok: $(grep -h EPD_ERR_TIMEOUT "$T/to.out" | head -1)"

echo "== node 1's only client of a group dies after sending its part of a step: that exchange still runs, node 0 keeps serving"
# rank 0 holds before the combine of step 3; rank 1 has submitted that combine (node 1 sent its frame and
# waits for node 0's) when it is killed, and node 1 removes the group. Node 0's combine then runs: node 1
# must take part in its NCCL exchange, or node 0's exchange hangs until the step timeout and its engine
# fails for every group (world communicator aborted). Node 1's removal notice then fails node 0's next
# step at once with EPD_ERR_PEER (not after the step timeout).
CUDA_VISIBLE_DEVICES=$(gpu_of 0) timeout 60 "$WORKER" -s "$T/n0/control.sock" -g gh -r 0 -n 2 --steps 8 --seed 16 --hidden 256 \
  --hold-at 3 --hold-file "$T/gh.go" > "$T/gh0.out" 2>&1 &
W_GH0=$!
CUDA_VISIBLE_DEVICES=$(gpu_of 1) timeout 60 "$WORKER" -s "$T/n1/control.sock" -g gh -r 1 -n 2 --steps 8 --seed 16 --hidden 256 \
  > "$T/gh1.out" 2>&1 &
W_GH1=$!
wait_for 30 grep -q "holding before the combine of step 3" "$T/gh0.out" || fail "gh: rank 0 did not reach the hold: $(tail -2 "$T/gh0.out")"
sleep 0.5 # rank 1 checked its dispatch of step 3 and submitted the combine
pkill -KILL -P "$W_GH1"
wait_for 10 grep -q "group gh has no clients left" "$T/node1.log" || fail "gh: node 1 did not remove the group"
touch "$T/gh.go"
s=$(date +%s%N)
wait "$W_GH0"; RC=$?
ms=$(( ($(date +%s%N) - s) / 1000000 ))
[ $RC -eq 2 ] || fail "gh: rank 0's worker exited $RC: $(tail -3 "$T/gh0.out")"
grep -q "the combine of step 3 after the hold: ok" "$T/gh0.out" || fail "gh: rank 0's combine of step 3 (node 1's client gone): $(tail -3 "$T/gh0.out")"
grep -q "step 4: dispatch failed.*EPD_ERR_PEER.*peer rank 1" "$T/gh0.out" || fail "gh: rank 0's next dispatch did not fail with EPD_ERR_PEER naming rank 1: $(tail -3 "$T/gh0.out")"
[ $ms -lt 3000 ] || fail "gh: rank 0's next dispatch failed only after $ms ms (node 1's removal notice; step timeout 5000 ms)"
grep -q "group gh step [0-9]*: its last client here left after the step's frame was sent" "$T/node1.log" ||
  fail "gh: node 1 did not keep the step of the removed group: $(grep 'group gh' "$T/node1.log" | tail -3)"
grep -q "did not finish within\|engine failed" "$T/node0.log" && fail "gh: node 0's engine failed: $(grep -m1 'did not finish within\|engine failed' "$T/node0.log")"
"$EPDCTL" -s "$T/n0/control.sock" health > "$T/gh-health.out" 2>&1 || fail "gh: node 0 not serving: $(cat "$T/gh-health.out")"
start_workers gz --steps 20 --seed 17 --hidden 256
expect_ok gz0 gz1
echo "   ok: rank 0's combine of step 3 ran with node 1's part; then in $ms ms $(grep -h 'step 4: dispatch failed' "$T/gh0.out" | cut -c1-140)"

echo "== a worker killed at a random moment of its steps, 8 rounds (node 1's, then node 0's: the node that orders the exchanges): the other node's worker stops with an error at once, no engine fails"
# each phase of the victim's step (collecting, waiting for the other part, ready, exchange running) may
# be hit over the rounds: no engine may fail, and a fresh group of both nodes runs at the end
for i in 1 2 3 4 5 6 7 8; do
  v=$(( i % 2 )); o=$(( 1 - v )) # the victim's rank (= node), the other's
  start_workers "k$i" --steps 100000 --seed $((30 + i)) --hidden 512 --tokens 32 -v
  wait_for 30 grep -q "^rank $v step 3:" "$T/k${i}$v.out" || fail "k$i: rank $v's worker did not reach step 3: $(tail -2 "$T/k${i}$v.out")"
  sleep "0.0$((RANDOM % 10))$((RANDOM % 10))"
  pkill -KILL -P "$(eval echo \$W_k${i}$v)"
  s=$(date +%s%N)
  eval "wait \$W_k${i}$o"; RC=$?
  ms=$(( ($(date +%s%N) - s) / 1000000 ))
  [ $RC -eq 2 ] || fail "k$i: rank $o's worker exited $RC: $(tail -2 "$T/k${i}$o.out")"
  grep -q "failed.*peer rank $v" "$T/k${i}$o.out" || fail "k$i: rank $o's worker stopped without naming rank $v: $(tail -2 "$T/k${i}$o.out")"
  [ $ms -lt 3000 ] || fail "k$i: rank $o's worker stopped only after $ms ms: $(tail -1 "$T/k${i}$o.out")"
  grep -q "did not finish within\|engine failed" "$T/node0.log" "$T/node1.log" && fail "k$i: an engine failed: $(grep -h -m1 'did not finish within\|engine failed' "$T/node0.log" "$T/node1.log")"
  echo "   k$i: rank $v killed: $(grep -h 'failed' "$T/k${i}$o.out" | head -1 | cut -c1-100) ($ms ms)"
done 2>/dev/null # bash's "Killed" notices
"$EPDCTL" -s "$T/n0/control.sock" health > /dev/null 2>&1 || fail "node 0 not serving after the kills"
"$EPDCTL" -s "$T/n1/control.sock" health > /dev/null 2>&1 || fail "node 1 not serving after the kills"
echo "   steps of removed groups kept (node 0, node 1; the held-combine case's included): $(grep -c "its last client here left after the step's frame was sent" "$T/node0.log"), $(grep -c "its last client here left after the step's frame was sent" "$T/node1.log")"
start_workers kz --steps 20 --seed 39 --hidden 512 --tokens 32
expect_ok kz0 kz1
echo "== node 1's worker dies and restarts: the group made again there takes node 0's step and map, node 0's worker goes on"
# node 0's worker skips the ops that fail meanwhile (--until-streak) and stops after 20 steps in a row
# with the restarted worker; every step's inputs are step 0's (--same-inputs)
RJ="--seed 40 --hidden 512 --tokens 32 --fp8 --same-inputs"
CUDA_VISIBLE_DEVICES=$(gpu_of 0) timeout 120 "$WORKER" -s "$T/n0/control.sock" -g rj -r 0 -n 2 --steps 5000 $RJ --until-streak 20 > "$T/rj0.out" 2>&1 &
W_rj0=$!
CUDA_VISIBLE_DEVICES=$(gpu_of 1) timeout 120 "$WORKER" -s "$T/n1/control.sock" -g rj -r 1 -n 2 --steps 5000 $RJ -v > "$T/rj1.out" 2>&1 &
W_rj1=$!
wait_for 30 grep -q "^rank 1 step 10:" "$T/rj1.out" || fail "rejoin: rank 1 did not reach step 10: $(tail -2 "$T/rj1.out")"
pkill -KILL -P "$W_rj1"
wait_for 10 grep -q "rank 0 step [0-9]*: .* failed (skipped).*EPD_ERR_PEER" "$T/rj0.out" || fail "rejoin: node 0's worker did not fail meanwhile: $(tail -2 "$T/rj0.out")"
CUDA_VISIBLE_DEVICES=$(gpu_of 1) timeout 120 "$WORKER" -s "$T/n1/control.sock" -g rj -r 1 -n 2 --steps 20 $RJ > "$T/rjb1.out" 2>&1 &
W_rjb1=$!
expect_ok rjb1 rj0
grep -q "group rj: made again here while the other nodes step it: it runs from their step [1-9]" "$T/node1.log" ||
  fail "rejoin: node 1's log: $(grep 'group rj' "$T/node1.log" | tail -3)"
grep -q "did not finish within\|engine failed" "$T/node0.log" "$T/node1.log" && fail "rejoin: an engine failed"
echo "   $(grep -o 'group rj: made again here.*' "$T/node1.log" | head -1); node 0's worker skipped $(grep -c 'failed (skipped)' "$T/rj0.out") ops meanwhile"

echo "== node 1 drains between a dispatch and its combine: the combines run, then both workers stop on EPD_ERR_DRAINING, node 0's at once"
start_workers dr --steps 100000 --seed 9 --hidden 256 --hold-at 5 --hold-file "$T/dr.go"
wait_for 30 all_holding 5 dr0 dr1 || fail "group dr did not reach the hold on both nodes: $(tail -qn1 "$T"/dr[01].out)"
"$EPDCTL" -s "$T/n1/control.sock" drain > "$T/drain.out" 2>&1 || fail "epdctl drain: $(cat "$T/drain.out")"
wait_for 5 grep -q "group dr: node 1 is draining" "$T/node0.log" || fail "node 0's log does not say node 1 drains"
touch "$T/dr.go"
s=$(date +%s%N)
expect_drained 5 dr0
ms=$(( ($(date +%s%N) - s) / 1000000 ))
grep -q "EPD_ERR_DRAINING.*peer rank 1" "$T/dr0.out" || fail "drain of a running group, node 0: $(tail -2 "$T/dr0.out")"
[ $ms -lt 4000 ] || fail "drain of a running group: node 0's step failed only after $ms ms"
expect_drained 5 dr1
echo "   ok: the combines of step 5 ran after the drain; node 0 stopped $ms ms after the release: $(grep -h EPD_ERR_DRAINING "$T/dr0.out" | head -1 | cut -c1-150)"
echo "   node 1: $(grep -h EPD_ERR_DRAINING "$T/dr1.out" | head -1 | cut -c1-150)"

echo "== node 1 drains: node 0's dispatch in a group node 1 will not step fails with EPD_ERR_DRAINING at once"
wait_for 10 grep -q "node 1 is draining: the dispatches of groups it does not have fail here" "$T/node0.log" ||
  fail "node 0's log does not say node 1 drains"
node0_fails EPD_ERR_DRAINING 4000 "drain (step_timeout_ms 5000)" nd
fi
"$EPDCTL" -s "$T/n0/control.sock" metrics > "$T/metrics.out" || fail "metrics"
grep -q '^epd_cluster_info{transport="nccl-p2p"} 1$' "$T/metrics.out" || fail "metrics: transport"
R1=0
if [ "${TWO_NODES_QUICK:-0}" != 1 ]; then
  echo "== node 1 stops: EPD_ERR_PEER naming rank 1, promptly; node 0 keeps serving and stops cleanly"
  kill -TERM "$P_1"; wait "$P_1"; R1=$? # its NCCL log lines reach the file; then it is gone for good
  wait_for 5 grep -q "data link to node 1 lost" "$T/node0.log" || fail "node 0 did not notice the lost link"
  node0_fails EPD_ERR_PEER 3000 "lost node" pe
  "$EPDCTL" -s "$T/n0/control.sock" status > /dev/null || fail "node 0 stopped serving after losing node 1"
  kill -TERM "$P_0"
else
  kill -TERM "$P_0" "$P_1"
  wait "$P_1"; R1=$?
fi
wait "$P_0"; R0=$?
[ $R0 -eq 0 ] && [ $R1 -eq 0 ] || fail "daemons exited $R0 $R1 on SIGTERM"
# NCCL's INFO lines reach the (block-buffered) log file at exit.
grep -h " via " "$T/node0.log" "$T/node1.log" | head -4 | sed 's/^.*NCCL INFO/   NCCL INFO/'
grep -q "via NET/Socket" "$T/node0.log" || fail "NCCL did not use its socket transport (no 'via NET/Socket' in the log)"
grep -q "via P2P\|via SHM" "$T/node0.log" && fail "NCCL used P2P or SHM between the two nodes"
save_logs

if [ "${TWO_NODES_BASELINE:-1}" = 1 ]; then
  echo "== baseline: the same LL steps on one daemon driving both GPUs (NVLink, LSA kernels)"
  [ "$SHARE" -gt 1 ] && echo "   (both ranks on one GPU: no NVLink, not a baseline for the figures above)"
  mkdir -p "$T/one"
  # shellcheck disable=SC2046 # devices_opt: an option and its value, or nothing
  timeout 120 "$EPD" -s "$T/one/control.sock" -f -o daemon.attach_socket="$T/one/attach.sock" -o engine.backend=cuda \
    -o engine.num_ranks=2 $(devices_opt 2) -o engine.step_timeout_ms=5000 2> "$T/one.log" &
  PO=$!
  PIDS+=($PO)
  wait_for 60 test -S "$T/one/attach.sock" || fail "single-node daemon did not come up"
  for r in 0 1; do
    timeout 100 "$WORKER" -s "$T/one/control.sock" -g b -r $r -n 2 --steps 20 --seed 5 --skew $COMMON --tokens 128 --bench 200 > "$T/b$r.out" 2>&1 &
    eval "W_b$r=$!"
  done
  expect_ok b0 b1
  for r in 0 1; do
    timeout 100 "$WORKER" -s "$T/one/control.sock" -g f -r $r -n 2 --steps 20 --seed 7 --fp8 $COMMON --tokens 128 --bench 200 > "$T/f$r.out" 2>&1 &
    eval "W_f$r=$!"
  done
  expect_ok f0 f1
  kill -TERM "$PO"; wait "$PO"
elif [ "$SHARE" -gt 1 ]; then
  echo "== baseline (one daemon driving both GPUs over NVLink): not run, the ranks share a GPU (no NVLink to compare with)"
fi
echo "165-two-nodes-cuda: all checks passed"
