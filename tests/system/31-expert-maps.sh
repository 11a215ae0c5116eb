#!/bin/bash
# 31-expert-maps: the real daemon (host backend, redundant slots) with 4 epd-worker processes stepping
# continuously while rank 0 stages a new random expert map through SetExpertMap every 3 steps. Every
# worker reads each step's map from libepd's mapped map table (no round trip) and checks the step's
# routing and combine against the reference with it (LL, then HT + FP8, then LL with expert weights that
# move with the maps: weight copies at every switch, each slot's toy expert runs on the weights it holds). Afterwards the metrics show the
# switches and per-replica counters while the workers run.
set -u
B=${EPD_BUILD:-build}
EPD=$B/bin/epd
WORKER=$B/bin/epd-worker
EPDCTL=$B/bin/epdctl
[ -x "$EPD" ] || { echo "skip: $EPD is not built"; exit 77; }
[ -x "$WORKER" ] || { echo "skip: $WORKER is not built"; exit 77; }
T=${EPD_TEST_TMPDIR:-$(mktemp -d)}
mkdir -p "$T/run"
LOG=$T/epd.log
SOCK=$T/run/control.sock
PID=
fail() {
  echo "FAIL: $*"
  for f in "$T"/w*.out; do [ -f "$f" ] && sed "s/^/  $(basename "$f"): /" "$f" | tail -8; done
  [ -f "$LOG" ] && sed 's/^/  log| /' "$LOG" | tail -30
  [ -n "$PID" ] && kill -KILL "$PID" 2>/dev/null
  exit 1
}
wait_for() { local n=$(( $1 * 20 )); shift; while ! "$@" 2>/dev/null; do n=$((n-1)); [ $n -le 0 ] && return 1; sleep 0.05; done; }

"$EPD" -s "$SOCK" -f -o engine.backend=host -o engine.num_ranks=4 -o engine.step_timeout_ms=8000 \
  -o engine.slots_factor_pct=200 -o daemon.attach_socket="$T/run/attach.sock" 2> "$LOG" &
PID=$!
wait_for 15 test -S "$SOCK" || fail "no control socket"
wait_for 5 test -S "$T/run/attach.sock" || fail "no attach socket"

start4() { # GROUP STEPS ARGS...: 4 workers in the background
  local g=$1 steps=$2; shift 2
  for r in 0 1 2 3; do
    ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0" timeout 60 "$WORKER" -s "$SOCK" -g "$g" -r $r -n 4 \
      --steps "$steps" --map-every 3 "$@" > "$T/w$g$r.out" 2>&1 &
    eval "P$r=$!"
  done
}
wait4() { # GROUP STEPS: each worker must pass every step and see about steps/3 switches
  local g=$1 steps=$2
  for r in 0 1 2 3; do
    eval "wait \$P$r" || fail "worker $g/$r exited $?"
    grep -q "steps ok" "$T/w$g$r.out" || fail "worker $g/$r printed no summary"
  done
  grep -h "map switches seen" "$T"/w"$g"?.out
  local seen; seen=$(sed -n 's/.*: \([0-9]*\) map switches seen.*/\1/p' "$T/w${g}1.out")
  [ "${seen:-0}" -ge $(( steps / 3 - 2 )) ] || fail "rank 1 saw ${seen:-0} map switches in $steps steps"
}
metrics_ok() {
  "$EPDCTL" -s "$SOCK" metrics > "$T/metrics.txt" 2>&1 &&
    grep -q 'epd_slot_tokens_total{group="ll",rank="3",slot="' "$T/metrics.txt" &&
    grep -Eq 'epd_map_switches_total\{group="ll"\} [1-9]' "$T/metrics.txt"
}

echo "== LL, 300 steps, a new map every 3 steps (metrics read while it runs)"
start4 ll 300 --seed 11 --experts 10 --topk 3 --tokens 24 --hidden 64
wait_for 30 metrics_ok || fail "no per-slot counters or map switches in the metrics"
grep -E 'epd_map_switches_total|epd_slot_tokens_total\{group="ll",rank="0",slot="0"\}' "$T/metrics.txt"
# epdctl set-map with a weight-copy line: refused whole for a group without a weights region.
{ echo "group ll"; for e in $(seq 0 9); do echo "expert $e: $((e / 3)):$((e % 3))"; done; echo "copy 0:0 -> 1:4"; } > "$T/map.txt"
"$EPDCTL" -s "$SOCK" set-map "$T/map.txt" > "$T/setmap.out" 2>&1 && fail "set-map with a copy succeeded on a group without weights"
grep -q "no expert-weights region" "$T/setmap.out" || fail "set-map error: $(cat "$T/setmap.out")"
echo "copy refused: $(cat "$T/setmap.out")"
wait4 ll 300
echo "== HT + FP8 + skew, 120 steps, a new map every 3 steps"
start4 ht 120 --seed 12 --experts 10 --topk 3 --tokens 24 --hidden 128 --mode ht --fp8 --skew
wait4 ht 120
echo "== LL + weight migration: maps move replicas into free slots with copies every 3 steps, 150 steps"
start4 mw 150 --seed 13 --experts 10 --topk 3 --tokens 24 --hidden 64 --weights 4096
wait4 mw 150
grep -h "weight copies asked" "$T/wmw0.out"
copies=$(sed -n 's/.*, \([0-9]*\) weight copies asked.*/\1/p' "$T/wmw0.out")
[ "${copies:-0}" -ge 50 ] || fail "rank 0 asked for only ${copies:-0} weight copies"
grep -Eq "switched expert map .* \([1-9][0-9]* weight bytes copied\)" "$LOG" || fail "no switch copied weights"
grep -q "event map_switch" "$LOG" || fail "no map_switch event in the log"
kill -TERM "$PID"; wait "$PID"
echo "ok"
