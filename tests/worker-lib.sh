# worker-lib.sh - sourced by the test scripts and libraries that run epd-worker processes in the
# background (tests/system/30-e2e.sh, cluster-lib.sh; tests/gpu/daemon-lib.sh, two-nodes-lib.sh,
# 160-python-moe.sh; bench/e2e/run_gpu.sh for its GPU helpers). They start worker NAME with its output in
# $T/NAME.out and its pid in W_NAME, and define fail().
# expect_ok NAME...: each worker exited 0 and printed its summary ("steps ok"); its summary lines (and
# bench, map-switch and HT counts) are printed, prefixed with its name.
# GPU scripts: CUDA numbers GPUs as nvidia-smi does (its default order may differ on mixed hosts);
# gpu_of I: the CUDA_VISIBLE_DEVICES entry of GPU I of the script's own view (its inherited
# CUDA_VISIBLE_DEVICES if set, else every GPU), for a daemon or worker that should see only that GPU.
# With fewer GPUs in the view than I + 1 it wraps (entry I mod count): ranks then share GPUs, as the
# daemon's engine.devices from devices_opt places them (rank r on GPU r mod count).
export CUDA_DEVICE_ORDER=PCI_BUS_ID
# Never NVLink SHARP / multicast on the lent GPU machines (every process these scripts start inherits it).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# wait_for SECONDS COMMAND...: poll until the command succeeds (1 if it never does).
wait_for() { local n=$(( $1 * 20 )); shift; while ! "$@" 2>/dev/null; do n=$((n-1)); [ $n -le 0 ] && return 1; sleep 0.05; done; }
# gpu_view: ask nvidia-smi once how many GPUs the machine has (_EPD_ALL_GPUS); the GPU libraries call it
# in the script's own shell, so that gpu_of in $(...) does not run nvidia-smi for every worker.
_EPD_ALL_GPUS=
gpu_view() { [ -n "$_EPD_ALL_GPUS" ] || _EPD_ALL_GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU'); }
# visible_gpus: how many GPUs the script may use (its inherited CUDA_VISIBLE_DEVICES, else nvidia-smi's)
visible_gpus() {
  if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .
  else gpu_view; echo "$_EPD_ALL_GPUS"; fi
}
gpu_of() {
  local n; n=$(visible_gpus)
  [ "$n" -ge 1 ] || n=$(($1 + 1)) # no GPU: entry I as before (whatever uses it fails with its own message)
  if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then echo "$CUDA_VISIBLE_DEVICES" | cut -d, -f$(($1 % n + 1)); else echo $(($1 % n)); fi
}
# ranks_per_gpu N: how many of N ranks share a GPU of this view (ceil(N / visible GPUs); 1: a GPU per
# rank; 0 without a GPU). The daemon takes at most 4 ranks on one GPU (NCCL's multi-rank mode).
ranks_per_gpu() { local v; v=$(visible_gpus); [ "$v" -ge 1 ] && echo $((($1 + v - 1) / v)) || echo 0; }
# devices_list N: the daemon's engine.devices for N ranks when this view has fewer GPUs than ranks (the
# ordinals r mod visible, as the daemon sees this view), empty when every rank has a GPU of its own.
devices_list() {
  local v r l=; v=$(visible_gpus)
  [ "$v" -ge 1 ] && [ "$v" -lt "$1" ] || return 0
  for r in $(seq 0 $(($1 - 1))); do l="$l${l:+,}$((r % v))"; done
  echo "$l"
}
# devices_opt N: "-o engine.devices=LIST" for N ranks when they share GPUs (devices_list), nothing otherwise;
# unquoted on the daemon's command line.
devices_opt() { local l; l=$(devices_list "$1"); [ -z "$l" ] || echo "-o engine.devices=$l"; }
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
