#!/bin/bash
# 168-mask-chaos-cuda.sh - masked ranks on the CUDA backend under chaos (the GPU twin of
# tests/system/66-mask-chaos.py): one group of 4 ranks (on one GPU they share it) attached with
# on_rank_loss = mask and an expert map that places every expert on two ranks. For EPD_MASK_CHAOS_SECONDS
# (default 20) a random worker is SIGKILLed about every 0.5 s (at most two ranks down at once) and a new
# worker of its rank starts 0.1-0.5 s later: LL steps for half the time, then HT steps in another group
# (workers that restart at any step agree on a step's kind only without a cadence).
# Every worker (epd-worker --mask) checks each step against the reference computed with the mask its
# completion reports (no tokens from masked ranks, the map without their replicas, exactly the entries of
# experts without a live replica dropped); a combine whose dispatch ran with a rank masked since fails
# (EPD_ERR_PEER) and the worker goes on with its next step. The workers still running at the end are
# killed, then a clean round of 4 workers must run.
# Fails on: a result mismatch or a wrong dropped count in any worker's output (killed or not), fewer than
# 1000 steps checked by workers that ran to their end, no rank masked, a clean round that fails or hangs,
# a daemon fd count above its baseline once every worker left, or a daemon that is not ready afterwards.
# EPD_MASK_MODE=persistent (mask-chaos-mps-cuda.sh, under MPS): the same with the daemon in persistent
# mode, where groups that mask step in launch mode (the workers submit from their kernels).
# Usage (repository root, on the GPU machine): bash tests/gpu/168-mask-chaos-cuda.sh [build-dir]
set -u
B=${1:-${EPD_BUILD:-build}}
DL_NGPU=4
. "$(dirname "$0")/daemon-lib.sh"
CHAOS_S=${EPD_MASK_CHAOS_SECONDS:-20}
MASK_MODE=${EPD_MASK_MODE:-launch}
R=4 E=16
RANDOM=${EPD_CHAOS_SEED:-4321}
start_daemon -o engine.step_timeout_ms=2000 -o engine.slots_factor_pct=200 -o engine.cuda_mode="$MASK_MODE"
ctl() { "$CTL" -s "$SOCK" "$@"; }
now_ms() { date +%s%3N; }
fds() { ls /proc/"$1"/fd | wc -l; }

declare -A WP=() WO=() DOWN=()
GROUP=chaos MODE=ll
seq_no=0 killed=0 retried=0 maps=0
FINISHED=$T/finished # rank rc outfile, one line per worker that exited on its own
: > "$FINISHED"
start() { # start RANK [STEPS]: a new worker of the rank
  local r=$1 n=${2:-400}
  seq_no=$((seq_no + 1))
  WO[$r]=$T/w$r.$seq_no.out
  "$WORKER" -s "$SOCK" -g "$GROUP" --mode "$MODE" -r "$r" -n $R --steps "$n" --seed 9 --experts $E \
    --hidden 128 --topk 4 --tokens 16 --same-inputs --mask --until-streak 1000000 > "${WO[$r]}" 2>&1 &
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
# every expert on its rank and on the next one: one rank down drops nothing
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
      echo "expert $e: $((e / per)):$((e % per)) $(((e / per + 1) % R)):$((per + e % per))"
    done
  } > "$T/map.txt"
  ctl set-map "$T/map.txt" > /dev/null 2>&1 && maps=$((maps + 1))
  return 0
}

echo "== warm-up: one clean round of 4 workers, then the daemon's fds with nobody attached"
for r in 0 1 2 3; do start $r; done
while [ ${#WP[@]} -gt 0 ]; do
  reap
  sleep 0.05
done
while read -r r rc f; do [ "$rc" = 0 ] || fail "warm-up: rank $r's worker exited $rc: $(head -5 "$f")"; done < "$FINISHED"
: > "$FINISHED"
sleep 0.5
base_fds=$(fds "$PID")

# chaos SECONDS: kill and restart workers of group $GROUP (at most two ranks down); then kill the ones
# still running
chaos() {
  local stop next_kill next_map t r alive
  for r in 0 1 2 3; do start $r; done
  wait_for 20 sh -c "'$CTL' -s '$SOCK' experts $GROUP | grep -q '^expert'" || fail "group $GROUP not made"
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
      alive=()
      for r in "${!WP[@]}"; do kill -0 "${WP[$r]}" 2> /dev/null && alive+=("$r"); done
      if [ ${#alive[@]} -gt 2 ]; then
        r=${alive[$((RANDOM % ${#alive[@]}))]}
        kill -KILL "${WP[$r]}" 2> /dev/null
        wait "${WP[$r]}" 2> /dev/null
        unset "WP[$r]"
        killed=$((killed + 1))
        DOWN[$r]=$((t + 100 + RANDOM % 400))
      fi
      next_kill=$((t + 300 + RANDOM % 400))
    fi
    kill -0 "$PID" 2> /dev/null || fail "the daemon exited"
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
masks=$(grep -c "rank_masked: group chaos[-ht]* rank [0-9] masked.*(its client" "$LOG")
failed=$(cat "$T"/w*.out | grep -c "failed")
echo "killed $killed workers, $masks ranks masked; $nfin workers finished ($retried attaches retried, $maps" \
  "replicated maps staged); $steps checked steps, $failed failed ops"
[ $killed -ge 5 ] || fail "only $killed kills in $CHAOS_S s: the run exercised too little"
[ "$masks" -ge 1 ] || fail "the group masked no rank for $killed kills"
[ $steps -ge 1000 ] || fail "only $steps checked steps (want 1000+)"
if [ "$MASK_MODE" = persistent ]; then
  grep -q "group chaos[-ht]*: LL steps run in persistent kernels" "$LOG" && fail "a group that masks ran persistent kernels"
  grep -q "kernel submission" "$T"/w*.out || fail "no worker submitted from its kernels"
fi
ctl status | grep -q "^state: *ready" || fail "daemon not ready after the chaos: $(ctl status | head -3)"
# once every worker left: the groups are gone and the daemon's fds are back to the baseline
wait_for 20 sh -c "[ \$(ls /proc/$PID/fd | wc -l) -le $((base_fds + 2)) ]" ||
  fail "daemon fds $base_fds -> $(fds "$PID") after every worker left"
stop_daemon
stop_mps
echo "168-mask-chaos-cuda: every checked step matched the reference with its mask"
