#!/bin/bash
# mask-chaos-mps-cuda.sh - 168-mask-chaos-cuda.sh under CUDA MPS with the daemon in persistent mode and
# the workers submitting from their kernels (the queue's device twin); groups that mask step in launch
# mode. Not in the GPU suite (no NN- prefix): on one H200 it ends with an illegal memory access in the
# daemon's context after some tens of SIGKILLed workers (the fault is open, docs/FAULTS.md); kept to
# reproduce it. 168 (no MPS, host submission) runs the same chaos clean.
# Usage (repository root, on the GPU machine): bash tests/gpu/mask-chaos-mps-cuda.sh [build-dir]
GPU_MPS=1 EPD_SUBMIT=kernel EPD_MASK_MODE=persistent EPD_MASK_CHAOS_SECONDS=${EPD_MASK_CHAOS_SECONDS:-12} \
  exec bash "$(dirname "$0")/168-mask-chaos-cuda.sh" "$@"
