#!/bin/bash
# run_gpu.sh - one GPU-machine run of the end-to-end benchmarks (2 ranks), packed into $OUT/e2e-results.tgz:
#   inproc/        epd-bench (bench_ll.c: kernel time, in-process end to end, NCCL baselines)
#   nomps/         daemon backend=cuda without MPS, default poll loop: bench_e2e (C) + py_overhead (Python)
#   nomps-spin/    (MOE=1) the same daemon with engine.idle_spin_ns (rank threads never sleep while busy)
#   mps-spin/      under CUDA MPS (nvidia-cuda-mps-control -d, pipe/log dirs under /tmp), spin on: C + Python
#   python-moe.txt (MOE=1) tests/gpu/160-python-moe.sh
# PERSIST=1: inproc/, inproc-p/ (epd-bench with EPD_BENCH_BLOCKS=$PBLOCKS, default 64: the persistent
#   mode's blocks), then under MPS mps-launch/ (engine.cuda_mode=launch, 128 blocks) and mps-persist/
#   (engine.cuda_mode=persistent, engine.ll_blocks=$PBLOCKS) and mps-persist128/ (persistent, 128 blocks),
#   all spinning, C only (PY=1: Python too). Where the ranks share a GPU, these block counts are halved
#   (the blocks of both ranks' persistent kernels must be resident at once).
# With one GPU both ranks share it (the daemon gets engine.devices=0,0; the in-process benches do the
# same on their own): one line says so, in env.txt too; no NVLink, figures not comparable with the
# records of 2 GPUs.
# Usage (repository root of the GPU machine): bash bench/e2e/run_gpu.sh BUNDLE_DIR   (OUT=... set)
set -u
D=${1:-dist/epd-0.1.0-linux-x86_64}
FINAL=${OUT:-/tmp/e2e-out}
mkdir -p "$FINAL"
WORK=$(mktemp -d /tmp/e2e.XXXX)
OUT=$WORK/out  # everything lands here, then one tarball in $FINAL (the device tool returns few files)
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NCCL_LIB=${NCCL_LIB:-/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib}
export LD_LIBRARY_PATH=$NCCL_LIB:$PWD/$D/lib
export PYTHONPATH=$PWD/python EPD_LIBRARY=$PWD/$D/lib/libepd.so.1
ITERS=${ITERS:-300}
. tests/worker-lib.sh # visible_gpus, devices_list
gpu_view
DEVS=$(devices_list 2) # both ranks on one GPU where there is one: the daemon's engine.devices
SHARED=
[ -n "$DEVS" ] && SHARED="the 2 ranks share one GPU (engine.devices=$DEVS): no NVLink, figures not comparable with the records of 2 GPUs"
[ -n "$SHARED" ] && echo "== $SHARED"
rm -f /dev/shm/epd-bench-e2e-* 2>/dev/null
{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  nvidia-smi topo -m 2>/dev/null | head -4
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" 2>&1
  ls "$NCCL_LIB"
  [ -n "$SHARED" ] && echo "$SHARED"
} > "$OUT/env.txt" 2>&1

DPID=
start_daemon() { # name [-o key=value...]
  local n=$1; shift
  mkdir -p "$WORK/$n" "$OUT/$n"
  SOCK=$WORK/$n/control.sock
  "$D/bin/epd" "$@" -s "$SOCK" -f -o engine.backend=cuda -o engine.num_ranks=2 -o engine.step_timeout_ms=5000 \
    ${DEVS:+-o engine.devices=$DEVS} -o daemon.attach_socket="$WORK/$n/attach.sock" -o daemon.drain_timeout_ms=2000 \
    2> "$OUT/$n/daemon.log" &
  DPID=$!
  for _ in $(seq 600); do [ -S "$WORK/$n/attach.sock" ] && break; sleep 0.05; done
  [ -S "$WORK/$n/attach.sock" ] || echo "daemon $n did not start: $(grep -v DEBUG "$OUT/$n/daemon.log" | tail -1)"
  grep -iE "mode|mps" "$OUT/$n/daemon.log" | head -3
}
stop_daemon() {
  [ -n "$DPID" ] || return
  kill -TERM "$DPID" 2>/dev/null
  for _ in $(seq 100); do kill -0 "$DPID" 2>/dev/null || break; sleep 0.05; done
  kill -KILL "$DPID" 2>/dev/null
  wait "$DPID" 2>/dev/null
  DPID=
}
bench_c() { # name dev_iters
  local n=$1 di=$2
  for r in 0 1; do
    timeout 150 "$D/bin/epd-bench-e2e" -s "$SOCK" -r $r -g "c-$n" --iters "$ITERS" --dev-iters "$di" \
      --out "$OUT/$n/e2e" > "$OUT/$n/e2e.r$r.log" 2>&1 &
    eval "P$r=\$!"
  done
  wait "$P0"; echo "bench_e2e $n rank 0 rc $?"; wait "$P1"; echo "bench_e2e $n rank 1 rc $?"
  tail -3 "$OUT/$n/e2e.r0.log"
}
py_overhead() { # name: the Python client's overhead benchmark against the running daemon
  timeout 200 python3 bench/e2e/py_overhead.py --socket "$SOCK" --iters "$ITERS" --out "$OUT/$1/py" \
    > "$OUT/$1/py.log" 2>&1
  echo "py_overhead rc $?"; tail -3 "$OUT/$1/py.log"
}
start_mps() { # 0 when the MPS control daemon started (pipe and log directories under /tmp)
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/e2e-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/e2e-mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d && return 0
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  return 1
}
finish() { # stop MPS if it runs, pack the results, exit
  [ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ] && echo quit | nvidia-cuda-mps-control
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  rm -f /dev/shm/epd-bench-e2e-* 2>/dev/null
  tar -C "$OUT" -czf "$FINAL/e2e-results.tgz" .
  echo "== done"
  exit 0
}

echo "== in-process (epd-bench)"
mkdir -p "$OUT/inproc"
EPD_BENCH_CMD="epd-bench (bench/e2e/run_gpu.sh, same device call)" timeout 150 "$D/bin/epd-bench" "$OUT/inproc" \
  > "$OUT/inproc/log.txt" 2>&1
echo "epd-bench rc $?"; tail -3 "$OUT/inproc/log.txt"

if [ "${PERSIST:-0}" = 1 ]; then
  SH=$(ranks_per_gpu 2)
  [ "$SH" -ge 1 ] || SH=1
  PB=${PBLOCKS:-$((64 / SH))}
  FULL=$((128 / SH)) # "128 blocks": the default grid, the rank's part of it where ranks share a GPU
  echo "== in-process (epd-bench), $PB blocks"
  mkdir -p "$OUT/inproc-p"
  EPD_BENCH_BLOCKS=$PB EPD_BENCH_CMD="EPD_BENCH_BLOCKS=$PB epd-bench (bench/e2e/run_gpu.sh PERSIST=1)" timeout 150 \
    "$D/bin/epd-bench" "$OUT/inproc-p" > "$OUT/inproc-p/log.txt" 2>&1
  echo "epd-bench rc $?"; tail -2 "$OUT/inproc-p/log.txt"
  echo "== MPS: launch mode vs persistent mode"
  if start_mps; then
    # The in-process path under MPS too: the daemon's rows run under MPS, the in-process baseline above
    # does not; this separates MPS's own launch and synchronisation costs from the daemon's.
    echo "== in-process (epd-bench) under MPS, $FULL blocks"
    mkdir -p "$OUT/inproc-mps"
    EPD_BENCH_CMD="epd-bench under MPS (bench/e2e/run_gpu.sh PERSIST=1)" timeout 150 "$D/bin/epd-bench" \
      "$OUT/inproc-mps" > "$OUT/inproc-mps/log.txt" 2>&1
    echo "epd-bench under MPS rc $?"; tail -2 "$OUT/inproc-mps/log.txt"
    for m in launch persist persist128; do
      case $m in
        launch) start_daemon mps-$m -o engine.cuda_mode=launch -o engine.idle_spin_ns=20000000 ;;
        persist) start_daemon mps-$m -o engine.cuda_mode=persistent -o engine.idle_spin_ns=20000000 -o engine.ll_blocks=$PB ;;
        persist128) start_daemon mps-$m -o engine.cuda_mode=persistent -o engine.idle_spin_ns=20000000 -o engine.ll_blocks=$FULL ;;
      esac
      bench_c mps-$m "$ITERS"
      if [ "${PY:-0}" = 1 ]; then
        py_overhead mps-$m
      fi
      stop_daemon
      grep -E "persistent kernels|launch mode" "$OUT/mps-$m/daemon.log" | head -3
    done
  else
    echo "MPS did not start"
  fi
  finish
fi

echo "== no MPS, default poll loop"
start_daemon nomps
bench_c nomps 20
py_overhead nomps
stop_daemon

if [ "${MOE:-0}" = 1 ]; then
  echo "== no MPS, spinning poll loop"
  start_daemon nomps-spin -o engine.idle_spin_ns=20000000
  bench_c nomps-spin 20
  stop_daemon
  echo "== python moe layer"
  timeout 400 bash tests/gpu/160-python-moe.sh "$D" > "$OUT/python-moe.txt" 2>&1
  echo "160-python-moe rc $?"; tail -8 "$OUT/python-moe.txt"
fi

echo "== MPS, spinning poll loop"
if start_mps; then
  start_daemon mps-spin -o engine.idle_spin_ns=20000000
  bench_c mps-spin "$ITERS"
  py_overhead mps-spin
  stop_daemon
else
  echo "MPS did not start"
fi
finish
