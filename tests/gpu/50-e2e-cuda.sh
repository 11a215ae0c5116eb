#!/bin/bash
# 50-e2e-cuda.sh - the real daemon with engine.backend=cuda on 2 GPUs and epd-worker processes checking
# every LL step against the reference (BF16 and FP8, skewed routing, H 7168 x 256 experts x top-8 x 128
# tokens), and a worker killed mid-step: its peer gets EPD_ERR_PEER/EPD_ERR_TIMEOUT naming rank 1, the
# daemon keeps serving and a new client of that rank runs. Optionally under CUDA MPS (E2E_MPS=1).
# Usage (repository root, on the GPU machine): bash tests/gpu/50-e2e-cuda.sh [build-dir]
set -u
B=${1:-${EPD_BUILD:-build}}
EPD=$B/bin/epd
WORKER=$B/bin/epd-worker
[ -x "$EPD" ] || { echo "skip: $EPD is not built"; exit 77; }
[ -x "$WORKER" ] || { echo "skip: $WORKER is not built"; exit 77; }
[ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ] || { echo "skip: needs 2 GPUs"; exit 77; }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NCCL_LIB=${NCCL_LIB:-/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib}
[ -d "$NCCL_LIB" ] && export LD_LIBRARY_PATH=$NCCL_LIB:${LD_LIBRARY_PATH:-}
T=$(mktemp -d)
mkdir -p "$T/run"
LOG=$T/epd.log
SOCK=$T/run/control.sock
PID=
if [ "${E2E_MPS:-0}" = 1 ]; then
  export CUDA_MPS_PIPE_DIRECTORY=$T/mps-pipe CUDA_MPS_LOG_DIRECTORY=$T/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d || { echo "FAIL: MPS did not start"; exit 1; }
fi
stop_mps() { [ "${E2E_MPS:-0}" = 1 ] && echo quit | nvidia-cuda-mps-control; }
fail() {
  echo "FAIL: $*"
  for f in "$T"/w*.out; do [ -f "$f" ] && sed "s/^/  $(basename "$f"): /" "$f" | tail -8; done
  [ -f "$LOG" ] && sed 's/^/  log| /' "$LOG" | tail -30
  [ -n "$PID" ] && kill -KILL "$PID" 2>/dev/null
  stop_mps
  exit 1
}
wait_for() { local n=$(( $1 * 20 )); shift; while ! "$@" 2>/dev/null; do n=$((n-1)); [ $n -le 0 ] && return 1; sleep 0.05; done; }

"$EPD" -s "$SOCK" -f -o engine.backend=cuda -o engine.num_ranks=2 -o engine.step_timeout_ms=2000 \
  -o daemon.attach_socket="$T/run/attach.sock" -o daemon.drain_timeout_ms=2000 2> "$LOG" &
PID=$!
wait_for 30 test -S "$SOCK" || fail "no control socket"
wait_for 5 test -S "$T/run/attach.sock" || fail "no attach socket"
grep -E "backend|mode" "$LOG" | head -3

worker() {
  local n=$1; shift
  timeout 120 "$WORKER" -s "$SOCK" "$@" > "$T/$n.out" 2>&1 &
  eval "W_$n=$!"
}
expect_ok() {
  local n=$1 pid; eval "pid=\$W_$n"
  wait "$pid"; local rc=$?
  [ $rc -eq 0 ] || fail "worker $n exited $rc"
  grep -q "steps ok" "$T/$n.out" || fail "worker $n printed no summary"
  grep -h "steps ok" "$T/$n.out"
}

echo "== LL BF16, skewed routing, 20 steps (hidden 256)"
worker wa0 -g ll -r 0 -n 2 --steps 20 --seed 5 --skew --hidden 256
worker wa1 -g ll -r 1 -n 2 --steps 20 --seed 5 --skew --hidden 256
expect_ok wa0; expect_ok wa1

echo "== LL FP8 and BF16, H 7168, 256 experts, top-8, 128 tokens (two groups at once)"
worker wb0 -g big8 -r 0 -n 2 --steps 20 --seed 9 --fp8 --experts 256 --hidden 7168 --topk 8 --tokens 128
worker wb1 -g big8 -r 1 -n 2 --steps 20 --seed 9 --fp8 --experts 256 --hidden 7168 --topk 8 --tokens 128
worker wc0 -g big16 -r 0 -n 2 --steps 20 --seed 6 --experts 256 --hidden 7168 --topk 8 --tokens 128
worker wc1 -g big16 -r 1 -n 2 --steps 20 --seed 6 --experts 256 --hidden 7168 --topk 8 --tokens 128
expect_ok wb0; expect_ok wb1; expect_ok wc0; expect_ok wc1

echo "== HT FP8 and BF16 (skewed), H 7168, 256 experts, top-8, 256 tokens (two groups at once)"
worker wh0 -g ht8 -r 0 -n 2 --steps 8 --seed 4 --mode ht --fp8 --experts 256 --hidden 7168 --topk 8 --tokens 256
worker wh1 -g ht8 -r 1 -n 2 --steps 8 --seed 4 --mode ht --fp8 --experts 256 --hidden 7168 --topk 8 --tokens 256
worker wi0 -g ht16 -r 0 -n 2 --steps 8 --seed 8 --mode ht --skew --experts 256 --hidden 7168 --topk 8 --tokens 256
worker wi1 -g ht16 -r 1 -n 2 --steps 8 --seed 8 --mode ht --skew --experts 256 --hidden 7168 --topk 8 --tokens 256
expect_ok wh0; expect_ok wh1; expect_ok wi0; expect_ok wi1

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
grep -q "kernel submission" "$T/wa0.out" && fail "launch mode without EPD_SUBMIT: worker wa0 used kernel submission"

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

kill -TERM "$PID"
wait_for 10 sh -c "! kill -0 $PID" || fail "daemon did not exit on SIGTERM"
stop_mps
echo "e2e_cuda: all passed"
