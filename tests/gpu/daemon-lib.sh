# daemon-lib.sh - sourced by the single-daemon GPU scripts (50-e2e-cuda.sh, 55-expert-maps-cuda.sh,
# 56-persistent-cuda.sh, 57-four-gpus-cuda.sh): one daemon with engine.backend=cuda on NGPU GPUs,
# epd-worker processes at it. Before sourcing: B (build directory). Optional: DL_NGPU (the daemon's GPUs,
# default 2), GPU_MPS=1 (start CUDA MPS for the script, pipe and log directories under its temporary
# directory; skip if it does not start), EPD_KEEP_LOG=FILE (copy the daemon's log there on exit or
# failure). Skips (exit 77) without the binaries or NGPU GPUs.
EPD=$B/bin/epd
CTL=$B/bin/epdctl
WORKER=$B/bin/epd-worker
[ -x "$EPD" ] || { echo "skip: $EPD is not built"; exit 77; }
[ -x "$WORKER" ] || { echo "skip: $WORKER is not built"; exit 77; }
NGPU=${DL_NGPU:-2}
. "$(dirname "${BASH_SOURCE[0]}")/../worker-lib.sh"
[ "$(visible_gpus)" -ge "$NGPU" ] || { echo "skip: needs $NGPU GPUs"; exit 77; }
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
keep_log() { [ -n "${EPD_KEEP_LOG:-}" ] && cp "$LOG" "$EPD_KEEP_LOG"; }
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
# start_daemon [-o k=v ...]: the daemon on NGPU GPUs with the attach socket in $T/run (its env from the caller).
start_daemon() {
  "$EPD" -s "$SOCK" -f -o engine.backend=cuda -o engine.num_ranks="$NGPU" -o daemon.attach_socket="$T/run/attach.sock" \
    "$@" 2> "$LOG" &
  PID=$!
  wait_for 30 test -S "$SOCK" || fail "no control socket"
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
