# mask-three-nodes-lib.sh - sourced by 69-mask-three-nodes.sh and 72-mask-node0-lost.sh: three nodes on
# this host (host backend, 2 ranks each, cluster-lib.sh; node 0 "a", 1 "b", 2 "c") for a group that
# masks, every expert on two ranks of different nodes (replicated_map of mask-chaos-lib.sh). Helpers: ctl (node 0's epdctl), run_worker RANK OUT [ARGS...] (an epd-worker --mask
# -v at the rank's node, checking every step against the reference with the mask its completion reports),
# checked FILE, stepping N FILE... (each output checked N more steps within 20 s). GROUP: set after it.
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
R=6
checked() { grep -c " ok$" "$1"; }
stepping() { # stepping N FILE...: each worker output checked N more steps (within 20 s)
  local n=$1 f c=""
  shift
  for f in "$@"; do c="$c [ \$(grep -c ' ok\$' $f) -ge $(($(checked "$f") + n)) ] &&"; done
  wait_for 20 sh -c "$c true"
}
