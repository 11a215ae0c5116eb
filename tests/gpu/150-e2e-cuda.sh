#!/bin/bash
# 150-e2e-cuda.sh - the real daemon with engine.backend=cuda, 2 ranks, and epd-worker processes checking
# every LL and HT (on engine.ht_sms = 20 SMs) step against the reference (BF16 and FP8, skewed routing, H 7168 x 256 experts x top-8 x 128
# tokens; FP8 with special values in some groups), and a worker killed mid-step: its peer gets
# EPD_ERR_PEER/EPD_ERR_TIMEOUT naming rank 1, the daemon keeps serving and a new client of that rank runs;
# last, a drain while two workers hold between a dispatch and its combine: the combines run and match,
# the next dispatches fail with EPD_ERR_DRAINING. Optionally under CUDA MPS (E2E_MPS=1).
# On one GPU both ranks share it (daemon-lib.sh): everything runs the same (the kernel-submission workers
# time-sliced against the daemon without MPS), but for the worker that cannot see its rank's GPU: with
# one GPU for both ranks there is none such, that case says so and is left out.
# Usage (repository root, on the GPU machine): bash tests/gpu/150-e2e-cuda.sh [build-dir]
set -u
B=${1:-${EPD_BUILD:-build}}
GPU_MPS=${E2E_MPS:-0}
. "$(dirname "$0")/daemon-lib.sh"

# HT kernels on 20 SMs (engine.ht_sms; default 24): the HT steps below check it against the reference
start_daemon -o engine.step_timeout_ms=2000 -o daemon.drain_timeout_ms=2000 -o engine.ht_sms=20
grep -E "backend|mode" "$LOG" | head -3
grep -q "HT SMs 20" "$LOG" || fail "engine.ht_sms = 20 not in effect: $(grep 'LL blocks' "$LOG")"

echo "== LL BF16, skewed routing, 20 steps (hidden 256)"
worker wa0 -g ll -r 0 -n 2 --steps 20 --seed 5 --skew --hidden 256
worker wa1 -g ll -r 1 -n 2 --steps 20 --seed 5 --skew --hidden 256
expect_ok wa0; expect_ok wa1

echo "== LL FP8 (special values in some groups) and BF16, H 7168, 256 experts, top-8, 128 tokens (two groups at once)"
worker wb0 -g big8 -r 0 -n 2 --steps 20 --seed 9 --fp8 --experts 256 --hidden 7168 --topk 8 --tokens 128 --specials
worker wb1 -g big8 -r 1 -n 2 --steps 20 --seed 9 --fp8 --experts 256 --hidden 7168 --topk 8 --tokens 128 --specials
worker wc0 -g big16 -r 0 -n 2 --steps 20 --seed 6 --experts 256 --hidden 7168 --topk 8 --tokens 128
worker wc1 -g big16 -r 1 -n 2 --steps 20 --seed 6 --experts 256 --hidden 7168 --topk 8 --tokens 128
expect_ok wb0; expect_ok wb1; expect_ok wc0; expect_ok wc1

echo "== HT FP8 (special values in some groups) and BF16 (skewed), H 7168, 256 experts, top-8, 256 tokens (two groups at once)"
worker wh0 -g ht8 -r 0 -n 2 --steps 8 --seed 4 --mode ht --fp8 --experts 256 --hidden 7168 --topk 8 --tokens 256 --specials
worker wh1 -g ht8 -r 1 -n 2 --steps 8 --seed 4 --mode ht --fp8 --experts 256 --hidden 7168 --topk 8 --tokens 256 --specials
worker wi0 -g ht16 -r 0 -n 2 --steps 8 --seed 8 --mode ht --skew --experts 256 --hidden 7168 --topk 8 --tokens 256
worker wi1 -g ht16 -r 1 -n 2 --steps 8 --seed 8 --mode ht --skew --experts 256 --hidden 7168 --topk 8 --tokens 256
expect_ok wh0; expect_ok wh1; expect_ok wi0; expect_ok wi1

echo "== HT dense layout: BF16 rows by the copy engines, and FP8 (kernel rows), 256 tokens (two groups at once)"
worker wj0 -g htd16 -r 0 -n 2 --steps 6 --seed 21 --mode ht --dense --skew --experts 256 --hidden 7168 --topk 8 --tokens 256
worker wj1 -g htd16 -r 1 -n 2 --steps 6 --seed 21 --mode ht --dense --skew --experts 256 --hidden 7168 --topk 8 --tokens 256
worker wl0 -g htd8 -r 0 -n 2 --steps 4 --seed 22 --mode ht --dense --fp8 --experts 256 --hidden 7168 --topk 8 --tokens 256
worker wl1 -g htd8 -r 1 -n 2 --steps 4 --seed 22 --mode ht --dense --fp8 --experts 256 --hidden 7168 --topk 8 --tokens 256
expect_ok wj0; expect_ok wj1; expect_ok wl0; expect_ok wl1
wait_for 5 grep -q "group htd16 rank 1: 6 dense HT dispatches moved their BF16 rows with the copy engines" "$LOG" ||
  fail "group htd16: the daemon's dense BF16 dispatches did not all use the copy engines"
grep -q "group htd8 rank .*copy engines" "$LOG" && fail "group htd8 (FP8): copy engines used for FP8 rows"

echo "== submission through the queue's device twin in launch mode (EPD_SUBMIT=kernel): the daemon's CPU"
echo "   completes only the host copy, libepd's wait kernels must see it there (LL FP8, HT, graph replays)"
EPD_SUBMIT=kernel worker wk0 -g tw -r 0 -n 2 --steps 12 --seed 12 --fp8 --hidden 512 --experts 32 --topk 4 --ht-every 3
EPD_SUBMIT=kernel worker wk1 -g tw -r 1 -n 2 --steps 12 --seed 12 --fp8 --hidden 512 --experts 32 --topk 4 --ht-every 3
expect_ok wk0; expect_ok wk1
grep -q "kernel submission" "$T/wk0.out" || fail "EPD_SUBMIT=kernel: worker wk0 did not submit with kernels"
EPD_SUBMIT=kernel worker wg0 -g twg -r 0 -n 2 --steps 10 --seed 13 --graph --hidden 512 --experts 32 --topk 4
EPD_SUBMIT=kernel worker wg1 -g twg -r 1 -n 2 --steps 10 --seed 13 --graph --hidden 512 --experts 32 --topk 4
expect_ok wg0; expect_ok wg1
grep -q "kernel submission" "$T/wg1.out" || fail "EPD_SUBMIT=kernel: worker wg1 did not submit with kernels"
# launch mode (no MPS) submits with stream memory operations unless EPD_SUBMIT=kernel; persistent mode (the
# default under MPS) with kernels
[ "$GPU_MPS" = 1 ] || ! grep -q "kernel submission" "$T/wa0.out" || fail "launch mode without EPD_SUBMIT: worker wa0 used kernel submission"

echo "== workers that see only their own GPU (CUDA_VISIBLE_DEVICES): libepd finds the rank's GPU by its UUID"
G0=$(gpu_of 0) G1=$(gpu_of 1)
CUDA_VISIBLE_DEVICES=$G1 worker wv1 -g vis -r 1 -n 2 --steps 6 --seed 14 --fp8 --hidden 512 --experts 32 --topk 4
CUDA_VISIBLE_DEVICES=$G0 worker wv0 -g vis -r 0 -n 2 --steps 6 --seed 14 --fp8 --hidden 512 --experts 32 --topk 4
expect_ok wv0; expect_ok wv1
"$CTL" -s "$SOCK" status > "$T/status.out" || fail "epdctl status"
U1=$(nvidia-smi --query-gpu=uuid --format=csv,noheader -i "$G1")
case "$U1" in GPU-*) ;; *) fail "nvidia-smi gave no UUID for GPU $G1: '$U1'" ;; esac
grep -q "^ *1 .*$U1" "$T/status.out" || fail "status does not show rank 1 on $U1: $(cat "$T/status.out")"
echo "== a worker that cannot see its rank's GPU gets an error naming it; the rank stays free"
if [ "$G0" = "$G1" ]; then
  echo "   ranks share a GPU: a worker seeing only rank 0's GPU ($G0) sees rank 1's too, the refusal case is not applicable"
else
  CUDA_VISIBLE_DEVICES=$G0 worker wn1 -g vis2 -r 1 -n 2 --steps 2 --hidden 256
  wait "$W_wn1"; rc=$?
  [ $rc -ne 0 ] || fail "a worker attached to rank 1 from GPU 0 only succeeded"
  grep -q "$U1 is not among" "$T/wn1.out" || fail "wrong error: $(tail -3 "$T/wn1.out")"
fi
worker wo0 -g vis2 -r 0 -n 2 --steps 3 --seed 2 --hidden 256
CUDA_VISIBLE_DEVICES=$G1 worker wo1 -g vis2 -r 1 -n 2 --steps 3 --seed 2 --hidden 256
expect_ok wo0; expect_ok wo1

echo "== a worker dies mid-step"
worker wd0 -g die -r 0 -n 2 --steps 20 --seed 3 --hidden 256
worker wd1 -g die -r 1 -n 2 --steps 20 --seed 3 --hidden 256 --die-at-step 4
start=$(date +%s%N)
wait "$W_wd1"; rc=$?
[ $rc -eq 3 ] || fail "dying worker exited $rc, want 3"
wait "$W_wd0"; rc=$?
ms=$(( ($(date +%s%N) - start) / 1000000 ))
[ $rc -eq 2 ] || fail "survivor exited $rc, want 2 (an op error)"
grep -Eq "EPD_ERR_PEER|EPD_ERR_TIMEOUT" "$T/wd0.out" || fail "survivor's error names neither PEER nor TIMEOUT"
grep -h "failed" "$T/wd0.out"
echo "survivor failed after $ms ms"
kill -0 "$PID" 2>/dev/null || fail "the daemon died"

echo "== a new client of the dead rank attaches and runs"
worker we0 -g die -r 0 -n 2 --steps 6 --seed 4 --hidden 256
worker we1 -g die -r 1 -n 2 --steps 6 --seed 4 --hidden 256
expect_ok we0; expect_ok we1

echo "== drain between a dispatch and its combine: the combines run and match, the next dispatches fail with EPD_ERR_DRAINING"
worker wf0 -g drn -r 0 -n 2 --steps 50 --seed 6 --fp8 --hidden 512 --experts 32 --topk 4 --hold-at 3 --hold-file "$T/drn.go"
worker wf1 -g drn -r 1 -n 2 --steps 50 --seed 6 --fp8 --hidden 512 --experts 32 --topk 4 --hold-at 3 --hold-file "$T/drn.go"
wait_for 30 all_holding 3 wf0 wf1 || fail "group drn did not reach the hold: $(tail -qn1 "$T"/wf[01].out)"
"$CTL" -s "$SOCK" drain > "$T/drain.out" 2>&1 || fail "epdctl drain: $(cat "$T/drain.out")"
touch "$T/drn.go"
expect_drained 3 wf0 wf1
grep -h "EPD_ERR_DRAINING" "$T/wf0.out" | head -1 | cut -c1-150 | sed 's/^/   /'

stop_daemon
stop_mps
echo "e2e_cuda: all passed"
