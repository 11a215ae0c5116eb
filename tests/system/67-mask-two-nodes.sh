#!/bin/bash
# 67-mask-two-nodes: masked ranks across two nodes (host backend). Two daemons on this host are nodes 0
# and 1 of one world of 4 ranks (2 each); one group is attached with on_rank_loss = mask and an expert map
# that places every expert on two ranks of different nodes. For EPD_MASK_CHAOS_SECONDS (default 15) a
# random worker is SIGKILLed about every 0.5 s (at most one rank of each node down at once) and a new
# worker of its rank starts 0.1-0.5 s later: LL steps for half the time, then HT steps in another group. Every worker (epd-worker --mask) checks each step
# against the reference computed with the mask its completion reports. A node masks its own ranks and
# tells the other; a step one node sent before the notice came fails everywhere (the worker goes on);
# the last live rank of a node is not masked but lost (steps fail until its new worker attaches).
# Then the workers still running are killed (one that outlives every worker of the other node could not
# step: that node has no group any more) and a clean round of 4 workers must run.
# Fails on: a mismatch or a wrong dropped count in any worker's output, killed or not, fewer than 600
# steps checked by workers that ran to their end, no rank masked on either node or no mask learnt from
# the other node, a clean round that fails or hangs, daemon fd counts above their baselines once every
# worker left.
set -u
STEP_TIMEOUT_MS=2000 WORKER_TIMEOUT=300
. "$(dirname "$0")/cluster-lib.sh"
CHAOS_S=${EPD_MASK_CHAOS_SECONDS:-15}
R=4 E=16
RANDOM=${EPD_CHAOS_SEED:-4321}
PORT=$(free_ports 1)
node a 0 2 "$PORT" -o engine.slots_factor_pct=200
node b 1 2 "$PORT" -o engine.slots_factor_pct=200
wait_for 15 test -S "$T/a/attach.sock" || fail "node 0 did not come up"
wait_for 15 test -S "$T/b/attach.sock" || fail "node 1 did not come up"
ctl() { "$EPDCTL" -s "$T/a/control.sock" "$@"; }
now_ms() { date +%s%3N; }
node_of() { [ "$1" -lt 2 ] && echo a || echo b; }

declare -A WP=() WO=() DOWN=()
GROUP=chaos MODE=ll
seq_no=0 killed=0 retried=0 maps=0
FINISHED=$T/finished # rank rc outfile, one line per worker that exited on its own
: > "$FINISHED"
start() { # start RANK [STEPS]: a new worker of the rank at its node
  local r=$1 n=${2:-300}
  seq_no=$((seq_no + 1))
  WO[$r]=$T/w$r.$seq_no.out
  ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0" "$WORKER" \
    -s "$T/$(node_of "$r")/control.sock" -g "$GROUP" --mode "$MODE" -r "$r" -n $R --steps "$n" --seed 9 --experts $E --hidden 64 \
    --topk 4 --tokens 16 --same-inputs --mask --until-streak 1000000 --node-ranks 2 > "${WO[$r]}" 2>&1 &
  WP[$r]=$!
}
reap() { # collect the workers that exited; one whose attach found its rank still held retries soon
  local r rc
  for r in "${!WP[@]}"; do
    kill -0 "${WP[$r]}" 2> /dev/null && continue
    wait "${WP[$r]}"
    rc=$?
    if [ $rc -eq 2 ] && grep -q "is already attached" "${WO[$r]}"; then
      retried=$((retried + 1))
      DOWN[$r]=$(($(now_ms) + 200))
    else
      echo "$r $rc ${WO[$r]}" >> "$FINISHED"
    fi
    unset "WP[$r]"
  done
}
# every expert on its rank and on a rank of the other node: one rank down drops nothing
replicated_map() {
  local head S per e
  head=$(ctl experts "$GROUP" 2> /dev/null | head -1)
  [ -n "$head" ] || return 0
  ctl experts "$GROUP" 2> /dev/null | grep -q '^expert [0-9]*: [0-9]*:[0-9]* [0-9]' && return 0 # replicated
  S=$(echo "$head" | sed -n 's/.*slots_per_rank \([0-9]*\).*/\1/p')
  per=$(((E + R - 1) / R))
  [ "$S" -ge $((2 * per)) ] || fail "slots_per_rank $S: no room for the replicas"
  {
    echo "$head"
    for e in $(seq 0 $((E - 1))); do
      echo "expert $e: $((e / per)):$((e % per)) $(((e / per + 2) % R)):$((per + e % per))"
    done
  } > "$T/map.txt"
  ctl set-map "$T/map.txt" > /dev/null 2>&1 && maps=$((maps + 1))
  return 0
}
fds() { ls /proc/"$1"/fd | wc -l; }

echo "== warm-up: one clean round of 4 workers, then the daemons' fds with nobody attached"
for r in 0 1 2 3; do start $r; done
while [ ${#WP[@]} -gt 0 ]; do
  reap
  sleep 0.05
done
while read -r r rc f; do [ "$rc" = 0 ] || fail "warm-up: rank $r's worker exited $rc: $(head -5 "$f")"; done < "$FINISHED"
: > "$FINISHED"
sleep 0.5
base_a=$(fds "$P_a") base_b=$(fds "$P_b")

# chaos SECONDS: kill and restart workers of group $GROUP; then kill the ones still running (a worker that
# outlives every worker of the other node cannot step: that node has no group any more)
chaos() {
  local stop next_kill next_map t r alive
  for r in 0 1 2 3; do start $r; done
  wait_for 20 sh -c "'$EPDCTL' -s '$T/a/control.sock' experts $GROUP | grep -q '^expert'" || fail "group $GROUP not made"
  replicated_map
  stop=$(($(now_ms) + $1 * 1000))
  next_kill=$(($(now_ms) + 700))
  next_map=$(($(now_ms) + 500))
  while [ "$(now_ms)" -lt $stop ]; do
    t=$(now_ms)
    if [ "$t" -ge $next_map ]; then
      replicated_map
      next_map=$((t + 500))
    fi
    reap
    for r in 0 1 2 3; do # a worker that ran all its steps: a new one of its rank
      [ -z "${WP[$r]:-}" ] && [ -z "${DOWN[$r]:-}" ] && start $r
    done
    for r in "${!DOWN[@]}"; do
      if [ "$t" -ge "${DOWN[$r]}" ]; then
        start "$r"
        unset "DOWN[$r]"
      fi
    done
    if [ "$t" -ge $next_kill ] && [ ${#DOWN[@]} -lt 2 ]; then
      alive=() # a rank of a node none of whose ranks is down (each node keeps a live rank: it masks)
      for r in "${!WP[@]}"; do
        [ -z "${DOWN[$((r ^ 1))]:-}" ] && [ -n "${WP[$((r ^ 1))]:-}" ] && kill -0 "${WP[$r]}" 2> /dev/null && alive+=("$r")
      done
      if [ ${#alive[@]} -gt 0 ]; then
        r=${alive[$((RANDOM % ${#alive[@]}))]}
        kill -KILL "${WP[$r]}" 2> /dev/null
        wait "${WP[$r]}" 2> /dev/null
        unset "WP[$r]"
        killed=$((killed + 1))
        DOWN[$r]=$((t + 100 + RANDOM % 400))
      fi
      next_kill=$((t + 300 + RANDOM % 400))
    fi
    kill -0 "$P_a" 2> /dev/null || fail "node 0 exited"
    kill -0 "$P_b" 2> /dev/null || fail "node 1 exited"
    sleep 0.02
  done
  reap
  for r in "${!WP[@]}"; do kill -KILL "${WP[$r]}" 2> /dev/null; done
  for r in "${!WP[@]}"; do wait "${WP[$r]}" 2> /dev/null; done
  WP=() DOWN=()
}

# Workers that restart at any step agree on a step's kind only without a cadence: LL steps, then HT.
half=$(((CHAOS_S + 1) / 2))
echo "== LL steps, chaos for $half s: SIGKILL a random worker about every 0.5 s, a new one of its rank 0.1-0.5 s later"
GROUP=chaos MODE=ll
chaos $half
echo "== HT steps, the same for $half s"
GROUP=chaos-ht MODE=ht
chaos $half

echo "== then one clean round of 4 workers"
# every step a worker checked, killed or not, matched the reference with its mask (printed as it runs)
pat="differs from the reference\|, want \|dropped [0-9]* entries\|entries dropped"
bad=$(grep -l "$pat" "$T"/w*.out | head -3)
[ -z "$bad" ] || fail "steps differ from the reference: $(grep -h "$pat" $bad | head -8)"
steps=0
while read -r r rc f; do
  [ "$rc" = 0 ] || fail "rank $r's worker exited $rc: $(grep -v '^  ' "$f" | head -12)"
  n=$(sed -n 's/^rank [0-9]*: \([0-9]*\) steps ok.*/\1/p' "$f")
  steps=$((steps + ${n:-0}))
done < "$FINISHED"
nfin=$(wc -l < "$FINISHED")
: > "$FINISHED"
for r in 0 1 2 3; do start $r 100; done
end=$(($(now_ms) + 60000))
while { [ ${#WP[@]} -gt 0 ] || [ ${#DOWN[@]} -gt 0 ]; } && [ "$(now_ms)" -lt $end ]; do
  reap
  for r in "${!DOWN[@]}"; do # its rank still held by a killed worker's attach: again
    if [ "$(now_ms)" -ge "${DOWN[$r]}" ]; then
      start "$r" 100
      unset "DOWN[$r]"
    fi
  done
  sleep 0.05
done
[ ${#WP[@]} -eq 0 ] && [ ${#DOWN[@]} -eq 0 ] || fail "the clean round after the chaos did not end within 60 s: a hang"
[ "$(wc -l < "$FINISHED")" -eq 4 ] || fail "the clean round: $(wc -l < "$FINISHED") of 4 workers ran"
while read -r r rc f; do
  [ "$rc" = 0 ] || fail "after the chaos: rank $r's worker exited $rc: $(grep -v '^  ' "$f" | head -12)"
done < "$FINISHED"
own_a=$(grep -c "rank_masked: group chaos[-ht]* rank [01] masked.*(its client" "$T/a.log")
own_b=$(grep -c "rank_masked: group chaos[-ht]* rank [23] masked.*(its client" "$T/b.log")
learnt=$(cat "$T/a.log" "$T/b.log" | grep -c "rank_masked: group chaos[-ht]* rank [0-9] masked.*(masked on its node)")
failed=$(cat "$T"/w*.out | grep -c "failed")
echo "killed $killed workers; ranks masked by their node: $own_a on node 0, $own_b on node 1, learnt from the" \
  "other node $learnt times; $nfin workers finished ($retried attaches retried, $maps" \
  "replicated maps staged); $steps checked steps, $failed failed ops"
[ $killed -ge 5 ] || fail "only $killed kills in $CHAOS_S s: the run exercised too little"
[ $((own_a + own_b)) -ge 1 ] || fail "no node masked a rank for $killed kills"
[ "$learnt" -ge 1 ] || fail "no node learnt a mask from the other node"
[ $steps -ge 600 ] || fail "only $steps checked steps (want 600+)"
# once every worker left: the group is gone on both nodes and their fds are back to the baselines
wait_for 20 sh -c "[ \$(ls /proc/$P_a/fd | wc -l) -le $((base_a + 2)) ] && [ \$(ls /proc/$P_b/fd | wc -l) -le $((base_b + 2)) ]" ||
  fail "daemon fds $base_a -> $(fds "$P_a") (node 0), $base_b -> $(fds "$P_b") (node 1) after every worker left"
for p in "$P_a" "$P_b"; do kill -TERM "$p"; done
for p in "$P_a" "$P_b"; do wait "$p"; done
echo "67-mask-two-nodes: every checked step matched the reference with its mask"
