#!/bin/sh
# bench.sh - run the epd benchmarks (make bench). Results: JSON + Markdown in $EPD_BENCH_OUT
# (default bench/results/). NVLink multicast stays off. Exit 0 when skipped for lack of GPUs.
set -u
B=${B:-build}
OUT_DIR=${EPD_BENCH_OUT:-bench/results}
mkdir -p "$OUT_DIR"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export EPD_BENCH_CMD="${EPD_BENCH_CMD:-make bench ($B/bin/epd-bench $OUT_DIR)}"
"$B/bin/epd-bench" "$OUT_DIR"
rc=$?
if [ $rc -eq 77 ]; then echo "bench: skipped (needs 2 GPUs)"; exit 0; fi
exit $rc
