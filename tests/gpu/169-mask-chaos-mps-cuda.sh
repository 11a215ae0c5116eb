#!/bin/bash
# 169-mask-chaos-mps-cuda.sh - 168-mask-chaos-cuda.sh under CUDA MPS with the daemon in persistent mode
# and the workers submitting from their kernels (the queue's device twin); groups that mask step in launch
# mode. A killed worker's submission kernel may still spin on a slot of a step that never ran: the daemon
# frees a lost client's submitted slots as it leaves, so that kernel ends at once (otherwise the MPS server
# saw an illegal memory access and tore down every client of the GPU, the daemon included).
# Usage (repository root, on the GPU machine): bash tests/gpu/169-mask-chaos-mps-cuda.sh [build-dir]
GPU_MPS=1 EPD_SUBMIT=kernel EPD_MASK_MODE=persistent EPD_MASK_CHAOS_SECONDS=${EPD_MASK_CHAOS_SECONDS:-12} \
  exec bash "$(dirname "$0")/168-mask-chaos-cuda.sh" "$@"
