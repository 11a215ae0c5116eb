#!/bin/sh
# bench.sh - run every epd benchmark (make bench) and record the results: JSON + Markdown (or raw text)
# in $EPD_BENCH_OUT (default bench/results/). Each runs 2 ranks (epd-bench-r4: 4), a GPU each where there
# are enough; with fewer the ranks share them (NCCL 2.30+ multi-rank mode, each rank on its part of the
# GPU's SMs), said in one line: no NVLink then, figures not comparable with the records of a GPU per rank.
# Each skips cleanly (exit 77) without a GPU.
#   epd-bench       LL kernels, in-process path, NCCL send/recv and allgather/reduce-scatter baselines
#   epd-bench-r4    the same with 4 ranks (on 4 GPUs, or sharing fewer)
#   epd-bench-ht    HT kernels at 4096 tokens, NCCL send/recv and the copy-kernel ceiling
#   epd-bench-map   SetExpertMap -> first step, switching step, migration, communicator re-creation
#   e2e/run_gpu.sh  end to end through the daemon (stream memops, graph, device-side enqueue; MPS or not)
# NVLink multicast stays off.
set -u
B=${B:-build}
OUT_DIR=${EPD_BENCH_OUT:-bench/results}
mkdir -p "$OUT_DIR"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then ngpu=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .)
else ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU'); fi
if [ "$ngpu" -ge 1 ] && [ "$ngpu" -lt 4 ]; then
  echo "== $ngpu GPU(s) for 2 ranks (epd-bench-r4: 4): where there are fewer GPUs than ranks they share them" \
    "(rank r on GPU r mod $ngpu): no NVLink between ranks of a GPU, figures not comparable with the records" \
    "of a GPU per rank"
fi
rc=0
run() { # name command...
  name=$1; shift
  echo "== $name: $*"
  EPD_BENCH_CMD="make bench ($*)" "$@"
  r=$?
  if [ $r -eq 77 ]; then echo "$name: skipped (no GPU)"; elif [ $r -ne 0 ]; then echo "$name: FAILED ($r)"; rc=1; fi
}
run ll "$B/bin/epd-bench" "$OUT_DIR"
[ -x "$B/bin/epd-bench-r4" ] && run ll-4gpus "$B/bin/epd-bench-r4" "$OUT_DIR"
[ -x "$B/bin/epd-bench-ht" ] && run ht sh -c "'$B/bin/epd-bench-ht' --iters 20 --blocks 24,32,48 > '$OUT_DIR/bench_ht.txt'"
[ -x "$B/bin/epd-bench-map" ] && run map "$B/bin/epd-bench-map" "$OUT_DIR" --cuda
if [ -x "$B/bin/epd-bench-e2e" ] && command -v nvidia-smi >/dev/null 2>&1; then
  OUT="$OUT_DIR" run e2e bash bench/e2e/run_gpu.sh "$B"
fi
exit $rc
