#!/bin/bash
# 156-persistent-cuda.sh - the CUDA backend's persistent mode under CUDA MPS (engine.cuda_mode = persistent) with
# 2 ranks, with epd-worker processes checking every step against the reference and its group step number:
# LL BF16 (skewed) and FP8 steps, two groups at once, a new expert map every 3 steps (each switch runs in
# launch mode, then the kernels resume), an HT step every 4th step of an LL group (the kernels stop and
# leave it to launch mode), and a worker killed mid-step (its peer fails at once with EPD_ERR_PEER, the
# daemon recovers, a new client of the rank runs). Asserts the daemon reports "persistent" and that the
# groups did run in persistent kernels, resumed after every fallback. Skips without a GPU or MPS. On one
# GPU both ranks share it (daemon-lib.sh): the daemon's persistent kernels of both ranks (each on half
# the blocks) and the workers' kernels run side by side under MPS, the checks the same.
# Usage (repository root, on the GPU machine): bash tests/gpu/156-persistent-cuda.sh [build-dir]
# (EPD_KEEP_LOG=FILE: copy the daemon's debug log there)
set -u
B=${1:-${EPD_BUILD:-build}}
GPU_MPS=1
. "$(dirname "$0")/daemon-lib.sh"

start_daemon -o engine.cuda_mode=persistent -o engine.step_timeout_ms=2000 -o engine.slots_factor_pct=200 \
  -o log.level=debug -o daemon.drain_timeout_ms=2000
grep -q "MPS on, mode persistent" "$LOG" || fail "the daemon does not say 'MPS on, mode persistent'"
if [ -x "$CTL" ]; then
  timeout 20 "$CTL" -s "$SOCK" status | grep -E "^mode: +persistent" || fail "epdctl status does not say persistent"
fi

resumes() { grep -c "persistent kernels resumed" "$LOG"; }

echo "== LL BF16, skewed routing, 40 steps (hidden 256)"
worker wa0 -g ll -r 0 -n 2 --steps 40 --seed 5 --skew --hidden 256
worker wa1 -g ll -r 1 -n 2 --steps 40 --seed 5 --skew --hidden 256
expect_ok wa0; expect_ok wa1
grep -q "group ll: LL steps run in persistent kernels" "$LOG" || fail "group ll never ran persistent kernels"
grep -q "kernel submission" "$T/wa0.out" || fail "worker wa0 did not submit through the queue's device twin"
EPD_SUBMIT=memop worker wz0 -g ll -r 0 -n 2 --steps 4 --seed 7 --hidden 256
EPD_SUBMIT=memop worker wz1 -g ll -r 1 -n 2 --steps 4 --seed 7 --hidden 256
expect_ok wz0; expect_ok wz1
grep -q "EPD_SUBMIT=memop ignored" "$T/wz0.out" || fail "EPD_SUBMIT=memop under persistent kernels: no warning"
grep -q "kernel submission" "$T/wz1.out" || fail "EPD_SUBMIT=memop must not turn the device twin off here"

echo "== graph replays through the device twin, FP8, 30 steps, a new map every 5 (hidden 512, 32 experts)"
r0=$(resumes)
worker wg0 -g graph -r 0 -n 2 --steps 30 --graph --map-every 5 --seed 17 --fp8 --hidden 512 --experts 32 --topk 4 --tokens 64
worker wg1 -g graph -r 1 -n 2 --steps 30 --graph --map-every 5 --seed 17 --fp8 --hidden 512 --experts 32 --topk 4 --tokens 64
expect_ok wg0; expect_ok wg1
grep -q "graph replays.*kernel submission" "$T/wg0.out" || fail "worker wg0: no graph replays through the twin"
r1=$(resumes)
[ $((r1 - r0)) -ge 3 ] || fail "graph group: the kernels resumed only $((r1 - r0)) times after the map switches"

echo "== LL FP8 and BF16, H 7168, 256 experts, top-8, 128 tokens (two groups at once)"
worker wb0 -g big8 -r 0 -n 2 --steps 16 --seed 9 --fp8 --experts 256 --hidden 7168 --topk 8 --tokens 128
worker wb1 -g big8 -r 1 -n 2 --steps 16 --seed 9 --fp8 --experts 256 --hidden 7168 --topk 8 --tokens 128
worker wc0 -g big16 -r 0 -n 2 --steps 16 --seed 6 --experts 256 --hidden 7168 --topk 8 --tokens 128
worker wc1 -g big16 -r 1 -n 2 --steps 16 --seed 6 --experts 256 --hidden 7168 --topk 8 --tokens 128
seen=0
if [ -x "$CTL" ]; then # the per-group mode while they run
  for _ in $(seq 200); do
    timeout 5 "$CTL" -s "$SOCK" status > "$T/st.txt" 2>/dev/null
    grep -Eq "^  big(8|16) .* persistent$" "$T/st.txt" && { seen=1; grep -E "^  big|NAME" "$T/st.txt"; break; }
    kill -0 "$W_wb0" 2>/dev/null || break
    sleep 0.01
  done
  [ $seen = 1 ] || fail "epdctl status never showed a big group in persistent mode"
fi
expect_ok wb0; expect_ok wb1; expect_ok wc0; expect_ok wc1
grep -Eq "group big(8|16): LL steps run in persistent kernels" "$LOG" || fail "no big group ran persistent kernels"
grep -h "group big.*persistent kernels\|group big.*launch mode" "$LOG" | grep -v DEBUG | head -4

echo "== LL FP8 + skew, 45 steps, a new map every 3 steps (hidden 512, 32 experts, top-4)"
r0=$(resumes)
worker wm0 -g maps -r 0 -n 2 --steps 45 --map-every 3 --seed 22 --hidden 512 --experts 32 --topk 4 --tokens 64 --fp8 --skew
worker wm1 -g maps -r 1 -n 2 --steps 45 --map-every 3 --seed 22 --hidden 512 --experts 32 --topk 4 --tokens 64 --fp8 --skew
expect_ok wm0; expect_ok wm1
seen=$(sed -n 's/.*: \([0-9]*\) map switches seen.*/\1/p' "$T/wm1.out")
[ "${seen:-0}" -ge 12 ] || fail "rank 1 saw ${seen:-0} map switches in 45 steps"
n=$(grep -c "group maps: stopping the persistent kernels (a map is staged)" "$LOG")
r1=$(resumes)
echo "map switches seen $seen; persistent kernels stopped for a staged map $n times, resumed $((r1 - r0)) times"
[ "$n" -ge 5 ] || fail "the kernels were stopped for a staged map only $n times"
[ $((r1 - r0)) -ge 5 ] || fail "the kernels resumed only $((r1 - r0)) times after the map switches"

echo "== an HT step every 4th step of an LL group, 24 steps (hidden 512, 32 experts, top-4, 64 tokens)"
r0=$(resumes)
worker wh0 -g mix -r 0 -n 2 --steps 24 --ht-every 4 --seed 31 --hidden 512 --experts 32 --topk 4 --tokens 64
worker wh1 -g mix -r 1 -n 2 --steps 24 --ht-every 4 --seed 31 --hidden 512 --experts 32 --topk 4 --tokens 64
expect_ok wh0; expect_ok wh1
n=$(grep -c "group mix: persistent kernels stopped (an op it does not run)" "$LOG")
r1=$(resumes)
echo "kernels stopped for an HT op $n times, resumed $((r1 - r0)) times"
[ "$n" -ge 5 ] || fail "the kernels were stopped for an HT op only $n times"

echo "== a worker dies mid-step"
worker wd0 -g die -r 0 -n 2 --steps 20 --seed 3 --hidden 256
worker wd1 -g die -r 1 -n 2 --steps 20 --seed 3 --hidden 256 --die-at-step 6
wait "$W_wd1"; rc=$?
start=$(date +%s%N)
[ $rc -eq 3 ] || fail "dying worker exited $rc, want 3"
wait "$W_wd0"; rc=$?
ms=$(( ($(date +%s%N) - start) / 1000000 ))
[ $rc -eq 2 ] || fail "survivor exited $rc, want 2 (an op error)"
grep -q "EPD_ERR_PEER\|died" "$T/wd0.out" || fail "survivor's error is not EPD_ERR_PEER"
grep -h "failed" "$T/wd0.out"
echo "survivor failed $ms ms after the dying worker exited"
[ "$ms" -lt 1500 ] || fail "the survivor waited $ms ms (the step timeout is 2000)"
kill -0 "$PID" 2>/dev/null || fail "the daemon died"

echo "== a new client of the dead rank attaches and runs"
worker we0 -g die -r 0 -n 2 --steps 10 --seed 4 --hidden 256
worker we1 -g die -r 1 -n 2 --steps 10 --seed 4 --hidden 256
expect_ok we0; expect_ok we1

grep -E "error|ERROR|WARN" "$LOG" | grep -v "DEBUG" | head -5
if [ -x "$CTL" ]; then timeout 20 "$CTL" -s "$SOCK" metrics | grep -E "^epd_ops_total|^epd_rank_ops" | head -4; fi
stop_daemon
grep -c "persistent kernels resumed" "$LOG" | sed 's/^/persistent kernel resumes in all: /'
keep_log
stop_mps
echo "persistent_cuda: all passed"
