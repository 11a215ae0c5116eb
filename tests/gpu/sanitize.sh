#!/bin/bash
# sanitize.sh - the GPU kernel tests under NVIDIA compute-sanitizer (make gpu-sanitize): memcheck (out of bounds
# and misaligned accesses, faults), racecheck (shared-memory hazards) and synccheck (barriers reached by part
# of a block or warp) on the LL kernels, the persistent kernel, the client's device-side submission and the
# HT kernels. Usage: tests/gpu/sanitize.sh [BUILD_DIR]; SANITIZE_QUICK=1 runs one test per tool, SANITIZE_PART=1|2
# half of the full list (memcheck | special values under memcheck, racecheck and synccheck). Prints a
# line per run and ends with "N passed, N failed, N skipped"; exit status 0 iff nothing failed. Skips without
# compute-sanitizer or a GPU. A run fails on any error the tool reports (NCCL's own API probes at init are
# not reported: --report-api-errors no) or any failed test. On one GPU the tests' two ranks share it
# (tests/gpu/harness_common.h: NCCL's multi-rank mode, half the blocks each).
# Known and excluded: racecheck reports the opt-in TMA combine's shared-memory reads against its bulk copies,
# which an mbarrier orders (bench/results/sanitizer_h200x2.md); the racecheck list has no TMA steps.
set -u
B=${1:-${EPD_BUILD:-build}}
export EPD_BUILD=$B
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NCCL_LIB=${NCCL_LIB:-/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib}
[ -d "$NCCL_LIB" ] && export LD_LIBRARY_PATH=$NCCL_LIB:${LD_LIBRARY_PATH:-}
CS=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)}
T=$B/bin/epd-gpu-tests
LOG=${SANITIZE_LOG:-$(mktemp -d)}
mkdir -p "$LOG"
pass=0 fail=0 skip=0
[ -x "$T" ] || { echo "FAIL: $T is not built"; echo "0 passed, 1 failed, 0 skipped"; exit 1; }
NG=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if [ -z "$CS" ] || [ "$NG" -lt 1 ]; then
  echo "skip: needs compute-sanitizer and a GPU"
  echo "0 passed, 0 failed, 1 skipped"
  exit 0
fi
[ "$NG" -lt 2 ] && echo "== one GPU: the tests' two ranks share it"
run() { # tool timeout_s tests... (exact test names: the run must report one pass per name)
  local tool=$1 to=$2
  shift 2
  local name="$tool:$(echo "$*" | tr ' ' ',')" out="$LOG/$tool-$(echo "$*" | tr ' ' '-' | cut -c1-120).txt"
  local t0=$SECONDS
  timeout "$to" "$CS" --tool "$tool" --report-api-errors no --print-limit 50 --error-exitcode 9 "$T" "$@" > "$out" 2>&1
  local rc=$?
  local sum
  sum=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$out" | tail -1 | sed 's/^========= //')
  # every named test ran and passed (a filter that matches nothing, or a skip, is a failure here)
  if [ $rc -eq 0 ] && grep -Eq "^$# passed, 0 failed, 0 skipped" "$out"; then
    printf 'ok      %-70s %4ds  %s\n' "$name" $((SECONDS - t0)) "$sum"
    pass=$((pass + 1))
  else
    printf 'FAIL    %-70s %4ds  rc %d  %s (%s)\n' "$name" $((SECONDS - t0)) $rc "$sum" "$out"
    grep -v "Host Frame\|Saved host" "$out" | grep -E "^========= [A-Z]|^=========     (at|by)|^FAIL" | head -12 | sed 's/^/    | /'
    fail=$((fail + 1))
  fi
}
if [ "${SANITIZE_QUICK:-0}" = 1 ]; then
  run memcheck 150 gpu_ll_fp8_h7168_k8_e256
  run racecheck 120 gpu_ll_persistent_queue
  run synccheck 90 gpu_ht_overflow_bad_expert_too_many gpu_ht_topk16_topk1_hidden640
else
  # SANITIZE_PART=1: three memcheck runs, 2: the special-value memcheck, racecheck and synccheck (each fits one 10-minute
  # call of a lent GPU machine); unset: all
  part=${SANITIZE_PART:-0}
  if [ "$part" != 2 ]; then
    run memcheck 300 gpu_ll_bf16_h2048_k8 gpu_ll_fp8_h7168_k8_e256 gpu_ll_topk9_topk1_skew_all_to_one gpu_ll_persistent_queue
    run memcheck 240 gpu_ht_overflow_bad_expert_too_many gpu_ht_topk16_topk1_hidden640 gpu_ht_h4096_8192_tokens_16_blocks
    run memcheck 120 plumb_device_submit_wait plumb_graph_replay
  fi
  if [ "$part" != 1 ]; then
    run memcheck 200 gpu_ll_fp8_special_values gpu_ht_fp8_special_values
    run racecheck 240 gpu_ll_bf16_h2048_k8 gpu_ll_persistent_queue gpu_ht_overflow_bad_expert_too_many
    run synccheck 240 gpu_ll_bf16_h2048_k8 gpu_ll_persistent_queue gpu_ht_overflow_bad_expert_too_many gpu_ht_topk16_topk1_hidden640
  fi
fi
echo "logs: $LOG"
echo "$pass passed, $fail failed, $skip skipped"
[ $fail -eq 0 ]
