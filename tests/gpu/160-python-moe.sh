#!/bin/bash
# 160-python-moe.sh - python/examples/moe_layer.py with 2 ranks: a daemon with engine.backend=cuda, two torch
# worker processes (one per rank, half of 16 experts each, gated-MLP weights), dispatch -> expert MLP ->
# combine for 40 steps compared with the single-process PyTorch reference, with an expert-map change
# halfway: eager, inside torch.cuda.graph (captured steps replayed), FP8 dispatch inside graphs, and FP8
# eager with each worker seeing only its GPU (--one-gpu: its entry of the GPU list below, torch on
# ep.device). A GPU per rank with two; with one both ranks share it (the daemon gets engine.devices=0,0
# through moe_layer.py --daemon-opt, each worker that GPU; the workers' kernels time-sliced against the
# daemon's, no MPS: slower, results the same).
# Skips (77) without a GPU, torch with CUDA, or a built daemon/libepd.
# Usage (repository root): bash tests/gpu/160-python-moe.sh [build-or-bundle-dir]
set -u
cd "$(dirname "$0")/../.." || exit 1
B=${1:-${EPD_BUILD:-build}}
case "$B" in /*) ;; *) B="$PWD/$B" ;; esac
PY=${PYTHON:-python3}
[ -x "$B/bin/epd" ] || { echo "skip: $B/bin/epd is not built"; exit 77; }
LIB=${EPD_LIBRARY:-}
for f in "$B/lib/libepd.so.1" "$B/lib/libepd.so"; do [ -z "$LIB" ] && [ -f "$f" ] && LIB=$f; done
[ -n "$LIB" ] || { echo "skip: no libepd in $B/lib"; exit 77; }
. tests/worker-lib.sh # visible_gpus, gpu_of, devices_list, the NCCL environment of the lent machines
gpu_view
[ "$(visible_gpus)" -ge 1 ] || { echo "skip: needs a GPU"; exit 77; }
"$PY" -c "import torch, numpy, sys; sys.exit(0 if torch.cuda.device_count() >= 1 else 1)" 2>/dev/null ||
  { echo "skip: $PY has no torch with a CUDA device"; exit 77; }
NCCL_LIB=${NCCL_LIB:-/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib}
[ -d "$NCCL_LIB" ] && export LD_LIBRARY_PATH=$NCCL_LIB:${LD_LIBRARY_PATH:-}
export EPD_LIBRARY=$LIB PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
# Only the two GPUs the test uses: on 4x H100 every process started CUDA on all four (a daemon's start to
# its control socket took 1.0-2.05 s there against 0.8 s on 2x H100: the daemon logs in
# bench/results/raw/e2e_persistent_h100_20261126/), and the whole test took 108-229 s there against 40-67 s on 2 GPUs. The parent's CPU reference check runs small torch ops one result at a time: cap its thread
# pools, which size themselves to every vCPU of the machine. With both: 40-46 s on 4x H100 (75 s without,
# same machine; bench/results/python_moe_env_h100x4.txt).
# With one GPU, only it (a list naming a GPU twice is not one CUDA takes), both ranks on it.
if [ "$(visible_gpus)" -ge 2 ]; then CUDA_VISIBLE_DEVICES="$(gpu_of 0),$(gpu_of 1)"
else CUDA_VISIBLE_DEVICES="$(gpu_of 0)"; fi
export CUDA_VISIBLE_DEVICES
DEVS=$(devices_list 2)
DOPT=()
if [ -n "$DEVS" ]; then
  DOPT=(--daemon-opt "engine.devices=$DEVS")
  echo "== both ranks share GPU $CUDA_VISIBLE_DEVICES (engine.devices=$DEVS): no NVLink, time-sliced with the workers"
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8} OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-8}
rc=0
run() {
  echo "== moe_layer.py $*"
  local t0=$SECONDS
  timeout 300 "$PY" python/examples/moe_layer.py --daemon "$B/bin/epd" ${DOPT[@]+"${DOPT[@]}"} --steps 40 "$@" ||
    { echo "FAIL: moe_layer.py $*"; rc=1; }
  echo "== moe_layer.py${*:+ $*}: $((SECONDS - t0)) s"
}
run
run --graph
run --one-gpu --fp8
run --graph --fp8 --hidden 1024 --inter 512 --max-tokens 64 --topk 8
[ $rc -eq 0 ] && echo "python_moe: all passed"
exit $rc
