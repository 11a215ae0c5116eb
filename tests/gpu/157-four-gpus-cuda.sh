#!/bin/bash
# 157-four-gpus-cuda.sh - one daemon driving 4 ranks (engine.num_ranks=4, one node), epd-worker processes
# checking every step against the reference: the LL and HT kernels with more than one peer. Launch mode:
# LL BF16 skewed and FP8 uniform (H 7168, 256 experts, top-8, 128 tokens), HT FP8 skewed and BF16 (256
# tokens), small LL steps with a new expert map every 3 steps (replicas), a worker killed mid-step (the
# three others fail with EPD_ERR_PEER/EPD_ERR_TIMEOUT, the daemon recovers, four new clients run). Then
# persistent mode (a second daemon, engine.cuda_mode = persistent): LL FP8 and BF16 with a map every 4 steps,
# CUDA graph replays through the device twin. Half the workers see only their own GPU
# (CUDA_VISIBLE_DEVICES). Runs under CUDA MPS throughout (the first daemon forced to launch mode). Skips
# without a GPU or MPS. A GPU per rank with 4; with fewer the ranks share them (daemon-lib.sh: rank r on
# GPU r mod count; all four on one GPU, a quarter of its SMs each): no NVLink, the checks the same.
# Usage (repository root, on the GPU machine): bash tests/gpu/157-four-gpus-cuda.sh [build-dir]
set -u
B=${1:-${EPD_BUILD:-build}}
DL_NGPU=4
GPU_MPS=1
. "$(dirname "$0")/daemon-lib.sh"

# ranks NAME ARGS...: the group's four workers NAME0..NAME3 (rank r on GPU r, or r mod count where they
# share; ranks 1 and 3 see only it).
ranks() {
  local n=$1 r; shift
  for r in 0 1 2 3; do
    if [ $((r % 2)) = 1 ]; then CUDA_VISIBLE_DEVICES=$(gpu_of $r) worker "$n$r" -r $r -n 4 "$@"
    else worker "$n$r" -r $r -n 4 "$@"; fi
  done
}
all_ok() { expect_ok "${1}0" "${1}1" "${1}2" "${1}3"; }
COMMON="--experts 256 --hidden 7168 --topk 8"

start_daemon -o engine.cuda_mode=launch -o engine.step_timeout_ms=3000 -o daemon.drain_timeout_ms=2000
grep -q "mode launch" "$LOG" || fail "the first daemon is not in launch mode"
"$CTL" -s "$SOCK" status > "$T/status.out" || fail "epdctl status"
grep -q "^ranks: *4" "$T/status.out" || fail "status: $(cat "$T/status.out")"

echo "== launch mode: LL BF16 skewed, 128 tokens, 12 steps + 50 timed"
ranks lb -g lb --steps 12 --seed 5 --skew $COMMON --tokens 128 --bench 50
all_ok lb
echo "== launch mode: LL FP8 uniform, 128 tokens, 12 steps + 50 timed"
ranks lf -g lf --steps 12 --seed 7 --fp8 $COMMON --tokens 128 --bench 50
all_ok lf
echo "== launch mode: HT FP8 skewed and HT BF16, 256 tokens, 6 steps each"
ranks hf -g hf --steps 6 --seed 4 --mode ht --fp8 --skew $COMMON --tokens 256 --bench 10
all_ok hf
ranks hb -g hb --steps 6 --seed 8 --mode ht $COMMON --tokens 256
all_ok hb
echo "== launch mode: LL small (hidden 256), a new map every 3 steps, 45 steps"
ranks lm -g lm --steps 45 --seed 11 --skew --hidden 256 --map-every 3
all_ok lm
grep -q "map switches seen" "$T/lm1.out" || fail "lm: no map switches reported"

echo "== a worker (rank 2) dies mid-step: the three others fail, the daemon recovers"
worker wd0 -g die -r 0 -n 4 --steps 20 --seed 3 --hidden 256
worker wd1 -g die -r 1 -n 4 --steps 20 --seed 3 --hidden 256
worker wd2 -g die -r 2 -n 4 --steps 20 --seed 3 --hidden 256 --die-at-step 4
worker wd3 -g die -r 3 -n 4 --steps 20 --seed 3 --hidden 256
wait "$W_wd2"; rc=$?
[ $rc -eq 3 ] || fail "dying worker exited $rc, want 3"
for r in 0 1 3; do
  eval "pid=\$W_wd$r"; wait "$pid"; rc=$?
  [ $rc -eq 2 ] || fail "survivor wd$r exited $rc, want 2 (an op error)"
  grep -Eq "EPD_ERR_PEER|EPD_ERR_TIMEOUT" "$T/wd$r.out" || fail "survivor wd$r's error names neither PEER nor TIMEOUT"
done
kill -0 "$PID" 2>/dev/null || fail "the daemon died"
ranks we -g die --steps 6 --seed 4 --hidden 256
all_ok we
stop_daemon

echo "== persistent mode: LL FP8 and BF16, a new map every 4 steps, 24 steps each + 50 timed"
start_daemon -o engine.cuda_mode=persistent -o engine.step_timeout_ms=3000 -o engine.slots_factor_pct=200 \
  -o daemon.drain_timeout_ms=2000
grep -q "mode persistent" "$LOG" || fail "the second daemon is not in persistent mode"
ranks pf -g pf --steps 24 --seed 21 --fp8 $COMMON --tokens 128 --map-every 4 --bench 50
all_ok pf
ranks pb -g pb --steps 24 --seed 22 --skew $COMMON --tokens 128 --map-every 4
all_ok pb
grep -q "group pf: LL steps run in persistent kernels" "$LOG" || fail "group pf never ran persistent kernels"
echo "== persistent mode: CUDA graph replays through the device twin, FP8, 20 steps"
ranks pg -g pg --steps 20 --graph --seed 17 --fp8 --hidden 512 --experts 32 --topk 4 --tokens 64
all_ok pg
for r in 0 1; do # rank 1 sees only its GPU
  grep -q "graph replays.*kernel submission" "$T/pg$r.out" || fail "pg$r: no graph replays through the twin"
done
stop_daemon
stop_mps
echo "four_gpus: all passed"
