# two-nodes-lib.sh - sourced by the multi-node GPU scripts (165-two-nodes-cuda.sh: one GPU per node,
# 166-two-nodes-2gpus-cuda.sh: two, 167-three-nodes-cuda.sh: three nodes of one): NODES (default 2) daemons
# with engine.backend=cuda on one host, told they are
# different hosts (NCCL_HOSTID node0 / node1 / ..., NCCL_SHM_DISABLE=1, NCCL_IB_DISABLE=1, sockets on lo), so the
# inter-node stage runs over NCCL's network transport. World rank r (node r / GPN) is on GPU r of the
# script's view (through an inherited CUDA_VISIBLE_DEVICES: gpu_of); with one rank per node
# NCCL_P2P_DISABLE=1 too (with two, the node's ranks need P2P for their LSA team, also where they share a
# GPU; the different host ids keep the nodes apart). Before sourcing: B (build directory), GPN (ranks
# per node), optionally NODES. Skips (exit 77) without the binaries or a GPU.
# With fewer GPUs than NODES x GPN ranks they share them (TWO_NODES_SHARE_GPU, default 1; 0: skip
# instead): rank r on GPU r mod count (gpu_of wraps), at most 4 ranks on one GPU. Each daemon sees the
# GPUs of its ranks (CUDA_VISIBLE_DEVICES) and, where its own ranks share one, gets engine.devices (166 on
# one GPU: CUDA_VISIBLE_DEVICES=G and engine.devices=0,0 for each node; NCCL's multi-rank mode inside a
# node). Processes of different nodes on one GPU are time-sliced without MPS (steps take milliseconds,
# results must still be exact); the nodes' NCCL ranks pass NCCL's duplicate-GPU check because their host
# ids differ. No NVLink then: 165's single-daemon baseline is left out (TWO_NODES_BASELINE=0). Logs go
# to $TWO_NODES_OUT if set; TWO_NODES_NCCL_ENV: extra NCCL variables for the daemons; TWO_NODES_DAEMON_OPTS:
# extra daemon options (the scripts set engine.slots_factor_pct=200: free slots for weight migrations).
# TWO_NODES_FAULTS=1: the daemons are epd-faults (test hooks); node N's is SIGKILLed in the exchange it
# starts once the file $T/die-nodeN exists (EPD_TEST_DIE_IN_EXCHANGE).
EPD=$B/bin/epd
[ "${TWO_NODES_FAULTS:-0}" = 1 ] && EPD=$B/bin/epd-faults
WORKER=$B/bin/epd-worker
EPDCTL=$B/bin/epdctl
for x in "$EPD" "$WORKER" "$EPDCTL"; do [ -x "$x" ] || { echo "skip: $x is not built"; exit 77; }; done
. "$(dirname "${BASH_SOURCE[0]}")/../worker-lib.sh"
NODES=${NODES:-2}
WR=$((NODES * GPN)) # world ranks
gpu_view
[ "$(visible_gpus)" -ge 1 ] || { echo "skip: needs a GPU"; exit 77; }
SHARE=$(ranks_per_gpu $WR)
if [ "$SHARE" -gt 1 ]; then
  [ "${TWO_NODES_SHARE_GPU:-1}" = 1 ] ||
    { echo "skip: needs $WR GPUs ($NODES nodes of $GPN; TWO_NODES_SHARE_GPU=0: ranks may not share GPUs)"; exit 77; }
  [ "$SHARE" -le 4 ] || { echo "skip: $WR ranks on $(visible_gpus) GPU(s) would put $SHARE on one (at most 4)"; exit 77; }
  export TWO_NODES_BASELINE=0
  echo "== $WR ranks ($NODES nodes of $GPN) share $(visible_gpus) GPU(s), up to $SHARE on one (rank r on GPU r mod" \
    "$(visible_gpus)): no NVLink; the nodes' processes time-sliced on a shared GPU"
fi
NCCL_LIB=${NCCL_LIB:-/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib}
[ -d "$NCCL_LIB" ] && export LD_LIBRARY_PATH=$NCCL_LIB:${LD_LIBRARY_PATH:-}
T=$(mktemp -d)
PIDS=()
save_logs() { [ -n "${TWO_NODES_OUT:-}" ] && mkdir -p "$TWO_NODES_OUT" && cp "$T"/*.log "$T"/*.out "$TWO_NODES_OUT"/ 2>/dev/null; }
# The outputs of the workers without a summary (failed or unfinished) come last: the test runner shows the
# last 40 lines.
fail() {
  echo "FAIL: $*"
  for f in "$T"/*.log; do [ -f "$f" ] && grep -v ' NCCL INFO ' "$f" | sed "s/^/  $(basename "$f")| /" | tail -12; done
  for f in "$T"/*.out; do [ -f "$f" ] && ! grep -q "steps ok" "$f" && sed "s/^/  $(basename "$f"): /" "$f" | tail -4; done
  save_logs
  kill_nodes
  exit 1
}
# PIDS are the timeout(1) processes of the daemons (node): SIGKILL does not reach through timeout, so the
# daemons, their children, are killed first.
kill_nodes() { for p in "${PIDS[@]}"; do pkill -KILL -P "$p" 2>/dev/null; kill -KILL "$p" 2>/dev/null; done; }
cleanup() { save_logs; kill_nodes; }
trap cleanup EXIT
trap 'exit 143' TERM INT
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')

# node N: the daemon of node N with its GPN ranks (local ranks 0 .. GPN-1, world ranks N*GPN ..) on their
# GPUs: CUDA_VISIBLE_DEVICES the distinct GPUs of its ranks, engine.devices each rank's ordinal among them
# where two of its ranks share one; its pid in P_N.
node() {
  local n=$1 where="-o cluster.coordinator=127.0.0.1:$PORT" devs='' ords='' dopt='' p2p='' r g i k e
  [ "$n" = 0 ] && where="-o cluster.listen=127.0.0.1:$PORT"
  for r in $(seq $((n * GPN)) $((n * GPN + GPN - 1))); do
    g=$(gpu_of $r) i=0 k=
    for e in ${devs//,/ }; do [ "$e" = "$g" ] && k=$i; i=$((i + 1)); done
    [ -n "$k" ] || { devs="$devs${devs:+,}$g"; k=$i; }
    ords="$ords${ords:+,}$k"
  done
  [ "$(echo "$devs" | tr ',' '\n' | grep -c .)" -lt "$GPN" ] && dopt="-o engine.devices=$ords"
  [ "$GPN" = 1 ] && p2p=NCCL_P2P_DISABLE=1
  mkdir -p "$T/n$n"
  env ${TWO_NODES_NCCL_ENV:-} EPD_TEST_DIE_IN_EXCHANGE="$T/die-node$n" CUDA_VISIBLE_DEVICES=$devs NCCL_HOSTID=node$n $p2p NCCL_SHM_DISABLE=1 \
    NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo NCCL_DEBUG=INFO \
    timeout 280 "$EPD" -s "$T/n$n/control.sock" -f -o daemon.attach_socket="$T/n$n/attach.sock" \
    -o engine.backend=cuda -o engine.num_ranks="$GPN" $dopt -o engine.step_timeout_ms=5000 -o engine.max_tokens=4096 \
    -o cluster.nodes=$NODES -o cluster.node_rank="$n" -o cluster.data_listen=127.0.0.1:0 \
    -o cluster.timeout_ms=60000 -o daemon.drain_timeout_ms=1000 $where ${TWO_NODES_DAEMON_OPTS:-} > "$T/node$n.log" 2>&1 &
  PIDS+=($!)
  eval "P_$n=$!"
}
# start_nodes: the daemons of every node, up (rendezvous and NCCL world communicator) within the limits;
# node 1's status must say NODES x GPN world ranks over nccl-p2p.
start_nodes() {
  local s0
  s0=$(date +%s%N)
  local n
  for n in $(seq 0 $((NODES - 1))); do node $n; done
  wait_for 120 test -S "$T/n0/attach.sock" || fail "node 0 did not come up"
  for n in $(seq 1 $((NODES - 1))); do wait_for 60 test -S "$T/n$n/attach.sock" || fail "node $n did not come up"; done
  echo "== all $NODES nodes up in $(( ($(date +%s%N) - s0) / 1000000 )) ms (rendezvous + NCCL world communicator)"
  "$EPDCTL" -s "$T/n1/control.sock" status > "$T/status.out" || fail "epdctl status"
  grep -q "node 1 of $NODES, $WR world ranks, inter-node transport nccl-p2p" "$T/status.out" ||
    fail "status: $(cat "$T/status.out")"
  # the start-up GIN probe (NCCL asked for a GIN context on the world communicator): a line in status,
  # the same verdict on both nodes, and in the log
  grep -E "^gin: +(unavailable \(|available \(|differs between local ranks \(|probe failed: )" "$T/status.out" || fail "no GIN line: $(cat "$T/status.out")"
  "$EPDCTL" -s "$T/n0/control.sock" --json status > "$T/status0.json" || fail "epdctl --json status"
  "$EPDCTL" -s "$T/n1/control.sock" --json status > "$T/status1.json" || fail "epdctl --json status"
  /usr/bin/python3 -c 'import json, sys; g = [json.load(open(f)).get("gin", "") for f in sys.argv[1:]]; assert g[0] and g[0].split(" (")[0] == g[1].split(" (")[0], g' \
    "$T/status0.json" "$T/status1.json" || fail "GIN line missing or a different verdict on the two nodes"
  grep -qF "GIN: $(sed -n 's/^gin: *//p' "$T/status.out" | cut -c1-40)" "$T/node1.log" || fail "the log lacks the GIN line"
}
# start_workers NAME ARGS...: the NODES x GPN world ranks of a group, rank r at node r / GPN on GPU r (r mod
# count where ranks share GPUs); the
# worker of rank r writes $T/NAMEr.out, its pid in W_NAMEr; --node-ranks GPN: the reference picks replicas
# (maps with --map-every have some) as the daemons do.
start_workers() {
  local g=$1 r; shift
  for r in $(seq 0 $((WR - 1))); do
    CUDA_VISIBLE_DEVICES=$(gpu_of $r) timeout 200 "$WORKER" -s "$T/n$((r / GPN))/control.sock" -g "$g" -r $r -n $WR --node-ranks "$GPN" "$@" \
      > "$T/$g$r.out" 2>&1 &
    eval "W_$g$r=$!"
  done
}
# weights_moved GROUP MIN: after workers with --weights --map-every: at least MIN copies' bytes crossed
# between the nodes (their "received from node" lines), every node copied weights at its switches and
# skipped none, and all switched at the same (version, step).
weights_moved() {
  local g=$1 min=$2 across n
  across=$(cat "$T"/node[0-9].log | grep -c "group $g: weights of copy .* received from node")
  [ "$across" -ge "$min" ] || fail "$g: only $across weight copies crossed nodes"
  for n in $(seq 0 $((NODES - 1))); do
    grep -o "group $g switched expert map [0-9]* -> [0-9]* at step [0-9]*" "$T/node$n.log" > "$T/wsw$n.txt"
    grep -Eq "group $g switched expert map .* \([1-9][0-9]* weight bytes copied\)" "$T/node$n.log" ||
      fail "$g: node $n copied no weights"
    grep -q "weight copy .* skipped" "$T/node$n.log" && fail "$g: node $n skipped a copy: $(grep -m1 'skipped' "$T/node$n.log")"
  done
  for n in $(seq 1 $((NODES - 1))); do cmp -s "$T/wsw0.txt" "$T/wsw$n.txt" || fail "$g: nodes 0 and $n switched at different steps"; done
  echo "   $g: $(wc -l < "$T/wsw0.txt") switches on all $NODES nodes at the same steps, $across copies across nodes; $(grep -h 'weight copies asked' "$T/${g}0.out" | sed 's/.*staged, //')"
}
