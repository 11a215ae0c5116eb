# daemon-lib.sh - sourced by the single-daemon GPU scripts (150-e2e-cuda.sh, 155-expert-maps-cuda.sh,
# 156-persistent-cuda.sh, 157-four-gpus-cuda.sh): one daemon with engine.backend=cuda and NGPU ranks,
# epd-worker processes at it. Before sourcing: B (build directory). Optional: DL_NGPU (the daemon's ranks,
# default 2), GPU_MPS=1 (start CUDA MPS for the script, pipe and log directories under its temporary
# directory; skip if it does not start), EPD_KEEP_LOG=FILE (copy the daemon's log there on exit or
# failure, and under MPS the MPS logs to FILE.mps/). Skips (exit 77) without the binaries or a GPU.
# A GPU per rank where the view has enough (rank r on GPU r); with fewer, ranks share them (rank r on GPU
# r mod count, up to 4 on one: SHARE, the most on one GPU; the daemon gets engine.devices from
# devices_opt, a worker of rank r CUDA_VISIBLE_DEVICES=$(gpu_of r) as before). The daemon then splits each
# GPU's SMs among its ranks (their kernels wait for each other, so all must be resident) and NCCL runs
# in its multi-rank mode (2.30 or later). Kernels of different processes that wait for each other (the
# daemon's persistent kernels and the workers' device-side submission) need CUDA MPS to run side by
# side (the scripts of persistent mode set GPU_MPS=1); without MPS the processes' kernels are only
# time-sliced: slower (a switch costs about 2 ms), results the same.
EPD=$B/bin/epd
CTL=$B/bin/epdctl
WORKER=$B/bin/epd-worker
[ -x "$EPD" ] || { echo "skip: $EPD is not built"; exit 77; }
[ -x "$WORKER" ] || { echo "skip: $WORKER is not built"; exit 77; }
NGPU=${DL_NGPU:-2}
. "$(dirname "${BASH_SOURCE[0]}")/../worker-lib.sh"
gpu_view
[ "$(visible_gpus)" -ge 1 ] || { echo "skip: needs a GPU"; exit 77; }
SHARE=$(ranks_per_gpu "$NGPU")
[ "$SHARE" -le 4 ] || { echo "skip: $NGPU ranks on $(visible_gpus) GPU(s) would put $SHARE on one (at most 4)"; exit 77; }
if [ "$SHARE" -gt 1 ]; then
  echo "== $NGPU ranks share $(visible_gpus) GPU(s), up to $SHARE on one ($(devices_opt "$NGPU")): no NVLink between" \
    "ranks of one GPU, each rank gets its part of the GPU's SMs; timings are not those of a GPU per rank"
fi
NCCL_LIB=${NCCL_LIB:-/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib}
[ -d "$NCCL_LIB" ] && export LD_LIBRARY_PATH=$NCCL_LIB:${LD_LIBRARY_PATH:-}
T=$(mktemp -d)
mkdir -p "$T/run"
LOG=$T/epd.log
SOCK=$T/run/control.sock
PID=
if [ "${GPU_MPS:-0}" = 1 ]; then
  command -v nvidia-cuda-mps-control > /dev/null || { echo "skip: no nvidia-cuda-mps-control (CUDA MPS)"; exit 77; }
  export CUDA_MPS_PIPE_DIRECTORY=$T/mps-pipe CUDA_MPS_LOG_DIRECTORY=$T/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d || { echo "skip: CUDA MPS did not start"; exit 77; }
fi
stop_mps() { [ "${GPU_MPS:-0}" = 1 ] && echo quit | nvidia-cuda-mps-control; }
keep_log() { # the daemon's log, and under MPS the MPS server's (which client faulted) beside it
  [ -n "${EPD_KEEP_LOG:-}" ] || return 0
  cp "$LOG" "$EPD_KEEP_LOG"
  [ "${GPU_MPS:-0}" = 1 ] && cp -r "$CUDA_MPS_LOG_DIRECTORY" "$EPD_KEEP_LOG.mps"
  return 0
}
fail() {
  echo "FAIL: $*"
  keep_log
  for f in "$T"/w*.out; do [ -f "$f" ] && sed "s/^/  $(basename "$f"): /" "$f" | tail -8; done
  [ -f "$LOG" ] && grep -v "DEBUG" "$LOG" | sed 's/^/  log| /' | tail -30
  [ -n "$PID" ] && kill -KILL "$PID" 2>/dev/null
  stop_mps
  exit 1
}
trap 'fail "killed (timeout?)"' TERM INT
# start_daemon [-o k=v ...]: the daemon with NGPU ranks (sharing GPUs where the view has fewer: devices_opt)
# and the attach socket in $T/run (its env from the caller).
start_daemon() {
  # shellcheck disable=SC2046 # devices_opt: an option and its value, or nothing
  "$EPD" -s "$SOCK" -f -o engine.backend=cuda -o engine.num_ranks="$NGPU" -o daemon.attach_socket="$T/run/attach.sock" \
    $(devices_opt "$NGPU") "$@" 2> "$LOG" &
  PID=$!
  # a daemon that cannot start (NCCL too old to share a GPU, ...) exits at once, saying why in its log
  wait_for 30 sh -c "test -S '$SOCK' || ! kill -0 $PID" || fail "no control socket"
  kill -0 "$PID" 2>/dev/null || { PID=; fail "the daemon exited at start: $(grep -v DEBUG "$LOG" | tail -1)"; }
  wait_for 5 test -S "$T/run/attach.sock" || fail "no attach socket"
}
# stop_daemon: SIGTERM, the daemon must exit within 10 s.
stop_daemon() {
  kill -TERM "$PID"
  wait_for 10 sh -c "! kill -0 $PID" || fail "daemon did not exit on SIGTERM"
  PID=
}
# worker NAME ARGS...: an epd-worker in the background (pid in W_NAME, output in $T/NAME.out).
worker() {
  local n=$1; shift
  timeout 120 "$WORKER" -s "$SOCK" "$@" > "$T/$n.out" 2>&1 &
  eval "W_$n=$!"
}
