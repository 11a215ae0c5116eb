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
# EPD_MASK_MODE=persistent (169-mask-chaos-mps-cuda.sh, under MPS): the same with the daemon in persistent
# mode, where groups that mask step in launch mode (the workers submit from their kernels).
# Usage (repository root, on the GPU machine): bash tests/gpu/168-mask-chaos-cuda.sh [build-dir]
set -u
B=${1:-${EPD_BUILD:-build}}
DL_NGPU=4
. "$(dirname "$0")/daemon-lib.sh"
CHAOS_S=${EPD_MASK_CHAOS_SECONDS:-20}
MASK_MODE=${EPD_MASK_MODE:-launch}
CHAOS_STEPS=400 E=16 REP_NEXT=1
RANDOM=${EPD_CHAOS_SEED:-4321}
start_daemon -o engine.step_timeout_ms=2000 -o engine.slots_factor_pct=200 -o engine.cuda_mode="$MASK_MODE"
ctl() { "$CTL" -s "$SOCK" "$@"; }
run_worker() { # RANK STEPS OUT
  "$WORKER" -s "$SOCK" -g "$GROUP" --mode "$MODE" -r "$1" -n 4 --steps "$2" --seed 9 --experts $E --hidden 128 \
    --topk 4 --tokens 16 --same-inputs --mask --until-streak 1000000 > "$3" 2>&1 &
}
may_kill() { [ ${#WP[@]} -gt 2 ]; } # at most two ranks down
daemons_alive() { kill -0 "$PID" 2> /dev/null || fail "the daemon exited"; }
. "$(dirname "$0")/../mask-chaos-lib.sh"

echo "== warm-up: one clean round of 4 workers, then the daemon's fds with nobody attached"
warm_up
base_fds=$(fds "$PID")
chaos_phases "$CHAOS_S"
clean_round
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
