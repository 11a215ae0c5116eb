# worker-lib.sh - sourced by the test scripts and libraries that run epd-worker processes in the
# background (tests/system/30-e2e.sh, cluster-lib.sh; tests/gpu/daemon-lib.sh, two-nodes-lib.sh, 60-python-moe.sh). They
# start worker NAME with its output in $T/NAME.out and its pid in W_NAME, and define fail().
# expect_ok NAME...: each worker exited 0 and printed its summary ("steps ok"); its summary lines (and
# bench, map-switch and HT counts) are printed, prefixed with its name.
# GPU scripts: CUDA numbers GPUs as nvidia-smi does (its default order may differ on mixed hosts);
# gpu_of I: the CUDA_VISIBLE_DEVICES entry of GPU I of the script's own view (its inherited
# CUDA_VISIBLE_DEVICES if set, else every GPU), for a daemon or worker that should see only that GPU.
export CUDA_DEVICE_ORDER=PCI_BUS_ID
# Never NVLink SHARP / multicast on the lent GPU machines (every process these scripts start inherits it).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# wait_for SECONDS COMMAND...: poll until the command succeeds (1 if it never does).
wait_for() { local n=$(( $1 * 20 )); shift; while ! "$@" 2>/dev/null; do n=$((n-1)); [ $n -le 0 ] && return 1; sleep 0.05; done; }
gpu_of() { if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then echo "$CUDA_VISIBLE_DEVICES" | cut -d, -f$(($1 + 1)); else echo "$1"; fi; }
# visible_gpus: how many GPUs the script may use (its inherited CUDA_VISIBLE_DEVICES, else nvidia-smi's)
visible_gpus() {
  if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .
  else nvidia-smi -L 2>/dev/null | wc -l; fi
}
expect_ok() {
  local n pid rc
  for n in "$@"; do
    eval "pid=\$W_$n"
    wait "$pid"; rc=$?
    [ $rc -eq 0 ] || fail "worker $n exited $rc"
    grep -q "steps ok" "$T/$n.out" || fail "worker $n printed no summary"
    grep -h "steps ok\|bench\|seen\|in between" "$T/$n.out" | sed "s/^/   $n: /"
  done
}
# Drain between a dispatch and its combine (workers started with --hold-at K --hold-file FILE):
# all_holding K NAME...: every named worker printed that it holds before the combine of step K.
all_holding() {
  local k=$1 n; shift
  for n in "$@"; do grep -q "holding before the combine of step $k\$" "$T/$n.out" || return 1; done
}
# expect_drained K NAME...: each worker exited 2 after its combine of step K ran after the hold and
# matched the reference, on its next dispatch failing with EPD_ERR_DRAINING.
expect_drained() {
  local k=$1 n pid rc; shift
  for n in "$@"; do
    eval "pid=\$W_$n"
    wait "$pid"; rc=$?
    [ $rc -eq 2 ] || fail "drain: worker $n exited $rc: $(tail -2 "$T/$n.out")"
    grep -q "the combine of step $k after the hold: ok" "$T/$n.out" ||
      fail "drain: worker $n's combine after the drain: $(tail -3 "$T/$n.out")"
    grep -q "step $((k + 1)): dispatch failed.*EPD_ERR_DRAINING" "$T/$n.out" ||
      fail "drain: worker $n's next dispatch: $(tail -2 "$T/$n.out")"
  done
}
