#!/bin/bash
# 169-mask-chaos-persistent-cuda.sh - 168-mask-chaos-cuda.sh with engine.cuda_mode = persistent under CUDA
# MPS (the workers submit through the queue's device twin next to the daemon's persistent kernels): a
# group steps in launch mode while a rank is masked and goes back to persistent kernels once none is.
# Usage (repository root, on the GPU machine): bash tests/gpu/169-mask-chaos-persistent-cuda.sh [build-dir]
GPU_MPS=1 EPD_MASK_MODE=persistent EPD_MASK_CHAOS_SECONDS=${EPD_MASK_CHAOS_SECONDS:-12} \
  exec bash "$(dirname "$0")/168-mask-chaos-cuda.sh" "$@"
