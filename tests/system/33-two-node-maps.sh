#!/bin/bash
# 33-two-node-maps: expert maps across nodes with the host backend. Two daemons on this host are nodes 0
# and 1 of one EP world (2 ranks each, 4 world ranks, redundant slots). A SetExpertMap sent to either
# node's daemon is numbered and staged by node 0, reaches every node with the same version and
# placements, and every node switches to it at the same dispatch step:
# - rank 0 (at node 0) stages a new random map every 3 (LL) / 4 (HT FP8) steps through its own daemon
#   only, hundreds of steps; the workers of BOTH nodes check every step against the reference with the
#   map version its completion carries (read from libepd's map table), and see the switches;
# - SetExpertMap sent to node 1's daemon, and to both daemons at once (concurrent calls get distinct
#   versions; the highest one ends active on both nodes, with the same placements); the daemons'
#   "dispatches with expert map version" mismatch check never fires;
# - SetExpertMap while the group exists on node 0 only: node 1 keeps the map and stages it when its first
#   client creates the group there, and both nodes switch to it at the same step;
# - an invalid map is refused on every node and changes no node's map;
# - expert weights move with the maps (--weights): copies between ranks of one node and of two nodes (the
#   source's node sends the bytes to the destination's), every slot checked at every step.
set -u
# a long step timeout: node 0's first step of group lt waits for node 1's workers, started after a set-map
STEP_TIMEOUT_MS=30000 WORKER_TIMEOUT=120
. "$(dirname "$0")/cluster-lib.sh"
world() { # GROUP STEPS ARGS...: ranks 0-1 at node a, 2-3 at node b
  local g=$1 s=$2; shift 2
  for r in 0 1; do worker "${g}$r" a -g "$g" -r $r -n 4 --steps "$s" --seed 21 --experts 10 --topk 3 --tokens 24 --node-ranks 2 "$@"; done
  for r in 2 3; do worker "${g}$r" b -g "$g" -r $r -n 4 --steps "$s" --seed 21 --experts 10 --topk 3 --tokens 24 --node-ranks 2 "$@"; done
}
ctl() { local nd=$1; shift; "$EPDCTL" -s "$T/$nd/control.sock" "$@"; }
# mapfile GROUP SHIFT: a valid map of 10 experts over 4 ranks x 5 slots, expert e on slot (e + SHIFT) % 20
# and, for even SHIFT, a second replica of expert 0 on slot (SHIFT + 10) % 20.
mapfile() {
  echo "group $1"
  for e in $(seq 0 9); do
    local i=$(( (e + $2) % 20 )) extra=""
    [ $e = 0 ] && [ $(( $2 % 2 )) = 0 ] && { local j=$(( ($2 + 10) % 20 )); extra=" $((j / 5)):$((j % 5))"; }
    echo "expert $e: $((i / 5)):$((i % 5))$extra"
  done
}
# The version a set-map output reports.
version_of() { sed -n 's/.*version \([0-9][0-9]*\).*/\1/p' "$1" | head -1; }
# wait_same GROUP VERSION: within 10 s both nodes' active maps of GROUP are identical, at VERSION
# (the group lives while its workers are attached).
same_now() {
  ctl a experts "$1" > "$T/ea.txt" && ctl b experts "$1" > "$T/eb.txt" && cmp -s "$T/ea.txt" "$T/eb.txt" &&
    grep -q "version $2\b" "$T/ea.txt"
}
wait_same() {
  wait_for 10 same_now "$1" "$2" ||
    fail "group $1: the nodes do not both run map version $2: node 0: $(head -2 "$T/ea.txt" | tr '\n' ' ') node 1: $(head -2 "$T/eb.txt" | tr '\n' ' ')"
}
# switches GROUP NODE: the "switched expert map A -> B at step S" events of GROUP in NODE's log.
switches() { grep -o "group $1 switched expert map [0-9]* -> [0-9]* at step [0-9]*" "$T/$2.log"; }

two_nodes -o engine.slots_factor_pct=200

echo "== rank 0 stages a new map on node 0's daemon only: LL 300 steps every 3, HT FP8 160 steps every 4"
world ll 300 --skew --hidden 64 --map-every 3
world ht 160 --skew --hidden 128 --mode ht --fp8 --map-every 4
expect_ok ll0 ll1 ll2 ll3 ht0 ht1 ht2 ht3
grep -h "map switches seen" "$T"/ll0.out "$T"/ll2.out "$T"/ht3.out
for w in ll2 ll3; do
  seen=$(sed -n 's/.*: \([0-9]*\) map switches seen.*/\1/p' "$T/$w.out")
  [ "${seen:-0}" -ge 90 ] || fail "$w (node 1) saw ${seen:-0} map switches in 300 steps"
done
seen=$(sed -n 's/.*: \([0-9]*\) map switches seen.*/\1/p' "$T/ht3.out")
[ "${seen:-0}" -ge 35 ] || fail "ht3 (node 1) saw ${seen:-0} map switches in 160 steps"
switches ll a > "$T/swa.txt"; switches ll b > "$T/swb.txt"
NS=$(wc -l < "$T/swa.txt")
[ "$NS" -ge 90 ] || fail "node 0 logged $NS switches of group ll"
cmp -s "$T/swa.txt" "$T/swb.txt" || fail "the nodes switched group ll at different steps: $(diff "$T/swa.txt" "$T/swb.txt" | head -4)"
echo "   $NS switches of group ll, the same (version, step) on both nodes; last: $(tail -1 "$T/swa.txt")"
grep -q "staged from node 0" "$T/b.log" || fail "node 1 did not log maps staged from node 0"

echo "== SetExpertMap sent to node 1's daemon while steps run"
world ex 6000 --hidden 64
wait_for 10 same_now ex 1 || fail "group ex did not come up on both nodes"
for s in 1 2 3; do
  mapfile ex $s > "$T/m$s.txt"
  ctl b set-map "$T/m$s.txt" > "$T/sb$s.out" 2>&1 || fail "set-map at node 1: $(cat "$T/sb$s.out")"
done
VB=$(version_of "$T/sb3.out")
[ -n "$VB" ] || fail "set-map printed no version: $(cat "$T/sb3.out")"
wait_same ex "$VB"
grep -q "expert 0: 0:3" "$T/ea.txt" || fail "group ex: not node 1's last map: $(head -3 "$T/ea.txt")"
echo "   node 1 staged versions $(version_of "$T/sb1.out") $(version_of "$T/sb2.out") $VB; active on both nodes: $VB"

echo "== SetExpertMap before the group exists on node 1: node 1 stages it when the group is created there"
for r in 0 1; do worker "lt$r" a -g lt -r $r -n 4 --steps 400 --seed 21 --experts 10 --topk 3 --tokens 24 --node-ranks 2 --hidden 64; done
wait_for 10 grep -q "group lt created" "$T/a.log" || fail "group lt was not created on node 0"
mapfile lt 7 > "$T/lt.txt"
ctl a set-map "$T/lt.txt" > "$T/lt.out" 2>&1 || fail "set-map lt: $(cat "$T/lt.out")"
VL=$(version_of "$T/lt.out")
wait_for 10 grep -q "group lt: expert map version $VL from node 0 kept" "$T/b.log" ||
  fail "node 1 did not keep map $VL of group lt: $(grep 'group lt' "$T/b.log" | tail -2)"
for r in 2 3; do worker "lt$r" b -g lt -r $r -n 4 --steps 400 --seed 21 --experts 10 --topk 3 --tokens 24 --node-ranks 2 --hidden 64; done
expect_ok lt0 lt1 lt2 lt3
switches lt a > "$T/swla.txt"; switches lt b > "$T/swlb.txt"
grep -q "1 -> $VL at step" "$T/swla.txt" || fail "node 0 did not switch group lt to $VL: $(cat "$T/swla.txt")"
cmp -s "$T/swla.txt" "$T/swlb.txt" || fail "group lt switched at different steps: $(cat "$T/swla.txt") / $(cat "$T/swlb.txt")"
echo "   $(cat "$T/swla.txt") on both nodes"

echo "== concurrent SetExpertMap on both nodes: distinct versions, the highest active on both"
# enough steps that the group still runs at its last check below (at ~1-1.3 ms a step; 1500 steps had ended
# before it on a fast run, and 4000 on a loaded 2-core CI machine: the check then found no group cc)
world cc 12000 --hidden 64
wait_for 10 same_now cc 1 || fail "group cc did not come up on both nodes"
VS=()
for i in 1 2 3 4 5; do
  mapfile cc $((2 * i)) > "$T/ca$i.txt"
  mapfile cc $((2 * i + 1)) > "$T/cb$i.txt"
  ctl a set-map "$T/ca$i.txt" > "$T/ca$i.out" 2>&1 & PA=$!
  ctl b set-map "$T/cb$i.txt" > "$T/cb$i.out" 2>&1 & PB=$!
  wait $PA || fail "concurrent set-map at node 0: $(cat "$T/ca$i.out")"
  wait $PB || fail "concurrent set-map at node 1: $(cat "$T/cb$i.out")"
  VS+=("$(version_of "$T/ca$i.out")" "$(version_of "$T/cb$i.out")")
done
[ "$(printf '%s\n' "${VS[@]}" | sort -u | wc -l)" = 10 ] || fail "concurrent calls got versions ${VS[*]}, want 10 distinct"
MAX=$(printf '%s\n' "${VS[@]}" | sort -n | tail -1)
wait_same cc "$MAX"
echo "   versions ${VS[*]}; active on both nodes: $MAX"

echo "== invalid maps are refused on every node and change nothing"
{ echo "group cc"; for e in $(seq 0 9); do echo "expert $e: 0:0"; done; } > "$T/bad.txt"
for nd in a b; do
  ctl $nd set-map "$T/bad.txt" > "$T/bad$nd.out" 2>&1 && fail "an invalid map was accepted at node $nd"
  grep -qi "slot\|twice\|invalid" "$T/bad$nd.out" || fail "invalid map at node $nd: $(cat "$T/bad$nd.out")"
done
echo "   refused: $(head -1 "$T/bada.out")"
sleep 0.5
same_now cc "$MAX" || fail "group cc changed after refused maps"
echo "== weights move with the maps, between the ranks of one node and of two: 150 LL steps, a map every 3"
# Rank 0 stages maps that move 1-3 experts into free slots of any rank, with weight copies; every worker
# checks every step that each slot holds its expert's weights, and its toy experts compute with them.
world wt 150 --hidden 64 --weights 4096 --map-every 3
expect_ok wt0 wt1 wt2 wt3
grep -h "weight copies asked" "$T/wt0.out"
across=$(sed -n 's/.*weight copies asked (\([0-9]*\) across nodes).*/\1/p' "$T/wt0.out")
[ "${across:-0}" -ge 10 ] || fail "only ${across:-0} of the staged weight copies crossed nodes"
# (the maps staged last may find the group gone on the other node: their bytes are not received)
got=$(cat "$T/a.log" "$T/b.log" | grep -c "group wt: weights of copy .* received from node")
[ "$got" -ge 10 ] && [ "$got" -le "$across" ] || fail "the nodes received the weights of $got copies, $across crossed nodes"
for nd in a b; do
  grep -Eq "group wt switched expert map .* \([1-9][0-9]* weight bytes copied\)" "$T/$nd.log" ||
    fail "node $nd: no switch of group wt copied weights"
  grep -q "weight copy .* skipped" "$T/$nd.log" && fail "node $nd skipped a weight copy: $(grep -m1 'skipped' "$T/$nd.log")"
done
# both nodes switched group wt at the same steps, to the same versions
switches wt a > "$T/swa.txt"; switches wt b > "$T/swb.txt"
cmp -s "$T/swa.txt" "$T/swb.txt" || fail "group wt: the nodes switched at different steps"
echo "   $(wc -l < "$T/swa.txt") switches on both nodes at the same steps; $across copies crossed nodes"
expect_ok ex0 ex1 ex2 ex3 cc0 cc1 cc2 cc3
grep -h "steps ok" "$T"/ex2.out "$T"/cc3.out "$T"/wt2.out

for n in a b; do
  grep -q "dispatches with expert map version" "$T/$n.log" && fail "the map mismatch check fired on node $n"
done
kill -TERM "$P_a" "$P_b"; wait "$P_a"; RA=$?; wait "$P_b"
[ $RA -eq 0 ] || fail "node 0 exited $RA on SIGTERM"
echo "33-two-node-maps: all checks passed"
