#!/bin/bash
# 64-hung-client: a client that stops making progress mid-run (SIGSTOP: alive, its attach socket open,
# never submits its side of the step) is covered by the step timeout: its peer gets EPD_ERR_TIMEOUT
# naming the stopped rank within about engine.step_timeout_ms, the daemon keeps serving; after SIGCONT the
# stopped worker sees an error too and leaves (or is SIGKILLed: hang-up = lost), and the group
# continues with a new attach of both ranks.
set -u
B=${EPD_BUILD:-build}
EPD=$B/bin/epd
WORKER=$B/bin/epd-worker
[ -x "$EPD" ] && [ -x "$WORKER" ] || { echo "skip: $EPD or $WORKER is not built"; exit 77; }
T=${EPD_TEST_TMPDIR:-$(mktemp -d)}
mkdir -p "$T/run"
LOG=$T/epd.log
SOCK=$T/run/control.sock
PID=
fail() {
  echo "FAIL: $*"
  for f in "$T"/*.out; do [ -f "$f" ] && sed "s/^/  $(basename "$f"): /" "$f" | tail -5; done
  sed 's/^/  log| /' "$LOG" | tail -20
  [ -n "$PID" ] && kill -KILL "$PID" 2>/dev/null
  exit 1
}
wait_for() { local n=$(( $1 * 20 )); shift; while ! "$@" 2>/dev/null; do n=$((n-1)); [ $n -le 0 ] && return 1; sleep 0.05; done; }
"$EPD" -s "$SOCK" -f -o engine.backend=host -o engine.num_ranks=2 -o engine.step_timeout_ms=1000 \
  -o daemon.drain_timeout_ms=2000 2> "$LOG" &
PID=$!
wait_for 15 test -S "$SOCK" || fail "no control socket"
export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0"

for how in CONT KILL; do
  echo "== rank 1 stopped mid-run, then SIG$how"
  # No timeout(1) wrapper: the signals must reach the workers themselves; a watchdog bounds the run.
  "$WORKER" -s "$SOCK" -g hung -r 0 -n 2 --steps 100000 --seed 7 > "$T/a0.out" 2>&1 & W0=$!
  "$WORKER" -s "$SOCK" -g hung -r 1 -n 2 --steps 100000 --seed 7 > "$T/a1.out" 2>&1 & W1=$!
  ( sleep 60; kill -KILL $W0 $W1 ) 2>/dev/null & WD=$!
  sleep 0.5
  kill -0 $W0 && kill -0 $W1 || fail "workers did not start"
  kill -STOP $W1
  t0=$(date +%s%N)
  wait $W0; rc=$?
  ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  [ $rc -eq 2 ] || fail "peer of the stopped worker exited $rc, want 2"
  grep -q "EPD_ERR_TIMEOUT" "$T/a0.out" || fail "peer's error is not EPD_ERR_TIMEOUT"
  grep -q "peer rank 1" "$T/a0.out" || fail "peer's error does not name rank 1"
  [ $ms -lt 4000 ] || fail "peer took $ms ms to fail (step timeout 1000 ms)"
  echo "peer failed with EPD_ERR_TIMEOUT naming rank 1 after $ms ms"
  kill -0 "$PID" || fail "daemon died"
  kill -$how $W1; kill -CONT $W1 2>/dev/null
  wait $W1; rc=$?
  if [ $how = CONT ]; then
    [ $rc -eq 2 ] || fail "resumed worker exited $rc, want 2 (its step failed too)"
  fi
  wait_for 5 grep -q "steps ok\|EPD_ERR" "$T/a1.out" || [ $how = KILL ] || fail "resumed worker printed nothing"
  kill $WD 2>/dev/null; wait $WD 2>/dev/null
  echo "stopped worker exit $rc after SIG$how"
  timeout 30 "$WORKER" -s "$SOCK" -g hung -r 0 -n 2 --steps 6 --seed 8 > "$T/b0.out" 2>&1 & B0=$!
  timeout 30 "$WORKER" -s "$SOCK" -g hung -r 1 -n 2 --steps 6 --seed 8 > "$T/b1.out" 2>&1 & B1=$!
  wait $B0 || fail "new rank 0 worker failed"
  wait $B1 || fail "new rank 1 worker failed"
  echo "group continues with new attaches: $(grep -h 'steps ok' "$T/b0.out")"
done
echo "== rank 1 stopped mid-run and left stopped: a new attach of rank 1 replaces it"
"$WORKER" -s "$SOCK" -g hung -r 0 -n 2 --steps 100000 --seed 7 > "$T/c0.out" 2>&1 & W0=$!
"$WORKER" -s "$SOCK" -g hung -r 1 -n 2 --steps 100000 --seed 7 > "$T/c1.out" 2>&1 & W1=$!
( sleep 60; kill -KILL $W0 $W1 ) 2>/dev/null & WD=$!
sleep 0.5
kill -STOP $W1
wait $W0; rc=$?
[ $rc -eq 2 ] || fail "peer of the stopped worker exited $rc, want 2"
# Rank 0's old client died (its peer error), so until rank 0 is attached again every step of the group
# fails at once with EPD_ERR_PEER (no waiting on a dead peer): attach the new rank 0 first.
n0=$(grep -c "attached to group hung rank 0" "$LOG")
timeout 30 "$WORKER" -s "$SOCK" -g hung -r 0 -n 2 --steps 6 --seed 9 > "$T/d0.out" 2>&1 & D0=$!
wait_for 10 sh -c "[ \$(grep -c 'attached to group hung rank 0' '$LOG') -gt $n0 ]" || fail "new rank 0 did not attach"
timeout 30 "$WORKER" -s "$SOCK" -g hung -r 1 -n 2 --steps 6 --seed 9 > "$T/d1.out" 2>&1 & D1=$!
wait $D0 || fail "new rank 0 worker failed: $(tail -3 "$T/d0.out")"
wait $D1 || fail "new rank 1 worker (replacing the stopped one) failed: $(tail -3 "$T/d1.out")"
grep -q "hung since a step timed out waiting for it: replaced by a new attach" "$LOG" ||
  fail "the log does not say the hung client was replaced"
echo "replacement of the still-stopped rank 1 ran: $(grep -h 'steps ok' "$T/d1.out")"
kill -CONT $W1; wait $W1; rc=$?
[ $rc -ne 0 ] || fail "the replaced worker exited 0 after waking up"
grep -q "daemon connection dropped" "$T/c1.out" || fail "the replaced worker was not told its attachment is gone: $(tail -2 "$T/c1.out")"
echo "the replaced worker, woken up, exited $rc: $(tail -1 "$T/c1.out")"
kill $WD 2>/dev/null; wait $WD 2>/dev/null
kill -0 "$PID" || fail "daemon died"

grep -q "timeout" "$LOG" || fail "no timeout event in the log"
kill -TERM "$PID"; wait "$PID"; rc=$?; PID=
[ $rc -eq 0 ] || fail "daemon exit $rc on SIGTERM"
echo "64-hung-client: all ok"
