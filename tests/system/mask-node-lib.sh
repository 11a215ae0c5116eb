# mask-node-lib.sh - sourced by 68-mask-node-out.sh and 70-mask-node-drains.sh: two nodes on this host
# (host backend, 2 ranks each, cluster-lib.sh), a group "out" that masks with every expert on two ranks of
# different nodes, and its four workers stepping (epd-worker --mask: every step checked against the
# reference with the mask its completion reports): node 0's verbose (-v) in $T/a0.out and a1.out (pids
# A0, A1), node 1's in $T/b2.out and b3.out (B2, B3). Helpers: run_worker, checked, stepping N (node 0's
# workers checked N more steps within 20 s), alive (node 0's workers still run).
STEP_TIMEOUT_MS=2000 WORKER_TIMEOUT=300
. "$(dirname "$0")/cluster-lib.sh"
E=16 REP_NEXT=2
two_nodes -o engine.slots_factor_pct=200
ctl() { "$EPDCTL" -s "$T/a/control.sock" "$@"; }
# run_worker RANK STEPS OUT [ARGS...]: at its node (ranks 0-1 node a, 2-3 node b)
run_worker() {
  local r=$1 steps=$2 out=$3 nd=a
  shift 3
  [ "$r" -ge 2 ] && nd=b
  ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0" "$WORKER" -s "$T/$nd/control.sock" -g "$GROUP" \
    --mode "$MODE" -r "$r" -n 4 --steps "$steps" --seed 9 --experts $E --hidden 64 --topk 4 --tokens 16 \
    --same-inputs --mask --node-ranks 2 "$@" > "$out" 2>&1 &
}
CHAOS_STEPS=1000000
. "$(dirname "$0")/../mask-chaos-lib.sh"
GROUP=out MODE=ll
checked() { grep -c " ok$" "$1"; } # the steps a worker (-v) checked and found equal to the reference
stepping() { # stepping N: each of node 0's workers checked N more steps (within 20 s)
  local want0=$(($(checked "$T/a0.out") + $1)) want1=$(($(checked "$T/a1.out") + $1))
  wait_for 20 sh -c "[ \$(grep -c ' ok\$' $T/a0.out) -ge $want0 ] && [ \$(grep -c ' ok\$' $T/a1.out) -ge $want1 ]"
}
alive() { kill -0 "$A0" 2> /dev/null && kill -0 "$A1" 2> /dev/null || fail "a worker of node 0 exited"; }

echo "== 4 workers, every expert replicated across the nodes"
run_worker 0 $CHAOS_STEPS "$T/a0.out" -v --until-streak 1000000
A0=$!
run_worker 1 $CHAOS_STEPS "$T/a1.out" -v --until-streak 1000000
A1=$!
run_worker 2 $CHAOS_STEPS "$T/b2.out" --until-streak 1000000
B2=$!
run_worker 3 $CHAOS_STEPS "$T/b3.out" --until-streak 1000000
B3=$!
wait_for 20 group_made || fail "group $GROUP not made"
replicated_map
[ "$maps" -ge 1 ] || fail "the replicated map was not staged"
stepping 100 || fail "no steps with the 4 workers"
alive
