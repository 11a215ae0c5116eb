#!/bin/bash
# 72-mask-node0-lost: node 0's daemon lost in a world of three (host backend, 2 ranks each, every expert on
# two ranks of different nodes, a group that masks). The six workers step; then node 0's daemon and its
# workers are SIGKILLed: nodes 1 and 2 take node 0's ranks out and step on together, every step checked
# against the reference with the mask its completion reports. The CUDA backend's twin:
# tests/gpu/176-node0-lost-three-cuda.sh.
# Fails on: a mismatch or a wrong dropped count in any worker's output, the workers of nodes 1 and 2 not
# stepping (200+ checked steps each) after node 0's loss, a daemon of node 1 or 2 exiting, more than 10
# failed ops per worker of nodes 1 and 2.
set -u
STEP_TIMEOUT_MS=1000 WORKER_TIMEOUT=300
. "$(dirname "$0")/cluster-lib.sh"
E=24 REP_NEXT=1 R=6
PORT=$(free_ports 1)
node a 0 3 "$PORT" -o engine.slots_factor_pct=200
node b 1 3 "$PORT" -o engine.slots_factor_pct=200
node c 2 3 "$PORT" -o engine.slots_factor_pct=200
for n in a b c; do wait_for 15 test -S "$T/$n/attach.sock" || fail "node $n did not come up"; done
ctl() { "$EPDCTL" -s "$T/a/control.sock" "$@"; }
NODE_OF=(a a b b c c)
run_worker() { # run_worker RANK OUT [ARGS...]
  local r=$1 out=$2
  shift 2
  ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0" "$WORKER" -s "$T/${NODE_OF[$r]}/control.sock" \
    -g "$GROUP" --mode ll -r "$r" -n 6 --seed 9 --experts $E --hidden 64 --topk 4 --tokens 16 --same-inputs \
    --mask --node-ranks 2 -v --until-streak 1000000 "$@" > "$out" 2>&1 &
}
CHAOS_STEPS=1000000
. "$(dirname "$0")/../mask-chaos-lib.sh"
GROUP=lead R=6
checked() { grep -c " ok$" "$1"; }
stepping() { # stepping N FILE...: each worker output checked N more steps (within 20 s)
  local n=$1 f c=""
  shift
  for f in "$@"; do c="$c [ \$(grep -c ' ok\$' $f) -ge $(($(checked "$f") + n)) ] &&"; done
  wait_for 20 sh -c "$c true"
}
alive() {
  kill -0 "$P_b" 2> /dev/null || fail "node 1's daemon exited"
  kill -0 "$P_c" 2> /dev/null || fail "node 2's daemon exited"
  for w in "$W2" "$W3" "$W4" "$W5"; do kill -0 "$w" 2> /dev/null || fail "a worker of node 1 or 2 exited"; done
}

echo "== 6 workers, every expert on two ranks of different nodes"
for r in 0 1 2 3 4 5; do run_worker $r "$T/w$r.out" --steps $CHAOS_STEPS; eval "W$r=\$!"; done
wait_for 20 group_made || fail "group $GROUP not made"
replicated_map
[ "$maps" -ge 1 ] || fail "the replicated map was not staged"
stepping 100 "$T/w0.out" "$T/w2.out" "$T/w4.out" || fail "no steps with the 6 workers"

echo "== node 0's daemon and workers SIGKILLed"
kill -KILL "$P_a" "$W0" "$W1"
wait "$P_a" "$W0" "$W1" 2> /dev/null
stepping 200 "$T"/w[2-5].out || fail "nodes 1 and 2 did not step without node 0"
alive
"$EPDCTL" -s "$T/b/control.sock" status | grep -q "node 0 down" || fail "node 1's status does not show node 0's link down"
grep -q "node 0 (ranks 0..1) is out of its steps" "$T/b.log" || fail "node 1 did not take node 0 out"

kill -TERM "$W2" "$W3" "$W4" "$W5"
wait "$W2" "$W3" "$W4" "$W5" 2> /dev/null
outputs_clean 10 "$T"/w[2-5].out
outputs_clean 2000 "$T"/w[01].out # killed: their last ops failed
echo "nodes 1 and 2 checked $(checked "$T/w2.out") and $(checked "$T/w4.out") steps (ranks 2, 4)," \
  "$(cat "$T"/w[2-5].out | grep -c failed) ops failed at node 0's loss"
for p in "$P_b" "$P_c"; do kill -TERM "$p"; done
for p in "$P_b" "$P_c"; do wait "$p"; done
echo "72-mask-node0-lost: nodes 1 and 2 served on without node 0"
