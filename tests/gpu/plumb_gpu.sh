#!/bin/bash
# plumb_gpu.sh - run the plumbing GPU tests on the lent 2x H200 machine (from the repository root, with
# build-plumb carried): without MPS, then the engine and device tests again under CUDA MPS.
# Usage: bash tests/gpu/plumb_gpu.sh [build-dir]   (results in $OUT when set)
set -u
B=${1:-build-plumb}
OUT=${OUT:-/tmp/plumb-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NCCL_LIB=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib
export LD_LIBRARY_PATH=$NCCL_LIB:$PWD/$B/extra-lib:${LD_LIBRARY_PATH:-}
export EPD_PLUMB_LOG=$OUT/plumb.log
nvidia-smi -L
ls $NCCL_LIB
echo "== without MPS"
timeout ${PLUMB_T1:-170} "$B/bin/plumb-tests" ${PLUMB_FILTER:-plumb} 2>&1 | tee "$OUT/nomps.txt"
if [ "${PLUMB_MPS:-1}" = 1 ]; then
  echo "== under MPS"
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/epd-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/epd-mps-log
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  nvidia-cuda-mps-control -d && echo "MPS started"
  echo "== under MPS" >> "$EPD_PLUMB_LOG"
  timeout ${PLUMB_T2:-90} "$B/bin/plumb-tests" ${PLUMB_MPS_FILTER:-plumb_engine plumb_device plumb_memops} 2>&1 | tee "$OUT/mps.txt"
  echo quit | nvidia-cuda-mps-control
fi
echo "== measurements"
cat "$EPD_PLUMB_LOG"
