#!/bin/bash
# 169-mask-chaos-persistent-cuda.sh - 168-mask-chaos-cuda.sh with engine.cuda_mode = persistent under CUDA
# MPS: the workers submit through the queue's device twin, and groups that mask lost ranks step in launch
# mode.
# Usage (repository root, on the GPU machine): bash tests/gpu/169-mask-chaos-persistent-cuda.sh [build-dir]
GPU_MPS=1 EPD_SUBMIT=kernel EPD_MASK_MODE=persistent EPD_MASK_CHAOS_SECONDS=${EPD_MASK_CHAOS_SECONDS:-12} \
  exec bash "$(dirname "$0")/168-mask-chaos-cuda.sh" "$@"
