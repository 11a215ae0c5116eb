# cluster-lib.sh - sourced by the two-node scripts (32-two-nodes.sh, 33-two-node-maps.sh,
# 34-two-nodes-tls.sh): two daemons on this host as nodes of one EP world with the host backend, and
# epd-worker processes at them.
# Before sourcing: STEP_TIMEOUT_MS (the daemons' engine.step_timeout_ms), WORKER_TIMEOUT (seconds a
# worker may run). Skips (exit 77) when the binaries are not built.
B=${EPD_BUILD:-build}
EPD=$B/bin/epd
WORKER=$B/bin/epd-worker
EPDCTL=$B/bin/epdctl
for x in "$EPD" "$WORKER" "$EPDCTL"; do [ -x "$x" ] || { echo "skip: $x is not built"; exit 77; }; done
T=${EPD_TEST_TMPDIR:-$(mktemp -d)}
PIDS=()
fail() {
  echo "FAIL: $*"
  for f in "$T"/*.out; do [ -f "$f" ] && sed "s/^/  $(basename "$f"): /" "$f" | tail -6; done
  for f in "$T"/*.log; do [ -f "$f" ] && sed "s/^/  $(basename "$f")| /" "$f" | tail -15; done
  for p in "${PIDS[@]}"; do kill -KILL "$p" 2>/dev/null; done
  echo "FAIL: $*" # again last: the test runner keeps the tail
  exit 1
}
wait_for() { local n=$(( $1 * 20 )); shift; while ! "$@" 2>/dev/null; do n=$((n-1)); [ $n -le 0 ] && return 1; sleep 0.05; done; }
# N distinct free TCP ports on 127.0.0.1 (all bound at once, then released; the daemons bind them right after).
free_ports() {
  /usr/bin/python3 -c 'import socket, sys
ss = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in ss: s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in ss))' "$1"
}
# node NAME NODE_RANK NODES PORT [-o k=v ...]: start a daemon in the background (pid in P_NAME), node 0
# the coordinator listening on PORT.
node() {
  local n=$1 rank=$2 nodes=$3 port=$4; shift 4
  local where="-o cluster.coordinator=127.0.0.1:$port"
  [ "$rank" = 0 ] && where="-o cluster.listen=127.0.0.1:$port"
  mkdir -p "$T/$n"
  "$EPD" -s "$T/$n/control.sock" -f -o daemon.attach_socket="$T/$n/attach.sock" -o engine.backend=host \
    -o engine.num_ranks=2 -o engine.step_timeout_ms="$STEP_TIMEOUT_MS" -o daemon.drain_timeout_ms=1000 \
    -o cluster.nodes="$nodes" -o cluster.node_rank="$rank" -o cluster.data_listen=127.0.0.1:0 \
    -o cluster.timeout_ms=8000 $where "$@" 2> "$T/$n.log" &
  eval "P_$n=$!"
  PIDS+=($!)
}
# two_nodes [-o k=v ...]: nodes a (0) and b (1) of a world of 2, 2 ranks each, on a free port, both up.
two_nodes() {
  PORT=$(free_ports 1)
  node a 0 2 "$PORT" "$@"
  node b 1 2 "$PORT" "$@"
  wait_for 15 test -S "$T/a/attach.sock" || fail "node 0 did not come up"
  wait_for 15 test -S "$T/b/attach.sock" || fail "node 1 did not come up"
}
# outputs_clean MAX_FAILED FILE...: no step an epd-worker (--mask -v) checked was wrong in any of these
# outputs (-v prints MISMATCH at the end of a wrong step's line; a result or a dropped count that differs
# from the reference, a completion with another step or map than the reference's), and none of them has
# more than MAX_FAILED failed ops.
outputs_clean() {
  local max=$1 f n
  shift
  for f in "$@"; do
    if grep -q " MISMATCH$\|differs\|entries dropped\|, want" "$f"; then
      fail "$(basename "$f"): $(grep -m3 " MISMATCH$\|differs\|entries dropped\|, want" "$f")"
    fi
    n=$(grep -c "failed" "$f")
    [ "$n" -le "$max" ] || fail "$(basename "$f"): $n failed ops (want at most $max)"
  done
}
# worker NAME NODE ARGS...: one epd-worker at NODE's daemon, output in $T/NAME.out, pid in W_NAME.
worker() {
  local n=$1 nd=$2; shift 2
  ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0" timeout "$WORKER_TIMEOUT" "$WORKER" \
    -s "$T/$nd/control.sock" "$@" > "$T/$n.out" 2>&1 &
  eval "W_$n=$!"
}
. "$(dirname "${BASH_SOURCE[0]}")/../worker-lib.sh"
# refused LIMIT_MS NAME...: each daemon NAME (started with node) exits 1, all within LIMIT_MS of the call.
refused() {
  local lim=$1 n pid rc S=$(date +%s%N)
  shift
  for n in "$@"; do
    eval "pid=\$P_$n"
    wait "$pid"; rc=$?
    [ $rc -eq 1 ] || fail "$n exited $rc, want 1"
  done
  local ms=$(( ($(date +%s%N) - S) / 1000000 ))
  [ $ms -lt "$lim" ] || fail "refusals took $ms ms"
}
# expect_log NAME PATTERN: daemon NAME's log has a line matching PATTERN (grep).
expect_log() { grep -q -- "$2" "$T/$1.log" || fail "$1: no \"$2\" in its log"; }
