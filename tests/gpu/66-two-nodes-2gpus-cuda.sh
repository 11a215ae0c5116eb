#!/bin/bash
# 66-two-nodes-2gpus-cuda.sh - two nodes of TWO GPUs each simulated on one host (needs 4 GPUs): two daemons
# with engine.backend=cuda and engine.num_ranks=2 (CUDA_VISIBLE_DEVICES 0,1 / 2,3), told they are different
# hosts (NCCL_HOSTID node0 / node1, NCCL_SHM_DISABLE=1, NCCL_IB_DISABLE=1, sockets on lo), so the
# inter-node stage runs over NCCL's network transport while each node's two GPUs share their LSA team
# over NVLink. This is the path 65 cannot reach with one GPU per node: a token is packed once per
# destination node, sent by the rail GPU (same local index) and expanded by both GPUs of the other node,
# reading a sibling's received rows over NVLink; combine reduces per node in float32 before the way back.
# Four epd-worker processes (world ranks 0..3, rank r on GPU r at node r / 2) check every step against
# the reference: LL BF16 skewed and FP8 (H 7168, 256 experts, top-8, 128 tokens), HT FP8 skewed and BF16
# (256 tokens), small LL steps with a new expert map every 3 steps staged through node 0's daemon (both
# nodes must log the same switches); status shows 4 world ranks and transport nccl-p2p; both daemons stop
# cleanly. Skips without 4 GPUs.
# Usage (repository root, GPU machine): bash tests/gpu/66-two-nodes-2gpus-cuda.sh [build-dir]; logs go to
# $TWO_NODES_OUT if set.
set -u
B=${1:-${EPD_BUILD:-build}}
EPD=$B/bin/epd
WORKER=$B/bin/epd-worker
EPDCTL=$B/bin/epdctl
for x in "$EPD" "$WORKER" "$EPDCTL"; do [ -x "$x" ] || { echo "skip: $x is not built"; exit 77; }; done
[ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 4 ] || { echo "skip: needs 4 GPUs (two nodes of two)"; exit 77; }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NCCL_LIB=${NCCL_LIB:-/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib}
[ -d "$NCCL_LIB" ] && export LD_LIBRARY_PATH=$NCCL_LIB:${LD_LIBRARY_PATH:-}
T=$(mktemp -d)
PIDS=()
save_logs() { [ -n "${TWO_NODES_OUT:-}" ] && mkdir -p "$TWO_NODES_OUT" && cp "$T"/*.log "$TWO_NODES_OUT"/ 2>/dev/null; }
fail() {
  echo "FAIL: $*"
  for f in "$T"/*.out; do [ -f "$f" ] && sed "s/^/  $(basename "$f"): /" "$f" | tail -6; done
  for f in "$T"/*.log; do [ -f "$f" ] && grep -v ' NCCL INFO ' "$f" | sed "s/^/  $(basename "$f")| /" | tail -25; done
  save_logs
  for p in "${PIDS[@]}"; do kill -KILL "$p" 2>/dev/null; done
  exit 1
}
cleanup() { save_logs; for p in "${PIDS[@]}"; do kill -KILL "$p" 2>/dev/null; done; }
trap cleanup EXIT
trap 'exit 143' TERM INT
wait_for() { local n=$(( $1 * 20 )); shift; while ! "$@" 2>/dev/null; do n=$((n-1)); [ $n -le 0 ] && return 1; sleep 0.05; done; }
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')

# node N: daemon of node N on GPUs 2N and 2N+1 (its local ranks 0 and 1).
node() {
  local n=$1 where="-o cluster.coordinator=127.0.0.1:$PORT"
  [ "$n" = 0 ] && where="-o cluster.listen=127.0.0.1:$PORT"
  mkdir -p "$T/n$n"
  env ${TWO_NODES_NCCL_ENV:-} CUDA_VISIBLE_DEVICES=$((2 * n)),$((2 * n + 1)) NCCL_HOSTID=node$n NCCL_SHM_DISABLE=1 \
    NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo NCCL_DEBUG=INFO \
    timeout 280 "$EPD" -s "$T/n$n/control.sock" -f -o daemon.attach_socket="$T/n$n/attach.sock" \
    -o engine.backend=cuda -o engine.num_ranks=2 -o engine.step_timeout_ms=5000 -o engine.max_tokens=4096 \
    -o cluster.nodes=2 -o cluster.node_rank="$n" -o cluster.data_listen=127.0.0.1:0 \
    -o cluster.timeout_ms=60000 -o daemon.drain_timeout_ms=1000 $where > "$T/node$n.log" 2>&1 &
  PIDS+=($!)
  eval "P_$n=$!"
}
# quad NAME ARGS...: the four world ranks of a group, rank r at node r / 2 on GPU r.
quad() {
  local g=$1; shift
  for r in 0 1 2 3; do
    CUDA_VISIBLE_DEVICES=$r timeout 200 "$WORKER" -s "$T/n$((r / 2))/control.sock" -g "$g" -r $r -n 4 "$@" \
      > "$T/$g$r.out" 2>&1 &
    eval "W_$g$r=$!"
  done
}
expect_ok() { # GROUP: its four workers
  local r pid rc
  for r in 0 1 2 3; do
    eval "pid=\$W_$1$r"
    wait "$pid"; rc=$?
    [ $rc -eq 0 ] || fail "worker $1$r exited $rc"
    grep -q "steps ok" "$T/$1$r.out" || fail "worker $1$r printed no summary"
  done
  grep -h "steps ok" "$T/${1}0.out" | sed "s/^/   ${1}0: /"
}

S0=$(date +%s%N)
node 0
node 1
wait_for 120 test -S "$T/n0/attach.sock" || fail "node 0 did not come up"
wait_for 60 test -S "$T/n1/attach.sock" || fail "node 1 did not come up"
echo "== both nodes up in $(( ($(date +%s%N) - S0) / 1000000 )) ms (rendezvous + NCCL world communicator)"
"$EPDCTL" -s "$T/n1/control.sock" status > "$T/status.out" || fail "epdctl status"
grep -q "node 1 of 2, 4 world ranks, inter-node transport nccl-p2p" "$T/status.out" || fail "status: $(cat "$T/status.out")"

COMMON="--experts 256 --hidden 7168 --topk 8"
echo "== LL BF16, skewed routing, 128 tokens, 20 steps"
quad llb --steps 20 --seed 5 --skew $COMMON --tokens 128 --bench 100
expect_ok llb
echo "== LL FP8, uniform routing, 128 tokens, 20 steps"
quad llf --steps 20 --seed 7 --fp8 $COMMON --tokens 128 --bench 100
expect_ok llf
echo "== HT FP8 skewed and HT BF16 (256 tokens, 8 steps)"
quad htf --steps 8 --seed 4 --mode ht --fp8 --skew $COMMON --tokens 256 --bench 20
expect_ok htf
quad htb --steps 8 --seed 8 --mode ht $COMMON --tokens 256 --bench 20
expect_ok htb
echo "== LL small (hidden 256), a new expert map every 3 steps through node 0's daemon, 60 steps"
quad lm --steps 60 --seed 11 --skew --hidden 256 --map-every 3
expect_ok lm
for n in 0 1; do grep -o "group lm switched expert map [0-9]* -> [0-9]* at step [0-9]*" "$T/node$n.log" > "$T/sw$n.txt"; done
[ "$(wc -l < "$T/sw0.txt")" -ge 15 ] || fail "lm: node 0 logged $(wc -l < "$T/sw0.txt") switches"
cmp -s "$T/sw0.txt" "$T/sw1.txt" || fail "lm: the nodes switched at different steps: $(diff "$T/sw0.txt" "$T/sw1.txt" | head -4)"
echo "   lm: $(wc -l < "$T/sw0.txt") switches, the same (version, step) on both nodes"

kill -TERM "$P_0" "$P_1"
wait "$P_1"; R1=$?
wait "$P_0"; R0=$?
[ $R0 -eq 0 ] && [ $R1 -eq 0 ] || fail "daemons exited $R0 $R1 on SIGTERM"
# NCCL's INFO lines reach the (block-buffered) log file at exit: the rail peers cross by NET/Socket
grep -h " via NET/Socket" "$T/node0.log" "$T/node1.log" > "$T/net.txt" || fail "NCCL did not use its socket transport between the nodes"
head -2 "$T/net.txt" | sed 's/^.*NCCL INFO/   NCCL INFO/'
echo "ok: two nodes of two GPUs, LL and HT equal to the reference, maps switched together"
