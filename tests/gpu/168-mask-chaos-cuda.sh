#!/bin/bash
# 168-mask-chaos-cuda.sh - masked ranks on the CUDA backend under chaos (the GPU twin of
# tests/system/66-mask-chaos.py): one group of 4 ranks (on one GPU they share it) attached with
# on_rank_loss = mask and an expert map that places every expert on two ranks. For EPD_MASK_CHAOS_SECONDS
# (default 20) a random worker is SIGKILLed about every 0.4 s (at most two ranks down at once) and a new
# worker of its rank starts 0.1-0.5 s later. Every third step is an HT dispatch/combine, the others LL.
# Every worker (epd-worker --mask) checks each step against the reference computed with the mask its
# completion reports (no tokens from masked ranks, the map without their replicas, exactly the entries of
# experts without a live replica dropped); a combine whose dispatch ran with a rank masked since fails
# (EPD_ERR_PEER) and the worker goes on with its next step.
# Fails on: a result mismatch or a wrong dropped count, a worker still running 60 s after the chaos,
# fewer than 1000 checked steps, no rank masked, a daemon fd count above its baseline once every worker
# left, or a daemon that is not ready afterwards.
# EPD_MASK_MODE=persistent (169-mask-chaos-persistent-cuda.sh, under MPS): the same in persistent mode,
# where a group runs its steps in launch mode while a rank is masked; its kernels must have run
# persistent too.
# Usage (repository root, on the GPU machine): bash tests/gpu/168-mask-chaos-cuda.sh [build-dir]
set -u
B=${1:-${EPD_BUILD:-build}}
DL_NGPU=4
. "$(dirname "$0")/daemon-lib.sh"
CHAOS_S=${EPD_MASK_CHAOS_SECONDS:-20}
MODE=${EPD_MASK_MODE:-launch}
R=4 E=16
RANDOM=${EPD_CHAOS_SEED:-4321}
start_daemon -o engine.step_timeout_ms=2000 -o engine.slots_factor_pct=200 -o engine.cuda_mode="$MODE"
ctl() { "$CTL" -s "$SOCK" "$@"; }
now_ms() { date +%s%3N; }

declare -A PIDS=() OUTS=() DOWN=()
seq_no=0 killed=0 retried=0 maps=0
FINISHED=$T/finished # rank rc outfile, one line per worker that exited on its own
: > "$FINISHED"
start() { # start RANK: a new worker of the rank
  local r=$1
  seq_no=$((seq_no + 1))
  OUTS[$r]=$T/w$r.$seq_no.out
  timeout 300 "$WORKER" -s "$SOCK" -g chaos -r "$r" -n $R --steps 400 --seed 9 --experts $E --hidden 128 \
    --topk 4 --tokens 16 --same-inputs --mask --ht-every 3 --until-streak 1000000 > "${OUTS[$r]}" 2>&1 &
  PIDS[$r]=$!
}
reap() { # collect the workers that exited; one whose attach found its rank still held retries soon
  local r rc
  for r in "${!PIDS[@]}"; do
    kill -0 "${PIDS[$r]}" 2> /dev/null && continue
    wait "${PIDS[$r]}"
    rc=$?
    if [ $rc -eq 2 ] && grep -q "is already attached" "${OUTS[$r]}"; then
      retried=$((retried + 1))
      DOWN[$r]=$(($(now_ms) + 200))
    else
      echo "$r $rc ${OUTS[$r]}" >> "$FINISHED"
    fi
    unset "PIDS[$r]"
  done
}
# every expert on its rank and on the next one: one rank down drops nothing
replicated_map() {
  local head S per e
  head=$(ctl experts chaos 2> /dev/null | head -1) || return 0
  [ -n "$head" ] || return 0
  ctl experts chaos 2> /dev/null | grep -q '^expert [0-9]*: [0-9]*:[0-9]* [0-9]' && return 0 # replicated
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
while [ ${#PIDS[@]} -gt 0 ]; do reap; sleep 0.05; done
while read -r r rc f; do [ "$rc" = 0 ] || fail "warm-up: rank $r's worker exited $rc: $(head -5 "$f")"; done < "$FINISHED"
: > "$FINISHED"
sleep 0.5
base_fds=$(ls /proc/"$PID"/fd | wc -l)

echo "== chaos for $CHAOS_S s: SIGKILL a random worker about every 0.4 s, a new one of its rank 0.1-0.5 s later"
for r in 0 1 2 3; do start $r; done
wait_for 20 sh -c "'$CTL' -s '$SOCK' experts chaos | grep -q '^expert'" || fail "group chaos not made"
replicated_map
stop=$(($(now_ms) + CHAOS_S * 1000))
next_kill=$(($(now_ms) + 500))
next_map=$(($(now_ms) + 500))
while [ "$(now_ms)" -lt $stop ]; do
  t=$(now_ms)
  if [ "$t" -ge $next_map ]; then
    replicated_map
    next_map=$((t + 500))
  fi
  reap
  for r in 0 1 2 3; do # a worker that ran all its steps: a new one of its rank
    [ -z "${PIDS[$r]:-}" ] && [ -z "${DOWN[$r]:-}" ] && start $r
  done
  for r in "${!DOWN[@]}"; do
    if [ "$t" -ge "${DOWN[$r]}" ]; then
      start "$r"
      unset "DOWN[$r]"
    fi
  done
  if [ "$t" -ge $next_kill ] && [ ${#DOWN[@]} -lt 2 ]; then
    alive=()
    for r in "${!PIDS[@]}"; do kill -0 "${PIDS[$r]}" 2> /dev/null && alive+=("$r"); done
    if [ ${#alive[@]} -gt 2 ]; then
      r=${alive[$((RANDOM % ${#alive[@]}))]}
      kill -KILL "${PIDS[$r]}" 2> /dev/null
      wait "${PIDS[$r]}" 2> /dev/null
      unset "PIDS[$r]"
      killed=$((killed + 1))
      DOWN[$r]=$((t + 100 + RANDOM % 400))
    fi
    next_kill=$((t + 200 + RANDOM % 400))
  fi
  kill -0 "$PID" 2> /dev/null || fail "the daemon exited"
  sleep 0.02
done
masks=$(grep -c "event rank_masked: group chaos rank [0-9]* masked" "$LOG")
[ "$masks" -ge 1 ] || fail "the group masked no rank for $killed kills"

echo "== every worker runs to its end"
end=$(($(now_ms) + 60000))
while { [ ${#PIDS[@]} -gt 0 ] || [ ${#DOWN[@]} -gt 0 ]; } && [ "$(now_ms)" -lt $end ]; do
  for r in "${!DOWN[@]}"; do
    if [ "$(now_ms)" -ge "${DOWN[$r]}" ]; then
      start "$r"
      unset "DOWN[$r]"
    fi
  done
  reap
  sleep 0.05
done
if [ ${#PIDS[@]} -gt 0 ]; then
  ctl status
  for r in "${!PIDS[@]}"; do echo "rank $r's worker still running: $(tail -4 "${OUTS[$r]}")"; done
  fail "a worker still runs 60 s after the chaos: a hang"
fi
steps=0
while read -r r rc f; do
  [ "$rc" = 0 ] || fail "rank $r's worker exited $rc: $(grep -v '^  ' "$f" | head -12)"
  n=$(sed -n 's/^rank [0-9]*: \([0-9]*\) steps ok.*/\1/p' "$f")
  steps=$((steps + ${n:-0}))
done < "$FINISHED"
echo "killed $killed workers, $masks ranks masked; $(wc -l < "$FINISHED") workers finished ($retried attaches" \
  "retried, $maps replicated maps staged); $steps checked steps"
[ $killed -ge 3 ] || fail "only $killed kills in $CHAOS_S s: the run exercised too little"
[ $steps -ge 1000 ] || fail "only $steps checked steps (want 1000+)"
if [ "$MODE" = persistent ]; then
  n=$(grep -c "group chaos: LL steps run in persistent kernels" "$LOG")
  echo "group chaos started its persistent kernels $n times"
  [ "$n" -ge 1 ] || fail "group chaos never ran persistent kernels"
fi
ctl status | grep -q "^state: *ready" || fail "daemon not ready after the chaos: $(ctl status | head -3)"
# once every worker left: the group is gone and the daemon's fds are back to the baseline
wait_for 20 sh -c "[ \$(ls /proc/$PID/fd | wc -l) -le $((base_fds + 2)) ]" ||
  fail "daemon fds $base_fds -> $(ls /proc/"$PID"/fd | wc -l) after every worker left"
stop_daemon
stop_mps
echo "168-mask-chaos-cuda: every checked step matched the reference with its mask"
