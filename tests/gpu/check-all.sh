#!/bin/bash
# check-all.sh - one GPU-machine call that checks a build end to end (every step under a timeout, so a hung
# kernel costs minutes, not the whole call): the GPU tests (make gpu-test), the kernel tests under
# compute-sanitizer (quick list), the HT benchmark with every baseline and the LL benchmark. Results in
# $OUT (default /tmp/epd-check): one file per step, env.txt (GPUs, driver, NCCL, date, commit). Runs on one
# GPU (the ranks share it: NCCL 2.30 or later, NCCL_LIB) as on several.
#   tests/gpu/check-all.sh DIR          DIR: a build directory, or a tree from deploy/dev-bundle.sh
#   CHECK_STEPS="tests sanitize ht ll"  the steps to run (default: all four, in this order)
#   CHECK_TESTS="gpu_ plumb_ system/15"  only the GPU tests whose names contain one of these words (the
#                                       runner's filters): on one GPU the whole list takes about 480 s
#                                       (kernel tests, 150-160 and 168: 225; 165-167: 215; 169-170: 45),
#                                       so two calls split it
#   CHECK_BUDGET_S=570                  seconds for all steps (a device call allows 600): a step's own
#                                       timeout is cut to what is left; once nothing is left, steps skip
# After each step every process still running from DIR/bin (a hung test's daemon or worker) is killed.
# Ends with "N passed, N failed, N skipped" over the steps (a step that finds no GPUs counts as skipped).
set -u
D=${1:?usage: tests/gpu/check-all.sh DIR}
case "$D" in /*) ;; *) D="$PWD/$D" ;; esac
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-/tmp/epd-check}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NCCL_LIB=${NCCL_LIB:-/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib}
[ -d "$NCCL_LIB" ] && export LD_LIBRARY_PATH=$NCCL_LIB:${LD_LIBRARY_PATH:-}
{
  date -u +%FT%TZ
  git log -1 --format='commit %H' 2>/dev/null || echo "commit: unknown (not a git tree)"
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader 2>&1
  ls "$NCCL_LIB" 2>/dev/null
} > "$OUT/env.txt"
# One GPU: every test's ranks share it (two ranks, four in 157 and 166; the multi-node simulations 165, 166, 167
# with every node on it: two-nodes-lib.sh), and the benchmarks' two ranks too.
NG=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
[ "$NG" = 1 ] && export TWO_NODES_SHARE_GPU=1
# Blocks of the benchmarks' kernels where their two ranks share a GPU: every block of both ranks resident
# at once (the LL kernel's default 128 is halved; the HT data kernels' 24 SMs each fit twice).
LL_BLOCKS= HT_BLOCKS=24
[ "$NG" = 1 ] && LL_BLOCKS=64
pass=0 fail=0 skip=0
BUDGET=${CHECK_BUDGET_S:-570}
step() { # name timeout_s command...: run, keep the output, count (77, or rc 0 with no test run = skipped)
  local n=$1 t=$2 t0=$SECONDS
  shift 2
  local left=$((BUDGET - SECONDS - 5))
  if [ $left -lt 30 ]; then
    echo "skip    $n (the budget of $BUDGET s is spent)"; skip=$((skip + 1)); return
  fi
  [ "$t" -gt "$left" ] && t=$left
  echo "== $n (at most $t s): $*"
  timeout -k 10 "$t" "$@" > "$OUT/$n.txt" 2>&1
  local rc=$?
  pkill -KILL -f "^$D/bin/" 2>/dev/null # what a killed runner left (each test runs in a process group of its own)
  tail -4 "$OUT/$n.txt" | sed 's/^/   /'
  if [ $rc -eq 77 ] || { [ $rc -eq 0 ] && tail -1 "$OUT/$n.txt" | grep -q "^0 passed, 0 failed, [1-9]"; }; then
    echo "skip    $n ($((SECONDS - t0)) s)"; skip=$((skip + 1))
  elif [ $rc -eq 0 ]; then
    echo "ok      $n ($((SECONDS - t0)) s)"; pass=$((pass + 1))
  else
    echo "FAIL    $n: rc $rc$([ $rc -eq 124 ] && echo ' (timeout)') ($((SECONDS - t0)) s)"; fail=$((fail + 1))
  fi
}
for s in ${CHECK_STEPS:-tests sanitize ht ll}; do
  case $s in
    # shellcheck disable=SC2086 # CHECK_TESTS: name filters, one word each
    tests) step gpu_tests 480 env EPD_BUILD="$D" EPD_SYSTEM_TESTS=tests/gpu "$D/bin/epd-gpu-tests" ${CHECK_TESTS:-} ;;
    sanitize) step sanitize 240 env SANITIZE_QUICK=1 SANITIZE_LOG="$OUT/sanitize-logs" bash tests/gpu/sanitize.sh "$D" ;;
    ht) step bench_ht 240 "$D/bin/epd-bench-ht" --blocks "$HT_BLOCKS" --modes reg,dense,dense-reg --iters 20 ;;
    ll) mkdir -p "$OUT/bench_ll"
      step bench_ll 240 env ${LL_BLOCKS:+EPD_BENCH_BLOCKS=$LL_BLOCKS} EPD_BENCH_CMD="tests/gpu/check-all.sh (epd-bench)" \
        "$D/bin/epd-bench" "$OUT/bench_ll" ;;
    *) echo "unknown step $s"; fail=$((fail + 1)) ;;
  esac
done
echo "results: $OUT"
echo "$pass passed, $fail failed, $skip skipped"
[ $fail -eq 0 ]
